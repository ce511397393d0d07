"""Head proposers (Medusa, EAGLE-1/2, EAGLE-3, MTP) through the ONE decode loop, adapter and acceptance module.

- Greedy output == `model.generate(do_sample=False)` token for token, with random heads (stories260K) and
  with "oracle" heads that draft well, so multi-token acceptance, KV trimming and feature feeding run
  (targets whose greedy next token is mostly a fixed permutation sigma of the current token).
- Drafts made incrementally (draft KV cache, lazily fed committed entries, tree entries) == drafts recomputed
  from scratch without any cache (fp64).
- Sampling: the first two emitted tokens follow the target's exact joint distribution (chi-square test,
  p-value > 1e-3) through every proposer with tree rejection sampling; a proposer reporting a wrong q fails it.
- Bad input: heads for another target, tree deeper than the heads, top_k larger than the draft vocabulary.
"""

from __future__ import annotations

import pytest
import torch

from heads import HeadsConfig, build_heads
from heads.draft_vocab import build_vocab_mapping, draft_target_ids
from runtime.acceptance import accept
from runtime.config import DecodeConfig, SpeculationConfig
from runtime.cost_model import CostCurve, DraftTimer, StepCosts
from runtime.loop import GenerationStats, generate
from runtime.proposers.base import Autoregressive, Draft, pending_entries, root_only
from runtime.proposers.eagle import DynamicTreeConfig, EagleProposer
from runtime.proposers.eagle3 import Eagle3Proposer
from runtime.proposers.factory import HeadsOptions, accuracy_table, proposer_from_heads
from runtime.proposers.hybrid import HybridProposer
from runtime.proposers.medusa import MedusaProposer
from runtime.proposers.mtp import MTPProposer
from runtime.sampling import SamplingConfig, logits_to_probs
from runtime.target import TargetModel
from runtime.tree import Tree
from runtime.tree_search import load_tree_file, static_tree
from tests.tiny_models import REPO, STORIES260K, stories260k, tiny_model

TREE16 = REPO / "configs" / "trees" / "medusa_default_16.yaml"
EAGLE1_TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]
PROPOSERS = ["medusa", "eagle2", "eagle1", "eagle3", "mtp", "hybrid"]
# the hybrid's step costs in these tests: verify nearly free per extra token, a cheap draft (it drafts both sources)
CHEAP_STEPS = StepCosts([256], [CostCurve([1, 64], [1.0, 1.0 + 0.02 * 63])], [0.05])


# ---------------------------------------------------------------------------------------------- fixtures

HYBRID_HEAD = {"hybrid_medusa": "medusa"}  # make_proposer("hybrid_medusa"): lookup + sampled Medusa children

def perm_target(arch: str, scale: float = 5.0, seed: int = 0, **overrides):
    """A tiny model whose greedy next token is mostly sigma(current token): big embeddings dominate the
    residual stream and lm_head rows are the embeddings permuted. Returns (model, sigma [V])."""
    model = tiny_model(arch, seed=seed, **overrides)
    vocab = model.config.vocab_size
    sigma = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed + 5))
    with torch.no_grad():
        embed = model.get_input_embeddings().weight
        embed.mul_(scale)
        model.get_output_embeddings().weight.copy_(embed[torch.argsort(sigma)])
    return model, sigma


def _inverse_power(sigma: torch.Tensor, power: int) -> torch.Tensor:
    """idx with idx[v] = sigma^{-power}(v)."""
    inverse, idx = torch.argsort(sigma), torch.arange(sigma.numel())
    for _ in range(power):
        idx = inverse[idx]
    return idx


def _quiet(layer) -> None:
    """Shrink a draft decoder layer's attention/MLP outputs (still non-zero, so its KV cache matters)."""
    with torch.no_grad():
        layer.self_attn.o_proj.weight.mul_(0.1)
        layer.mlp.down_proj.weight.mul_(0.1)


def make_heads(kind: str, model, sigma: torch.Tensor | None = None, seed: int = 0, **options):
    """Random heads of `kind` for `model`; with `sigma`, heads that predict the permutation target well."""
    torch.manual_seed(seed)
    defaults = {"medusa": dict(medusa_num_heads=4), "eagle3": dict(draft_vocab_size=200), "mtp": dict(mtp_num_depths=3)}
    config = HeadsConfig.for_target(kind, model, "tiny-target", **{**defaults.get(kind, {}), **options})
    heads = build_heads(config).to(model.dtype).eval()
    if sigma is None:
        return heads
    embed = model.get_input_embeddings().weight
    hidden = config.hidden_size
    eye, zero = torch.eye(hidden), torch.zeros(hidden, hidden)
    with torch.no_grad():
        if kind == "medusa":
            for h, head in enumerate(heads.heads):
                head[-1].weight.copy_(embed[_inverse_power(sigma, h + 2)])
        elif kind == "eagle":
            heads.fc.weight.copy_(torch.cat([eye, zero], 1))  # cat(embed(token t+1), feature) -> embed
            _quiet(heads.layers[0])
        elif kind == "eagle3":
            heads.fc.weight.copy_(torch.cat([zero, eye, zero], 1))  # the middle layer's feature ~ embed(t)
            _quiet(heads.midlayer)
            targets = heads.draft_to_target(torch.arange(config.draft_vocab_size))
            heads.lm_head.weight.copy_(embed[_inverse_power(sigma, 2)[targets]])
        elif kind == "mtp":
            for layer in heads.layers:
                layer.eh_proj.weight.copy_(torch.cat([eye, zero], 1))
                _quiet(layer.block)
    return heads


