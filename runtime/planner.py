"""The planner: how many tokens each row of a batch drafts, from one input to one output.

Input: what the drafter offers per size n (draft tokens per row) - its expected accepted length E[tau(n)]
(bonus included, 1.0 at n = 0) and its time per row t_draft(n) - and the target's verify cost over
(rows x tokens per row) on this device. Output: a size per row (0 = plain decoding for that row).

    size*(B) = argmax_n  B * E[tau(n)] / (t_verify(B rows x (n + 1) tokens) + B * t_draft(n))

At batch 1 on a GPU extra verify tokens are nearly free and the planner drafts big trees; as the batch fills
the hardware, B x (n + 1) tokens cost real time, rejected drafts are pure waste, and the size shrinks to 0.
Rows draft one after another (each row owns its drafter state), hence B * t_draft. Every row gets the same
size: the objective is symmetric in the rows, so a per-row optimum only differs where rows differ in what
their drafter expects, which the profile does not know per row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


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


def best_size(rows: Sequence[dict]) -> int:
    """The size of the fastest row (ties: the smaller size)."""
    return int(max(rows, key=lambda r: (r["tokens_per_second"], -r["size"]))["size"])


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
