"""The planner: how many tokens each row of a batch drafts, from one input to one output.

Input: what the drafter offers per size n (draft tokens per row) - its expected accepted length E[tau(n)]
(bonus included, 1.0 at n = 0) and its time per row t_draft(n) - and the target's verify cost over
(rows x tokens per row) on this device. Output: a size per row (0 = plain decoding for that row).

    size*(B) = argmax_n  B * E[tau(n)] / (t_verify(B rows x (n + 1) tokens) + B * t_draft(n))

`plan_drafter` makes the batch-1 choice for trained heads: it measures the draft time of every shape the
factory can build (runtime/proposers/factory.py only builds proposers and says what each shape is expected to
accept) and the verify cost curve, and picks the shape and size, or plain decoding. `BatchPlanner` then sizes
that drafter for each batch size.

At batch 1 on a GPU extra verify tokens are nearly free and the planner drafts big trees; as the batch fills
the hardware, B x (n + 1) tokens cost real time, rejected drafts are pure waste, and the size shrinks to 0.
Rows draft one after another (each row owns its drafter state), hence B * t_draft. Every row gets the same
size: the objective is symmetric in the rows, so a per-row optimum only differs where rows differ in what
their drafter expects, which the profile does not know per row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from runtime.cost_model import DraftTimer, verify_cost_curve
from runtime.target import TargetModel


@dataclass(frozen=True)
class DraftProfile:
    """What a drafter offers per size: sizes[i] draft tokens per row give expected_tau[i] accepted tokens per
    step (bonus included) for draft_seconds[i] of drafting per row. Size 0 (plain decoding) is always a
    candidate: tau 1.0, no drafting."""

    sizes: list[int]
    expected_tau: list[float]
    draft_seconds: list[float]
    source: str = ""  # where the numbers come from, for printing

    def __post_init__(self) -> None:
        if not (len(self.sizes) == len(self.expected_tau) == len(self.draft_seconds)) or not self.sizes:
            raise ValueError("draft profile: need as many (>= 1) sizes as expected taus and draft times")
        if list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] < 0:
            raise ValueError(f"draft profile sizes must be increasing and >= 0, got {self.sizes}")

    def with_plain(self) -> DraftProfile:
        if self.sizes[0] == 0:
            return self
        return DraftProfile([0, *self.sizes], [1.0, *self.expected_tau], [0.0, *self.draft_seconds], self.source)


def plan_rows(profile: DraftProfile, verify_seconds: Callable[[int, int], float], batch: int) -> list[dict]:
    """One row per candidate size for a batch of `batch` rows: size, expected_tau, seconds (one step of the
    whole batch), tokens_per_second (expected, whole batch). verify_seconds(rows, tokens_per_row)."""
    if batch < 1:
        raise ValueError(f"planner: batch must be >= 1, got {batch}")
    rows = []
    for n, tau, draft in zip(profile.sizes, profile.expected_tau, profile.draft_seconds, strict=True):
        seconds = verify_seconds(batch, n + 1) + batch * (draft if n > 0 else 0.0)
        if not seconds > 0:
            raise ValueError(f"step time for size {n} at batch {batch} must be positive, got {seconds}")
        rows.append(dict(size=n, expected_tau=tau, draft_seconds=draft if n > 0 else 0.0, seconds=seconds,
                         tokens_per_second=batch * tau / seconds))
    return rows


def best_row(rows: Sequence[dict]) -> dict:
    """The fastest row (ties: the smaller size)."""
    return max(rows, key=lambda r: (r["tokens_per_second"], -r["size"]))


def widest_equal(rows: Sequence[dict], best: dict) -> dict:
    """Among the rows of `best`'s size and depth whose held-out expected tau equals best's, the one of the largest
    `top_k` (best itself for shapes without one). The held-out table values an EAGLE-2 tree by its best static shape,
    so widths that allow that shape tie; at run time the dynamic tree picks its nodes by the draft's own confidence,
    and a wider top_k lets it put three children under an unsure root. Their measured draft times differ by noise
    (0.2 ms of a 44 ms step); on 28 prompts of 7 kinds (float32, SmolLM2-135M, the main job's head, size 3, depth 2)
    top_k 8 ran 1.1% faster than top_k 2, modelled, over two runs (docs/results/resting_heads.md)."""
    if "top_k" not in best:
        return best
    same = [r for r in rows if r.get("top_k") is not None and r["size"] == best["size"]
            and r.get("depth") == best.get("depth") and r["expected_tau"] == best["expected_tau"]]
    return max(same, key=lambda r: (r["top_k"], r["tokens_per_second"]))


def best_size(rows: Sequence[dict]) -> int:
    return int(best_row(rows)["size"])


@dataclass
class BatchPlanner:
    """`planner(rows)` -> per-row sizes for a batch of `rows` (the `size_for_batch` of generate_batch).

    verify_seconds(rows, tokens_per_row) is the measured cost (runtime.cost_model.BatchCostCurve.seconds);
    choices are cached per batch size and printed once each by `describe`.
    """

    profile: DraftProfile
    verify_seconds: Callable[[int, int], float]
    chosen: dict[int, int] = field(default_factory=dict)

    def __call__(self, rows: int) -> list[int]:
        if rows not in self.chosen:
            self.chosen[rows] = best_size(plan_rows(self.profile.with_plain(), self.verify_seconds, rows))
        return [self.chosen[rows]] * rows

    def table(self, batch_sizes: Sequence[int]) -> list[dict]:
        """Per batch size: the chosen size, its expected tokens/s and plain decoding's."""
        out = []
        for batch in batch_sizes:
            rows = plan_rows(self.profile.with_plain(), self.verify_seconds, batch)
            size = best_size(rows)
            chosen = next(r for r in rows if r["size"] == size)
            out.append(dict(batch_size=batch, size=size, expected_tau=chosen["expected_tau"],
                            expected_tokens_per_second=chosen["tokens_per_second"],
                            plain_tokens_per_second=rows[0]["tokens_per_second"]))
        return out

    def describe(self, batch_sizes: Sequence[int]) -> str:
        return "; ".join(f"batch {r['batch_size']}: size {r['size']} ({r['expected_tokens_per_second']:.1f} vs plain "
                         f"{r['plain_tokens_per_second']:.1f} tok/s)" for r in self.table(batch_sizes))


@dataclass(frozen=True)
class SizeChoice:
    """The chosen size and the table it was chosen from (one row per candidate size)."""

    size: int
    rows: list[dict[str, float]] = field(default_factory=list)  # size, expected_tau, seconds, tokens_per_second


def choose_tree_size(sizes: Sequence[int], expected_tau: Callable[[int], float],
                     verify_seconds: Callable[[int], float],
                     draft_seconds: Callable[[int], float] = lambda n: 0.0) -> SizeChoice:
    """argmax over `sizes` (non-root tree nodes) of E[tau(n)] / (verify_seconds(n + 1) + draft_seconds(n)): the
    planner at batch 1. Size 0 (no speculation: a 1-token forward, tau = 1) is a valid candidate when listed."""
    if not sizes:
        raise ValueError("choose_tree_size needs at least one candidate size")
    sizes = sorted(sizes)
    profile = DraftProfile(sizes, [expected_tau(n) for n in sizes], [draft_seconds(n) if n > 0 else 0.0 for n in sizes])
    rows = plan_rows(profile, lambda rows, tokens: verify_seconds(tokens), batch=1)
    return SizeChoice(size=best_size(rows), rows=rows)


@dataclass(frozen=True)
class DrafterFamily:
    """What the factory can build from one set of heads: shapes (e.g. {} or {"depth": 5, "top_k": 8}), the
    candidate sizes of each, their expected accepted length, and a constructor."""

    kind: str
    shapes: list[dict[str, int]]
    sizes: Callable[[dict[str, int]], list[int]]
    expected_tau: Callable[[dict[str, int], int], float]
    make: Callable[[dict[str, int], int], Any]
    hidden_state_indices: tuple[int, ...]


@dataclass(frozen=True)
class Plan:
    """The batch-1 choice: shape and size (size 0 = plain decoding predicted fastest), every candidate row
    (row 0 = plain decoding, then each shape's sizes with the shape's keys), and the chosen shape's profile."""

    shape: dict[str, int]
    size: int
    rows: list[dict[str, float]]
    profile: DraftProfile

    @property
    def off(self) -> bool:
        return self.size == 0

    @property
    def chosen(self) -> dict[str, float]:
        """The row of the chosen shape and size (plain decoding's row when off)."""
        return next(row for row in self.rows if row["size"] == self.size
                    and all(row.get(key) == value for key, value in self.shape.items()))


def timing_grid(sizes: list[int]) -> list[int]:
    """The sizes at which draft time is measured (powers of two and the largest size; linear in between):
    drafts are bounded by their size (levels, children and logits rows), so their time grows with it."""
    return sorted({1, 2, 4, 8, 16, 32, 64, max(sizes)} & set(sizes))


def _interpolate(measured: dict[int, float], n: int) -> float:
    grid = sorted(measured)
    if len(grid) == 1 or n <= grid[0]:
        return measured[grid[0]]
    hi = next((g for g in grid if g >= n), grid[-1])
    lo = max(g for g in grid if g <= n) if n <= grid[-1] else grid[-2]
    if hi == lo:
        return measured[lo]
    return measured[lo] + (measured[hi] - measured[lo]) * (n - lo) / (hi - lo)


def plan_drafter(family: DrafterFamily, target: TargetModel, kv_length: int = 256, allow_off: bool = True) -> Plan:
    """Measure (draft time per shape at a grid of sizes, verify cost curve at `kv_length`) and choose the
    shape and size maximising expected accepted tokens per second at batch 1; size 0 when plain decoding wins
    and `allow_off`. Clobbers the target's cache: call before generating."""
    sizes = {key: family.sizes(shape) for key, shape in ((tuple(sorted(s.items())), s) for s in family.shapes)}
    largest = max((max(v) for v in sizes.values() if v), default=1)
    curve = verify_cost_curve(target, kv_length=kv_length, max_tokens=largest + 1, repeats=7)
    timer = DraftTimer(target, kv_length, family.hidden_state_indices, use_cache=True)
    plain = dict(size=0, expected_tau=1.0, draft_seconds=0.0, seconds=curve.seconds_at(1),
                 tokens_per_second=1.0 / curve.seconds_at(1))
    rows, profiles = [plain], {}
    for shape in family.shapes:
        candidates = sizes[tuple(sorted(shape.items()))]
        if not candidates:
            continue
        measured = {n: timer.seconds(family.make(shape, n)) for n in timing_grid(candidates)}
        profile = DraftProfile(candidates, [family.expected_tau(shape, n) for n in candidates],
                               [_interpolate(measured, n) for n in candidates], f"{family.kind} heads' held-out accuracy")
        profiles[tuple(sorted(shape.items()))] = profile
        rows += [{**row, **shape} for row in plan_rows(profile, lambda r, q: curve.seconds_at(q), batch=1)]
    if len(rows) == 1:
        raise ValueError(f"{family.kind} heads: no draft size to choose from")
    best = widest_equal(rows, best_row(rows if allow_off else rows[1:]))
    shape = {k: int(best[k]) for k in family.shapes[0]} if best["size"] else {}
    if best["size"] == 0:  # plain decoding is predicted fastest: nothing to draft at any batch size
        return Plan({}, 0, rows, DraftProfile([0], [1.0], [0.0], "plain decoding"))
    profile = profiles[tuple(sorted(shape.items()))]
    keep = [i for i, n in enumerate(profile.sizes) if n <= best["size"]]
    chosen = DraftProfile([profile.sizes[i] for i in keep], [profile.expected_tau[i] for i in keep],
                          [profile.draft_seconds[i] for i in keep], profile.source)
    return Plan(shape, int(best["size"]), rows, chosen)
