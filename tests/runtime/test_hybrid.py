"""runtime.proposers.hybrid: prompt lookup and a head in one tree; the per-step split; the CLI and the factory.

Greedy identity across architectures and the chi-square test of rejection sampling run in test_head_proposers.py
("hybrid" in PROPOSERS, "hybrid_medusa" in SAMPLING_PROPOSERS)."""

from __future__ import annotations

import copy
import time

import pytest
import torch

from heads import HeadsConfig, build_heads
from runtime.cost_model import CostCurve, StepCosts
from runtime.proposers.base import Draft, root_only
from runtime.proposers.guard import LOSS_BUDGET, LOSS_SLACK
from runtime.proposers.hybrid import HEAD_MARGIN, HybridProposer, merge_chain, path_view
from runtime.tree import Tree
from tests.tiny_models import STORIES260K, stories260k


class _Fixed:
    """A head that drafts one fixed tree and records what it was fed."""

    hidden_state_indices = (-1,)
    tree_size = 3

    def __init__(self, draft: Draft):
        self.draft, self.fed = draft, []

    def reset(self, prompt_ids, prefill_hidden):
        self.fed = []

    def propose(self, committed_ids, max_tokens):
        return self.draft if max_tokens > 0 else root_only(committed_ids)

    def on_accept(self, committed_ids, draft, accepted_nodes, tree_hidden):
        self.fed.append((draft.tokens.tolist(), accepted_nodes, tree_hidden[-1].tolist()))


def _costs(per_token: float, draft: float = 0.05, kv_growth: float = 0.0) -> StepCosts:
    """Verify costing 1 + per_token per extra query token at KV 256 (kv_growth more per token at KV 2048)."""
    at = lambda growth: CostCurve([1, 64], [1.0, 1.0 + growth * 63])  # noqa: E731
    return StepCosts([256, 2048], [at(per_token), at(per_token + kv_growth)], [draft, draft])


def test_the_lookup_chain_is_merged_under_the_head_children_it_matches():
    head = Draft(tokens=torch.tensor([9, 4, 5, 6]), tree=Tree.from_parents([-1, 0, 0, 1]),
                 probs=torch.full((4, 10), 0.1))
    merged, added = merge_chain(head, [4, 6, 7, 8])  # 4 = node 1, 6 = node 3 (child of 1): 7 and 8 are new
    assert added == 2 and merged.tokens.tolist() == [9, 4, 5, 6, 7, 8]
    assert merged.tree.parents.tolist() == [-1, 0, 0, 1, 3, 4]
    assert merged.point_mass.tolist() == [False] * 4 + [True] * 2 and merged.probs[4:].abs().sum() == 0
    assert merge_chain(head, [4, 6])[0] is head  # nothing new: the head's draft unchanged
    other, added = merge_chain(head, [7])  # a new child of the root, after the head's children
    assert added == 1 and other.tree.children(0) == [1, 2, 4]
    plain, added = merge_chain(root_only(torch.tensor([3, 9])), [1, 2])  # no head draft: a chain, no probs
    assert plain.tree.parents.tolist() == [-1, 0, 1] and plain.probs is None and plain.point_mass is None


def test_the_head_is_fed_the_accepted_path_whatever_source_drafted_it():
    head_draft = Draft(tokens=torch.tensor([9, 4, 5]), tree=Tree.from_parents([-1, 0, 0]))
    head = _Fixed(head_draft)
    hybrid = HybridProposer(head, 2, 3.0, _costs(0.01), max_lookup=4)
    prompt = torch.tensor([1, 9, 7, 2, 3, 9])  # the last token 9 occurred before, followed by 7 2 3 9
    hybrid.reset(prompt, {-1: torch.zeros(6, 2)})
    draft = hybrid.propose(prompt, 16)
    assert draft.tokens.tolist()[:3] == [9, 4, 5] and draft.tokens.tolist()[3:] == [7, 2, 3, 9]
    accepted = [0, 3, 4]  # the lookup's 7 then 2
    hidden = {-1: torch.arange(14.0).reshape(7, 2)}
    hybrid.on_accept(torch.cat([prompt, torch.tensor([7, 2, 3])]), draft, accepted, hidden)
    tokens, nodes, rows = head.fed[-1]
    assert tokens == [9, 7, 2] and nodes == [0, 1, 2] and rows == hidden[-1][accepted].tolist()
    assert hybrid.tau.mean < 3.0  # the head's own nodes accepted nothing: tau 1 observed
    chain, nodes, rows = path_view(draft, [0], None)
    assert chain.tokens.tolist() == [9] and nodes == [0] and rows is None