def make_proposer(name: str, model, sigma=None, sampling=None, seed: int = 0, draft_vocab=None, **head_options):
    """draft_vocab: (token counts [V], size) gives Medusa/EAGLE/MTP heads a reduced draft vocabulary. "hybrid":
    prompt lookup + the EAGLE-2 heads in one tree (HYBRID_HEAD for another head)."""
    if name.startswith("hybrid"):
        head = make_proposer(HYBRID_HEAD.get(name, "eagle2"), model, sigma, sampling, seed, draft_vocab, **head_options)
        return HybridProposer(head, head.tree_size, 2.5 if name == "hybrid_medusa" else 2.0, CHEAP_STEPS, max_lookup=6,
                              gate=True)  # the confidence gate's path too (EAGLE-2 heads)
    kind = {"medusa": "medusa", "eagle2": "eagle", "eagle1": "eagle", "eagle3": "eagle3", "mtp": "mtp"}[name]
    heads = make_heads(kind, model, sigma, seed=seed, **head_options)
    if draft_vocab is not None:
        heads.set_vocab_mapping(*build_vocab_mapping(*draft_vocab))
    if name == "medusa":
        return MedusaProposer(heads, model, load_tree_file(TREE16, num_heads=4), sampling, seed)
    if name == "eagle2":
        return EagleProposer(heads, model, dynamic=DynamicTreeConfig(depth=4, top_k=3, total_tokens=10),
                             sampling=sampling, seed=seed)
    if name == "eagle1":
        return EagleProposer(heads, model, tree=static_tree(EAGLE1_TREE), sampling=sampling, seed=seed)
    if name == "eagle3":
        return Eagle3Proposer(heads, model, dynamic=DynamicTreeConfig(depth=3, top_k=3, total_tokens=8),
                              sampling=sampling, seed=seed)
    return MTPProposer(heads, model, 3, sampling, seed)


def run_loop(model, proposer, prompt: torch.Tensor, new_tokens: int, sampling=None, seed=0):
    config = DecodeConfig(max_new_tokens=new_tokens, eos_token_ids=(), sampling=sampling or SamplingConfig(),
                          speculation=SpeculationConfig(num_speculative_tokens=proposer.tree_size), seed=seed)
    stats = GenerationStats()
    tokens = torch.cat(list(generate(TargetModel(model), proposer, prompt, config, stats)))
    return tokens, stats


