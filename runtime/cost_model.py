"""Verification cost model: how a target forward's time grows with the number of tree tokens, and the tree
size that maximises expected accepted tokens per second.

Speculation pays when the extra tokens of a verify forward are nearly free. On a GPU at batch 1 they are,
up to tens of tokens; on a CPU they are not (a 32-token forward costs ~3x a 1-token one). So the tree size
is chosen per device:

    size* = argmax_n  E[tau(n)] / (t_verify(n + 1) + t_draft(n))

with E[tau(n)] the expected accepted length (bonus included) of the best n-node tree for the heads (from
their measured per-depth/per-rank accuracies), t_verify(q) the median time of a target forward over q tree
tokens (root + n nodes) at a given KV length, measured here, and t_draft(n) the drafter's time per step.

Measured curves are cached per (model, device, dtype, KV length, threads) as JSON under
`$SPECHEADS_CACHE/cost_curves/` (default ~/.cache/specheads), so a run measures them once.

A standalone curve of any model on this device: `python -m bench.cost_curve` (bench/cost_curve.py).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from heads import cache
from heads.files import atomic_write_json
from heads.loading import dtype_name
from runtime import kernels
from runtime.layout import model_fingerprint
from runtime.proposers.base import pending_entries
from runtime.target import TargetModel
from runtime.timing import (
    SMALL_FACTOR,
    SMALL_SIZES,
    device_name,
    kv_length_within,
    measure_curve,
    measurement_tree,
    target_verify_forward,
)
from runtime.tree import Tree

DEFAULT_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


@dataclass(frozen=True)
class CostCurve:
    """Median seconds of one target verify forward over `tokens[i]` query tokens (root + tree nodes)."""

    tokens: list[int]
    seconds: list[float]
    model: str = ""
    device: str = ""
    dtype: str = ""
    kv_length: int = 0
    rows: int = 1  # batch rows per forward (tokens[i] tokens in each)

    def __post_init__(self):
        if len(self.tokens) != len(self.seconds) or not self.tokens:
            raise ValueError("cost curve needs as many (>= 1) token counts as timings")
        if list(self.tokens) != sorted(set(self.tokens)) or self.tokens[0] < 1:
            raise ValueError(f"cost curve token counts must be increasing and >= 1, got {self.tokens}")

    @functools.cached_property
    def fitted(self) -> list[float]:
        """The medians made non-decreasing in the token count (isotonic least-squares fit): a forward over
        more tokens never costs less, so dips are timing noise of a shared machine."""
        return isotonic(self.seconds)

    def seconds_at(self, tokens: float) -> float:
        """Piecewise-linear interpolation of the fitted medians; linear extrapolation beyond the ends."""
        return max(interpolate(self.tokens, self.fitted, tokens), 0.0)

    def relative(self) -> list[float]:
        """Fitted cost of each point relative to a 1-token forward (interpolated if 1 was not measured)."""
        base = self.seconds_at(1)
        return [s / base for s in self.fitted]

    def relative_to_plain(self, max_tokens: int) -> list[float]:
        """[cost of a forward over n tokens / cost of 1] for n = 1..max_tokens (interpolated)."""
        base = self.seconds_at(1)
        return [self.seconds_at(n) / base for n in range(1, max_tokens + 1)]


def describe_relative_costs(costs: Sequence[float]) -> str:
    """'2: x1.56, 3: x2.15, ...': relative verify costs (costs[n - 1] for n tokens) at a few sizes, for a log line."""
    return ", ".join(f"{n}: x{costs[n - 1]:.2f}" for n in (2, 3, 5, 9, 17) if n <= len(costs))


def isotonic(values: Sequence[float]) -> list[float]:
    """Non-decreasing least-squares fit (pool adjacent violators): [K] -> [K]."""
    blocks: list[list[float]] = []  # [mean, weight]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, w1), (m2, w2) = blocks[-2], blocks[-1]
            blocks[-2:] = [[(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2]]
    return [m for m, w in blocks for _ in range(int(w))]


def _cache_file(model: str, device: str, dtype: str, kv_length: int, rows: int = 1, code: str = "") -> Path:
    rows_key = "" if rows == 1 else f"__rows{rows}"
    code_key = f"__{code}" if code else ""
    key = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{model}__{device}__{dtype}__kv{kv_length}{rows_key}{code_key}")
    return cache.entry("cost_curves", f"{key}.json")


def save_curve(curve: CostCurve, path: str | Path) -> None:
    """Write a curve as JSON atomically."""
    atomic_write_json(path, asdict(curve), indent=1)


def load_curve(path: str | Path) -> CostCurve:
    """A curve written by `save_curve` / the runtime's cache, or the `curve` entry of `bench.cost_curve --output`."""
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, dict) and isinstance(data.get("curve"), dict):
        data = data["curve"]
    try:
        return CostCurve(**data)
    except TypeError as err:
        raise ValueError(f"cost curve file {path}: unexpected content ({err})") from err


