"""runtime.proposers.guard: drafts while this sequence's acceptance pays, rests and probes otherwise; output is plain
greedy decoding's whatever it decides."""

from __future__ import annotations

import copy
import time

import pytest
import torch

from bench.common import run_ours
from runtime.config import DecodeConfig, SpeculationConfig
from runtime.cost_model import CostCurve, StepCosts
from runtime.loop import GenerationStats, generate_batch
from runtime.proposers import Autoregressive, PromptLookupProposer
from runtime.proposers.base import Draft
from runtime.proposers.guard import DECAY as DECAY_
from runtime.proposers.guard import PROBE_EVERY, PayingGuard
from runtime.proposers.oracle import OracleProposer
from runtime.target import TargetModel
from runtime.tree import Tree
from tests.tiny_models import stories260k

PROMPT = torch.tensor([1, 403, 407, 261, 400, 292, 327, 471, 263, 403, 407, 261, 400, 292, 327])


def _config(tokens: int = 48) -> DecodeConfig:
    return DecodeConfig(max_new_tokens=tokens, eos_token_ids=(), speculation=SpeculationConfig(num_speculative_tokens=3))


def test_a_cheap_step_drafts_every_time_and_an_expensive_one_only_probes():
    target = TargetModel(stories260k())
    plain = run_ours(target, Autoregressive(), PROMPT, _config())
    free = run_ours(target, PayingGuard(PromptLookupProposer(), step_cost=0.5, expected_tau=1.0), PROMPT, _config())
    bare = run_ours(target, PromptLookupProposer(), PROMPT, _config())
    assert free.tokens == bare.tokens == plain.tokens
    assert [s.drafted_nodes for s in free.stats.steps] == [s.drafted_nodes for s in bare.stats.steps]

    dear = PayingGuard(PromptLookupProposer(), step_cost=100.0, expected_tau=1.0)
    run = run_ours(target, dear, PROMPT, _config())
    assert run.tokens == plain.tokens
    offered = [i for i, s in enumerate(run.stats.steps) if s.drafted_nodes]
    probes = [PROBE_EVERY * (2 ** (k + 1) - 1) - 1 for k in range(5)]  # steps 3, 11, 27, ...: each wait doubled
    assert offered and set(offered) <= set(probes)  # only probes drafted (a probe without a lookup match drafts none)
    assert dear.estimated_tau < dear.step_cost and dear.probe_interval > PROBE_EVERY


def test_the_estimate_starts_at_the_prior_and_follows_what_is_accepted():
    target = TargetModel(stories260k())
    guard = PayingGuard(PromptLookupProposer(), step_cost=1.2, expected_tau=2.0, prior_steps=4)
    assert guard.estimated_tau == 2.0 and guard.pays()
    run = run_ours(target, guard, PROMPT, _config())
    drafted = [s.accepted_length for s in run.stats.steps if s.drafted_nodes]
    weight, accepted = 4.0, 8.0  # the prior: 4 steps of 2.0, then each drafted step with older ones decayed
    for length in drafted:
        weight, accepted = guard.decay * weight + 1, guard.decay * accepted + length
    assert drafted and guard.estimated_tau == pytest.approx(accepted / weight)
    undecayed = PayingGuard(PromptLookupProposer(), step_cost=1.2, expected_tau=2.0, prior_steps=4, decay=1.0)
    run = run_ours(target, undecayed, PROMPT, _config())
    drafted = [s.accepted_length for s in run.stats.steps if s.drafted_nodes]
    assert undecayed.estimated_tau == pytest.approx((2.0 * 4 + sum(drafted)) / (4 + len(drafted)))  # a plain mean
    guard.reset(PROMPT, None)
    assert guard.estimated_tau == 2.0  # per sequence
    with pytest.raises(ValueError, match="step_cost"):
        PayingGuard(Autoregressive(), step_cost=0.0, expected_tau=1.5)
    with pytest.raises(ValueError, match="decay"):
        PayingGuard(Autoregressive(), step_cost=1.2, expected_tau=1.5, decay=0.0)


