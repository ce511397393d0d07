"""Draft only while this sequence's acceptance says drafting pays: the planner's choice, checked as it runs.

The planner (runtime/planner.plan_drafter) turns a head on from its held-out accuracy, measured on text like its
training data. A prompt far from that text accepts less: an EAGLE head trained on 60K teacher-forced tokens had
held-out top-1 .28 and accepted .11 on MT-Bench, where drafting cost 1.23 plain steps per step and returned 1.11
tokens (0.90x). The
guard keeps a running estimate of the accepted length per drafted step, starting from the planner's expected tau
as a prior worth PRIOR_STEPS steps, each older step weighing DECAY times the next (a memory of about 16 drafted
steps, so the estimate follows where the answer is now), and drafts while

    estimated tau >= step_cost   (the planned step's verify + draft time over a plain step's, measured)

where "estimated tau" is read optimistically: the estimate plus CONFIDENCE standard errors of it (from the same
decayed sums of accepted lengths and their squares), so the head rests only where the evidence says it loses, and
otherwise runs plain steps, drafting once every PROBE_EVERY steps to see whether the text became easier. Why
optimistic: near break-even either choice costs little, while resting a head that pays loses its whole margin for
the several probes it takes to come back, and acceptance comes in bursts that a 16-step mean over-reads.
For the same reason it probes every 4th step, not 8th: a simulation of chain-1 drafting (each drafted token
accepted with a fixed probability, a drafted step costing 1.11 plain steps, prior tau 1.33 over 8 steps, 110
steps, 600 runs) gave, forced on / plain estimate with probes every 8 / optimistic with probes every 4:
1.127 / 1.115 / 1.129 at acceptance .25, 1.063 / 1.042 / 1.062 at .18, 0.946 / 0.985 / 0.971 at .05, and
1.098 / 1.061 / 1.087 for bursts of .05 and .45. Measured numbers are in the README ("The main job").
Without the decay a head that started an answer badly stayed rested (measured: tau 1.01 guarded against 1.35
forced on one MT-Bench turn, probes every 16 steps); with it a few good probes turn it back on. The
drafter's state keeps up while it rests (every proposer feeds what was committed on its next propose), so a
probe drafts from the full context. Output is unchanged whatever the guard decides: every draft is verified.

The break-even follows the sequence (issue 29): `step_cost` is a function of the KV length the sequence has
reached (runtime.cost_model.StepCosts: verify and draft time measured at KV 256, 1,024 and 2,048, relative to a
plain step at the same length), read at every step. A summary of a 2,000-token document was drafted against the
cost measured at 256 and lost down to 0.71x. And a head that keeps failing its probes is probed less and less
often: each failed probe doubles the interval (4, 8, ... up to MAX_PROBE_EVERY steps), a paying estimate resets it,
so a head that never accepts costs a few percent, not a probe step in every four.

The break-even is also measured (`timed`, the factory's guards): the model's step costs are measured once, on a
random context, and a real step pays what they leave out (the drafter fed each newly committed token, its
on_accept, a verify forward that costs more here than when the curve was cached). So every step is timed, from the
guard's propose to its on_accept (StepClock): the drafter's own seconds and the rest of a drafted step, and plain
steps, each over what the model says at that KV length; the break-even is the drafted step's time here over a plain
step's here. Measured on an AVX2-only VM: the model said x1.02 for an EAGLE step of one token at KV 256 (its
propose 1 ms on a warm context) while steps drafted 3-5 ms; a head that never accepted drafted 62 of 128 steps of
a translation at 0.88x (before).

The loss has a cap: a ledger of this sequence's steps (tokens committed, and their cost in plain steps: a drafted
step at its step cost, a plain one at 1) says how much drafting has lost so far, and while that loss is over
LOSS_BUDGET of the tokens plus LOSS_SLACK steps the head rests whatever its estimate says, drafting only the probes
(a probe that pays wins the loss back; plain steps raise the cap as the answer grows). A timed guard charges a
drafted step its measured time over this sequence's measured plain step, and never less than a plain step plus the
drafter's own measured time (until the sequence has timed plain steps, its plain step is the cost model's, which a
shared machine's drift can put well above the real one); an untimed one its modelled verify plus
the drafter's MEASURED time in this step (`charge`, where it is given one), else the step cost. The sequence's
first draft is charged the step cost alone: it also fed the head the whole prompt (an EAGLE layer over a
1,000-token prompt: 0.2-0.33 s, 2-4% of the answer), the one-off price of trying the head that the planner chose
to pay, and resting would not win it back (charged, even a head that pays would rest after it until probes
had won the loss back). So a guarded sequence loses at most LOSS_BUDGET of its tokens, LOSS_SLACK steps, its last
drafted step and its first draft's prompt feed. A step whose drafter was asked and declined (EAGLE-2's confidence
gate: it caught up with the committed tokens and read its first logits, then drafted nothing) is charged a plain step
plus the drafter's measured time, counts for the clock as a plain step less the drafter's time, and is not a draft
for the estimate: priced as a plain step (before), a head that kept declining was asked at every step, and its time
made plain steps look dearer to the clock. And an ask
is valued by what the gate lets through (DraftShare, ask_value): the share of this sequence's asks that drafted, at
the estimated tau and the drafted step's cost, the rest at a declined step's measured price for the plain step's one
token; so a drafter that keeps declining stops being asked before its declines have spent the loss budget.

Why the cap: the prior alone lets a head that never accepts draft until its estimate falls under the cost, which
loses PRIOR_STEPS x (prior tau - cost) plain steps whatever the cost: measured on a 36-token translation (prior 1.5,
a drafted step of 1.10 plain steps), 14 drafted steps at tau 1.0 before resting, 0.91x. And the optimistic reading
drafted on through a whole chat turn at tau 1.25 against a step of 1.37 plain steps (0.91x, as the cost model
predicted).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import torch

from runtime.cost_model import StepCosts
from runtime.proposers.base import Draft, Proposer, root_only

PRIOR_STEPS = 4  # was 8: a head that never accepts drafted 10 steps at a loss before resting, now 7
DECAY = 15 / 16
PROBE_EVERY = 4
MAX_PROBE_EVERY = 64
CONFIDENCE = 1.0
LOSS_BUDGET = 0.015  # (was 0.03: a never-accepting head re-drafted every ~30 tokens, 2-5% lost) the share of its tokens a sequence may lose to drafting before the head rests but for probes
LOSS_SLACK = 0.5  # plain steps of loss always allowed (early misses of a head that pays)
CLOCK_PRIOR_STEPS = 2  # the cost model's word on a step's time weighs this many measured steps


class RatioMean:
    """A decayed mean of measured over modelled times (each older observation weighs `decay` times the next), read
    from a prior worth `prior_steps` observations."""

    def __init__(self, prior_steps: int = CLOCK_PRIOR_STEPS, decay: float = DECAY):
        self.prior_steps, self.decay = prior_steps, decay
        self.reset()

    def reset(self) -> None:
        self.total, self.weight = 0.0, 0.0

    def observe(self, measured: float, modelled: float) -> None:
        if modelled <= 0:  # a model of 0 s (a drafter that costs nothing, a curve extrapolated to nothing) has no
            return  # time to compare with (it raised, dividing by 0)
        self.total = self.decay * self.total + measured / modelled
        self.weight = self.decay * self.weight + 1.0

    def mean(self, prior: float = 1.0) -> float:
        return (self.prior_steps * prior + self.total) / (self.prior_steps + self.weight)


class StepClock:
    """This sequence's measured steps against the cost model (runtime.cost_model.StepCosts) at each step's KV length,
    so that the guard's break-even is what its steps really take here.

    A drafted step is split into the drafter's own measured time (propose + on_accept) and the rest (verify,
    acceptance, commit); a plain step is all "rest". Three decayed means of measured over modelled: the drafter's
    time over the modelled draft time, a drafted step's rest over the modelled verify of `tokens` tokens, a plain
    step over the modelled plain step. Each starts from a prior worth `prior_steps` steps: 1 (the model is right)
    for the first two, the verify ratio's current value for the plain one (the machine as a whole may be slower
    or faster than when the curves were measured; only plain steps timed beside drafted ones tell the two apart).
    So a drafter slower than it was measured shows at its next step, a verify dearer than modelled once the
    sequence has run plain steps too (resting, between probes, or asks its drafter declined, less its time)."""

    def __init__(self, costs: StepCosts, tokens: int, prior_steps: int = CLOCK_PRIOR_STEPS, decay: float = DECAY):
        self.costs, self.tokens, self.prior_steps, self.decay = costs, tokens, prior_steps, decay
        self.reset()

    def reset(self) -> None:
        self.draft, self.verify, self.plain = (RatioMean(self.prior_steps, self.decay) for _ in range(3))

    def observe_plain(self, kv_length: int, seconds: float) -> None:
        self.plain.observe(seconds, self.costs.plain_seconds(kv_length))

    def observe_drafted(self, kv_length: int, seconds: float, draft_seconds: float) -> None:
        self.draft.observe(draft_seconds, self.costs.draft(kv_length))  # a drafter modelled at 0 s is skipped
        self.verify.observe(max(seconds - draft_seconds, 0.0), self.costs.verify_seconds(self.tokens, kv_length))

    @property
    def verify_ratio(self) -> float:
        return self.verify.mean()

    @property
    def plain_ratio(self) -> float:
        return self.plain.mean(self.verify_ratio)

    def plain_seconds(self, kv_length: int) -> float:
        """A plain step's time here at this KV length."""
        return self.plain_ratio * self.costs.plain_seconds(kv_length)

    def step_cost(self, kv_length: int) -> float:
        """A drafted step's time here over a plain step's, at this KV length."""
        drafted = (self.verify_ratio * self.costs.verify_seconds(self.tokens, kv_length)
                   + self.draft.mean() * self.costs.draft(kv_length))
        return drafted / self.plain_seconds(kv_length)


