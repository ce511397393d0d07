"""Loss masks cover exactly what the model emits in assistant turns, for every kind of chat template."""

import pytest

from data.chat_format import PLAIN_TEMPLATE, chat_format, highlight, prompt_ids, tokenize_conversation
from heads.loading import load_tokenizer
from tests.tiny_models import SMOLLM2, STORIES260K

CONVERSATION = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Tell me a story."},
    {"role": "assistant", "content": "Once upon a time, a cat sat."},
]
WITH_SYSTEM = [{"role": "system", "content": "You answer briefly."}] + CONVERSATION

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Llama-2 style: the system prompt is folded into the first user turn; no generation prompt; answers end in EOS.
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% if loop.first and system %}{% set content = '<<SYS>>\n' + system + '\n<</SYS>>\n\n' + m['content'] %}"
    "{% else %}{% set content = m['content'] %}{% endif %}"
    "{{ bos_token + '[INST] ' + content + ' [/INST]' }}"
    "{% else %}{{ ' ' + m['content'] | trim + ' ' + eos_token }}{% endif %}{% endfor %}"
)
# Reasoning template (Qwen3 / DeepSeek-R1 style): the generation prompt opens a <think> block; the last
# assistant turn keeps its reasoning, earlier turns are rendered with the <think> block stripped.
REASONING_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{% set content = m['content'] %}"
    "{% if not loop.last and '</think>' in content %}{% set content = content.split('</think>')[-1] | trim %}"
    "{% elif '<think>' in content %}{% set content = content.split('<think>')[-1] | trim %}"
    "{% elif loop.last %}{% set content = '\n</think>\n\n' + content %}{% endif %}"
    "{% if loop.last %}{{ '<|im_start|>assistant\n<think>\n' + content + '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>assistant\n' + content + '<|im_end|>\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer(str(SMOLLM2))


