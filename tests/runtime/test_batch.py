"""Batched speculative decoding (generate_batch): every row of a batch equals that prompt decoded alone with
plain greedy decoding (rows of different lengths, rows finishing at different steps, EOS mid-step, any
proposer, sliding windows), finished rows leave the batch, rejection sampling stays exact per row at batch 4,
and bad batches are refused naming the row."""

import functools

import pytest
import torch

from runtime.config import DecodeConfig, SpeculationConfig
from runtime.loop import GenerationStats, generate_batch
from runtime.proposers import Autoregressive, DraftModelProposer, PromptLookupProposer, per_row
from runtime.sampling import SamplingConfig, logits_to_probs
from runtime.target import TargetModel
from runtime.tree import Tree
from tests.runtime.test_generate import perturbed_copy
from tests.runtime.test_head_proposers import (
    PROPOSERS,
    chi_square_pvalue,
    make_proposer,
    perm_target,
    small_vocab_target,
)
from tests.tiny_models import stories260k, tiny_model

BATCH_ARCHITECTURES = ["llama", "qwen3", "gpt2", "gemma2", "phi3", "deepseek_v3"]


def prompts(lengths, seed=0, vocab=256):
    """Prompts of the given lengths, each with a repeated stretch (prompt lookup finds matches)."""
    out = []
    for i, length in enumerate(lengths):
        part = torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed + i))
        out.append(torch.cat([part, part[: max(length // 2, 1)]]))
    return out


def plain_greedy(model, prompt, max_new_tokens, eos=()):
    """HF greedy decoding of one prompt alone, cut right after the first EOS: new tokens [n]."""
    out = model.generate(prompt[None], attention_mask=torch.ones(1, prompt.numel(), dtype=torch.long),
                         do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                         eos_token_id=None, pad_token_id=0)[0, prompt.numel():]
    hits = [i for i, t in enumerate(out.tolist()) if t in eos]
    return out[: hits[0] + 1] if hits else out


def run_batch(model, proposers, batch, max_new_tokens, k=4, size_for_batch=None, **config):
    config = DecodeConfig(max_new_tokens=max_new_tokens, speculation=SpeculationConfig(k), **config)
    stats = [GenerationStats() for _ in batch]
    rows = [[] for _ in batch]
    for step in generate_batch(TargetModel(model), proposers, batch, config, stats, size_for_batch):
        assert len(step) == len(batch)
        for row, tokens in zip(rows, step, strict=True):
            row.extend(tokens.tolist())
    return [torch.tensor(r, dtype=torch.long) for r in rows], stats


def _quiet_model(name):
    model = stories260k() if name == "stories260K" else tiny_model(name)
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("name", BATCH_ARCHITECTURES + ["stories260K"])
def test_batched_rows_equal_plain_greedy_alone(name):
    """Rows of different lengths, draft-model trees and prompt lookup: each row == its prompt decoded alone."""
    model = _quiet_model(name)
    batch = prompts([5, 17, 9, 30])
    expected = [plain_greedy(model, p, 40) for p in batch]
    draft = DraftModelProposer(perturbed_copy(model), model.config.vocab_size, branching=(2, 1))
    out, stats = run_batch(model, per_row(draft, len(batch)), batch, 40, k=6)
    assert all(torch.equal(o, e) for o, e in zip(out, expected, strict=True))
    assert all(s.new_tokens == 40 and s.stop_reason == "max_new_tokens" for s in stats)
    assert min(s.tau for s in stats) > 1.2, "the perturbed copy must get drafts accepted in every row"
    out, stats = run_batch(model, per_row(PromptLookupProposer(), len(batch)), batch, 40)
    assert all(torch.equal(o, e) for o, e in zip(out, expected, strict=True))
    by_cost = PromptLookupProposer(step_costs=[1.0, 1.5, 1.6, 1.7, 1.8, 1.9, 2.0])  # each row learns its own length
    out, stats = run_batch(model, per_row(by_cost, len(batch)), batch, 40)
    assert all(torch.equal(o, e) for o, e in zip(out, expected, strict=True))


@pytest.mark.parametrize("name", PROPOSERS)
def test_batched_head_proposers_equal_plain_greedy(name):
    """Medusa, EAGLE-1/2, EAGLE-3 and MTP drafting per row, verified together."""
    model, sigma = perm_target("llama")
    model.generation_config.eos_token_id = None
    batch = prompts([3, 11, 6], seed=4, vocab=model.config.vocab_size)
    proposer = make_proposer(name, model, sigma)
    out, stats = run_batch(model, per_row(proposer, len(batch)), batch, 30, k=proposer.tree_size,
                           eos_token_ids=())
    for o, p in zip(out, batch, strict=True):
        assert torch.equal(o, plain_greedy(model, p, 30))
    assert min(s.tau for s in stats) > 1.5, "heads built to predict the permutation target must be accepted"


def test_rows_finish_at_different_steps_and_leave_the_batch():
    """EOS mid-step in one row, a shorter max_new_tokens reach in another: each row stops right after its own
    EOS, the others go on, and every later forward runs only the rows still decoding."""
    model = _quiet_model("llama")
    batch = prompts([4, 12, 8])
    alone = [plain_greedy(model, p, 50) for p in batch]
    eos = int(alone[1][9])  # the 10th token of row 1: its row stops there (others stop at their first one, if any)
    expected = [plain_greedy(model, p, 50, eos=(eos,)) for p in batch]
    assert len({e.numel() for e in expected}) > 1, "rows must finish at different steps"
    draft = DraftModelProposer(perturbed_copy(model), model.config.vocab_size)  # copied before the spy is set
    batch_sizes = []
    original = model.forward

    @functools.wraps(original)  # keeps forward's signature: the target passes its cache by the keyword forward takes
    def spy(*args, **kwargs):
        batch_sizes.append(kwargs["input_ids"].shape[0])
        return original(*args, **kwargs)

    model.forward = spy
    out, stats = run_batch(model, per_row(draft, 3), batch, 50, k=4, eos_token_ids=(eos,))
    assert all(torch.equal(o, e) for o, e in zip(out, expected, strict=True))
    assert [s.stop_reason for s in stats] == ["eos" if e.numel() < 50 else "max_new_tokens" for e in expected]
    verify_sizes = batch_sizes[3:]  # after one prefill per row
    assert verify_sizes == sorted(verify_sizes, reverse=True) and verify_sizes[-1] < 3


def test_sliding_window_rows_past_the_window():
    model = tiny_model("mistral", sliding_window=8)
    model.generation_config.eos_token_id = None
    batch = prompts([3, 14, 7])
    draft = DraftModelProposer(perturbed_copy(model), model.config.vocab_size, branching=(2,))
    out, _ = run_batch(model, per_row(draft, 3), batch, 30, k=5)
    assert all(torch.equal(o, plain_greedy(model, p, 30)) for o, p in zip(out, batch, strict=True))


def test_planner_size_zero_is_plain_decoding_and_sizes_may_change_per_batch():
    """size_for_batch: 0 drafts nothing (tau 1); a size that depends on the rows left stays exact."""
    model = _quiet_model("qwen3")
    batch = prompts([6, 10])
    expected = [plain_greedy(model, p, 20) for p in batch]
    draft = DraftModelProposer(perturbed_copy(model), model.config.vocab_size)
    out, stats = run_batch(model, per_row(draft, 2), batch, 20, k=8, size_for_batch=lambda rows: [0] * rows)
    assert all(torch.equal(o, e) for o, e in zip(out, expected, strict=True)) and all(s.tau == 1.0 for s in stats)
    seen = []
    out, _ = run_batch(model, per_row(draft, 2), batch, 20, k=8,
                       size_for_batch=lambda rows: seen.append(rows) or [3 if rows > 1 else 1] * rows)
    assert all(torch.equal(o, e) for o, e in zip(out, expected, strict=True)) and 2 in seen


def _exact_joint(model, prompt, sampling):
    """p(t1, t2 | prompt) [V, V] from plain forwards."""
    vocab = model.config.vocab_size
    with torch.no_grad():
        p1 = logits_to_probs(model(prompt[None]).logits[0, -1], sampling)
        seqs = torch.cat([prompt.repeat(vocab, 1), torch.arange(vocab)[:, None]], dim=1)
        p2 = logits_to_probs(model(seqs).logits[:, -1], sampling)  # [V, V]
    return p1[:, None] * p2


def test_rejection_sampling_is_exact_per_row_at_batch_4():
    """Batch of 4 rows (two prompts of different lengths, twice each) with EAGLE-2 trees and Medusa
    sampling: the first two tokens of each row follow the target's exact joint (chi-square, p > 1e-3)."""
    model = small_vocab_target()
    sampling = SamplingConfig(temperature=1.0)
    prompt_a, prompt_b = torch.tensor([1, 5, 3, 6, 7, 4, 3]), torch.tensor([2, 6, 4])
    batch = [prompt_a, prompt_b, prompt_a, prompt_b]
    vocab = model.config.vocab_size
    for name in ("medusa", "eagle2"):
        proposer = make_proposer(name, model, sampling=sampling, seed=6)
        counts = {0: torch.zeros(vocab, vocab), 1: torch.zeros(vocab, vocab)}
        for run in range(150):  # 4 new tokens: t2 comes from a verified draft of up to 2 tokens
            out, stats = run_batch(model, per_row(proposer, 4), batch, 4, k=proposer.tree_size, sampling=sampling,
                                   acceptance="rejection", seed=run, eos_token_ids=())
            assert all(s.steps[0].drafted_nodes >= 2 for s in stats)
            for row, tokens in enumerate(out):
                counts[row % 2][tokens[0], tokens[1]] += 1
        for which, prompt in ((0, prompt_a), (1, prompt_b)):
            assert chi_square_pvalue(counts[which], _exact_joint(model, prompt, sampling)) > 1e-3, (name, which)


def test_a_batch_too_big_for_memory_is_refused_with_the_estimate(monkeypatch):
    import runtime.target

    model = _quiet_model("llama")
    monkeypatch.setattr(runtime.target, "available_memory", lambda device: 1000)
    with pytest.raises(ValueError, match=r"batch of 2 prompts .* needs ~.* GiB .* free"):
        list(generate_batch(TargetModel(model), per_row(Autoregressive(), 2), prompts([4, 6]), DecodeConfig(4)))


def test_bad_batches_name_the_row():
    model = _quiet_model("llama")
    config = DecodeConfig(max_new_tokens=4)
    batch = [torch.tensor([1, 2, 3]), torch.tensor([], dtype=torch.long)]
    with pytest.raises(ValueError, match="prompt 1 of the batch: prompt: empty"):
        list(generate_batch(TargetModel(model), per_row(Autoregressive(), 2), batch, config))
    with pytest.raises(ValueError, match="one per row"):
        list(generate_batch(TargetModel(model), [Autoregressive()], batch, config))
    with pytest.raises(ValueError, match="distinct proposer"):
        proposer = Autoregressive()
        list(generate_batch(TargetModel(model), [proposer, proposer], [batch[0], batch[0]], config))
    with pytest.raises(ValueError, match="chain mode.*one at a time"):
        list(generate_batch(TargetModel(model, mode="chain"), per_row(Autoregressive(), 2), [batch[0]] * 2, config))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_grouped_prefill_is_each_prompt_alone_up_to_rounding(arch):
    """TargetModel.group_prefill (the data engine's): 11 prompts of mixed lengths in length-sorted, right-padded
    groups (more than one group) give each prompt's last logits and hidden states as its own prefill does, up to
    float32 rounding, the same row lengths and slots, and the next step of every row sees its own prompt only."""
    model = tiny_model(arch)
    lengths = [17, 3, 40, 9, 9, 25, 1, 33, 12, 5, 28]
    batch = [torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]
    results = []
    for grouped in (False, True):
        target = TargetModel(model)
        target.group_prefill = grouped
        outs = target.prefill_rows(batch, (-1,))
        state = (list(target.row_lengths), target.slots)
        step = target.forward_rows([torch.tensor([7 + b]) for b in range(len(batch))], [Tree.chain(0)] * len(batch))
        results.append((outs, state, step))
    (alone, state, step), (grouped, grouped_state, grouped_step) = results
    assert grouped_state == state == (lengths, max(lengths))
    for a, g, s, gs in zip(alone, grouped, step, grouped_step, strict=True):
        assert torch.allclose(a.logits, g.logits, atol=1e-5) and a.logits.shape == g.logits.shape
        assert torch.allclose(a.hidden[-1], g.hidden[-1], atol=1e-5) and a.hidden[-1].shape == g.hidden[-1].shape
        assert torch.allclose(s.logits, gs.logits, atol=1e-5)