def test_each_step_goes_to_the_source_that_pays_at_this_kv_length():
    hybrid = HybridProposer(_Fixed(root_only(torch.tensor([1]))), 4, 1.8, _costs(0.03), max_lookup=6)
    copying = [0.95] * 6
    cold = [0.05] * 6
    # text being copied, a weak head: the lookup chain alone
    assert hybrid.plan(256, copying, 6, 4, 1.05, probe=False) == (6, 0)
    # nothing to copy, a head that accepts: the head alone
    assert hybrid.plan(256, cold, 6, 4, 2.2, probe=False) == (0, 4)
    # both promise: one tree with both
    cheap = HybridProposer(_Fixed(root_only(torch.tensor([1]))), 4, 1.8, _costs(0.01, draft=0.0), max_lookup=6)
    k, m = cheap.plan(256, [0.7] * 6, 6, 4, 3.0, probe=False)
    assert k > 0 and m == 4
    # neither pays: a plain step
    assert hybrid.plan(256, cold, 6, 4, 1.05, probe=False) == (0, 0)
    # a probe makes the head draft, with whatever lookup pays
    assert hybrid.plan(256, cold, 6, 4, 1.05, probe=True)[1] == 4
    # the same head, its step dearer at a long context: rests there
    dear = HybridProposer(_Fixed(root_only(torch.tensor([1]))), 4, 1.8, _costs(0.03, kv_growth=0.3), max_lookup=6)
    assert dear.plan(256, cold, 6, 4, 1.5, probe=False) == (0, 4)
    assert dear.plan(2048, cold, 6, 4, 1.5, probe=False) == (0, 0)
    # a target that verifies chains only: never both in one step
    chains = HybridProposer(_Fixed(root_only(torch.tensor([1]))), 4, 1.8, _costs(0.03), max_lookup=6, trees=False)
    assert 0 in chains.plan(256, [0.7] * 6, 6, 4, 3.0, probe=False)


def test_a_rested_head_pays_for_the_entries_it_must_feed_before_it_drafts():
    """After a run of lookup steps the head has hundreds of committed entries to feed before it can draft: that
    time is part of its step. The same promise pays with a step's feed, not with 400 entries to catch up on."""
    costs = StepCosts([256], [CostCurve([1, 64], [1.0, 1.0 + 0.01 * 63])], [0.05], [0.004])
    hybrid = HybridProposer(_Fixed(root_only(torch.tensor([1]))), 4, 1.8, costs, max_lookup=6)
    both = [0.6] * 6
    assert hybrid.plan(256, both, 6, 4, 2.5, probe=False, pending=2)[1] == 4
    assert hybrid.plan(256, both, 6, 4, 2.5, probe=False, pending=400) == (hybrid.plan(256, both, 6, 0, 2.5, False)[0], 0)
    head = _Fixed(Draft(tokens=torch.tensor([9, 4]), tree=Tree.chain(1)))
    head.pending_entries = 400
    rested = HybridProposer(head, 1, 2.0, costs, max_lookup=4)
    rested.reset(torch.arange(1, 9), {-1: torch.zeros(8, 2)})
    assert rested.propose(torch.arange(1, 9), 16).tree.num_nodes == 1  # plain: a head step would cost 2.7 steps
    head.pending_entries = 1
    assert rested.propose(torch.arange(1, 9), 16).tree.num_nodes == 2


