"""Parallel drafters (DFlash, P-EAGLE) through the ONE decode loop, adapter and acceptance module.

- Greedy output == `model.generate(do_sample=False)` token for token on 8 architectures and stories260K, with random
  heads and with "oracle" rows (the proposer's own rows plus a large bonus on the target's true continuation), so
  multi-token acceptance, context feeding and cache cropping run.
- Parity: every logits row drafted incrementally (context cache, lazily fed committed entries) == a from-scratch
  forward without any cache (fp64); the training-time forwards (all blocks / all depths of a sequence under one
  mask) == that same per-position forward.
- Sampling: the first two emitted tokens follow the target's exact joint distribution (chi-square, p > 1e-3).
- Batches, the factory (kinds, auto size from per-position accuracy), bad input.
"""

from __future__ import annotations

import pytest
import torch

from heads import HeadsConfig, build_heads
from runtime.proposers import per_row
from runtime.proposers.factory import HeadsOptions, proposer_from_heads
from runtime.proposers.parallel import DFlashProposer, PEagleProposer
from runtime.sampling import SamplingConfig
from runtime.target import TargetModel
from runtime.tree_search import static_tree
from tests.runtime.test_head_proposers import (
    SAMPLES,
    chi_square_pvalue,
    first_two_tokens,
    reference,
    run_loop,
    small_vocab_target,
)
from tests.tiny_models import stories260k, tiny_model
from training.methods import dflash_blocks, peagle_entries

KINDS = ["dflash", "peagle"]
TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]
ARCHITECTURES = ["llama", "qwen3", "mistral", "phi3", "gemma2", "gpt2", "gemma3_text", "deepseek_v3"]


def make_heads(kind: str, model, seed: int = 0, block_size: int = 5, layers: int = 2, **options):
    torch.manual_seed(seed)
    config = HeadsConfig.for_target(kind, model, "tiny-target", block_size=block_size, num_draft_layers=layers,
                                    **options)
    heads = build_heads(config).to(model.dtype).eval()
    with torch.no_grad():
        for p in heads.parameters():  # weights large enough that the context and every slot matter
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=p.dtype) * 0.05)
    return heads


def make_proposer(kind: str, model, tree=TREE, sampling=None, seed: int = 0, **options):
    heads = make_heads(kind, model, seed, **options)
    cls = DFlashProposer if kind == "dflash" else PEagleProposer
    return cls(heads, model, static_tree(tree, num_heads=heads.config.draft_tokens), sampling, seed)


def with_oracle(proposer, prompt: torch.Tensor, continuation: torch.Tensor, rows: list | None = None):
    """Add a large bonus on the true continuation to the proposer's own rows (which still run: its state is fed as
    usual); `rows` collects (committed length, real rows) for the parity check."""
    real = proposer.depth_logits

    def depth_logits(committed, depth):
        logits = real(committed, depth)
        if logits is None:
            return None
        if rows is not None:
            rows.append((committed.numel(), logits.clone()))
        start = committed.numel() - prompt.numel()
        boosted = logits.clone()
        for d in range(depth):
            if start + d < continuation.numel():
                boosted[d, int(continuation[start + d])] += 1e4
        return boosted

    proposer.depth_logits = depth_logits
    return proposer


# ------------------------------------------------------------------------------------ greedy equivalence

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_identical_other_architectures(arch, kind):
    model = tiny_model(arch)
    prompt = torch.randint(3, 256, (11,), generator=torch.Generator().manual_seed(1))
    expected = reference(model, prompt, 40)
    tokens, _ = run_loop(model, make_proposer(kind, model, seed=2), prompt, 40)  # random heads
    assert torch.equal(tokens, expected)
    oracle = with_oracle(make_proposer(kind, model, seed=2), prompt, expected)
    tokens, stats = run_loop(model, oracle, prompt, 40)
    assert torch.equal(tokens, expected)
    assert stats.tau > 3.0, f"oracle rows must be accepted deep, tau {stats.tau:.2f}"


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_identical_stories260k(kind):
    model = stories260k()
    prompt = torch.tensor([1, 403, 407, 261, 378, 285, 446, 374])
    tokens, _ = run_loop(model, make_proposer(kind, model, seed=3, draft_vocab_size=200 if kind == "peagle" else 0),
                         prompt, 48)
    assert torch.equal(tokens, reference(model, prompt, 48))


# ----------------------------------------------------------------------------- parity with scratch forwards