def test_a_rested_head_comes_back_when_its_drafts_start_to_land():
    """A long bad start rests the head; probes whose drafts are accepted bring the decayed estimate back over the
    cost within a few probes, where a plain mean over the whole answer would need many more (the estimate alone:
    the ledger's loss cap is off here). With the cap, the head drafts again once the probes have won back the loss
    over its budget."""
    committed = PROMPT.clone()
    chain = Draft(tokens=committed[-3:], tree=Tree.chain(2))

    def probes_to_return(decay: float, budget: float = float("inf")) -> int:
        guard = PayingGuard(Autoregressive(), step_cost=1.3, expected_tau=1.4, prior_steps=8, decay=decay)
        guard.ledger.budget = budget
        for _ in range(40):
            guard.on_accept(committed, chain, [0], None)  # nothing accepted
        assert not guard.pays()
        probes = 0
        while not guard.pays():
            guard.on_accept(committed, chain, [0, 1, 2], None)  # both draft tokens accepted
            probes += 1
        return probes

    decay = PayingGuard(Autoregressive(), 1.3, 1.4).decay
    assert probes_to_return(decay) <= 3 < probes_to_return(1.0)
    # lost 40 x 0.3 = 12 steps; each landing probe wins back 3 - 1.3: the cap lifts once the loss is within budget
    assert probes_to_return(decay, budget=0.03) == 6


def test_rows_of_a_batch_each_get_their_own_guard_and_drafter_state():
    target = TargetModel(stories260k())
    guard = PayingGuard(PromptLookupProposer(), step_cost=100.0, expected_tau=1.0)
    twin = copy.copy(guard)
    assert twin.inner is not guard.inner
    prompts = [PROMPT, PROMPT[:9]]
    stats = [GenerationStats(), GenerationStats()]
    rows: list[list[int]] = [[], []]
    for step in generate_batch(target, [guard, twin], prompts, _config(24), stats):
        for b, new in enumerate(step):
            rows[b].extend(new.tolist())
    for b, prompt in enumerate(prompts):
        assert rows[b] == run_ours(target, Autoregressive(), prompt, _config(24)).tokens


def test_the_head_rests_only_on_evidence_that_it_loses():
    """Bursty acceptance whose mean dips just under the cost keeps the head drafting (the estimate is read with its
    standard error); steady acceptance under the cost rests it; confidence 0 reads the estimate alone."""
    committed = PROMPT.clone()
    chain = Draft(tokens=committed[-3:], tree=Tree.chain(2))

    def feed(guard: PayingGuard, lengths: list[int]) -> PayingGuard:
        for length in lengths:
            guard.on_accept(committed, chain, list(range(length)), None)
        return guard

    # mean 1.3 against a cost of 1.33: 1.2 steps lost over 52 tokens, inside the ledger's cap (LOSS_BUDGET x 52 +
    # LOSS_SLACK = 1.28), so only the reading of the estimate decides
    bursty = [1, 1, 1, 3, 1, 1, 1, 1, 2, 1] * 4
    optimistic = feed(PayingGuard(Autoregressive(), step_cost=1.33, expected_tau=1.4), bursty)
    assert optimistic.estimated_tau < optimistic.step_cost <= optimistic.optimistic_tau and optimistic.pays()
    plain = feed(PayingGuard(Autoregressive(), step_cost=1.33, expected_tau=1.4, confidence=0.0), bursty)
    assert plain.optimistic_tau == plain.estimated_tau and not plain.pays()
    steady = feed(PayingGuard(Autoregressive(), step_cost=1.35, expected_tau=1.4), [1] * 40)
    assert not steady.pays()
    with pytest.raises(ValueError, match="confidence"):
        PayingGuard(Autoregressive(), step_cost=1.2, expected_tau=1.5, confidence=-1.0)


def test_the_break_even_is_the_step_cost_at_the_sequences_kv_length():
    """step_cost as a function of the KV length: a head that pays at a short context rests at a long one, where the
    same draft costs more than it returns."""
    cost = lambda kv_length: 1.2 if kv_length < 100 else 3.0  # noqa: E731
    guard = PayingGuard(Autoregressive(), step_cost=cost, expected_tau=2.0)
    short, long = torch.arange(1, 60), torch.arange(1, 160)
    guard.propose(short, 3)
    assert guard.step_cost == 1.2 and guard.pays()
    guard.propose(long, 3)
    assert guard.step_cost == 3.0 and not guard.pays()
    with pytest.raises(ValueError, match="step_cost"):
        PayingGuard(Autoregressive(), step_cost=lambda kv_length: -1.0, expected_tau=1.5)


