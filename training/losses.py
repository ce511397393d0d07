"""Loss functions per method, as pure functions on tensors.

One alignment rule for every method: the prediction of *depth d* (0-based) made at position t is for token
t + 2 + d (position t has already seen token t; the target's own LM head predicts t + 1). It counts iff
`loss_mask[t + 2 + d] == 1` (assistant token, not padding) and t + 2 + d < T.

Methods evaluate heads only where some depth has a label (`depth_targets(...).positions`): on chat data
most tokens are prompt, and the vocabulary projection is the expensive part. The loss functions below take
those gathered rows ([N, ...]) already aligned with their labels.

Every function returns *sums* over the counted positions, never means: the training loop divides by one
normaliser (the number of depth-0 labels in the whole global batch, across processes and accumulation
steps), so a global batch gives the same loss and gradients however it is split over processes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class DepthStats:
    """Per-depth sums over counted positions; all tensors are [D] float64 on the loss device."""

    loss: Tensor      # unweighted loss sum of depth d
    correct: Tensor   # top-1 hits
    correct_topk: Tensor  # top-k hits
    count: Tensor     # counted positions

    @staticmethod
    def stack(items: list[tuple[Tensor, Tensor, Tensor, Tensor]]) -> DepthStats:
        columns = list(zip(*items, strict=True))
        return DepthStats(*(torch.stack([c.detach().double() for c in col]) for col in columns))


@dataclass
class LossOutput:
    """`loss` is the weighted sum to backpropagate (before normalisation); `depth` has per-depth statistics."""

    loss: Tensor
    depth: DepthStats
    extra: dict[str, Tensor]  # other unnormalised sums worth logging (e.g. feature loss), detached


def depth_weights(num_depths: int, decay: float) -> list[float]:
    """[1, decay, decay**2, ...]: the weight of depth d."""
    return [decay**d for d in range(num_depths)]


def shift_left(x: Tensor, shift: int) -> Tensor:
    """out[:, t] = x[:, t + shift], zeros past the end. [B, T, ...] -> [B, T, ...]."""
    out = torch.zeros_like(x)
    if shift < x.shape[1]:
        out[:, : x.shape[1] - shift] = x[:, shift:]
    return out


@dataclass
class DepthTargets:
    """Labels of depths 0..D-1 at the positions where at least one depth counts.

    positions [B, T] bool; labels [D, N] int64 (token t+2+d at the n-th selected position t);
    masks [D, N] bool (whether depth d counts there). N = positions.sum().
    """

    positions: Tensor
    labels: Tensor
    masks: Tensor


def depth_targets(input_ids: Tensor, loss_mask: Tensor, num_depths: int) -> DepthTargets:
    """input_ids, loss_mask [B, T] -> DepthTargets for `num_depths` depths."""
    masks = torch.stack([shift_left(loss_mask, 2 + d).bool() for d in range(num_depths)])  # [D, B, T]
    positions = masks.any(0)
    labels = torch.stack([shift_left(input_ids, 2 + d)[positions] for d in range(num_depths)])
    return DepthTargets(positions, labels, masks[:, positions])


def label_count(loss_mask: Tensor) -> Tensor:
    """Number of depth-0 labels in a batch (the loss normaliser): loss_mask [B, T] -> scalar int64."""
    return loss_mask[:, 2:].sum()


def topk_hits(logits: Tensor, labels: Tensor, mask: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Top-1 and top-k hit counts. logits [..., V], labels [...], mask [...] bool -> two scalars."""
    with torch.no_grad():
        top = logits.topk(min(k, logits.shape[-1]), dim=-1).indices  # [..., k]
        hit = top == labels.unsqueeze(-1)
        top1 = (hit[..., 0] & mask).sum()
        topk = (hit.any(-1) & mask).sum()
    return top1, topk


def token_cross_entropy(logits: Tensor, labels: Tensor, mask: Tensor) -> Tensor:
    """Sum of CE over counted positions (fp32). logits [..., V], labels [...], mask [...] bool -> scalar."""
    losses = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    return (losses * mask.reshape(-1)).sum()


def soft_cross_entropy(logits: Tensor, target_probs: Tensor, mask: Tensor) -> Tensor:
    """Sum over counted positions of -sum_v p(v) log q(v). logits, target_probs [..., V]; mask [...]."""
    losses = -(target_probs.float() * F.log_softmax(logits.float(), dim=-1)).sum(-1)
    return (losses * mask).sum()


def feature_regression(predicted: Tensor, target: Tensor, mask: Tensor) -> Tensor:
    """Sum over counted positions of the smooth-L1 loss averaged over the hidden size. [..., H] -> scalar."""
    losses = F.smooth_l1_loss(predicted.float(), target.float(), reduction="none").mean(-1)
    return (losses * mask).sum()


def kl_to_reference(logits: Tensor, reference_logits: Tensor, mask: Tensor) -> Tensor:
    """Sum over counted positions of KL(reference || model). logits, reference_logits [..., V]; mask [...]."""
    log_q = F.log_softmax(logits.float(), dim=-1)
    log_p = F.log_softmax(reference_logits.float(), dim=-1)
    losses = (log_p.exp() * (log_p - log_q)).sum(-1)
    return (losses * mask).sum()


