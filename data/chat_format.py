"""Tokenise conversations with the target's own chat template and an exact loss mask.

The loss mask is 1 exactly on what the model emits in an assistant turn: the assistant content as the
template renders it, up to and including the end-of-turn token (the first stop token after the turn
starts), and 0 on everything else: system and user messages, and template scaffolding such as
"<|im_start|>assistant\\n" (the generation prompt) or the "\\n" a template writes after "<|im_end|>".

How spans are found, without knowing the template: the full conversation is rendered once (text T).
For the i-th message, when it is an assistant turn, the conversation before it is rendered with
`add_generation_prompt=True` (text P_i): that is exactly the prompt the model saw when it wrote the turn,
so the turn starts at len(P_i) in T. When a template renders earlier turns differently from the prompt
(reasoning templates that put "<think>\\n" in the generation prompt but strip <think> blocks from
earlier answers), the turn starts where T and P_i stop agreeing. The turn ends after the first stop
string (the tokenizer's EOS plus the generation config's EOS ids) at or after its start; a template that
does not close assistant turns with one is an error. T is tokenised once (`add_special_tokens=False`: the
template writes BOS itself, as `apply_chat_template` does) and a token is masked when it starts inside a
span (character offsets from the fast tokenizer).

Models without a chat template (stories260K) use PLAIN_TEMPLATE, only when asked (`--plain_format`):

    <bos>System: {system}\\n\\nUser: {user}\\n\\nAssistant: {answer}<eos>User: {user}\\n\\nAssistant: ...

with the generation prompt "Assistant:" (no trailing space: SentencePiece models emit the space with the
first word, so the answer is rendered as " " + answer and the space token is part of the masked span).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from data.prompts import Conversation

PLAIN_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ 'System: ' + message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\n\n' }}"
    "{% else %}{{ 'Assistant: ' + message['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


@dataclass(frozen=True)
class ChatFormat:
    """How a model's conversations become text: its jinja chat template and the ids that end a turn."""

    template: str
    stop_token_ids: tuple[int, ...]
    stop_strings: tuple[str, ...]
    plain: bool

    @property
    def template_hash(self) -> str:
        """sha256 of the template text (recorded in manifests; a different template means different data)."""
        return hashlib.sha256(self.template.encode()).hexdigest()


@dataclass(frozen=True)
class TokenizedConversation:
    input_ids: list[int]       # [T]
    loss_mask: list[int]       # [T], 1 on assistant tokens incl. end-of-turn token
    text: str                  # the rendered conversation
    spans: list[tuple[int, int]]  # character spans of the assistant turns in `text`


