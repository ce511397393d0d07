"""The Python API (runtime/api.py) on the real stories260K model: generate on text, a batch of texts and token
ids equals plain greedy decoding of each prompt alone; stream gives the same text; bad input names itself.
And the planner: sizes shrink to plain decoding as the batch fills a device whose verify cost grows with
rows x tokens."""

import pytest
import torch

from runtime.api import SpecGenerationConfig, SpeculativeModel
from runtime.loop import GenerationStats
from runtime.planner import BatchPlanner, DraftProfile
from tests.tiny_models import STORIES260K


@pytest.fixture(scope="module")
def model():
    # float32 pinned: identity with transformers' generate (the reference below) is a float32 property; where --dtype
    # auto picks bfloat16 (an AVX512-BF16 CPU, or SPECHEADS_CPU_BF16=native), transformers' bf16 kernels round
    # differently from ours (bf16 identity with our own plain loop: tests/runtime/test_row_attention.py)
    return SpeculativeModel.from_pretrained(str(STORIES260K), method="prompt_lookup", num_speculative_tokens="4",
                                            dtype="float32")


def plain(model, ids, max_new_tokens):
    out = model.target.model.generate(ids[None], attention_mask=torch.ones(1, ids.numel(), dtype=torch.long),
                                      do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, ids.numel():].tolist()


PROMPTS = ["Once upon a time, there was a little girl named Lily. Lily", "The cat sat on the mat. The cat",
           "Tom had a red ball."]


def test_generate_text_batch_and_ids_equal_plain_greedy(model):
    one = model.generate(PROMPTS[0], max_new_tokens=30)
    ids = model._encode(PROMPTS[0])[0]
    expected = plain(model, ids, 30)
    assert one.token_ids[:len(expected)] == expected[:len(one.token_ids)] and one.text
    many = model.generate(PROMPTS, SpecGenerationConfig(max_new_tokens=30))
    assert isinstance(many, list) and len(many) == 3 and many[0].token_ids == one.token_ids
    for out, prompt in zip(many, PROMPTS, strict=True):
        ids = model._encode(prompt)[0]
        reference = plain(model, ids, 30)
        assert out.token_ids == reference[:len(out.token_ids)]  # cut at EOS, where the model stops
        assert out.stats.new_tokens == len(out.token_ids)
    from_ids = model.generate(ids, max_new_tokens=10)
    assert from_ids.text is None and from_ids.token_ids == plain(model, ids, 10)[:len(from_ids.token_ids)]


def test_stream_gives_the_generated_text(model):
    stats = GenerationStats()
    text = "".join(model.stream(PROMPTS[1], stats=stats, max_new_tokens=25))
    assert text == model.generate(PROMPTS[1], max_new_tokens=25).text
    assert stats.new_tokens > 0 and stats.tau >= 1.0


def test_sampling_options_and_bad_input(model):
    a = model.generate(PROMPTS[2], do_sample=True, temperature=0.8, top_k=20, seed=3, max_new_tokens=12)
    b = model.generate(PROMPTS[2], do_sample=True, temperature=0.8, top_k=20, seed=3, max_new_tokens=12)
    assert a.token_ids == b.token_ids  # seeded
    with pytest.raises(ValueError, match="prompt 1: empty text"):
        model.generate(["fine", "  "])
    with pytest.raises(ValueError, match="temperature"):
        model.generate("x", do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="unknown options.*bogus"):
        SpeculativeModel.from_pretrained(str(STORIES260K), bogus=1)
    with pytest.raises(ValueError, match="empty list"):
        model.generate([])


def test_planner_turns_drafting_down_as_the_batch_fills():
    """Verify cost = a fixed weight-streaming part plus a part per (row x token): at batch 1 the extra tokens
    are nearly free and the planner drafts; at batch 64 they are not and it plans plain decoding."""
    profile = DraftProfile(sizes=[1, 2, 4, 8], expected_tau=[1.7, 2.2, 2.7, 3.0], draft_seconds=[0.0] * 4)

    def verify_seconds(rows, tokens):
        return 1.0 + 0.05 * rows * tokens

    planner = BatchPlanner(profile, verify_seconds)
    sizes = {batch: planner(batch)[0] for batch in (1, 4, 16, 64)}
    assert sizes[1] >= sizes[4] >= sizes[16] >= sizes[64] and sizes[1] >= 4 and sizes[64] == 0
    assert planner(4) == [sizes[4]] * 4
    table = planner.table([1, 64])
    assert table[1]["size"] == 0 and table[0]["expected_tokens_per_second"] > table[0]["plain_tokens_per_second"]


def test_batched_heads_with_the_planner_equal_plain_greedy(tmp_path, monkeypatch, capsys):
    """Heads with tree_size auto: the API measures the verify cost over rows x tokens, prints the planner's
    size per batch size, and a batch of 3 decodes identically to each prompt alone."""
    from heads import HeadsConfig, build_heads
    from tests.tiny_models import stories260k

    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    target = stories260k()
    config = HeadsConfig.for_target("eagle", target, str(STORIES260K))
    config.metrics = {"top1_accuracy_per_depth": [0.9, 0.85, 0.8], "top3_accuracy_per_depth": [0.95, 0.9, 0.9]}
    build_heads(config).save_pretrained(tmp_path / "eagle")
    model = SpeculativeModel.from_pretrained(str(STORIES260K), heads=str(tmp_path / "eagle"), tree_depth="3",
                                             tree_top_k="2", dtype="float32")  # compared with generate: float32
    outs = model.generate(PROMPTS, max_new_tokens=20)
    assert "[planner]" in capsys.readouterr().err and model._planner_sizes == [1, 2, 4]
    for out, prompt in zip(outs, PROMPTS, strict=True):
        ids = model._encode(prompt)[0]
        assert out.token_ids == plain(model, ids, 20)[:len(out.token_ids)]