class Ledger:
    """A sequence's committed tokens and what its steps cost in plain steps; `losing` while the cost exceeds the
    tokens by more than `budget` of the tokens plus `slack` steps."""

    def __init__(self, budget: float = LOSS_BUDGET, slack: float = LOSS_SLACK):
        self.budget, self.slack = budget, slack
        self.reset()

    def reset(self) -> None:
        self.tokens, self.cost = 0.0, 0.0

    def add(self, tokens: int, cost: float) -> None:
        self.tokens += tokens
        self.cost += cost

    @property
    def losing(self) -> bool:
        return self.cost - self.tokens > self.budget * self.tokens + self.slack


class RunningTau:
    """This sequence's accepted tokens per drafted step (bonus included): a prior of `prior_steps` steps at
    `prior_tau`, then every observed step, each older one weighing `decay` times the next; `optimistic` adds
    `confidence` standard errors (decayed variance over the decayed weight)."""

    def __init__(self, prior_tau: float, prior_steps: int = PRIOR_STEPS, decay: float = DECAY,
                 confidence: float = CONFIDENCE):
        if prior_tau < 1 or prior_steps <= 0 or not 0 < decay <= 1 or confidence < 0:
            raise ValueError(f"running tau: need expected_tau >= 1, prior_steps > 0, 0 < decay <= 1, confidence >= 0; "
                             f"got {prior_tau}, {prior_steps}, {decay}, {confidence}")
        self.prior_tau, self.prior_steps, self.decay, self.confidence = prior_tau, prior_steps, decay, confidence
        self.reset()

    def reset(self) -> None:
        self._weight = float(self.prior_steps)
        self._accepted = self.prior_steps * self.prior_tau
        self._squares = self.prior_steps * self.prior_tau ** 2

    def observe(self, accepted_length: int) -> None:
        self._weight = self.decay * self._weight + 1
        self._accepted = self.decay * self._accepted + accepted_length
        self._squares = self.decay * self._squares + accepted_length ** 2

    @property
    def mean(self) -> float:
        return self._accepted / self._weight

    @property
    def optimistic(self) -> float:
        mean = self.mean
        variance = max(self._squares / self._weight - mean * mean, 0.0)
        return mean + self.confidence * (variance / self._weight) ** 0.5