@pytest.fixture(scope="module")
def llama3():
    tokenizer = load_tokenizer(str(SMOLLM2))
    tokenizer.add_tokens(["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
                         special_tokens=True)
    tokenizer.bos_token = "<|begin_of_text|>"
    tokenizer.chat_template = LLAMA3_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def stories():
    return load_tokenizer(str(STORIES260K))


def masked_runs(tokenizer, tokenized):
    """The text covered by each run of masked tokens (from the tokenizer's offsets)."""
    offsets = tokenizer(tokenized.text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    runs, previous = [], 0
    for (start, end), mask in zip(offsets, tokenized.loss_mask, strict=True):
        if mask and not previous:
            runs.append([start, end])
        elif mask:
            runs[-1][1] = end
        previous = mask
    return [tokenized.text[start:end] for start, end in runs]


def assert_prefixes_match_generation_prompts(tokenizer, fmt, messages, tokenized):
    """Tokens before each assistant turn equal the prompt the model is given to write that turn."""
    starts = [i for i, m in enumerate(tokenized.loss_mask) if m and (i == 0 or not tokenized.loss_mask[i - 1])]
    positions = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    assert len(starts) == len(positions)
    for start, position in zip(starts, positions, strict=True):
        assert tokenized.input_ids[:start] == prompt_ids(tokenizer, fmt, messages[:position])


def test_chatml_smollm2_masks_content_and_im_end_only(smollm2):
    fmt = chat_format(smollm2)
    tokenized = tokenize_conversation(smollm2, fmt, CONVERSATION)
    assert masked_runs(smollm2, tokenized) == ["Hello! How can I help?<|im_end|>",
                                               "Once upon a time, a cat sat.<|im_end|>"]
    masked = [t for t, m in zip(tokenized.input_ids, tokenized.loss_mask, strict=True) if m]
    assert smollm2.decode(masked) == "Hello! How can I help?<|im_end|>Once upon a time, a cat sat.<|im_end|>"
    # the default system prompt the template injects, "<|im_start|>assistant\n" and the "\n" after
    # <|im_end|> are all scaffolding
    assert tokenized.text.startswith("<|im_start|>system\nYou are a helpful AI assistant")
    assert tokenized.loss_mask[-1] == 0 and smollm2.decode(tokenized.input_ids[-1:]) == "\n"
    assert_prefixes_match_generation_prompts(smollm2, fmt, CONVERSATION, tokenized)


def test_chatml_with_explicit_system_prompt(smollm2):
    fmt = chat_format(smollm2)
    tokenized = tokenize_conversation(smollm2, fmt, WITH_SYSTEM)
    assert "You answer briefly." in tokenized.text and "SmolLM" not in tokenized.text
    assert masked_runs(smollm2, tokenized) == ["Hello! How can I help?<|im_end|>",
                                               "Once upon a time, a cat sat.<|im_end|>"]
    assert_prefixes_match_generation_prompts(smollm2, fmt, WITH_SYSTEM, tokenized)


def test_llama3_style_with_trimmed_content_and_eot(llama3):
    eot = llama3.convert_tokens_to_ids("<|eot_id|>")
    fmt = chat_format(llama3, stop_token_ids=[eot])
    messages = [dict(m, content=" " + m["content"] + "\n") if m["role"] == "assistant" else m for m in WITH_SYSTEM]
    tokenized = tokenize_conversation(llama3, fmt, messages)
    assert tokenized.text.startswith("<|begin_of_text|><|start_header_id|>system")
    assert masked_runs(llama3, tokenized) == ["Hello! How can I help?<|eot_id|>",
                                              "Once upon a time, a cat sat.<|eot_id|>"]
    # no prefix check here: this GPT-2-regex tokenizer splits "\n\n" differently at the end of a prompt
    # ("\n\n") than before text ("\n", "\n"); the whole conversation is tokenised as one text, as in training


def test_llama3_without_eot_as_stop_token_is_an_error(llama3):
    with pytest.raises(ValueError, match="does not end assistant turn 0 with an end-of-turn token"):
        tokenize_conversation(llama3, chat_format(llama3), CONVERSATION)


def test_llama2_style_system_prompt_on_sentencepiece_tokenizer(stories):
    stories.chat_template = LLAMA2_TEMPLATE
    try:
        fmt = chat_format(stories)
        tokenized = tokenize_conversation(stories, fmt, WITH_SYSTEM)
    finally:
        stories.chat_template = None
    assert tokenized.text.startswith("<s>[INST] <<SYS>>\nYou answer briefly.\n<</SYS>>\n\nHi there [/INST]")
    assert masked_runs(stories, tokenized) == [" Hello! How can I help? </s>", " Once upon a time, a cat sat. </s>"]
    assert_prefixes_match_generation_prompts(stories, fmt, WITH_SYSTEM, tokenized)


def test_reasoning_template_adds_and_strips_think_blocks(smollm2):
    smollm2_reasoning = load_tokenizer(str(SMOLLM2))
    smollm2_reasoning.chat_template = REASONING_TEMPLATE
    fmt = chat_format(smollm2_reasoning)
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4"},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "<think>\nAdd again.\n</think>\n\n6"},
    ]
    tokenized = tokenize_conversation(smollm2_reasoning, fmt, messages)
    # earlier turn: reasoning stripped by the template, only the answer is learned; last turn: the
    # "<think>\n" written by the generation prompt is scaffolding, the reasoning the model writes is learned
    assert "Add them" not in tokenized.text
    assert masked_runs(smollm2_reasoning, tokenized) == ["4<|im_end|>", "Add again.\n</think>\n\n6<|im_end|>"]
    last_start = tokenized.loss_mask.index(1, tokenized.loss_mask.index(0, tokenized.loss_mask.index(1)))
    assert tokenized.input_ids[:last_start] == prompt_ids(smollm2_reasoning, fmt, messages[:3])
    # a single answer without reasoning: the template closes the empty think block itself
    plain_answer = tokenize_conversation(smollm2_reasoning, fmt, messages[:1] + [{"role": "assistant",
                                                                                  "content": "4"}])
    assert masked_runs(smollm2_reasoning, plain_answer) == ["\n</think>\n\n4<|im_end|>"]


def test_plain_format_for_model_without_template(stories):
    assert stories.chat_template is None
    with pytest.raises(ValueError, match="no chat template; pass --plain_format"):
        chat_format(stories, model_name="stories260K")
    fmt = chat_format(stories, plain_format=True)
    assert fmt.template == PLAIN_TEMPLATE and fmt.plain
    tokenized = tokenize_conversation(stories, fmt, WITH_SYSTEM)
    assert tokenized.text == ("<s>System: You answer briefly.\n\nUser: Hi there\n\nAssistant: Hello! How can I "
                              "help?</s>User: Tell me a story.\n\nAssistant: Once upon a time, a cat sat.</s>")
    assert masked_runs(stories, tokenized) == [" Hello! How can I help?</s>", " Once upon a time, a cat sat.</s>"]
    assert tokenized.input_ids[0] == stories.bos_token_id and tokenized.loss_mask[0] == 0
    assert_prefixes_match_generation_prompts(stories, fmt, WITH_SYSTEM, tokenized)


def test_truncated_last_turn_does_not_learn_end_of_turn(smollm2):
    fmt = chat_format(smollm2)
    tokenized = tokenize_conversation(smollm2, fmt, CONVERSATION, truncated_turns=[1])
    assert masked_runs(smollm2, tokenized) == ["Hello! How can I help?<|im_end|>", "Once upon a time, a cat sat."]
    tokenized = tokenize_conversation(smollm2, fmt, CONVERSATION, truncated_turns=[0])
    assert masked_runs(smollm2, tokenized) == ["Hello! How can I help?", "Once upon a time, a cat sat.<|im_end|>"]


def test_user_only_conversation_has_empty_mask(smollm2):
    tokenized = tokenize_conversation(smollm2, chat_format(smollm2), CONVERSATION[:1])
    assert sum(tokenized.loss_mask) == 0 and len(tokenized.input_ids) > 0


def test_highlight_marks_masked_runs(stories):
    fmt = chat_format(stories, plain_format=True)
    tokenized = tokenize_conversation(stories, fmt, CONVERSATION[:2])
    shown = highlight(stories, tokenized.input_ids, tokenized.loss_mask)
    assert shown.count("\u27e6") == 1 and shown.endswith("Hello! How can I help?</s>\u27e7")