def test_a_head_that_never_accepts_costs_under_five_percent_on_a_long_prompt():
    """A drafter that is always wrong (the plain answer's tokens shifted by one), a prior that promised tau 2 and a
    drafted step that costs more the longer the context (1.3 plain steps at KV 0, 1.55 at 500): the guard drafts a few
    steps until the evidence is in, then only probes, ever more rarely. Its steps, priced by the same cost, stay
    within 5% of plain decoding's; the output is plain decoding's."""
    target = TargetModel(stories260k())
    prompt = PROMPT.repeat(26)[:380]  # a long context for the 512-position model
    config = _config(120)
    plain = run_ours(target, Autoregressive(), prompt, config)
    wrong = OracleProposer([(t + 1) % target.vocab_size for t in plain.tokens[1:]])
    cost = lambda kv_length: 1.3 + kv_length / 2000  # noqa: E731
    run = run_ours(target, PayingGuard(wrong, step_cost=cost, expected_tau=2.0), prompt, config)
    assert run.tokens == plain.tokens
    kv, priced = prompt.numel() + 1, 0.0
    for step in run.stats.steps:
        priced += cost(kv) if step.drafted_nodes else 1.0
        kv += step.accepted_length
    assert all(s.accepted_length == 1 for s in run.stats.steps)
    drafted = sum(1 for s in run.stats.steps if s.drafted_nodes)
    assert len(run.stats.steps) / priced >= 0.95, (drafted, len(run.stats.steps), priced)


class _FixedChain:
    """A drafter that always offers the same 2-token chain (what it accepts is decided by the test)."""

    hidden_state_indices = ()
    tree_size = 2

    def __init__(self, draft: Draft):
        self.draft = draft

    def reset(self, prompt_ids, prefill_hidden) -> None:
        pass

    def propose(self, committed_ids, max_tokens) -> Draft:
        return self.draft

    def on_accept(self, committed_ids, draft, accepted_nodes, tree_hidden) -> None:
        pass


def test_a_sequence_that_loses_stops_the_optimism():
    """Acceptance just under the cost for a long answer (mean ~1.3 against a drafted step of 1.45 plain steps, like the
    chat turn that ran at 0.91x): read optimistically the guard drafts on; once the ledger shows a loss over
    LOSS_BUDGET of the tokens, the estimate is read as it is and the head rests but for probes. A head that pays is
    never held back."""
    import random

    from runtime.proposers.guard import Ledger

    committed = PROMPT.clone()
    chain = Draft(tokens=committed[-3:], tree=Tree.chain(2))
    rng = random.Random(0)
    accepted = [rng.choices([1, 2, 3], weights=[80, 15, 5])[0] for _ in range(400)]  # mean ~1.25

    def run(guard: PayingGuard, cost: float, steps: int = 150) -> tuple[float, int]:
        tokens, priced, drafted = 0, 0.0, 0
        for i in range(steps):
            draft = guard.propose(committed, 3)
            length = accepted[i] if draft.tree.num_nodes > 1 else 1
            drafted += draft.tree.num_nodes > 1
            guard.on_accept(committed, draft, list(range(length)), None)
            tokens, priced = tokens + length, priced + (cost if draft.tree.num_nodes > 1 else 1.0)
        return tokens / priced, drafted

    # however optimistic the reading (5 standard errors here), the ledger bounds what drafting loses
    forever = PayingGuard(_FixedChain(chain), step_cost=1.45, expected_tau=1.5, confidence=5.0)
    forever.ledger.budget = float("inf")  # optimism never bounded: the behaviour before the ledger
    speedup, drafted = run(forever, 1.45)
    assert speedup < 0.95 and drafted > 100
    speedup, drafted = run(PayingGuard(_FixedChain(chain), step_cost=1.45, expected_tau=1.5, confidence=5.0), 1.45)
    assert speedup >= 0.95 and drafted < 100
    speedup, drafted = run(PayingGuard(_FixedChain(chain), step_cost=1.1, expected_tau=1.4), 1.1)
    assert speedup > 1.1 and drafted == 150  # tau 1.25 pays for a step of 1.1: drafted throughout
    ledger = Ledger(budget=0.1, slack=1.0)
    ledger.add(10, 12.5)  # lost 2.5 steps: over 10% of 10 tokens + 1
    assert ledger.losing and not Ledger(budget=0.1, slack=1.0).losing