def test_a_head_that_loses_to_the_lookup_alternative_rests_once_over_its_loss_budget():
    """The head's steps are charged what the best step without it would have committed in their time. A head whose
    estimate is read with wide errors (confidence 5) drafts on at tau ~1.2 against a step of 1.35 plain steps
    without the ledger; with it, once its steps have lost more than the budget, plain steps (and probes) take
    over."""
    def run(budget: float) -> tuple[list[bool], HybridProposer]:
        head = _Fixed(Draft(tokens=torch.tensor([9, 4, 5, 6]), tree=Tree.chain(3)))
        hybrid = HybridProposer(head, 3, 1.6, _costs(0.1), max_lookup=4)
        hybrid.tau.confidence, hybrid.ledger.budget = 5.0, budget
        prompt = torch.arange(1, 9)  # no repeated n-gram: lookup has nothing, each step is the head's or plain
        hybrid.reset(prompt, {-1: torch.zeros(8, 2)})
        drafted = []
        for step in range(60):
            committed = torch.cat([prompt, torch.arange(100, 101 + step)])
            draft = hybrid.propose(committed, 16)
            drafted.append(draft.tree.num_nodes > 1)
            accepted = [0, 1] if drafted[-1] and step % 4 == 0 else [0]
            hybrid.on_accept(committed, draft, accepted, {-1: torch.zeros(draft.tree.num_nodes, 2)})
        return drafted, hybrid

    unbounded, _ = run(float("inf"))
    assert all(unbounded)  # the optimism alone never rests this head
    drafted, hybrid = run(0.03)
    assert all(drafted[:5]) and sum(drafted[-20:]) <= 5
    assert hybrid.ledger.cost - hybrid.ledger.tokens <= LOSS_BUDGET * hybrid.ledger.tokens + LOSS_SLACK + 1.35


class _Gated(_Fixed):
    """A _Fixed head with a confidence gate: records the threshold each propose is given."""

    def __init__(self, draft: Draft):
        super().__init__(draft)
        self.min_expected, self.seen = 0.0, []

    def propose(self, committed_ids, max_tokens):
        self.seen.append(self.min_expected)
        return super().propose(committed_ids, max_tokens)


@pytest.mark.parametrize("gate", [True, False])
def test_a_head_only_step_tells_the_head_its_break_even(gate):
    """Gate on: a step the head drafts alone asks it to expect what the best step without it commits in the head
    step's time (here plain decoding: the head step's cost in plain steps, minus the root's token); a step with the
    lookup chain too asks nothing (the head's tokens count only where the chain's first one fails). Off: 0 always."""
    costs = _costs(0.1)
    head = _Gated(Draft(tokens=torch.tensor([9, 4, 5]), tree=Tree.from_parents([-1, 0, 0])))
    hybrid = HybridProposer(head, 2, 3.0, costs, max_lookup=4, gate=gate)
    prompt = torch.arange(1, 9)  # no repeated n-gram: the head alone
    hybrid.reset(prompt, {-1: torch.zeros(8, 2)})
    hybrid.propose(prompt, 16)
    assert hybrid.last_choice == "lookup 0 + head 2"
    head_step = costs.relative(3, 0, False) + costs.draft(0) / costs.plain_seconds(0)  # KV 8 is in the bucket of 0
    assert head.seen[-1] == (pytest.approx(head_step / costs.relative(1, 0, False) - 1.0) if gate else 0.0)
    repeated = torch.tensor([1, 9, 7, 2, 3, 9])  # 9 occurred before: the lookup chain 7 2 3 9 as well
    cheap = HybridProposer(_Gated(head.draft), 2, 3.0, _costs(0.001, draft=0.0), max_lookup=4, gate=gate)
    cheap.reset(repeated, {-1: torch.zeros(6, 2)})
    cheap.head.min_expected = 0.7
    cheap.propose(repeated, 16)
    assert cheap.last_choice.startswith("lookup 4 + head 2")
    assert cheap.head.seen[-1] == (0.0 if gate else 0.7)
    assert copy.copy(hybrid).gate is gate