def chat_format(tokenizer: PreTrainedTokenizerBase, plain_format: bool = False,
                stop_token_ids: Iterable[int] = (), model_name: str = "the model") -> ChatFormat:
    """The chat format of `tokenizer`: its own template, or PLAIN_TEMPLATE with `plain_format`.

    `stop_token_ids` adds end-of-turn ids (e.g. `generation_config.eos_token_id`) to the tokenizer's EOS.
    Raises ValueError naming `--plain_format` when the tokenizer has no chat template and it is not set.
    """
    if not tokenizer.is_fast:
        raise ValueError(f"--model {model_name}: a fast tokenizer (tokenizer.json) is needed for loss masks")
    if plain_format:
        template = PLAIN_TEMPLATE
    elif isinstance(tokenizer.chat_template, str) and tokenizer.chat_template:
        template = tokenizer.chat_template
    else:
        raise ValueError(f"--model {model_name}: the tokenizer has no chat template; pass --plain_format to use "
                         "the plain 'User: ...\\n\\nAssistant: ...' format (see data/chat_format.py)")
    ids = set(stop_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if not ids:
        raise ValueError(f"--model {model_name}: neither the tokenizer nor the generation config has an EOS token")
    ordered = tuple(sorted(ids))
    strings = tuple(tokenizer.decode([token]) for token in ordered)
    return ChatFormat(template, ordered, strings, plain_format)


def render(tokenizer: PreTrainedTokenizerBase, fmt: ChatFormat, messages: Conversation,
           add_generation_prompt: bool = False) -> str:
    """The conversation as text, through the format's jinja template."""
    return tokenizer.apply_chat_template(messages, chat_template=fmt.template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of rendered text; no special tokens added (templates write their own BOS)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompt_ids(tokenizer: PreTrainedTokenizerBase, fmt: ChatFormat, messages: Conversation) -> list[int]:
    """Token ids the model is given to write the next assistant turn after `messages`."""
    return encode(tokenizer, render(tokenizer, fmt, messages, add_generation_prompt=True))


def _common_prefix_length(a: str, b: str) -> int:
    limit = min(len(a), len(b))
    index = 0
    while index < limit and a[index] == b[index]:
        index += 1
    return index


def assistant_spans(tokenizer: PreTrainedTokenizerBase, fmt: ChatFormat, messages: Conversation, text: str,
                    truncated_turns: Collection[int] = ()) -> list[tuple[int, int]]:
    """Character spans [start, end) in `text` (= render(messages)) of what each assistant turn emits.

    For assistant turns (0-based among assistant messages) in `truncated_turns` (the answer hit
    max_new_tokens) the span stops before the stop string: the model never emitted the end-of-turn token
    there and must not learn to.
    """
    spans: list[tuple[int, int]] = []
    assistant_positions = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    for number, position in enumerate(assistant_positions):
        prompt = render(tokenizer, fmt, messages[:position], add_generation_prompt=True)
        start = len(prompt) if text.startswith(prompt) else _common_prefix_length(text, prompt)
        if spans and start < spans[-1][1]:
            raise ValueError(f"chat template renders assistant turn {number} before the end of turn {number - 1}; "
                             "cannot derive a loss mask")
        closed = render(tokenizer, fmt, messages[:position + 1])
        limit = len(closed) if text.startswith(closed) else len(text)
        found = [(text.find(stop, start), stop) for stop in fmt.stop_strings]
        found = [(index, stop) for index, stop in found if 0 <= index and index + len(stop) <= limit]
        if not found:
            raise ValueError(f"chat template does not end assistant turn {number} with an end-of-turn token "
                             f"(one of {list(fmt.stop_strings)}); pass the model's EOS ids as stop tokens")
        index, stop = min(found)
        spans.append((start, index if number in truncated_turns else index + len(stop)))
    return spans


def tokenize_conversation(tokenizer: PreTrainedTokenizerBase, fmt: ChatFormat, messages: Conversation,
                          truncated_turns: Collection[int] = ()) -> TokenizedConversation:
    """Render `messages` with the chat format and tokenise it with a loss mask on the assistant turns.

    Returns input_ids [T] and loss_mask [T] (1 on tokens that start inside an assistant span, see
    `assistant_spans`), the rendered text and the character spans.
    """
    text = render(tokenizer, fmt, messages)
    spans = assistant_spans(tokenizer, fmt, messages, text, truncated_turns)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    loss_mask = [0] * len(encoded["input_ids"])
    span_index = 0
    for token, (token_start, _) in enumerate(encoded["offset_mapping"]):
        while span_index < len(spans) and token_start >= spans[span_index][1]:
            span_index += 1
        if span_index < len(spans) and spans[span_index][0] <= token_start:
            loss_mask[token] = 1
    return TokenizedConversation(list(encoded["input_ids"]), loss_mask, text, spans)


def highlight(tokenizer: PreTrainedTokenizerBase, input_ids: Sequence[int], loss_mask: Sequence[int],
              open_mark: str = "\u27e6", close_mark: str = "\u27e7") -> str:
    """The decoded tokens with every run of loss_mask == 1 wrapped in open_mark ... close_mark."""
    pieces, run, current = [], [], None
    for token, mask in zip(input_ids, loss_mask, strict=True):
        if mask != current and run:
            text = tokenizer.decode(run)
            pieces.append(open_mark + text + close_mark if current else text)
            run = []
        current = mask
        run.append(token)
    if run:
        text = tokenizer.decode(run)
        pieces.append(open_mark + text + close_mark if current else text)
    return "".join(pieces)