def rows_verify_forward(target: TargetModel, rows: int, kv_length: int, seed: int = 0) -> Callable[[int], None]:
    """`run_forward(q)` for a batch: `rows` random prefixes of `kv_length` tokens, then each call one forward of
    q tree tokens in every row (`forward_rows`), dropped again (`commit_rows`)."""
    gen = torch.Generator().manual_seed(seed)
    target.prefill_rows([torch.randint(target.vocab_size, (max(kv_length, 1),), generator=gen) for _ in range(rows)])
    trees: dict[int, tuple[torch.Tensor, Tree]] = {}

    def run(q: int) -> None:
        if q not in trees:
            trees[q] = (torch.randint(target.vocab_size, (q,), generator=gen), measurement_tree(q))
        tokens, tree = trees[q]
        target.forward_rows([tokens] * rows, [tree] * rows)
        target.commit_rows([[] for _ in range(rows)])

    return run


@dataclass(frozen=True)
class BatchCostCurve:
    """Verify cost over rows x tokens per row: curves[i] times one forward of batch_sizes[i] rows."""

    batch_sizes: list[int]
    curves: list[CostCurve]

    def __post_init__(self):
        if len(self.batch_sizes) != len(self.curves) or not self.curves:
            raise ValueError("batch cost curve needs one (>= 1) curve per batch size")
        if list(self.batch_sizes) != sorted(set(self.batch_sizes)) or self.batch_sizes[0] < 1:
            raise ValueError(f"batch sizes must be increasing and >= 1, got {self.batch_sizes}")

    def seconds(self, rows: int, tokens: int) -> float:
        """Seconds of one forward of `rows` rows x `tokens` tokens: each measured batch size's curve at `tokens`,
        linear in rows between (and beyond) the measured batch sizes."""
        xs, ys = self.batch_sizes, [c.seconds_at(tokens) for c in self.curves]
        if len(xs) == 1:
            return ys[0] * rows / xs[0]
        i = next((k for k in range(1, len(xs)) if xs[k] >= rows), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(y0 + (y1 - y0) * (rows - x0) / (x1 - x0), 1e-9)


def batch_cost_curve(target: TargetModel, batch_sizes: Sequence[int], kv_length: int = 256, max_tokens: int = 16,
                     repeats: int = 3, use_cache: bool = True) -> BatchCostCurve:
    """The verify cost over rows x tokens per row on the target's device (cached per batch size like
    `verify_cost_curve`, which is the batch-1 curve). Leaves the target's cache holding random rows."""
    curves = [verify_cost_curve(target, kv_length, max_tokens, repeats, use_cache, rows=rows) for rows in batch_sizes]
    return BatchCostCurve(list(batch_sizes), curves)


def verify_cost_curve(target: TargetModel, kv_length: int = 256, max_tokens: int = 64, repeats: int = 5,
                      use_cache: bool = True, run_forward: Callable[[int], None] | None = None,
                      rows: int = 1) -> CostCurve:
    """The verify cost curve of `target` on its device, from the on-disk cache or measured (then cached).

    max_tokens: largest verify size measured (root + tree nodes); sizes are DEFAULT_SIZES up to it.
    run_forward: how to run a q-token verify (default: `target_verify_forward(target, kv_length)`; it
    leaves the target's cache holding the random prefix, so measure before generating, not during).
    rows: measure a batch of this many rows, q tokens each (`rows_verify_forward`; cached separately).
    """
    model = target.model
    device = next(model.parameters()).device
    meta = dict(model=model_fingerprint(model), device=device_name(device),
                dtype=dtype_name(model.dtype), kv_length=kv_length, rows=rows)
    tokens = [q for q in DEFAULT_SIZES if q <= max_tokens]
    if not tokens or tokens[-1] != max_tokens:
        tokens.append(max_tokens)
    sync = torch.cuda.synchronize if device.type == "cuda" else None

    def measure() -> dict:
        run = run_forward or (target_verify_forward(target, kv_length) if rows == 1
                              else rows_verify_forward(target, rows, kv_length))
        return asdict(CostCurve(tokens=tokens, seconds=measure_curve(run, tokens, repeats=repeats, synchronize=sync),
                                **meta))

    def covers(record) -> bool:
        try:
            return CostCurve(**record).tokens[-1] >= max_tokens
        except (TypeError, ValueError, IndexError, KeyError):
            return False

    # what runs the forward is part of the key (the layout is in the fingerprint): the kernels and the lean forward
    # and how many runs a size's median is read from (measure_curve: sizes up to SMALL_SIZES SMALL_FACTOR x as many)
    lean = "-lean" if target.lean_forward() is not None else ""
    code = f"k{kernels.source_key()}{lean}-small{SMALL_SIZES}x{SMALL_FACTOR}"
    return CostCurve(**cache.cached_json(_cache_file(**meta, code=code), measure, covers, use_cache))


def predicted_speedup(tau: float, verify_seconds: float, draft_seconds: float, plain_seconds: float,
                      prefill_seconds: float = 0.0, plain_prefill_seconds: float = 0.0,
                      new_tokens: float = 0.0) -> float | None:
    """The cost model's speed-up over plain decoding.

    tau: mean accepted length per step (bonus included); verify_seconds / draft_seconds: mean target forward
    and drafter time per speculative step; plain_seconds: mean target forward of one plain decoding step.
    Without a prefill this is the steady state, tau * t_plain / (t_verify + t_draft). With the mean prefill of
    a call (`prefill_seconds` for the method, `plain_prefill_seconds` for plain decoding) and the mean new tokens
    per call, it covers whole calls as the bench times them: the prefill yields the first token, the other
    n - 1 take (n - 1) steps of plain decoding or (n - 1) / tau speculative steps. Loop overhead is left out on
    both sides, so realised / predicted < 1 measures what it (and timing noise) costs. None when a time is not
    positive.
    """
    step = verify_seconds + draft_seconds
    if step <= 0 or plain_seconds <= 0:
        return None
    decoded = max(new_tokens - 1.0, 0.0)
    if decoded == 0.0:
        return tau * plain_seconds / step
    return (plain_prefill_seconds + decoded * plain_seconds) / (prefill_seconds + decoded / tau * step)


def chain_expected_tau(per_depth_accuracy: Sequence[float]) -> Callable[[int], float]:
    """E[tau(n)] for a chain of n draft tokens whose depth-d token is right with prob acc[d] given the
    previous ones: 1 + sum_{d<n} prod_{i<=d} acc[i]. Beyond the measured depths the chain gains nothing."""
    acc = [float(a) for a in per_depth_accuracy]

    def tau(n: int) -> float:
        total, run = 1.0, 1.0
        for a in acc[:n]:
            run *= a
            total += run
        return total

    return tau


def _tree_text(tree) -> str:
    inner = getattr(tree, "tree", tree)
    parents = getattr(inner, "parents", None)
    return str(parents.tolist()) if isinstance(parents, torch.Tensor) else repr(tree)


# Bumped when the drafters' own code changes what a draft or a feed costs, so cached draft times are measured again
# (2: feeding committed entries computes the newest entry's output only, heads.layers.DecoderLayer's `last`)
DRAFT_CODE_VERSION = "draft-code-2"


def drafter_key(proposer) -> str | None:
    """What a heads drafter's time depends on, hashed: its class, size and tree shape, the shapes and dtypes of its
    weights (not their values: the timer forwards every level whatever the weights say) and of its draft LM head.
    None for a drafter without heads (its time is measured afresh each run)."""
    heads = getattr(proposer, "heads", None)
    if not isinstance(heads, torch.nn.Module):
        return None
    parts = [DRAFT_CODE_VERSION, type(proposer).__name__, str(proposer.tree_size),
             repr(getattr(proposer, "dynamic", None)),
             _tree_text(getattr(proposer, "tree", None)), _tree_text(getattr(proposer, "chain", None))]
    parts += [f"{name}:{tuple(t.shape)}:{t.dtype}" for name, t in heads.state_dict().items()]
    lm_head = getattr(proposer, "draft_lm_head", None)
    if lm_head is not None:
        parts.append(f"lm_head:{tuple(lm_head.weight.shape)}:{lm_head.weight.dtype}:{type(lm_head).__name__}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


class DraftTimer:
    """Times `proposer.propose` on one random context of `kv_length` tokens (draft side only).

    The context is prefilled through the target on first need (this clobbers the target's cache: use before
    generating); every proposer timed is reset on it and fed it before timing.

    With `use_cache` (the planner and the step costs), a heads drafter's times are cached on disk per target
    (fingerprint, device and threads, dtype, kernels), KV length and `drafter_key`, like the verify cost curves: a
    3 ms draft timed in one process moved by 10-20% on this shared CPU, enough to flip the planner between near-tied
    sizes (1, 2 or 3 for the main job's head in three runs), and with it every per-kind speed after. Measured once,
    a machine plans the same way every run.
    """

    def __init__(self, target: TargetModel, kv_length: int, hidden_state_indices: tuple[int, ...], seed: int = 0,
                 use_cache: bool = False):
        self.target, self.kv_length, self.indices, self.seed = target, kv_length, tuple(hidden_state_indices), seed
        self.use_cache = use_cache
        self.sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)

    @functools.cached_property
    def _context(self) -> tuple[torch.Tensor, dict | None, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed)
        prompt = torch.randint(self.target.vocab_size, (max(self.kv_length, 2),), generator=gen)
        out = self.target.prefill(prompt, self.indices)
        committed = torch.cat([prompt, out.logits[-1].argmax().reshape(1).cpu()]).to(self.target.device)
        return prompt, out.hidden or None, committed

    @property
    def prompt(self) -> torch.Tensor:
        return self._context[0]

    @property
    def hidden(self) -> dict | None:
        return self._context[1]

    @property
    def committed(self) -> torch.Tensor:
        return self._context[2]

    feed_seconds = 0.0  # of the last proposer timed: seconds per committed entry its first propose fed at once

    def seconds(self, proposer, repeats: int = 5) -> float:
        """Median seconds of the proposer's part of one decode step at its own size: on_accept of the previous
        draft (its root alone accepted, one new token committed) and the next propose(), which feeds the draft its
        new entry, as every step of the loop does (timing propose alone on an unchanged context left that out:
        1 ms measured against 3-5 ms in real steps of an EAGLE layer). Sets `feed_seconds`."""
        key = drafter_key(proposer) if self.use_cache else None
        if key is None:
            return self._measure(proposer, repeats)
        model = self.target.model
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{model_fingerprint(model)}__{device_name(self.target.device)}__"
                      f"{dtype_name(model.dtype)}__kv{self.kv_length}__k{kernels.source_key()}__{key}")

        def measure() -> dict:
            seconds = self._measure(proposer, repeats)
            return {"seconds": seconds, "feed_seconds": self.feed_seconds, "repeats": repeats}

        def valid(record) -> bool:
            return isinstance(record, dict) and all(isinstance(record.get(k), float) and record[k] >= 0
                                                    for k in ("seconds", "feed_seconds"))

        record = cache.cached_json(cache.entry("draft_times", f"{name}.json"), measure, valid)
        self.feed_seconds = record["feed_seconds"]
        return record["seconds"]

    def _measure(self, proposer, repeats: int) -> float:
        stop_when_final = getattr(proposer, "stop_when_final", None)
        if stop_when_final is not None:  # an EAGLE-2 tree is timed with every level forwarded (its upper bound)
            proposer.stop_when_final = False
        try:
            return self._seconds(proposer, repeats)
        finally:
            if stop_when_final is not None:
                proposer.stop_when_final = stop_when_final

    def _seconds(self, proposer, repeats: int) -> float:
        proposer.reset(self.prompt, self.hidden)
        committed = self.committed
        entries = pending_entries(proposer)
        self.sync()
        start = time.perf_counter()
        draft = proposer.propose(committed, proposer.tree_size)  # feeds the context into the draft's own cache
        self.sync()
        first = time.perf_counter() - start
        times = []
        for _ in range(repeats):
            committed = torch.cat([committed, committed[-1:]])  # the bonus token of a step that accepted nothing
            hidden = None if not self.hidden else {
                i: h[-1:].expand(draft.tree.num_nodes, -1) for i, h in self.hidden.items()}
            self.sync()
            start = time.perf_counter()
            proposer.on_accept(committed, draft, [0], hidden)
            draft = proposer.propose(committed, proposer.tree_size)
            self.sync()
            times.append(time.perf_counter() - start)
        step = statistics.median(times)
        # the first propose fed the whole context in one call: its time beyond a step's, per entry beyond one
        self.feed_seconds = max(first - step, 0.0) / (entries - 1) if entries > 1 else 0.0
        return step