def scratch_rows(kind: str, heads, model, committed: torch.Tensor, depth: int) -> torch.Tensor:
    """Logits rows of depths 0..depth-1 for the root committed[-1], recomputed with no cache at all."""
    emb = model.get_input_embeddings()
    hs = model(committed[None], output_hidden_states=True).hidden_states
    t = committed.numel() - 1  # root position: the context / committed entries are 0..t-1
    feats = heads.project([hs[i][0, :t] for i in heads.config.target_layers])
    if kind == "dflash":
        cache = heads.context_cache(feats[None], torch.arange(t)[None])
        block = heads.block_ids(committed[-1:])
        out = heads(block, embed_tokens=emb, position_ids=torch.arange(t, t + heads.block_size)[None], context=cache)
        return heads.compute_logits(out[0, 1: depth + 1], model.get_output_embeddings())
    masked = depth - 1
    hidden = torch.cat([feats, heads.mask_features(masked)])
    ids = torch.cat([committed[1: t + 1], torch.full((masked,), heads.config.mask_token_id)])
    out, _ = heads(hidden[None], ids[None], embed_tokens=emb, position_ids=torch.arange(t + masked)[None])
    return heads.compute_logits(out[0, t - 1:])


@pytest.mark.parametrize("kind", KINDS)
def test_incremental_rows_equal_scratch(kind):
    """After oracle-driven steps (several tokens accepted per step), every row drafted == the no-cache forward."""
    model = tiny_model("llama", dtype=torch.float64)
    prompt = torch.randint(3, 256, (9,), generator=torch.Generator().manual_seed(2))
    expected = reference(model, prompt, 24)
    rows: list = []
    proposer = with_oracle(make_proposer(kind, model, seed=4), prompt, expected, rows)
    tokens, stats = run_loop(model, proposer, prompt, 24)
    assert torch.equal(tokens, expected) and stats.tau > 2.0 and len(rows) >= 4
    committed_all = torch.cat([prompt, tokens])
    with torch.no_grad():
        for length, row in rows:
            want = scratch_rows(kind, proposer.heads, model, committed_all[:length], row.shape[0])
            torch.testing.assert_close(row.float(), want.float(), rtol=1e-9, atol=1e-9)


def test_dflash_training_blocks_equal_runtime_blocks():
    """All blocks of two sequences in one forward under the training mask == each block run alone (runtime)."""
    model = tiny_model("llama", dtype=torch.float64)
    heads = make_heads("dflash", model, seed=5)
    ids = torch.randint(3, 256, (2, 20), generator=torch.Generator().manual_seed(3))
    hs = model(ids, output_hidden_states=True).hidden_states
    context = heads.project([hs[i] for i in heads.config.target_layers])
    anchors = torch.tensor([[3, 9, 14], [5, 6, 18]])
    valid = torch.tensor([[True, True, True], [True, False, True]])
    with torch.no_grad():
        out = dflash_blocks(heads, context, ids, anchors, valid, model.get_input_embeddings())
        for b in range(2):
            for j in range(3):
                if not valid[b, j]:
                    continue
                a = int(anchors[b, j])
                want = scratch_rows("dflash", heads, model, ids[b, : a + 1], heads.block_size - 1)
                got = heads.compute_logits(out[b, j, 1:], model.get_output_embeddings())
                torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_peagle_training_depths_equal_runtime_depths():
    """Depth-0 entries of every position and masked entries of a nested subset, one forward == per-root runtime."""
    model = tiny_model("llama", dtype=torch.float64)
    heads = make_heads("peagle", model, seed=6, block_size=4)
    ids = torch.randint(3, 256, (1, 16), generator=torch.Generator().manual_seed(4))
    hs = model(ids, output_hidden_states=True).hidden_states
    first = heads.project([hs[i] for i in heads.config.target_layers])
    groups = [(torch.arange(16)[None], torch.ones(1, 16, dtype=torch.bool)),
              (torch.tensor([[2, 7, 11]]), torch.ones(1, 3, dtype=torch.bool)),
              (torch.tensor([[7, 11, 0]]), torch.tensor([[True, True, False]])),
              (torch.tensor([[11]]), torch.ones(1, 1, dtype=torch.bool))]
    with torch.no_grad():
        out = peagle_entries(heads, first, ids, groups, model.get_input_embeddings())[0]
        offsets = [0, 16, 19, 22]
        for t in (2, 7, 11):  # chain from position t: root token t+1 at position t+1
            want = scratch_rows("peagle", heads, model, ids[0, : t + 2], 4)
            got = [out[t]] + [out[offsets[d] + int((groups[d][0][0] == t).nonzero()[0])] for d in range(1, 4)
                              if bool((groups[d][0][0] == t).any() & groups[d][1][0][(groups[d][0][0] == t)].any())]
            torch.testing.assert_close(heads.compute_logits(torch.stack(got)), want[: len(got)], rtol=1e-9, atol=1e-9)


# ----------------------------------------------------------------------------------------------- sampling