class ProbeSchedule:
    """When a resting drafter drafts anyway to see whether the text became easier: after `first` resting steps,
    each probe doubling the wait for the next (up to `longest`) until `paid()` says the drafter pays again."""

    def __init__(self, first: int = PROBE_EVERY, longest: int = MAX_PROBE_EVERY):
        if not 1 <= first <= longest:
            raise ValueError(f"probes: need 1 <= probe_every <= max_probe_every, got {first}, {longest}")
        self.first, self.longest = first, longest
        self.paid()

    def paid(self) -> None:
        self.interval, self._resting = self.first, 0

    def due(self) -> bool:
        """Count one resting step; True when it is a probe (the wait for the next one then doubles)."""
        if self._resting + 1 >= self.interval:
            self._resting, self.interval = 0, min(2 * self.interval, self.longest)
            return True
        self._resting += 1
        return False


class GateCalibration:
    """This sequence's word on the drafter's own confidence: decayed sums of the accepted draft tokens its drafts
    expected (Draft.expected, from its path probabilities) and of those they got, each from a prior of `prior`
    tokens, both sums decaying by `decay` at every ask (a draft or a decline), so that a gate that declines everything
    drifts back to the prior. `scale` = expected / accepted, kept within [1 / max_scale, max_scale], multiplies the
    gate's threshold.

    Why: the gate trusts the draft's probabilities, which are calibrated on text like the head's training data (7
    kinds pooled: drafts expecting .25 accepted .23) but not on text it has never seen. The main job's chat-trained
    head on 4 translations drafted 26 steps expecting .08-.48 tokens each (~4 in all) and accepted none: each such
    draft cost its drafting and verify tokens (~0.1 plain steps) while the estimate of tau came down slowly from its
    prior. With the calibration, after a few misses a draft must expect twice or thrice as much to be verified."""

    def __init__(self, prior: float = 1.0, decay: float = DECAY, max_scale: float = 4.0):
        if prior <= 0 or max_scale < 1:
            raise ValueError(f"gate calibration: need prior > 0 and max_scale >= 1, got {prior}, {max_scale}")
        self.prior, self.decay, self.max_scale = prior, decay, max_scale
        self.reset()

    def reset(self) -> None:
        self.expected, self.accepted = 0.0, 0.0

    def ask(self) -> None:
        self.expected *= self.decay
        self.accepted *= self.decay

    def observe(self, expected: float | None, accepted: int) -> None:
        if expected is not None:
            self.expected += expected
            self.accepted += accepted

    @property
    def scale(self) -> float:
        ratio = (self.prior + self.expected) / (self.prior + self.accepted)
        return min(max(ratio, 1.0 / self.max_scale), self.max_scale)