def test_generate_cli_and_bad_flags(tmp_path, capsys, monkeypatch):
    from runtime.cli import main
    from runtime.config import GenerateArguments

    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    model = stories260k()
    build_heads(HeadsConfig.for_target("eagle", model, str(STORIES260K))).save_pretrained(tmp_path / "eagle")
    args = GenerateArguments(model=str(STORIES260K), method="hybrid", heads=str(tmp_path / "eagle"))
    assert args.resolved_method() == "hybrid" and args.speculation().num_speculative_tokens >= 64
    stats = main(["--model", str(STORIES260K), "--method", "hybrid", "--heads", str(tmp_path / "eagle"),
                  "--tree_size", "4", "--tree_depth", "2", "--tree_top_k", "2", "--max_speculative_tokens", "6",
                  "--prompt", "Once upon a time there was a cat. Once upon a time", "--max_new_tokens", "24",
                  "--exact"])
    err = capsys.readouterr().err
    assert stats.new_tokens == 24 and "[hybrid] hybrid: prompt lookup (up to 6 tokens) + eagle dynamic tree" in err
    plain = main(["--model", str(STORIES260K), "--method", "autoregressive", "--prompt",
                  "Once upon a time there was a cat. Once upon a time", "--max_new_tokens", "24", "--exact"])
    assert plain.new_tokens == 24
    with pytest.raises(ValueError, match="--method hybrid needs --heads"):
        GenerateArguments(method="hybrid").resolved_method()


def test_the_python_api_takes_method_hybrid(tmp_path, monkeypatch):
    from runtime.api import SpeculativeModel

    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    model = stories260k()
    build_heads(HeadsConfig.for_target("medusa", model, str(STORIES260K), medusa_num_heads=3)).save_pretrained(
        tmp_path / "medusa")
    prompt = "Once upon a time there was a dog. The dog was happy. Once upon a time there was a dog."
    hybrid = SpeculativeModel.from_pretrained(str(STORIES260K), method="hybrid", heads=str(tmp_path / "medusa"),
                                              tree_size="3", exact=True)
    plain = SpeculativeModel.from_pretrained(str(STORIES260K), method="autoregressive", exact=True)
    assert isinstance(hybrid.proposer, HybridProposer)
    assert hybrid.generate(prompt, max_new_tokens=40).token_ids == plain.generate(prompt, max_new_tokens=40).token_ids


class _Declining(_Fixed):
    """A head whose confidence gate always declines, spending `seconds` on each ask (catching up, its first logits)."""

    def __init__(self, seconds: float):
        super().__init__(root_only(torch.tensor([1])))
        self.seconds, self.asked = seconds, 0

    def propose(self, committed_ids, max_tokens):
        self.asked += 1
        time.sleep(self.seconds)
        return root_only(committed_ids)


def _run_declining(head: _Declining, head_size: int, expected_tau: float, plain: float, steps: int
                   ) -> HybridProposer:
    """`steps` steps of a gated hybrid over a prompt with no repeated n-gram (each step the head's or plain), a plain
    step `plain` seconds, verify 0.1 plain steps more per token, the head's modelled draft 0.05 plain steps."""
    costs = StepCosts([256], [CostCurve([1, 64], [plain, plain * 7.3])], [plain * 0.05])
    hybrid = HybridProposer(head, head_size, expected_tau, costs, max_lookup=4, gate=True)
    prompt = torch.arange(1, 9)
    hybrid.reset(prompt, {-1: torch.zeros(8, 2)})
    for step in range(steps):
        committed = torch.cat([prompt, torch.arange(100, 101 + step)])
        draft = hybrid.propose(committed, 16)
        assert draft.tree.num_nodes == 1
        hybrid.on_accept(committed, draft, [0], {-1: torch.zeros(1, 2)})
    return hybrid


def test_a_head_that_keeps_declining_is_charged_and_rested():
    """Head-only steps the head declines (its gate) are charged what the best step without it commits in their
    measured time (the first ask, which fed it the prompt, at the verify's price alone) and are not observed as
    drafts. A head that spends 0.3 of a plain step on every declined ask rests once over the loss budget; priced as
    plain steps (before), it was asked at every one of the 60 steps."""
    plain = 0.01
    head = _Declining(0.3 * plain)
    hybrid = _run_declining(head, 3, 1.8, plain, steps=60)
    assert hybrid.tau.mean == pytest.approx(1.8)  # nothing observed: the gate declined, the text was not tried
    assert hybrid.ledger.cost - hybrid.ledger.tokens >= 0.25 * (head.asked - 1)  # each ask but the first charged
    assert head.asked < 20  # rested but for probes and what the growing budget allows