class _SlowFirstDraft(_FixedChain):
    """A 2-token chain whose first propose takes `first_seconds` (a head fed a long prompt on its first draft)."""

    def __init__(self, draft: Draft, first_seconds: float):
        super().__init__(draft)
        self.first_seconds, self.calls = first_seconds, 0

    def propose(self, committed_ids, max_tokens) -> Draft:
        self.calls += 1
        if self.calls == 1:
            time.sleep(self.first_seconds)
        return self.draft


def test_the_ledger_charges_the_drafters_measured_time():
    """With `charge` (the factory's: modelled verify + the drafter's measured seconds over a plain step's), a first
    draft that took 10 plain steps' time (feeding a long prompt) is on the ledger at once, so a head that then does
    not accept rests at once; priced by the model alone (no charge), the prior keeps it drafting several steps."""
    committed = PROMPT.clone()
    chain = Draft(tokens=committed[-3:], tree=Tree.chain(2))
    plain_seconds = 0.01

    def run(guard: PayingGuard, steps: int = 12) -> list[bool]:
        drafted = []
        for _ in range(steps):
            draft = guard.propose(committed, 3)
            drafted.append(draft.tree.num_nodes > 1)
            guard.on_accept(committed, draft, [0], None)  # never accepts
        return drafted

    charged = PayingGuard(_SlowFirstDraft(chain, 10 * plain_seconds), step_cost=1.1, expected_tau=2.0,
                          charge=lambda kv_length, seconds: 1.1 + seconds / plain_seconds)
    drafted = run(charged)
    assert charged.ledger.cost >= 1.1 + 10 and charged.ledger.losing
    assert drafted[0] and not any(drafted[1:PROBE_EVERY])  # rested from the second step until the first probe
    modelled = PayingGuard(_SlowFirstDraft(chain, 10 * plain_seconds), step_cost=1.1, expected_tau=2.0)
    assert sum(run(modelled)[:PROBE_EVERY]) > 2 and modelled.ledger.cost < 1.1 * 12


class _FakeClock:
    """Seconds that pass only when the test says so."""

    def __init__(self):
        self.seconds = 0.0

    def __call__(self) -> float:
        return self.seconds


class _SleepyChain(_FixedChain):
    """A 2-token chain whose propose takes `seconds` on the test's clock."""

    def __init__(self, draft: Draft, clock: _FakeClock, seconds: float):
        super().__init__(draft)
        self.clock, self.seconds = clock, seconds

    def propose(self, committed_ids, max_tokens) -> Draft:
        self.clock.seconds += self.seconds
        return self.draft


def _timed_run(guard: PayingGuard, clock: _FakeClock, accepted: int, plain: float, verify: float,
               steps: int) -> list[bool]:
    """Play `steps` steps: a drafted one's verify takes `verify` seconds (the drafter its own) and accepts `accepted`
    tokens (bonus included), a plain one takes `plain` seconds."""
    committed, out = PROMPT.clone(), []
    for _ in range(steps):
        draft = guard.propose(committed, 3)
        is_drafted = draft.tree.num_nodes > 1
        clock.seconds += verify if is_drafted else plain
        guard.on_accept(committed, draft, list(range(accepted if is_drafted else 1)), None)
        out.append(is_drafted)
    return out


def _costs(plain: float, verify: float, draft: float) -> StepCosts:
    """A cost model: a plain step `plain` seconds, a 3-token verify `verify`, the drafter `draft`, at every KV."""
    curve = CostCurve(tokens=[1, 3], seconds=[plain, verify])
    return StepCosts([256], [curve], [draft])