class DraftShare:
    """This sequence's share of asks its drafter answered with a draft (its confidence gate declines the others): a
    prior of `prior_steps` asks that drafted, then every ask, each older one weighing `decay` times the next (the
    prior too, as RunningTau's), so a drafter that keeps declining is soon read by its declines.

    Why: the tau estimate reads drafted steps only (a decline is the gate's choice, not a test of the text), so a
    drafter whose gate declined most asks looked as good as its drafts and was asked at every step. Measured: on 4
    translations the hybrid asked the main job's chat-trained head 43 times; it declined 27 (each ~0.05 plain steps
    of feeding and first logits, for the plain step's one token) while its estimate stayed at 1.24-1.27."""

    def __init__(self, prior_steps: int = PRIOR_STEPS, decay: float = DECAY):
        if prior_steps <= 0 or not 0 < decay <= 1:
            raise ValueError(f"draft share: need prior_steps > 0 and 0 < decay <= 1, got {prior_steps}, {decay}")
        self.prior_steps, self.decay = prior_steps, decay
        self.reset()

    def reset(self) -> None:
        self._drafted = self._weight = float(self.prior_steps)

    def observe_ask(self, drafted: bool) -> None:
        self._drafted = self.decay * self._drafted + (1.0 if drafted else 0.0)
        self._weight = self.decay * self._weight + 1.0

    @property
    def share(self) -> float:
        return self._drafted / self._weight


