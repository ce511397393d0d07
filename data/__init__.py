"""Text to tensors: prompts -> the target's own answers -> tokens with loss masks -> (optional) hidden states.

- `data.prompts.read_conversations(source, max_rows=None, split="train") -> (conversations, skipped_rows)`
- `data.chat_format.tokenize_conversation(tokenizer, chat_format(tokenizer), messages) -> input_ids, loss_mask`
- `python -m data.distill --model M --prompts P --output_dir OUT`: a `datasets.save_to_disk` directory with
  columns input_ids / loss_mask / text / conversation / index / truncated_turns / generated_tokens and
  OUT/manifest.json (written last).
- `python -m data.hidden_states --model M --dataset OUT --layers eagle3 --output_dir FEAT`, read back with
  `data.hidden_states.HiddenStateShards(FEAT)[i] -> {layer: Tensor[T, H]}`.

`data` is a leaf package: it imports only `heads.loading` from this project.
"""