def test_a_drafter_slower_than_modelled_shows_at_its_next_step():
    """The model says a drafted step costs 1.15 plain steps (verify 1.05, the drafter 0.1), but the drafter takes
    1.5 plain steps here: a head accepting 2 tokens a step, which the model alone keeps drafting throughout, rests
    once its timed steps show the truth (no plain step is needed to see a drafter's own time). Where the model is
    right, the same head drafts throughout."""
    chain = Draft(tokens=PROMPT[-3:], tree=Tree.chain(2))
    costs = _costs(0.010, 0.0105, 0.001)

    def run(draft_seconds: float, timed: bool) -> tuple[PayingGuard, list[bool]]:
        clock = _FakeClock()
        guard = PayingGuard(_SleepyChain(chain, clock, draft_seconds), step_cost=lambda kv_length: 1.15,
                            expected_tau=2.0, timed=costs if timed else None, verify_tokens=3, clock=clock)
        return guard, _timed_run(guard, clock, 2, plain=0.010, verify=0.0105, steps=120)

    guard, drafted = run(0.015, timed=True)
    assert 2.0 < guard.step_cost <= 2.55 and sum(drafted[-60:]) < 10  # true 2.55; a few probes measure it
    guard, drafted = run(0.015, timed=False)
    assert all(drafted)  # the model alone never sees it
    guard, drafted = run(0.001, timed=True)
    assert all(drafted) and guard.step_cost == pytest.approx(1.15, rel=0.02)


def test_a_verify_dearer_than_modelled_shows_beside_plain_steps():
    """A head that never accepts; the model prices its drafted step at 1.02 plain steps, the machine runs it at 1.3
    (and everything 20% slower than the model). Once resting, its plain steps are timed beside its probes: the
    break-even becomes the measured 1.3, and the ledger, charging real seconds over real plain steps, keeps the
    sequence within LOSS_BUDGET of its tokens plus LOSS_SLACK plus the first draft of plain decoding's time."""
    from runtime.proposers.guard import LOSS_BUDGET, LOSS_SLACK

    chain = Draft(tokens=PROMPT[-3:], tree=Tree.chain(2))
    clock = _FakeClock()
    guard = PayingGuard(_SleepyChain(chain, clock, 0.0005), step_cost=lambda kv_length: 1.02, expected_tau=1.6,
                        timed=_costs(0.050, 0.0505, 0.0005), verify_tokens=3, clock=clock)
    plain, verify = 0.060, 0.060 * 1.3 - 0.0005
    drafted = _timed_run(guard, clock, 1, plain=plain, verify=verify, steps=200)
    seconds = sum(verify + 0.0005 if d else plain for d in drafted)
    lost_steps = seconds / plain - len(drafted)
    assert lost_steps <= LOSS_BUDGET * len(drafted) + LOSS_SLACK + 1.3
    assert 1.15 < guard.step_cost < 1.31  # the model said 1.02; measured 1.3, a few probes in
    assert guard.ledger.cost - guard.ledger.tokens == pytest.approx(lost_steps, abs=0.35)  # the first draft: 1.02


class _GatedChain(_FixedChain):
    """A _FixedChain with a confidence gate: records the threshold each propose is given."""

    def __init__(self, draft: Draft):
        super().__init__(draft)
        self.min_expected, self.seen = 0.0, []

    def propose(self, committed_ids, max_tokens) -> Draft:
        self.seen.append(self.min_expected)
        return Draft(tokens=torch.cat([committed_ids[-1:], self.draft.tokens[1:]]), tree=self.draft.tree)


@pytest.mark.parametrize("gate", [True, False])
def test_each_drafted_step_tells_the_drafter_its_break_even(gate):
    """With the gate on, the guard sets the drafter's min_expected to the step cost at the sequence's KV length minus
    one before every draft (a step must expect that many accepted draft tokens to pay); off, it is never touched."""
    target = TargetModel(stories260k())
    inner = _GatedChain(Draft(tokens=torch.tensor([0, 5, 6]), tree=Tree.chain(2)))
    cost = lambda kv_length: 1.2 + kv_length / 1000  # noqa: E731
    guard = PayingGuard(inner, step_cost=cost, expected_tau=3.0, gate=gate)
    run_ours(target, guard, PROMPT, _config(12))
    assert inner.seen
    if gate:
        assert all(0.2 < seen < 0.3 for seen in inner.seen)  # 0.2 + kv / 1000 at KV 16..28
        assert inner.seen == sorted(inner.seen) and inner.seen[0] == pytest.approx(cost(PROMPT.numel() + 1) - 1)
    else:
        assert set(inner.seen) == {0.0}
    assert copy.copy(guard).gate is gate