def ask_value(tau: float, cost: float, declined_cost: float, share: float) -> tuple[float, float]:
    """(tokens, cost in plain steps) of asking a drafter with a confidence gate: a `share` of asks draft, accepting
    `tau` tokens (bonus included) for `cost`; the others are declined and commit a plain step's one token for
    `declined_cost` (the verify of the root plus what the drafter spent before declining)."""
    return 1.0 + share * (tau - 1.0), share * cost + (1.0 - share) * declined_cost


def set_gate(proposer: Proposer, minimum: float) -> None:
    """Tell a drafter with a confidence gate (EAGLE-2's `min_expected`) how many accepted draft tokens this step
    must expect to pay for itself; drafters without one draft as they always do."""
    if hasattr(proposer, "min_expected"):
        proposer.min_expected = max(minimum, 0.0)


class PayingGuard:
    """A proposer that drafts through `inner` while the estimated accepted length pays for `step_cost`, a number or
    a function of the KV length (committed tokens) giving the drafted step's cost over a plain step's."""

    def __init__(self, inner: Proposer, step_cost: float | Callable[[int], float], expected_tau: float,
                 prior_steps: int = PRIOR_STEPS, probe_every: int = PROBE_EVERY, decay: float = DECAY,
                 confidence: float = CONFIDENCE, max_probe_every: int = MAX_PROBE_EVERY,
                 charge: Callable[[int, float], float] | None = None,
                 timed: StepCosts | None = None, verify_tokens: int = 0,
                 clock: Callable[[], float] = time.perf_counter, gate: bool = True):
        cost = step_cost if callable(step_cost) else (lambda kv_length, c=float(step_cost): c)
        if cost(1) <= 0:
            raise ValueError(f"guard: need step_cost > 0, got {cost(1)}")
        self.inner = inner
        self.hidden_state_indices = inner.hidden_state_indices
        self.cost, self.expected_tau = cost, expected_tau
        # the ledger's price of a drafted step from (KV length, the drafter's measured seconds in it); None: step_cost
        self.charge = charge
        # with the cost model (`timed`, its steps verifying `verify_tokens` tokens) every step is timed against it
        # (StepClock) and the break-even and the ledger use the steps' measured times; None: step_cost alone
        self.timed, self.verify_tokens = timed, verify_tokens
        self.clock = StepClock(timed, verify_tokens, decay=decay) if timed is not None else None
        self.now = clock  # seconds (tests pass their own)
        # each drafted step tells the drafter its break-even (step cost - 1 tokens), for its confidence gate
        self.gate = gate
        self._draft_seconds, self._step_started, self._drafted_before, self._asked = 0.0, 0.0, False, False
        self.tau = RunningTau(expected_tau, prior_steps, decay, confidence)
        self.probes = ProbeSchedule(probe_every, max_probe_every)
        self.ledger = Ledger()
        self.calibration = GateCalibration(decay=decay)
        self.asks = DraftShare(prior_steps, decay)  # the share of asks the drafter drafted (its gate declines some)
        self._declined = RatioMean(CLOCK_PRIOR_STEPS, decay)  # a declined ask's price in plain steps
        self._kv_length = 0

    def __copy__(self) -> PayingGuard:  # runtime.proposers.base.per_row: each row its own inner state
        return PayingGuard(copy.copy(self.inner), self.cost, self.expected_tau, self.tau.prior_steps,
                           self.probes.first, self.tau.decay, self.tau.confidence, self.probes.longest, self.charge,
                           self.timed, self.verify_tokens, self.now, self.gate)

    @property
    def decay(self) -> float:
        return self.tau.decay

    @property
    def modelled_step_cost(self) -> float:
        """The cost model's drafted step over its plain step at the KV length this sequence has reached."""
        return self.cost(self._kv_length)

    @property
    def step_cost(self) -> float:
        """A drafted step's cost over a plain step's at the KV length this sequence has reached: the model's,
        corrected by this sequence's measured steps where they are timed."""
        return self.modelled_step_cost if self.clock is None else self.clock.step_cost(self._kv_length)

    @property
    def probe_interval(self) -> int:
        """Steps between probes while resting: probe_every, doubled by each failed probe up to max_probe_every."""
        return self.probes.interval

    @property
    def tree_size(self) -> int:
        """The inner drafter's draft tokens per step (what the loop budgets for)."""
        return self.inner.tree_size

    @property
    def estimated_tau(self) -> float:
        """Accepted tokens per drafted step (bonus included): the prior's steps and this sequence's, each older
        one weighing `decay` times the next."""
        return self.tau.mean

    @property
    def optimistic_tau(self) -> float:
        """The estimate plus `confidence` standard errors of it."""
        return self.tau.optimistic

    @property
    def declined_cost(self) -> float:
        """A declined ask's price in plain steps: the measured ones' decayed mean, from a prior of a plain step."""
        return self._declined.mean(1.0)

    def pays(self) -> bool:
        """An ask, at the estimate read optimistically and the share of asks the drafter drafts (ask_value), covers
        its cost, and this sequence has not lost its budget."""
        if self.ledger.losing:
            return False
        tokens, cost = ask_value(self.optimistic_tau, self.step_cost, self.declined_cost, self.asks.share)
        return tokens >= cost

    def reset(self, prompt_ids: torch.Tensor, prefill_hidden: dict[int, torch.Tensor] | None) -> None:
        self.inner.reset(prompt_ids, prefill_hidden)
        self.tau.reset()
        self.probes.paid()
        self.ledger.reset()
        self.calibration.reset()
        self.asks.reset()
        self._declined.reset()
        if self.clock is not None:
            self.clock.reset()
        self._kv_length, self._drafted_before = 0, False

    def propose(self, committed_ids: torch.Tensor, max_tokens: int) -> Draft:
        self._step_started = self.now()
        self._kv_length = committed_ids.numel()
        self._draft_seconds, self._asked = 0.0, False
        if max_tokens > 0 and self.pays():
            self.probes.paid()
            return self._timed_propose(committed_ids, max_tokens)
        if max_tokens > 0 and self.probes.due():
            return self._timed_propose(committed_ids, max_tokens)
        return root_only(committed_ids)

    def _timed_propose(self, committed_ids: torch.Tensor, max_tokens: int) -> Draft:
        started = self.now()
        if self.gate:
            self.calibration.ask()
            set_gate(self.inner, (self.step_cost - 1.0) * self.calibration.scale)
        draft = self.inner.propose(committed_ids, max_tokens)
        self._draft_seconds, self._asked = self.now() - started, True
        return draft

    def drafted_step_price(self, step_seconds: float) -> float:
        """What the ledger charges the step just drafted, in plain steps. Timed (`timed` given): its
        measured time over a plain step's measured here, and never less than a plain step plus the drafter's own
        measured seconds (a verify of more tokens does not cost less than the root's; before the sequence has run
        plain steps, the plain step is the cost model's, and a shared machine's drift put it 35% above what this
        sequence's plain steps took: drafted steps that committed one token were charged 0.84-0.99 of one, so a
        head that never accepted looked like it paid); but for the sequence's first draft, charged the step
        cost: it also fed the drafter the whole prompt, the one-off price of trying the head at all (the planner's
        decision), which resting would not win back. Untimed: the modelled verify plus the drafter's measured time
        (`charge`), else the step cost."""
        if self.clock is not None:
            if not self._drafted_before:
                return self.step_cost
            return max(step_seconds / self.clock.plain_seconds(self._kv_length), self._plain_and_drafter())
        return self.step_cost if self.charge is None else self.charge(self._kv_length, self._draft_seconds)

    def declined_step_price(self) -> float:
        """What the ledger charges a step whose drafter was asked and declined (its confidence gate: it caught up
        with the committed tokens and computed its first logits, then drafted nothing), in plain steps. Timed: a
        plain step plus the drafter's measured seconds over a plain step's here (the rest of the step verified the
        root alone, a plain step by definition; priced as the whole step over a plain step estimated before the
        sequence had run any, a decline came out at the floor of one plain step, free, and on a translation the
        head was asked and declined 12 steps in a row at ~2.3 ms, 7% of a step, each), but for the sequence's
        first ask, charged as a plain step (it fed the drafter the prompt, the one-off price of trying the head, as
        for a first draft). Untimed: a plain step."""
        if self.clock is None or not self._drafted_before:
            return 1.0
        return self._plain_and_drafter()

    def _plain_and_drafter(self) -> float:
        """A plain step plus the drafter's measured seconds in this step, in plain steps here (timed guards)."""
        return 1.0 + self._draft_seconds / self.clock.plain_seconds(self._kv_length)

    def on_accept(self, committed_ids: torch.Tensor, draft: Draft, accepted_nodes: list[int],
                  tree_hidden: dict[int, torch.Tensor] | None) -> None:
        started = self.now()
        self.inner.on_accept(committed_ids, draft, accepted_nodes, tree_hidden)
        ended = self.now()
        self._draft_seconds += ended - started  # read only for a drafted step
        drafted = draft.tree.num_nodes > 1
        step_seconds = ended - self._step_started
        if self._asked and not drafted:  # the drafter was asked and declined (its confidence gate): charged; its
            # verify was the root's alone, so the step less the drafter's time is a plain step for the clock (a
            # guard that drafts at most steps runs few other plain steps: without these, its plain time would stay
            # the verify ratio's prior and hide a verify dearer than modelled); not a draft for the tau estimate
            # (the gate chose it, not the text)
            price = self.declined_step_price()
            self.ledger.add(len(accepted_nodes), price)
            self._declined.observe(price, 1.0)
            self.asks.observe_ask(False)
            if self.clock is not None:
                self.clock.observe_plain(self._kv_length, max(step_seconds - self._draft_seconds, 0.0))
            self._drafted_before = True
            return
        if drafted:
            self.asks.observe_ask(True)
        self.ledger.add(len(accepted_nodes), self.drafted_step_price(step_seconds) if drafted else 1.0)
        if self.clock is not None:
            self._time_step(drafted, step_seconds)
        if drafted:
            self.tau.observe(len(accepted_nodes))
            self.calibration.observe(draft.expected, len(accepted_nodes) - 1)
            if self.pays() or len(accepted_nodes) >= self.step_cost:  # a probe that landed calls the next one soon
                self.probes.paid()

    def _time_step(self, drafted: bool, seconds: float) -> None:
        """Add the step to the clock; the sequence's first draft is left out (it fed the drafter the prompt)."""
        if not drafted:
            self.clock.observe_plain(self._kv_length, seconds)
        elif self._drafted_before:
            self.clock.observe_drafted(self._kv_length, seconds, self._draft_seconds)
        self._drafted_before = self._drafted_before or drafted