@pytest.mark.parametrize("kind", KINDS)
def test_tree_rejection_sampling_matches_target(kind):
    model = small_vocab_target()
    sampling = SamplingConfig(temperature=1.0)
    options = {"draft_vocab_size": 6} if kind == "peagle" else {}
    proposer = make_proposer(kind, model, tree=[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]], sampling=sampling,
                             seed=6, block_size=4, **options)
    counts, exact = first_two_tokens(model, proposer, SAMPLES)
    drafted = proposer.propose(torch.tensor([1, 5, 3, 6, 7, 4, 3, 5, 6]), proposer.tree_size)
    assert drafted.tree.num_nodes > 2 and drafted.probs is not None  # sampled children with their q rows
    assert chi_square_pvalue(counts, exact) > 1e-3


# ------------------------------------------------------------------------------------ batches and factory

@pytest.mark.parametrize("kind", KINDS)
def test_batched_rows_equal_plain_greedy(kind):
    from tests.runtime.test_batch import plain_greedy, prompts, run_batch

    model = tiny_model("qwen3")
    model.generation_config.eos_token_id = None
    batch = prompts([3, 11, 6], seed=4)
    proposer = make_proposer(kind, model, seed=1)
    out, _ = run_batch(model, per_row(proposer, len(batch)), batch, 24, k=proposer.tree_size, eos_token_ids=())
    for o, p in zip(out, batch, strict=True):
        assert torch.equal(o, plain_greedy(model, p, 24))


@pytest.mark.parametrize("kind", KINDS)
def test_factory_builds_and_plans(kind, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    model = tiny_model("llama")
    target = TargetModel(model)
    heads = make_heads(kind, model)
    heads.save_pretrained(tmp_path / "h")
    cls = DFlashProposer if kind == "dflash" else PEagleProposer
    built = proposer_from_heads(tmp_path / "h", target, HeadsOptions(tree_size="3"), target_name="tiny-target")
    assert type(built.proposer) is cls and built.size == 3 and built.proposer.tree.tree.max_depth == 3  # a chain
    with pytest.raises(ValueError, match=f"--tree_size 9: {kind} heads draft a chain of at most "
                                         f"{heads.config.draft_tokens} tokens"):
        proposer_from_heads(tmp_path / "h", target, HeadsOptions(tree_size="9"), target_name="tiny-target")
    heads.config.metrics = {"top1_accuracy_per_depth": [0.8, 0.6, 0.5, 0.4, 0.3][: heads.config.draft_tokens],
                            "top3_accuracy_per_depth": [0.9, 0.8, 0.7, 0.6, 0.5][: heads.config.draft_tokens]}
    planned = proposer_from_heads(heads, target, HeadsOptions(max_tree_size=8, cost_kv_length=16, allow_off=False),
                                  target_name="tiny-target")
    plain, *rows = planned.plan.rows
    assert [r["size"] for r in rows] == list(range(1, 9))
    assert planned.size == max(rows, key=lambda r: r["tokens_per_second"])["size"]
    prompt = torch.randint(3, 256, (11,), generator=torch.Generator().manual_seed(1))
    tokens, _ = run_loop(model, planned.proposer, prompt, 20)
    assert torch.equal(tokens, reference(model, prompt, 20))


def test_one_forward_per_step():
    """Whatever the tree, a propose() runs the drafter once (DFlash: one block; P-EAGLE: one causal forward)."""
    model = tiny_model("llama")
    for kind in KINDS:
        proposer = make_proposer(kind, model)
        calls: list[int] = []
        original = type(proposer.heads).forward

        def counting(self, *args, calls=calls, original=original, **kwargs):
            calls.append(1)
            return original(self, *args, **kwargs)

        type(proposer.heads).forward = counting
        try:
            prompt = torch.randint(3, 256, (11,), generator=torch.Generator().manual_seed(1))
            _, stats = run_loop(model, proposer, prompt, 12)
        finally:
            type(proposer.heads).forward = original
        drafted = sum(1 for step in stats.steps if step.drafted_nodes > 0)
        assert len(calls) == drafted > 3, (kind, len(calls), drafted)


def test_bad_tree_for_the_block():
    model = tiny_model("llama")
    heads = make_heads("dflash", model, block_size=3)  # drafts 2 positions
    with pytest.raises(ValueError, match="deeper than the 2 heads"):
        DFlashProposer(heads, model, static_tree([[0], [0, 0], [0, 0, 0]]))


@pytest.mark.parametrize("kind", KINDS)
def test_hybrid_with_a_parallel_drafter(kind):
    """Prompt lookup and a parallel drafter in one tree per step: still plain greedy decoding's output."""
    from runtime.proposers.hybrid import HybridProposer
    from tests.runtime.test_head_proposers import CHEAP_STEPS

    model = tiny_model("llama")
    part = torch.randint(3, 256, (11,), generator=torch.Generator().manual_seed(1))
    prompt = torch.cat([part, part])
    expected = reference(model, prompt, 30)
    head = with_oracle(make_proposer(kind, model), prompt, expected)
    tokens, stats = run_loop(model, HybridProposer(head, head.tree_size, 2.5, CHEAP_STEPS, max_lookup=6), prompt, 30)
    assert torch.equal(tokens, expected) and stats.tau > 2.0