def test_a_head_whose_gate_keeps_declining_is_asked_less_than_its_estimate_says():
    """A head-only ask is worth what the head's gate lets through (guard.ask_value): a share of asks draft at the
    estimated tau, the others commit one token for the root's verify and the head's time. A head that declines at
    no measurable cost (so the ledger never rests it) and never drafts keeps its estimate, 1.3, at the prior; before,
    it was asked at every one of the 60 steps. Now its declines bring the share down until asking loses to a plain
    step, and only probes ask it after that."""
    head = _Declining(0.0)
    hybrid = _run_declining(head, 1, 1.3, 0.01, steps=60)
    costs = hybrid.costs
    assert hybrid.tau.mean == pytest.approx(1.3) and not hybrid.ledger.losing  # neither rested it
    assert hybrid.asks.share < 0.5, head.asked
    assert head.asked <= 12, head.asked
    # the option's value, by hand: 1 + share (tau - 1) tokens for share x the drafted step + the rest x a declined one
    kv = 256
    options = hybrid.options(kv, [0.5], 0, 1, 1.3, 0, drafted_share=0.4)
    drafted = costs.relative(2, kv, False) + costs.draft(kv) / costs.plain_seconds(kv)
    declined = costs.relative(1, kv, False) + costs.draft(kv) / costs.plain_seconds(kv)
    assert options[(0, 1)] == pytest.approx((1 + 0.4 * 0.3) / (0.4 * drafted + 0.6 * declined) / HEAD_MARGIN)
    assert hybrid.options(kv, [0.5], 0, 1, 1.3)[(0, 1)] == pytest.approx(1.3 / drafted / HEAD_MARGIN)


def _draft_lengths(proposer, model, prompt: torch.Tensor, new_tokens: int) -> tuple[list[int], list[int]]:
    """(the output tokens, the number of drafted nodes at each step) of greedy decoding with `proposer`."""
    from runtime.config import DecodeConfig, SpeculationConfig
    from runtime.loop import generate
    from runtime.target import TargetModel

    lengths, propose = [], proposer.propose

    def recorded(committed_ids, max_tokens):
        draft = propose(committed_ids, max_tokens)
        lengths.append(draft.tree.num_nodes - 1)
        return draft

    proposer.propose = recorded
    config = DecodeConfig(max_new_tokens=new_tokens, speculation=SpeculationConfig(16))
    steps = list(generate(TargetModel(model), proposer, prompt, config))
    return torch.cat(steps).tolist(), lengths


def test_where_its_head_rests_the_hybrid_drafts_what_prompt_lookup_drafts():
    """Prompt lookup alone and the hybrid's lookup part price drafts with one table (runtime.cost_model.VerifyTable)
    at the sequence's KV length. With a head the hybrid never prefers (expected tau 1, a gate that declines its
    probes), the hybrid is prompt lookup step for step: the same draft length at every step, the same output. Costs
    that fall with the KV length (drafts dear at KV 16, cheap by KV 256) make the lengths change along the answer, as
    a fixed curve (KV 16's) does not."""
    from runtime.cost_model import VerifyTable
    from runtime.proposers import PromptLookupProposer

    model = stories260k()
    model.generation_config.eos_token_id = None
    costs = StepCosts([16, 256], [CostCurve([1, 64], [1.0, 1.0 + 0.3 * 63]), CostCurve([1, 64], [1.0, 1.0 + 0.004 * 63])],
                      [0.0, 0.0])
    prompt = torch.tensor(model.config.bos_token_id).reshape(1)
    story, _ = _draft_lengths(PromptLookupProposer(), model, prompt, 40)  # the model's own text, which repeats
    prompt = torch.tensor([model.config.bos_token_id, *story])
    lookup_out, lookup = _draft_lengths(PromptLookupProposer(step_costs=VerifyTable(costs)), model, prompt, 160)
    hybrid_head = _Declining(0.0)
    hybrid = HybridProposer(hybrid_head, 1, 1.0, costs, max_lookup=16)
    hybrid_out, mixed = _draft_lengths(hybrid, model, prompt, 160)
    assert hybrid_out == lookup_out and mixed == lookup, (lookup, mixed)
    assert hybrid_head.asked > 0  # probes asked it (each declined: a plain step, where lookup had no draft either)
    fixed_out, fixed = _draft_lengths(PromptLookupProposer(step_costs=costs.curves[0].relative_to_plain(17)), model,
                                      prompt, 160)
    assert fixed_out == lookup_out and sum(fixed) < sum(lookup), (fixed, lookup)