def reference(model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    out = model.generate(prompt[None], max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, prompt.numel():]


# ------------------------------------------------------------------------------------ greedy equivalence

@pytest.mark.parametrize("name", PROPOSERS)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_identical_with_drafting_heads(arch, name):
    model, sigma = perm_target(arch)
    prompt = torch.randint(3, 256, (11,), generator=torch.Generator().manual_seed(1))
    tokens, stats = run_loop(model, make_proposer(name, model, sigma), prompt, 80)
    assert torch.equal(tokens, reference(model, prompt, 80))
    assert stats.tau > 1.6, f"oracle heads should draft well, tau {stats.tau:.2f}"


@pytest.mark.parametrize("name", PROPOSERS)
def test_greedy_identical_stories260k_random_heads(name):
    model = stories260k()
    prompt = torch.tensor([1, 403, 407, 261, 378, 285, 446, 374])  # "Once upon a time ..." ids
    tokens, _ = run_loop(model, make_proposer(name, model, seed=3), prompt, 64)
    assert torch.equal(tokens, reference(model, prompt, 64))


# ------------------------------------------------------------------------- incremental == from scratch

def _scratch_logits(name: str, proposer, model, committed: torch.Tensor, path: list[int], first: int = 0
                    ) -> torch.Tensor:
    """Draft logits (target vocab; draft vocab for EAGLE-3) for the child of the node reached by `path` (root
    excluded), recomputed with no cache at all: target features of committed[first:-1] (EAGLE: entries before
    `first` are outside the draft's prompt window), then the path's entries."""
    heads, emb, lm_head = proposer.heads, model.get_input_embeddings(), model.get_output_embeddings()
    hs = model(committed[None], output_hidden_states=True).hidden_states
    t = committed.numel() - 1  # root position
    ids = torch.cat([committed, torch.tensor(path, dtype=torch.long)])
    if name == "mtp":  # depth d reads h_d(s) and token s+d+1, s = 0..T-1
        h = hs[-1][0, :t]
        for d in range(len(path) + 1):
            h = heads(h[None], ids[d + 1: d + 1 + t][None], depth=d, embed_tokens=emb,
                      position_ids=torch.arange(t)[None]).hidden_states[0]
        return heads.compute_logits(h[-1], depth=len(path), lm_head=lm_head)
    if name == "eagle3":
        feats = heads.project([hs[i][0, first:t] for i in heads.config.target_layers])
    else:
        feats = hs[-1][0, first:t]
    out = heads(feats[None], ids[first + 1: t + 1][None], embed_tokens=emb,
                position_ids=torch.arange(first, t)[None]).hidden_states[0]
    for j in range(len(path)):  # entry (previous entry's output, path[j]) at position t + j
        feats = torch.cat([feats, out[-1:]])
        out = heads(feats[None], ids[first + 1: t + 2 + j][None], embed_tokens=emb,
                    position_ids=torch.arange(first, t + 1 + j)[None]).hidden_states[0]
    return heads.compute_logits(out[-1]) if name == "eagle3" else heads.compute_logits(out[-1], lm_head)


@pytest.mark.parametrize("name,window", [("eagle1", None), ("eagle2", None), ("eagle3", None), ("mtp", None),
                                         ("eagle2", 4), ("eagle3", 4)])
def test_incremental_draft_equals_scratch(name, window, monkeypatch):
    """Every logits row the proposer drafted from equals a no-cache recomputation (fp64, 1e-9); with a prompt
    window of 4 (EAGLE), a recomputation over the prompt's last 4 entries at their true positions and all after."""
    model = tiny_model("llama", dtype=torch.float64)
    proposer = make_proposer(name, model, seed=4)
    if window is not None:
        proposer.prompt_window = window
    prompt = torch.randint(3, 256, (9,), generator=torch.Generator().manual_seed(2))
    tokens, _ = run_loop(model, proposer, prompt, 15)  # leaves the proposer's state after several steps
    committed = torch.cat([prompt, tokens])
    rows: list[tuple[list[int], torch.Tensor]] = []  # (path tokens below the root, logits row for its children)
    if name == "mtp":
        original = proposer._logits

        def recording_mtp(depth, h):
            out = original(depth, h)
            rows.append((depth, out))
            return out

        monkeypatch.setattr(proposer, "_logits", recording_mtp)
    else:
        from runtime.proposers import eagle

        original = eagle._DraftSession.rows_for
        token_of = {0: None}

        def recording(self, depth, nodes, node_tokens, parents):
            out = original(self, depth, nodes, node_tokens, parents)
            for node, token, row in zip(nodes, node_tokens, out, strict=True):
                token_of[node] = token
                path, walk = [], node
                while walk > 0:
                    path.append(token_of[walk])
                    walk = parents[walk]
                rows.append((path[::-1], row))
            return out

        monkeypatch.setattr(eagle._DraftSession, "rows_for", recording)
    draft = proposer.propose(committed, proposer.tree_size)
    assert draft.tree.max_depth >= 2 and len(rows) >= 3
    with torch.no_grad():
        for path, row in rows:
            if name == "mtp":  # the row of depth d is for the child of the chain node at depth d
                path = draft.tokens[1: path + 1].tolist()
            first = 0 if window is None else prompt.numel() - window
            expected = _scratch_logits(name, proposer, model, committed, path, first).float()
            torch.testing.assert_close(row.float().flatten(), expected.flatten(), rtol=1e-9, atol=1e-9)


# ----------------------------------------------------------------------------------------------- sampling

SAMPLES = 500


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells expected < 5 are merged into one. counts, probs: [K]."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    expected = probs * counts.sum()
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    expected = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = expected > 0
    observed, expected = observed[keep], expected[keep]
    stat = ((observed - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((observed.numel() - 1) / 2.0, dtype=torch.float64), stat / 2))


def first_two_tokens(model, proposer, samples: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Empirical counts [V, V] of the first two tokens emitted after a fixed context by draft -> verify ->
    tree rejection sampling (the second completed from the target when the step emitted one), and their exact
    target probabilities p(x) p(y | x)."""
    sampling = SamplingConfig(temperature=1.0)
    target = TargetModel(model)
    vocab = model.config.vocab_size
    prompt = torch.tensor([1, 5, 3, 6, 7, 4, 3, 5])
    out = target.prefill(prompt, proposer.hidden_state_indices)
    proposer.reset(prompt, out.hidden)
    root = 6
    committed = torch.cat([prompt, torch.tensor([root])])
    star = Tree.from_parents([-1] + [0] * vocab)  # root + every token: exact p(. | root) and p(. | root, x)
    exact_out = target.forward(torch.tensor([root] + list(range(vocab))), star)
    target.commit([])
    p1 = logits_to_probs(exact_out.logits[0], sampling)
    p2 = logits_to_probs(exact_out.logits[1:], sampling)  # [V, V]
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(vocab, vocab)
    for _ in range(samples):
        draft = proposer.propose(committed, proposer.tree_size)
        verify = target.forward(draft.tokens, draft.tree, hidden_state_indices=proposer.hidden_state_indices)
        acceptance = accept(draft, verify.logits, sampling, "rejection", generator)
        target.commit([])
        emitted = draft.tokens[acceptance.accepted_nodes[1:]].tolist() + [acceptance.bonus_token]
        x = emitted[0]
        y = emitted[1] if len(emitted) > 1 else int(torch.multinomial(p2[x], 1, generator=generator))
        counts[x, y] += 1
    return counts, p1[:, None] * p2


def small_vocab_target():
    model = tiny_model("llama", vocab_size=8)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(6.0)  # a peaked target: q (random heads) differs from p
    return model


SAMPLING_PROPOSERS = ["medusa", "eagle1", "eagle2", "eagle3_tree", "mtp", "hybrid_medusa"]


def _sampling_proposer(name: str, model):
    sampling = SamplingConfig(temperature=1.0)
    if name == "eagle3_tree":
        heads = make_heads("eagle3", model, seed=6, draft_vocab_size=6)
        return Eagle3Proposer(heads, model, tree=static_tree(EAGLE1_TREE), sampling=sampling, seed=6)
    options = {"draft_vocab_size": 6} if name == "eagle3" else {}
    return make_proposer(name, model, sampling=sampling, seed=6, **options)


@pytest.mark.parametrize("name", SAMPLING_PROPOSERS)
def test_tree_rejection_sampling_matches_target(name):
    model = small_vocab_target()
    proposer = _sampling_proposer(name, model)
    counts, exact = first_two_tokens(model, proposer, SAMPLES)
    drafted = proposer.propose(torch.tensor([1, 5, 3, 6, 7, 4, 3, 5, 6]), proposer.tree_size)
    assert drafted.tree.num_nodes > 2
    assert (drafted.probs is None) == (name == "eagle2")  # dynamic trees: point masses; static: sampled q rows
    if name == "hybrid_medusa":  # lookup tokens (point masses) merged into a tree of sampled Medusa children
        assert drafted.point_mass is not None and 0 < int(drafted.point_mass.sum()) < drafted.tree.num_nodes - 1
    assert chi_square_pvalue(counts, exact) > 1e-3


def test_sampling_test_detects_a_wrong_q():
    """Negative control: the same test fails when the proposer reports uniform q instead of the real one."""
    model = small_vocab_target()
    proposer = _sampling_proposer("medusa", model)
    real = proposer.propose

    def wrong_q(committed, budget):
        draft = real(committed, budget)
        uniform = (draft.probs > 0).float()
        return Draft(draft.tokens, draft.tree, uniform / uniform.sum(-1, keepdim=True).clamp(min=1))

    proposer.propose = wrong_q
    counts, exact = first_two_tokens(model, proposer, SAMPLES)
    assert chi_square_pvalue(counts, exact) < 1e-3


# ------------------------------------------------------------------------------ factory and bad input

def test_factory_picks_proposer_from_kind(tmp_path):
    model, _ = perm_target("llama")
    target = TargetModel(model)
    expected = {"medusa": MedusaProposer, "eagle": EagleProposer, "eagle3": Eagle3Proposer, "mtp": MTPProposer}
    for kind, cls in expected.items():
        heads = make_heads(kind, model)
        heads.save_pretrained(tmp_path / kind)
        built = proposer_from_heads(tmp_path / kind, target, HeadsOptions(tree_size="3"), target_name="tiny-target")
        assert type(built.proposer) is cls and built.size == 3 and built.proposer.tree_size == 3
    static = proposer_from_heads(tmp_path / "eagle", target, HeadsOptions(eagle_tree="static", tree=str(TREE16)),
                                 target_name="tiny-target")
    assert static.proposer.tree_size == 16


def test_factory_auto_size_uses_metrics_and_cost(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    model, sigma = perm_target("llama")
    target = TargetModel(model)
    heads = make_heads("medusa", model, sigma)
    heads.config.metrics = {"top1_accuracy_per_depth": [0.9, 0.8, 0.7, 0.6], "top5_accuracy_per_depth":
                            [0.95, 0.9, 0.85, 0.8]}
    table = accuracy_table(heads.config)
    assert table[0][0] == 0.9 and sum(table[0]) == pytest.approx(0.95) and len(table[0]) == 5
    built = proposer_from_heads(heads, target, HeadsOptions(max_tree_size=12, cost_kv_length=16, allow_off=False),
                                target_name="tiny-target")
    plain, *rows = built.plan.rows
    assert plain["size"] == 0 and plain["expected_tau"] == 1.0
    assert [r["size"] for r in rows] == list(range(1, 13))
    best = max(rows, key=lambda r: r["tokens_per_second"])
    assert built.size == best["size"] == built.proposer.tree_size
    assert list((tmp_path / "cache" / "cost_curves").glob("*.json"))  # the verify curve was cached
    prompt = torch.randint(3, 256, (11,), generator=torch.Generator().manual_seed(1))
    tokens, _ = run_loop(model, built.proposer, prompt, 30)
    assert torch.equal(tokens, reference(model, prompt, 30))


def test_auto_with_allow_off_guards_the_plan_with_its_measured_step_cost(tmp_path, monkeypatch):
    """auto (allow_off, the default): the planned proposer drafts while this sequence's acceptance pays for the
    planned step's cost over a plain step; output stays plain greedy decoding's."""
    from runtime.proposers.guard import PayingGuard

    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    model, sigma = perm_target("llama")
    heads = make_heads("medusa", model, sigma)
    heads.config.metrics = {"top1_accuracy_per_depth": [0.9, 0.8, 0.7, 0.6]}
    built = proposer_from_heads(heads, TargetModel(model), HeadsOptions(max_tree_size=6, cost_kv_length=16),
                                target_name="tiny-target")
    if built.plan.off:
        pytest.skip("plain decoding predicted faster on this machine: nothing to guard")
    plain, *rows = built.plan.rows
    chosen = next(r for r in rows if r["size"] == built.size)
    guard = built.proposer
    assert isinstance(guard, PayingGuard) and isinstance(guard.inner, MedusaProposer) and "guarded" in built.description
    costs = built.step_costs  # verify (the planner's cached curve at KV 16) + draft time, by KV length
    assert costs.kv_lengths[0] == 16 and costs.plain_seconds(16) == pytest.approx(plain["seconds"])
    assert costs.verify_seconds(built.size + 1, 16) == pytest.approx(chosen["seconds"] - chosen["draft_seconds"])
    for kv in (*costs.kv_lengths, 100, 5000):
        assert guard.cost(kv) == pytest.approx(costs.relative(built.size + 1, kv)) and guard.cost(kv) > 0
    assert guard.expected_tau == chosen["expected_tau"]
    prompt = torch.randint(3, 256, (11,), generator=torch.Generator().manual_seed(1))
    tokens, _ = run_loop(model, guard, prompt, 30)
    assert torch.equal(tokens, reference(model, prompt, 30))


def test_auto_without_metrics_is_a_clear_error():
    model, _ = perm_target("llama")
    with pytest.raises(ValueError, match="--tree_size auto.*no measured accuracy"):
        proposer_from_heads(make_heads("eagle", model), TargetModel(model), target_name="tiny-target")


def test_heads_for_another_target(tmp_path):
    model, _ = perm_target("llama")
    other = tiny_model("llama", hidden_size=32, head_dim=8)
    heads = make_heads("medusa", other)
    heads.save_pretrained(tmp_path / "h")
    with pytest.raises(ValueError, match="cannot run on target"):
        proposer_from_heads(tmp_path / "h", TargetModel(model), HeadsOptions(tree_size="4"), target_name="tiny-target")


def test_tree_deeper_than_heads(tmp_path):
    model, _ = perm_target("llama")
    heads = make_heads("medusa", model, medusa_num_heads=2)
    with pytest.raises(ValueError, match="deeper than the 2 heads"):
        MedusaProposer(heads, model, load_tree_file(TREE16))
    heads.save_pretrained(tmp_path / "h")
    with pytest.raises(ValueError, match=str(TREE16)):
        proposer_from_heads(tmp_path / "h", TargetModel(model), HeadsOptions(tree=str(TREE16)),
                            target_name="tiny-target")


def test_top_k_larger_than_draft_vocab():
    model, _ = perm_target("llama")
    heads = make_heads("eagle3", model, draft_vocab_size=10)
    with pytest.raises(ValueError, match="--tree_top_k 16.*draft vocabulary has 10"):
        Eagle3Proposer(heads, model, dynamic=DynamicTreeConfig(depth=2, top_k=16, total_tokens=8))
    with pytest.raises(ValueError, match="draft vocabulary"):
        Eagle3Proposer(heads, model, tree=static_tree([[0], [11]]))


def test_bad_options():
    with pytest.raises(ValueError, match="--tree_size"):
        HeadsOptions(tree_size="big")
    with pytest.raises(ValueError, match="--eagle_tree"):
        HeadsOptions(eagle_tree="chain")
    model, _ = perm_target("llama")
    with pytest.raises(ValueError, match="MTP drafts a chain of 1..3"):
        MTPProposer(make_heads("mtp", model), model, 5)


def test_medusa_shared_lm_head_and_shallow_tree():
    model, sigma = perm_target("llama")
    heads = make_heads("medusa", model, medusa_shared_lm_head=True, medusa_num_heads=3)
    proposer = MedusaProposer(heads, model, static_tree([[0], [1], [0, 0]], num_heads=3))
    prompt = torch.randint(3, 256, (11,), generator=torch.Generator().manual_seed(1))
    tokens, _ = run_loop(model, proposer, prompt, 40)
    assert torch.equal(tokens, reference(model, prompt, 40))
    with torch.inference_mode():
        assert proposer._head_logits(2).shape == (2, 256)  # only the heads the tree reaches are computed


@pytest.mark.parametrize("arch", ["llama", "gpt2", "phi3"])
def test_medusa_shared_lm_head_drafts_greedy_identically(arch):
    """Shared-LM-head Medusa (trained residual blocks, the target's LM head; gpt2's is tied to its embedding) with
    the default 16-node tree: output identical to plain greedy decoding; drafts are the target LM head's top
    tokens on the blocks' output."""
    model = tiny_model(arch)
    heads = make_heads("medusa", model, medusa_shared_lm_head=True)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.05, generator=torch.Generator().manual_seed(3))
    proposer = MedusaProposer(heads, model, load_tree_file(TREE16, num_heads=4))
    prompt = torch.randint(3, 256, (11,), generator=torch.Generator().manual_seed(1))
    tokens, _ = run_loop(model, proposer, prompt, 48)
    assert torch.equal(tokens, reference(model, prompt, 48))
    with torch.inference_mode():
        expected = model.get_output_embeddings()(heads.head_hidden_states(proposer._hidden[None], 2))[:, 0]
        torch.testing.assert_close(proposer._head_logits(2), expected.float())


@pytest.mark.parametrize("name", PROPOSERS)
def test_sampling_through_the_loop(name):
    """temperature > 0 through generate(): exact length, accepted drafts (oracle heads), reproducible by seed."""
    model, sigma = perm_target("llama")
    prompt = torch.randint(3, 256, (11,), generator=torch.Generator().manual_seed(1))
    sampling = SamplingConfig(temperature=0.5)
    first, stats = run_loop(model, make_proposer(name, model, sigma, sampling=sampling, seed=1), prompt, 40,
                            sampling=sampling, seed=1)
    again, _ = run_loop(model, make_proposer(name, model, sigma, sampling=sampling, seed=1), prompt, 40,
                        sampling=sampling, seed=1)
    assert first.numel() == 40 and torch.equal(first, again)
    assert stats.tau > 1.3


@pytest.mark.parametrize("name", PROPOSERS)
@pytest.mark.parametrize("arch", ["mistral", "phi3", "gemma2", "gpt2", "gemma3_text", "deepseek_v3"])
def test_greedy_identical_other_architectures(arch, name):
    """Untied models get drafting (oracle) heads, tied ones (gemma, gpt2) random heads."""
    tied = arch in ("gemma2", "gpt2", "gemma3_text")
    model, sigma = (tiny_model(arch), None) if tied else perm_target(arch)
    prompt = torch.randint(3, 256, (11,), generator=torch.Generator().manual_seed(1))
    tokens, stats = run_loop(model, make_proposer(name, model, sigma, seed=2), prompt, 48)
    assert torch.equal(tokens, reference(model, prompt, 48))
    if not tied:
        assert stats.tau > 1.6


def test_eagle_auto_shape(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    model, sigma = perm_target("llama")
    heads = make_heads("eagle", model, sigma)
    heads.config.metrics = {"top1_accuracy_per_depth": [0.9, 0.85, 0.8], "top4_accuracy_per_depth": [0.95, 0.9, 0.9]}
    built = proposer_from_heads(heads, TargetModel(model), HeadsOptions(tree_depth="auto", tree_top_k="auto",
                                                                        max_tree_size=8, cost_kv_length=16,
                                                                        allow_off=False),
                                target_name="tiny-target")
    shapes = {(r["depth"], r["top_k"]) for r in built.plan.rows[1:]}
    assert shapes == {(d, k) for d in (2, 3, 4, 5, 6) for k in (2, 4, 8)}
    best = max(built.plan.rows[1:], key=lambda r: r["tokens_per_second"])
    config = built.proposer.dynamic
    # the fastest row's depth and size, at the widest top_k the held-out table values the same (planner.widest_equal)
    ties = [r for r in built.plan.rows[1:] if (r["depth"], r["size"], r["expected_tau"]) ==
            (best["depth"], best["size"], best["expected_tau"])]
    assert (config.depth, config.top_k, config.total_tokens) == (best["depth"], max(r["top_k"] for r in ties),
                                                                 best["size"])
    prompt = torch.randint(3, 256, (11,), generator=torch.Generator().manual_seed(1))
    tokens, _ = run_loop(model, built.proposer, prompt, 30)
    assert torch.equal(tokens, reference(model, prompt, 30))
    with pytest.raises(ValueError, match="--tree_depth"):
        HeadsOptions(tree_depth="deep")


def test_auto_turns_speculation_off_when_plain_is_faster(tmp_path, monkeypatch):
    from runtime import cost_model
    from runtime.proposers.base import Autoregressive

    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cost_model.DraftTimer, "seconds", lambda self, proposer, repeats=3: 10.0)  # a very slow drafter
    model, sigma = perm_target("llama")
    heads = make_heads("medusa", model, sigma)
    heads.config.metrics = {"top1_accuracy_per_depth": [0.9, 0.8, 0.7, 0.6]}
    options = HeadsOptions(max_tree_size=6, cost_kv_length=16)
    built = proposer_from_heads(heads, TargetModel(model), options, target_name="tiny-target")
    assert isinstance(built.proposer, Autoregressive) and built.size == 0 and "speculation off" in built.description
    forced = proposer_from_heads(heads, TargetModel(model), HeadsOptions(tree_size="4"), target_name="tiny-target")
    assert isinstance(forced.proposer, MedusaProposer) and forced.size == 4


@pytest.mark.parametrize("name", ["medusa", "eagle2"])
def test_typical_acceptance_with_heads(name):
    """Medusa's typical acceptance (lossy, documented) runs through the same loop with head drafts."""
    model, sigma = perm_target("llama")
    prompt = torch.randint(3, 256, (11,), generator=torch.Generator().manual_seed(1))
    sampling = SamplingConfig(temperature=0.7)
    proposer = make_proposer(name, model, sigma, sampling=sampling, seed=1)
    config = DecodeConfig(max_new_tokens=40, eos_token_ids=(), sampling=sampling, acceptance="typical", seed=1,
                          speculation=SpeculationConfig(num_speculative_tokens=proposer.tree_size))
    stats = GenerationStats()
    tokens = torch.cat(list(generate(TargetModel(model), proposer, prompt, config, stats)))
    assert tokens.numel() == 40 and stats.tau > 1.3


def test_generate_cli_with_heads(tmp_path, capsys):
    """`python -m runtime.generate --heads DIR` picks the proposer from the head config (flags plumbed)."""
    from runtime.cli import main
    from runtime.config import GenerateArguments

    model = stories260k()
    build_heads(HeadsConfig.for_target("eagle", model, str(STORIES260K))).save_pretrained(tmp_path / "eagle")
    args = GenerateArguments(model=str(STORIES260K), heads=str(tmp_path / "eagle"))
    assert args.resolved_method() == "heads" and args.speculation().num_speculative_tokens >= 64
    stats = main(["--model", str(STORIES260K), "--heads", str(tmp_path / "eagle"), "--tree_size", "5",
                  "--tree_depth", "3", "--tree_top_k", "2", "--prompt", "Once upon a time", "--max_new_tokens", "20"])
    assert stats.new_tokens == 20 and "eagle dynamic tree depth 3 top_k 2 total 5" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--method heads needs --heads"):
        GenerateArguments(method="heads").resolved_method()


# ------------------------------------------------------------------------------ reduced draft vocabulary

VOCAB_PROPOSERS = ["medusa", "eagle2", "eagle1", "mtp"]


@pytest.mark.parametrize("name", VOCAB_PROPOSERS)
def test_greedy_identical_with_a_draft_vocabulary(name):
    """Drafting over the 120 most frequent ids (counted on the target's own output, as training data would be)
    keeps the output identical and still drafts well; every drafted token is in the draft vocabulary."""
    model, sigma = perm_target("llama")
    prompt = torch.randint(3, 256, (11,), generator=torch.Generator().manual_seed(1))
    expected = reference(model, prompt, 80)
    counts = torch.bincount(expected, minlength=256) * 10 + torch.randint(0, 5, (256,), generator=torch.Generator())
    proposer = make_proposer(name, model, sigma, draft_vocab=(counts, 120))
    assert proposer.vocab.size == 120
    tokens, stats = run_loop(model, proposer, prompt, 80)
    assert torch.equal(tokens, expected)
    assert stats.tau > 1.6, f"tau {stats.tau:.2f}"
    allowed = set(draft_target_ids(proposer.heads.d2t).tolist())
    draft = proposer.propose(torch.cat([prompt, tokens]), proposer.tree_size)
    assert set(draft.tokens[1:].tolist()) <= allowed


@pytest.mark.parametrize("name", ["medusa", "eagle1"])  # own projections / the target's LM head (EAGLE, MTP)
def test_rejection_sampling_with_a_draft_vocabulary(name):
    """Sampled children from q over 6 of 8 ids (zero elsewhere): the emitted tokens still follow the target."""
    model = small_vocab_target()
    counts = torch.tensor([5, 1, 7, 3, 9, 2, 8, 4])
    proposer = make_proposer(name, model, sampling=SamplingConfig(temperature=1.0), seed=6, draft_vocab=(counts, 6))
    counts_seen, exact = first_two_tokens(model, proposer, SAMPLES)
    drafted = proposer.propose(torch.tensor([1, 5, 3, 6, 7, 4, 3, 5, 6]), proposer.tree_size)
    assert drafted.tree.num_nodes > 2 and bool((drafted.probs[:, [1, 5]] == 0).all())
    assert chi_square_pvalue(counts_seen, exact) > 1e-3


def _eagle2_drafts(monkeypatch, heads, model, prompt, total: int, keep: int, expand_all: bool = False,
                   min_expected: float = 0.0):
    """One EAGLE-2 propose after `prompt`: (draft, logits rows per level, the candidate tree before selection).
    expand_all: every level up to the depth and budget is forwarded (no stop once the kept tree is final).
    min_expected: the confidence gate's threshold (0: off)."""
    from runtime.proposers import eagle

    proposer = EagleProposer(heads, model, dynamic=DynamicTreeConfig(depth=5, top_k=8, total_tokens=total))
    target = TargetModel(model)
    out = target.prefill(prompt, proposer.hidden_state_indices)
    proposer.reset(prompt, out.hidden)
    committed = torch.cat([prompt, out.logits[-1].argmax().reshape(1)])
    rows, captured = [], []
    original_logits, original_select = proposer.draft_logits, eagle.select_nodes
    with monkeypatch.context() as patch:
        patch.setattr(proposer, "draft_logits", lambda o: rows.append(o.reshape(-1, o.shape[-1]).shape[0])
                      or original_logits(o))
        patch.setattr(eagle, "select_nodes", lambda c, n: captured.append(c) or original_select(c, n))
        proposer.stop_when_final = not expand_all
        proposer.min_expected = min_expected
        draft = proposer.propose(committed, keep)
    return draft, rows, captured[0] if captured else None  # None: the gate stopped the step at the root


def test_eagle2_draft_is_bounded_by_the_budget(monkeypatch):
    """depth 5 / top_k 8 with 3 nodes kept: at most 3 levels, logits rows 1 + 2 + 1, and the same tree as expanding
    the whole depth-5 top-8 candidate set and keeping its best 3."""
    from runtime.proposers import eagle

    model = tiny_model("llama")
    heads = make_heads("eagle", model, seed=2)
    prompt = torch.randint(3, 256, (12,), generator=torch.Generator().manual_seed(3))
    small, rows, _ = _eagle2_drafts(monkeypatch, heads, model, prompt, 3, 3)
    assert rows == [1, 2, 1][:len(rows)] and small.tree.num_nodes == 4
    _, bounded_rows, _ = _eagle2_drafts(monkeypatch, heads, model, prompt, 3, 3, expand_all=True)
    assert bounded_rows == [1, 2, 1]
    _, full_rows, candidates = _eagle2_drafts(monkeypatch, heads, model, prompt, 64, 64, expand_all=True)
    assert full_rows == [1, 8, 8, 8, 8]
    expected = eagle.ordered_draft(candidates, eagle.select_nodes(candidates, 3))
    assert torch.equal(small.tokens, expected.tokens) and torch.equal(small.tree.parents, expected.tree.parents)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_eagle2_stops_expanding_once_the_kept_tree_is_final(monkeypatch, seed):
    """Levels whose nodes cannot enter the kept set are not forwarded, and the draft is the one that forwarding
    every level gives (tokens and tree), for budgets 1-12 after prompts of a random and a sharp head."""
    model, sigma = perm_target("llama", seed=seed)
    saved = 0
    for heads in (make_heads("eagle", model, seed=seed), make_heads("eagle", model, sigma, seed=seed)):
        for length, budget in ((5, 1), (9, 3), (12, 5), (7, 8), (15, 12)):
            prompt = torch.randint(3, 256, (length,), generator=torch.Generator().manual_seed(seed * 31 + length))
            draft, rows, _ = _eagle2_drafts(monkeypatch, heads, model, prompt, budget, budget)
            full, full_rows, _ = _eagle2_drafts(monkeypatch, heads, model, prompt, budget, budget, expand_all=True)
            assert torch.equal(draft.tokens, full.tokens) and torch.equal(draft.tree.parents, full.tree.parents)
            assert rows == full_rows[:len(rows)]
            saved += sum(full_rows) - sum(rows)
    assert saved > 0  # some level was left out


@pytest.mark.parametrize("seed", [0, 1])
def test_eagle2_draft_expects_its_path_probabilities(monkeypatch, seed):
    """Draft.expected of an EAGLE-2 draft is the sum of its kept nodes' path probabilities."""
    import math

    from runtime.proposers.tree_drafting import select_nodes

    model, sigma = perm_target("llama", seed=seed)
    for heads in (make_heads("eagle", model, seed=seed), make_heads("eagle", model, sigma, seed=seed)):
        prompt = torch.randint(3, 256, (9,), generator=torch.Generator().manual_seed(seed))
        draft, _, candidates = _eagle2_drafts(monkeypatch, heads, model, prompt, 6, 6, expand_all=True)
        kept = select_nodes(candidates, 6)
        assert draft.tree.num_nodes == 7 and 0 < draft.expected <= 6
        assert draft.expected == pytest.approx(sum(math.exp(candidates.score[n]) for n in kept[1:]), rel=1e-9)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_confidence_gate(monkeypatch, seed):
    """With min_expected above the bound on what a tree of 4 nodes can expect (depth 4 > the budget: every level of
    the best child's subtree adds at most its probability, so 4 x the best child's), the step drafts nothing and
    forwards no level past the root's logits; just under it, the draft is the ungated one (a random head and a
    sharp one)."""
    model, sigma = perm_target("llama", seed=seed)
    for heads in (make_heads("eagle", model, seed=seed), make_heads("eagle", model, sigma, seed=seed)):
        prompt = torch.randint(3, 256, (11,), generator=torch.Generator().manual_seed(seed + 5))
        full, _, candidates = _eagle2_drafts(monkeypatch, heads, model, prompt, 4, 4)
        best = max(candidates.score[n] for n in range(1, len(candidates.tokens)) if candidates.depth[n] == 1)
        bound = 4 * torch.tensor(best).exp().item()
        gated, rows, _ = _eagle2_drafts(monkeypatch, heads, model, prompt, 4, 4, min_expected=bound * 1.001)
        assert gated.tree.num_nodes == 1 and gated.expected == 0 and rows == [1]
        assert torch.equal(gated.tokens, full.tokens[:1])
        passed, _, _ = _eagle2_drafts(monkeypatch, heads, model, prompt, 4, 4, min_expected=bound * 0.999)
        assert torch.equal(passed.tokens, full.tokens) and torch.equal(passed.tree.parents, full.tree.parents)
        assert full.expected <= bound + 1e-9


def test_confidence_gate_keeps_greedy_output():
    """A gated EAGLE-2 head (some steps draft nothing, others a tree) decodes exactly what plain greedy does."""
    model, sigma = perm_target("llama", seed=4)
    proposer = make_proposer("eagle2", model, sigma, seed=4)
    prompt = torch.randint(3, 256, (10,), generator=torch.Generator().manual_seed(8))
    sizes, original = [], proposer.propose

    def propose(committed, max_tokens):
        draft = original(committed, max_tokens)
        sizes.append(draft.tree.num_nodes)
        return draft

    proposer.propose = propose
    proposer.min_expected = 1.5
    tokens, _ = run_loop(model, proposer, prompt, 24)
    assert torch.equal(tokens[:24], reference(model, prompt, 24))
    assert 1 in sizes and any(size > 1 for size in sizes)


def test_expected_bound():
    """Each level of a child's subtree adds at most the child's probability and takes a node: the bound is the sum of
    the budget's largest of every child's probability repeated depth times; real subtrees stay under it."""
    import math

    from runtime.proposers.tree_drafting import Candidates, expected_bound

    c = Candidates.rooted(7)
    a, b, d = c.add(0, 1, math.log(0.5)), c.add(0, 2, math.log(0.3)), c.add(0, 3, math.log(0.1))
    assert expected_bound(c, [a, b, d], 3, 1) == pytest.approx(0.9)  # one level: the three children
    assert expected_bound(c, [a, b, d], 3, 2) == pytest.approx(0.5 + 0.5 + 0.3)
    assert expected_bound(c, [a, b, d], 8, 2) == pytest.approx(1.8)  # every child twice, budget to spare
    assert expected_bound(c, [a, b, d], 2, 5) == pytest.approx(1.0)
    aa, ab = c.add(a, 4, math.log(0.6)), c.add(a, 5, math.log(0.4))  # a's children: 0.3 and 0.2 in all
    kept = math.exp(c.score[a]) + math.exp(c.score[aa]) + math.exp(c.score[ab])
    assert kept <= expected_bound(c, [a, b, d], 3, 2) + 1e-12


def test_draft_timer_times_every_level():
    """The planner's draft time is an upper bound: DraftTimer forwards every level of an EAGLE-2 tree (its random
    context says nothing about where text stops) and gives the proposer back as it was."""
    model = tiny_model("llama")
    proposer = EagleProposer(make_heads("eagle", model, seed=2), model,
                             dynamic=DynamicTreeConfig(depth=5, top_k=8, total_tokens=3))
    seen, original = [], proposer._dynamic_draft
    proposer._dynamic_draft = lambda *args: seen.append(proposer.stop_when_final) or original(*args)
    DraftTimer(TargetModel(model), 16, proposer.hidden_state_indices).seconds(proposer)
    assert seen and not any(seen) and proposer.stop_when_final


def test_draft_timer_measures_what_feeding_missed_entries_costs():
    """The first propose on the timer's context feeds its entries in one call: the time beyond a step's, per entry,
    is the feed cost a head pays after resting (runtime.proposers.hybrid); pending_entries counts what is left."""
    import time

    class Feeding:  # feeds its pending entries at 0.2 ms each, as a draft layer does, then drafts nothing
        hidden_state_indices, tree_size = (), 1

        def reset(self, prompt_ids, prefill_hidden):
            self.pending_entries = prompt_ids.numel()

        def propose(self, committed_ids, max_tokens):
            time.sleep(2e-4 * self.pending_entries)
            self.pending_entries = 0
            return root_only(committed_ids)

        def on_accept(self, committed_ids, draft, accepted_nodes, tree_hidden):
            self.pending_entries += len(accepted_nodes)

    model = tiny_model("llama")
    timer = DraftTimer(TargetModel(model), 64, ())
    timer.seconds(Feeding())
    assert 1.5e-4 < timer.feed_seconds < 1e-3  # the first propose's 64 entries, less a step's one, per entry
    proposer = EagleProposer(make_heads("eagle", model, seed=2), model,
                             dynamic=DynamicTreeConfig(depth=2, top_k=2, total_tokens=3))
    timer = DraftTimer(TargetModel(model), 64, proposer.hidden_state_indices)
    proposer.reset(timer.prompt, timer.hidden)
    assert pending_entries(proposer) == 64  # the prompt's entries, all waiting
    proposer.propose(timer.committed, 3)
    assert pending_entries(proposer) == 0
    assert pending_entries(Autoregressive()) == 0  # a drafter without such state
    costs = StepCosts([64, 1024], [CostCurve([1, 8], [1.0, 1.5])] * 2, [0.01, 0.01], [2e-4, 4e-4])
    assert costs.feed(1, 64) == 0.0 and costs.feed(11, 64) == pytest.approx(10 * 2e-4)
    assert costs.feed(11, 544) == pytest.approx(10 * 3e-4)  # interpolated between the measured KV lengths


def test_draft_times_are_measured_once_per_machine_and_drafter_shape(tmp_path, monkeypatch):
    """With use_cache (the planner, the step costs) a heads drafter's time is read back from disk in the next run,
    so a machine plans the same way every time; another size is another key, and use_cache=False measures."""
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    model = tiny_model("llama")
    heads = make_heads("eagle", model, seed=2)
    make = lambda size: EagleProposer(heads, model, dynamic=DynamicTreeConfig(depth=2, top_k=2,  # noqa: E731
                                                                              total_tokens=size))
    target, indices = TargetModel(model), make(3).hidden_state_indices
    first = DraftTimer(target, 16, indices, use_cache=True)
    seconds, feed = first.seconds(make(3)), first.feed_seconds
    again = DraftTimer(target, 16, indices, use_cache=True)
    monkeypatch.setattr(DraftTimer, "_measure", lambda self, proposer, repeats: pytest.fail("measured again"))
    assert again.seconds(make(3)) == seconds and again.feed_seconds == feed
    assert "_context" not in again.__dict__  # nothing measured: not even the context was prefilled
    measured = []
    monkeypatch.setattr(DraftTimer, "_measure", lambda self, proposer, repeats: measured.append(1) or 0.5)
    assert again.seconds(make(2)) == 0.5 and DraftTimer(target, 16, indices).seconds(make(3)) == 0.5
    assert len(measured) == 2


def test_deeper_can_enter():
    """A deeper node enters the kept set only with a score above the budget-th best (ties keep the older node)."""
    from runtime.proposers.tree_drafting import Candidates, deeper_can_enter

    c = Candidates.rooted(7)
    a, _ = c.add(0, 1, -0.1), c.add(0, 2, -1.0)
    aa, ab = c.add(a, 3, -0.5), c.add(a, 4, -2.0)  # scores -0.6, -2.1
    assert deeper_can_enter(c, [aa, ab], 5)  # fewer candidates than the budget: anything enters
    assert deeper_can_enter(c, [aa, ab], 3)  # 3rd best is -1.0; aa's children may score up to -0.6
    assert not deeper_can_enter(c, [ab], 2)  # 2nd best is -0.6 (aa); ab's descendants score <= -2.1
    assert not deeper_can_enter(c, [aa], 2)  # aa is the 2nd best itself: its children tie at best, and lose
    assert not deeper_can_enter(c, [], 1)


def test_static_tree_rows_only_for_nodes_that_get_children():
    """A 7-node EAGLE-1 tree cut to 2 tokens: rows for the root only (its two children fill the budget)."""
    model = tiny_model("llama")
    proposer = make_proposer("eagle1", model, seed=1)
    target = TargetModel(model)
    prompt = torch.randint(3, 256, (10,), generator=torch.Generator().manual_seed(4))
    out = target.prefill(prompt, proposer.hidden_state_indices)
    proposer.reset(prompt, out.hidden)
    committed = torch.cat([prompt, out.logits[-1].argmax().reshape(1)])
    rows = []
    original = proposer.draft_logits
    proposer.draft_logits = lambda o: rows.append(o.reshape(-1, o.shape[-1]).shape[0]) or original(o)
    draft = proposer.propose(committed, 2)
    assert draft.tree.num_nodes == 3 and rows == [1]