class _DecliningChain(_SleepyChain):
    """A drafter whose confidence gate always declines: each propose takes `seconds` on the test's clock (catching
    up with the committed tokens, its first logits) and returns the root alone."""

    def propose(self, committed_ids, max_tokens) -> Draft:
        self.clock.seconds += self.seconds
        self.calls = getattr(self, "calls", 0) + 1
        return Draft(tokens=committed_ids[-1:], tree=Tree.chain(0))


def test_a_drafter_that_keeps_declining_is_charged_and_rested():
    """Asked steps the drafter declines (its gate) cost their measured time on the ledger (the first ask, which fed
    it the prompt, as a plain step), are plain steps for the clock less the drafter's time, and not drafts for the
    tau estimate. A drafter that declines at 0.3 of a plain step each time soon rests but for probes, so the
    sequence loses at most the guard's budget; before (declines priced as plain steps), it was asked at every step
    and lost 30%."""
    from runtime.proposers.guard import LOSS_BUDGET, LOSS_SLACK

    clock = _FakeClock()
    inner = _DecliningChain(Draft(tokens=PROMPT[-3:], tree=Tree.chain(2)), clock, 0.003)
    guard = PayingGuard(inner, step_cost=lambda kv_length: 1.1, expected_tau=2.0, timed=_costs(0.010, 0.0105, 0.001),
                        verify_tokens=3, clock=clock, gate=True)
    committed = PROMPT.clone()
    steps, seconds = 200, 0.0
    for _ in range(steps):
        started = clock.seconds
        draft = guard.propose(committed, 3)
        assert draft.tree.num_nodes == 1
        clock.seconds += 0.010  # the verify of the root alone: a plain step
        guard.on_accept(committed, draft, [0], None)
        seconds += clock.seconds - started
    assert guard.estimated_tau == pytest.approx(2.0)  # no draft observed
    assert guard.clock.plain_ratio == pytest.approx(1.0)  # the plain steps timed are the real ones (0.010 s)
    assert inner.calls < 20  # rested but for probes and the asks the budget allows as the answer grows
    lost = seconds / 0.010 - steps
    assert guard.ledger.cost - guard.ledger.tokens == pytest.approx(lost - 0.3, abs=1e-6)  # the first ask: plain
    # the budget, the first ask, the ask that crossed it, and the probes while over it (each at most 0.3)
    assert lost <= LOSS_BUDGET * steps + LOSS_SLACK + 0.3 + 0.3 + 0.3 * (inner.calls - 3) / 2
    assert lost / steps < 0.025