GUARD_KV_LENGTHS = (256, 1024, 2048)  # where step costs are measured; in between they are interpolated


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs[i], ys[i]) (xs increasing), extended linearly beyond both ends, but outside the
    measured range never below the lowest measured value: a last segment that falls (timing noise: a 260K-parameter
    model's curve measured cheaper at KV 504 than at 256) would otherwise reach zero further out, and so would a
    steep first segment extended back towards KV 0 (a step's weights cost the same at any KV length)."""
    if len(xs) == 1:
        return float(ys[0])
    i = next((k for k in range(1, len(xs)) if xs[k] >= x), len(xs) - 1)
    value = float(ys[i - 1] + (ys[i] - ys[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1]))
    if x > xs[-1] or x < xs[0]:
        value = max(value, float(min(ys)))
    return value


@dataclass(frozen=True)
class StepCosts:
    """What a step costs at the KV length a sequence has reached, relative to a plain step at that same length.

    Verify cost curves and a drafter's propose() time, measured at a few KV lengths (`measure_step_costs`) and
    interpolated linearly in between (attention makes both grow about linearly with the KV length; beyond the
    last length they are extended along the last segment). One plain step at KV 2,000 costs more than at 256,
    and so does a drafted one, but not in the same proportion: a break-even measured at 256 alone is wrong for
    a summary of a long document.
    """

    kv_lengths: list[int]
    curves: list[CostCurve]
    draft_seconds: list[float] | None = None  # the drafter at each KV length; None: a drafter that costs nothing
    # seconds per entry a stateful drafter feeds beyond the one of a step (after resting, runtime.proposers.base.
    # pending_entries), at each KV length; None: nothing to feed
    feed_seconds: list[float] | None = None

    def __post_init__(self) -> None:
        if not self.kv_lengths or list(self.kv_lengths) != sorted(set(self.kv_lengths)) \
                or len(self.curves) != len(self.kv_lengths) \
                or any(times is not None and len(times) != len(self.kv_lengths)
                       for times in (self.draft_seconds, self.feed_seconds)):
            raise ValueError(f"step costs: need increasing KV lengths with one curve (and draft time) each, got "
                             f"{self.kv_lengths}, {len(self.curves)} curves")

    def plain_seconds(self, kv_length: int) -> float:
        return max(interpolate(self.kv_lengths, [c.seconds_at(1) for c in self.curves], kv_length), 1e-9)

    def verify_seconds(self, tokens: int, kv_length: int) -> float:
        return max(interpolate(self.kv_lengths, [c.seconds_at(tokens) for c in self.curves], kv_length), 0.0)

    def draft(self, kv_length: int) -> float:
        if self.draft_seconds is None:
            return 0.0
        return max(interpolate(self.kv_lengths, self.draft_seconds, kv_length), 0.0)

    def feed(self, entries: int, kv_length: int) -> float:
        """Seconds a drafter spends feeding `entries` pending entries beyond the one that `draft` includes."""
        if self.feed_seconds is None or entries <= 1:
            return 0.0
        return (entries - 1) * max(interpolate(self.kv_lengths, self.feed_seconds, kv_length), 0.0)

    def relative(self, tokens: int, kv_length: int, drafting: bool = True) -> float:
        """(verify over `tokens` query tokens [+ the drafter's time]) / a plain step, both at `kv_length`."""
        extra = self.draft(kv_length) if drafting and tokens > 1 else 0.0
        return max((self.verify_seconds(tokens, kv_length) + extra) / self.plain_seconds(kv_length), 1e-3)

    def measured(self, tokens: int, kv_length: int, draft_seconds: float) -> float:
        """A drafted step over `tokens` query tokens, in plain steps at `kv_length`: the modelled verify plus the
        drafter's measured seconds in that step (what the guards' ledgers charge)."""
        return self.relative(tokens, kv_length, drafting=False) + draft_seconds / self.plain_seconds(kv_length)

    def describe(self, tokens: int, drafting: bool = True) -> str:
        """'x1.21 at KV 256, x1.35 at KV 2048': the relative cost of a `tokens`-token step at each measured length."""
        return ", ".join(f"x{self.relative(tokens, kv, drafting):.2f} at KV {kv}" for kv in self.kv_lengths)


KV_BUCKET = 16  # step costs are read at the KV length rounded down to a multiple of this


class VerifyTable:
    """[relative verify cost of q tokens, q = 1, 2, ...] at a sequence's KV length, and the drafter's modelled draft
    time over a plain step there, read from `costs` (StepCosts) at the KV length rounded down to a multiple of
    KV_BUCKET, once per bucket: a step reads up to ~20 costs, and reading them one by one costs more than prompt
    lookup's whole propose. Prompt lookup alone and the hybrid's lookup part price their drafts with this one table,
    so where the hybrid's head rests it drafts what prompt lookup drafts."""

    def __init__(self, costs: StepCosts):
        self.costs = costs
        self._verify: dict[int, list[float]] = {}
        self._draft: dict[int, float] = {}

    def at(self, kv_length: int, tokens: int) -> list[float]:
        """At least `tokens` entries: entry q - 1 is verifying q tokens over a plain step, both at `kv_length`."""
        bucket = kv_length // KV_BUCKET
        table = self._verify.get(bucket)
        if table is None or len(table) < tokens:
            kv = bucket * KV_BUCKET
            table = self._verify[bucket] = [self.costs.relative(q, kv, False) for q in range(1, tokens + 1)]
        return table

    def draft_at(self, kv_length: int) -> float:
        """The drafter's modelled draft time over a plain step at `kv_length`'s bucket (0 without a drafter)."""
        bucket = kv_length // KV_BUCKET
        draft = self._draft.get(bucket)
        if draft is None:
            kv = bucket * KV_BUCKET
            draft = self._draft[bucket] = self.costs.draft(kv) / self.costs.plain_seconds(kv)
        return draft


def measure_step_costs(target: TargetModel, max_tokens: int, proposer=None,
                       first_kv_length: int = GUARD_KV_LENGTHS[0]) -> StepCosts:
    """Verify cost curves up to `max_tokens` query tokens (cached on disk) and, with `proposer`, its propose() time
    at its own size, at `first_kv_length` (the planner's) and the longer lengths of GUARD_KV_LENGTHS, each shortened
    to fit the target's context."""
    wanted = (first_kv_length, *(kv for kv in GUARD_KV_LENGTHS if kv > first_kv_length))
    lengths = sorted({kv_length_within(target, kv, max_tokens) for kv in wanted})
    curves = [verify_cost_curve(target, kv_length=kv, max_tokens=max_tokens, repeats=7) for kv in lengths]
    draft, feed = None, None
    if proposer is not None:
        draft, feed = [], []
        for kv in lengths:
            timer = DraftTimer(target, kv, tuple(proposer.hidden_state_indices), use_cache=True)
            draft.append(timer.seconds(proposer))
            feed.append(timer.feed_seconds)
    return StepCosts(lengths, curves, draft, feed)
