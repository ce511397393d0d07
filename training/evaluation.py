"""Held-out evaluation metrics: per-depth top-1 / top-k accuracy and the expected acceptance length.

Accuracy of depth d = fraction of counted held-out positions where the draft's prediction for token t+2+d
(teacher-forced tokens; EAGLE-style drafts unrolled on their own features) equals the dataset token, which
is the target's own answer in a distilled dataset.
"""

from __future__ import annotations

import torch
from torch import Tensor

from training.losses import DepthStats


def expected_acceptance_length(accuracies: list[float]) -> float:
    """tau of a greedy chain = 1 + sum_k prod_{j<=k} acc_j (counts the bonus token, so no drafting = 1.0).

    acc_j is taken as the probability that depth j is right given depths < j were right.
    """
    tau, prefix = 1.0, 1.0
    for accuracy in accuracies:
        if not 0.0 <= accuracy <= 1.0:
            raise ValueError(f"accuracy must be in [0, 1], got {accuracy}")
        prefix *= accuracy
        tau += prefix
    return tau


def sum_stats(items: list[DepthStats]) -> DepthStats:
    """Add per-depth sums of several batches."""
    return DepthStats(*(torch.stack([getattr(s, f) for s in items]).sum(0)
                        for f in ("loss", "correct", "correct_topk", "count")))


def depth_metrics(stats: DepthStats, top_k: int, prefix: str = "eval") -> dict[str, float]:
    """Per-depth loss/top-1/top-k and tau from (globally reduced) sums.

    -> {"eval/loss_d0", "eval/top1_d0", "eval/top{k}_d0", ..., "eval/acceptance_length"}; depth names are
    0-based: d0 is the first drafted token.
    """
    metrics: dict[str, float] = {}
    count = stats.count.clamp(min=1)
    top1 = (stats.correct / count).tolist()
    topk = (stats.correct_topk / count).tolist()
    loss = (stats.loss / count).tolist()
    for depth in range(len(top1)):
        metrics[f"{prefix}/loss_d{depth}"] = loss[depth]
        metrics[f"{prefix}/top1_d{depth}"] = top1[depth]
        metrics[f"{prefix}/top{top_k}_d{depth}"] = topk[depth]
    metrics[f"{prefix}/acceptance_length"] = expected_acceptance_length(top1)
    metrics[f"{prefix}/tokens"] = float(stats.count[0])
    return metrics


def per_depth(metrics: dict[str, float], name: str, prefix: str = "eval") -> list[float]:
    """[metrics['eval/top1_d0'], metrics['eval/top1_d1'], ...] for name='top1'."""
    values, depth = [], 0
    while f"{prefix}/{name}_d{depth}" in metrics:
        values.append(metrics[f"{prefix}/{name}_d{depth}"])
        depth += 1
    return values


def as_tensor(stats: DepthStats) -> Tensor:
    """[4, D] float64 tensor (for one all-reduce)."""
    return torch.stack([stats.loss, stats.correct, stats.correct_topk, stats.count])


def from_tensor(values: Tensor) -> DepthStats:
    return DepthStats(*values.unbind(0))