def test_a_machine_faster_than_its_cost_model_makes_no_step_look_free():
    """The cost model was measured while the machine was slow (a plain step 0.050 s, a 3-token verify 0.0505 s);
    here a plain step takes 0.035 s and a drafted step's verify 0.040 s. Before a sequence has timed plain steps,
    its plain step is the model's, so a step's measured time over it reads under one plain step. A drafted step is
    still charged at least a plain step plus the drafter's measured time, so a head that never accepts is never
    credited on the ledger (before: its second and third drafts were, 0.90 and 0.95 plain steps); and a declined
    ask is charged a plain step plus the drafter's time, so a drafter whose gate declines every ask rests but for
    probes (before: a decline was priced 1.004 plain steps, free)."""
    from runtime.proposers.guard import LOSS_BUDGET, LOSS_SLACK

    chain = Draft(tokens=PROMPT[-3:], tree=Tree.chain(2))
    clock = _FakeClock()
    guard = PayingGuard(_SleepyChain(chain, clock, 0.002), step_cost=lambda kv_length: 1.05, expected_tau=1.6,
                        timed=_costs(0.050, 0.0505, 0.002), verify_tokens=3, clock=clock)
    committed, balance = PROMPT.clone(), []
    for _ in range(60):
        draft = guard.propose(committed, 3)
        clock.seconds += 0.040 if draft.tree.num_nodes > 1 else 0.035
        guard.on_accept(committed, draft, [0], None)
        balance.append(guard.ledger.cost - guard.ledger.tokens)
    assert min(balance) >= 0.0

    clock = _FakeClock()
    inner = _DecliningChain(Draft(tokens=PROMPT[-3:], tree=Tree.chain(2)), clock, 0.002)
    guard = PayingGuard(inner, step_cost=lambda kv_length: 1.05, expected_tau=1.6, timed=_costs(0.050, 0.0505, 0.002),
                        verify_tokens=3, clock=clock, gate=True)
    steps, seconds = 200, 0.0
    for _ in range(steps):
        started = clock.seconds
        draft = guard.propose(committed, 3)
        clock.seconds += 0.035  # the verify of the root alone: a plain step
        guard.on_accept(committed, draft, [0], None)
        seconds += clock.seconds - started
    assert guard.declined_cost == pytest.approx(1 + 0.002 / 0.035, rel=0.05)
    assert inner.calls < 30
    assert seconds / 0.035 - steps <= LOSS_BUDGET * steps + LOSS_SLACK + 0.002 / 0.035 * 12


class _SometimesDeclining(_SleepyChain):
    """A drafter whose gate declines every `every`-th ask (the root alone) and drafts its chain otherwise; each
    propose takes `seconds` on the test's clock."""

    def __init__(self, draft: Draft, clock: _FakeClock, seconds: float, every: int):
        super().__init__(draft, clock, seconds)
        self.every, self.calls = every, 0

    def propose(self, committed_ids, max_tokens) -> Draft:
        self.clock.seconds += self.seconds
        self.calls += 1
        return Draft(tokens=committed_ids[-1:], tree=Tree.chain(0)) if self.calls % self.every == 0 else self.draft


def test_declined_asks_time_plain_steps_so_a_dearer_verify_shows():
    """The model says a drafted step costs 1.15 plain steps (verify 1.05, drafter 0.1), but here a drafted step's
    verify takes 1.25 plain steps, which only plain steps timed beside the drafted ones can show. A guard whose
    drafter is asked at every step and declines one ask in three (its gate) runs no other plain step: the declined
    asks, less the drafter's time, are its plain steps. So the clock reads a plain step at its true time and the
    step cost at its true 1.35, and a head accepting 1.2 tokens a drafted step rests; before, the plain time stayed
    the verify ratio's prior, the step cost read ~1.15 and the head drafted throughout, losing."""
    chain = Draft(tokens=PROMPT[-3:], tree=Tree.chain(2))
    clock = _FakeClock()
    inner = _SometimesDeclining(chain, clock, 0.001, every=3)
    guard = PayingGuard(inner, step_cost=lambda kv_length: 1.15, expected_tau=1.2, timed=_costs(0.010, 0.0105, 0.001),
                        verify_tokens=3, clock=clock, gate=True)
    committed, drafted = PROMPT.clone(), []
    for step in range(200):
        draft = guard.propose(committed, 3)
        is_drafted = draft.tree.num_nodes > 1
        clock.seconds += 0.0125 if is_drafted else 0.010
        accepted = 2 if is_drafted and step % 10 < 2 else 1  # ~1.2 tokens a drafted step
        guard.on_accept(committed, draft, list(range(accepted)), None)
        drafted.append(is_drafted)
    assert guard.clock.plain_ratio == pytest.approx(1.0, abs=0.02)
    assert 1.25 < guard.step_cost <= 1.36  # true 1.35; the verify ratio keeps part of its prior (few drafts)
    assert sum(drafted[-100:]) < 20


class _Confident:
    """A 2-token chain that always expects `expected` accepted tokens and records the gate it was given."""

    hidden_state_indices = ()
    tree_size = 2

    def __init__(self, expected: float):
        self.expected, self.min_expected, self.gates = expected, 0.0, []

    def reset(self, prompt_ids, prefill_hidden):
        pass

    def propose(self, committed_ids, max_tokens):
        self.gates.append(self.min_expected)
        return Draft(tokens=torch.cat([committed_ids[-1:], torch.tensor([5, 6])]), tree=Tree.chain(2),
                     expected=self.expected)

    def on_accept(self, committed_ids, draft, accepted_nodes, tree_hidden):
        pass