def depth_cross_entropy(depth_logits: list[Tensor], targets: DepthTargets, decay: float, top_k: int
                        ) -> LossOutput:
    """Medusa heads and MTP depths: CE of depth d's logits against token t+2+d, weighted decay**d.

    depth_logits: D tensors [N, V], the logits of depth d at `targets.positions`. A label -1 (a token outside a
    reduced draft vocabulary, see `to_draft_targets`) is left out of the loss and counts as a miss.
    """
    total = depth_logits[0].new_zeros((), dtype=torch.float32)
    stats = []
    for depth, (logits, weight) in enumerate(zip(depth_logits, depth_weights(len(depth_logits), decay),
                                                 strict=True)):
        labels, mask = targets.labels[depth], targets.masks[depth]
        loss = token_cross_entropy(logits, labels.clamp(min=0), mask & (labels >= 0))
        total = total + weight * loss
        stats.append((loss, *topk_hits(logits, labels, mask, top_k), mask.sum()))
    return LossOutput(total, DepthStats.stack(stats), {})


def lm_cross_entropy(logits: Tensor, input_ids: Tensor, loss_mask: Tensor) -> Tensor:
    """The target's next-token CE (token t+1 from position t), summed. logits [B, T, V] -> scalar."""
    return token_cross_entropy(logits[:, :-1], input_ids[:, 1:], loss_mask[:, 1:].bool())


def lm_distillation(logits: Tensor, reference_logits: Tensor, loss_mask: Tensor) -> Tensor:
    """KL(frozen target || adapted target) on the next-token distributions, summed. [B, T, V] -> scalar."""
    return kl_to_reference(logits[:, :-1], reference_logits[:, :-1], loss_mask[:, 1:].bool())


def eagle_step_loss(predicted_hidden: Tensor, predicted_logits: Tensor, target_hidden: Tensor,
                    target_logits: Tensor, labels: Tensor, mask: Tensor, top_k: int
                    ) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor, Tensor]]:
    """EAGLE-1/2 losses of one unroll step s, on N gathered positions t.

    predicted_hidden [N, H]: the draft output at t, standing for the target feature f_{t+1+s};
    predicted_logits [N, V]: its logits through the frozen LM head (token t+2+s);
    target_hidden [N, H]: f_{t+1+s} (target hs[-1]); target_logits [N, V]: LM head of target_hidden;
    labels [N] token t+2+s; mask [N] bool.
    Returns (feature-regression sum, soft-CE sum, (top-1 hits, top-k hits, count)).
    """
    feature = feature_regression(predicted_hidden, target_hidden, mask)
    token = soft_cross_entropy(predicted_logits, torch.softmax(target_logits.float(), dim=-1), mask)
    return feature, token, (*topk_hits(predicted_logits, labels, mask, top_k), mask.sum())


def eagle3_step_loss(draft_logits: Tensor, target_logits: Tensor, labels: Tensor, mask: Tensor,
                     draft_to_target: Tensor, target_in_draft: Tensor, top_k: int, over_draft: bool = False
                     ) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
    """EAGLE-3 soft CE over the draft vocabulary for one unroll step s, on N gathered positions t.

    draft_logits [N, Vd] predict token t+2+s; target_logits: the target LM head on hs[-1] at t+1+s, over the
    whole vocabulary [N, V], or with over_draft over the draft vocabulary only [N, Vd] (its rows in draft id
    order: 6x cheaper at 8,192 of 49,152; for labels from the data, which then decide what is expressible);
    labels [N] token t+2+s; mask [N] bool; draft_to_target [Vd] int64 target id of each draft id;
    target_in_draft [V] bool (t2d).
    The target distribution is softmax over the draft vocabulary of the target logits; positions whose target
    token (the argmax of full-vocabulary logits, else the label) is outside the draft vocabulary are left out of
    the loss (the draft cannot express them) but still count as misses in the accuracy, which compares the
    draft's top tokens, mapped to target ids, with the label token.
    Returns (soft-CE sum, (top-1 hits, top-k hits, count)).
    """
    target = target_logits.float()
    if over_draft:
        expressible = mask & target_in_draft[labels]
        target_probs = torch.softmax(target, dim=-1)  # [N, Vd]
    else:
        expressible = mask & target_in_draft[target.argmax(-1)]
        target_probs = torch.softmax(target[..., draft_to_target], dim=-1)  # [N, Vd]
    loss = soft_cross_entropy(draft_logits, target_probs, expressible)
    with torch.no_grad():
        top = draft_to_target[draft_logits.topk(min(top_k, draft_logits.shape[-1]), dim=-1).indices]  # [N, k]
        hit = top == labels.unsqueeze(-1)
        hits = ((hit[..., 0] & mask).sum(), (hit.any(-1) & mask).sum(), mask.sum())
    return loss, hits