def test_the_gate_asks_more_of_a_drafter_whose_drafts_miss_what_they_expected():
    """A head sure of .5 tokens per draft that gets none (text it never saw): each miss raises the gate's threshold
    (up to 4x); a head that gets what it expects keeps its break-even; asks without drafts decay the evidence back
    toward the prior."""
    from runtime.proposers.guard import GateCalibration

    def run(accepted: list[int]) -> list[float]:
        inner = _Confident(0.5)
        guard = PayingGuard(inner, step_cost=1.2, expected_tau=50.0, gate=True)  # drafts at every step
        guard.reset(PROMPT, None)
        guard.ledger.budget = float("inf")  # never rested by its losses: the gate alone is under test
        for nodes in accepted:
            draft = guard.propose(PROMPT, 2)
            guard.on_accept(PROMPT, draft, list(range(nodes + 1)), None)
        return inner.gates

    missing = run([0] * 6)
    assert missing[0] == pytest.approx(0.2) and all(b > a for a, b in zip(missing, missing[1:], strict=False))
    # the last ask's threshold: 0.2 x (1 + the misses' expectations, decayed at every ask since)
    assert len(missing) == 6 and missing[-1] > 0.2 * (1 + 0.5 * DECAY_ ** (len(missing) - 1) * (len(missing) - 1))
    hitting = run([1, 0] * 3)  # .5 per draft on average, as expected
    assert max(hitting) < 0.2 * 1.3
    calibration = GateCalibration(prior=1.0, max_scale=4.0)
    for _ in range(40):
        calibration.ask()
        calibration.observe(0.5, 0)
    assert calibration.scale == 4.0  # capped
    for _ in range(64):
        calibration.ask()  # declined asks only: the misses fade
    assert calibration.scale < 1.3
    with pytest.raises(ValueError, match="gate calibration"):
        GateCalibration(prior=0.0)


def test_a_drafter_that_keeps_declining_cheaply_is_asked_by_its_share_of_drafts():
    """The guard asks while an ask pays (guard.ask_value): the share of asks that draft at the estimated tau, the
    others at a declined step's measured price. A drafter that declines for 0.02 of a plain step never drafts, so
    its estimate stays at the planner's 1.3, and the ledger would let it be asked for ~100 steps before resting it.
    Its declines bring the share down until an ask costs more than it returns; then only probes ask."""
    from runtime.proposers.guard import DraftShare, ask_value

    clock = _FakeClock()
    inner = _DecliningChain(Draft(tokens=PROMPT[-3:], tree=Tree.chain(2)), clock, 0.0002)
    guard = PayingGuard(inner, step_cost=lambda kv_length: 1.1, expected_tau=1.3, timed=_costs(0.010, 0.0105, 0.001),
                        verify_tokens=3, clock=clock, gate=True)
    committed = PROMPT.clone()
    for _ in range(200):
        draft = guard.propose(committed, 3)
        clock.seconds += 0.010  # the verify of the root alone
        guard.on_accept(committed, draft, [0], None)
    assert guard.estimated_tau == pytest.approx(1.3) and not guard.ledger.losing  # neither rested it
    assert guard.declined_cost == pytest.approx(1.02, abs=0.005)
    assert inner.calls < 45  # ~100 before
    assert ask_value(1.3, 1.15, 1.02, 1.0) == (1.3, 1.15)  # every ask drafts: tau against the drafted step
    tokens, cost = ask_value(1.3, 1.15, 1.02, 0.25)
    assert tokens == pytest.approx(1.075) and cost == pytest.approx(1.0525)
    share = DraftShare(prior_steps=4, decay=0.5)
    share.observe_ask(False)
    assert share.share == pytest.approx(2 / 3)  # the prior decays with each ask: 4 x 0.5 drafted of 4 x 0.5 + 1
    with pytest.raises(ValueError, match="draft share"):
        DraftShare(prior_steps=0)
