"""One training module per method: batch -> LossOutput, with the target's features computed online (frozen
target forward under no_grad) or read from the batch (offline shards).

Every module's forward is `forward(batch, train, generator) -> LossOutput`: `train=True` computes the
training objective; `train=False` the held-out statistics (EAGLE-style drafts unrolled `eval_depth` steps on
their own outputs). `generator` seeds EAGLE's feature noise. The frozen target is held outside the module's
parameters (so DDP/FSDP wrap only what trains), except for Medusa-2 whose LoRA-adapted target trains.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from data.hidden_states import feature_name
from heads.base import HeadsModule, TargetModules, target_modules
from heads.checkpoint import build_heads, load_heads
from heads.config import HeadsConfig
from heads.draft_vocab import (
    build_vocab_mapping,
    count_tokens,
    draft_target_ids,
    draft_to_target_ids,
    target_to_draft_ids,
)
from heads.eagle import Eagle3Draft, EagleDraft
from heads.layers import LayerKV, additive_mask, visible_prefix
from heads.medusa import MedusaHeads, shared_lm_head_rows
from heads.mtp import MTPHeads
from heads.parallel import DFlashDraft, PEagleDraft
from training.config import PARALLEL_METHODS, TrainConfig, eagle3_layers, target_layer_ids
from training.losses import (
    DepthStats,
    DepthTargets,
    LossOutput,
    depth_cross_entropy,
    depth_targets,
    depth_weights,
    eagle3_step_loss,
    eagle_step_loss,
    feature_regression,
    lm_cross_entropy,
    lm_distillation,
    shift_left,
)


@torch.no_grad()
def target_hidden_states(target: nn.Module, batch: dict[str, Any], layers: list[int]) -> list[Tensor]:
    """HF hidden_states[l] for each l in `layers` ([B, T, H] each; [-1]/L = after the final norm).

    Offline batches carry them under `feature_name(l)`; otherwise the frozen target runs once (no_grad).
    """
    if "features" in batch:
        missing = [feature_name(i) for i in layers if feature_name(i) not in batch["features"]]
        if missing:
            raise ValueError(f"--features: the shards hold {sorted(batch['features'])}, this method needs "
                             f"{missing}; write shards for those layers")
        return [batch["features"][feature_name(i)] for i in layers]
    # logits_to_keep=1: the methods apply the LM head themselves to the rows they need; over every position it
    # would be a fifth of the forward (49k rows here) for nothing.
    out = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True,
                 use_cache=False, logits_to_keep=1)
    return [out.hidden_states[i] for i in layers]


def apply_head(module: nn.Module, x: Tensor) -> Tensor:
    """Run a frozen target module (LM head) on x cast to its weight dtype. [..., H] -> [..., V]."""
    return module(x.to(module.weight.dtype))


def target_greedy_labels(targets: DepthTargets, config: TrainConfig, greedy: Callable[[int], Tensor]
                         ) -> DepthTargets:
    """With --label_source target, the labels become the target's own greedy tokens: greedy(d) -> [N] argmax
    of the target's logits for token t+2+d (its LM head on hs[-1] at t+1+d, after the dataset prefix). That is
    what greedy verification accepts, so accuracies measure acceptance whatever wrote the answers (teacher-forced
    text or the target itself; on greedy self-distilled answers the two agree). --label_source data keeps the
    dataset tokens."""
    if config.label_source != "target":
        return targets
    with torch.no_grad():
        labels = torch.stack([greedy(depth) for depth in range(targets.labels.shape[0])])
    return DepthTargets(targets.positions, labels, targets.masks)


class ShiftedRows:
    """Rows of x at t + 1 + s for the selected positions t, for every unroll step s, with a per-row function
    (the frozen LM head) applied once per needed row instead of once per step.

    x [B, T, H]; positions [B, T] bool; `rows(s)` -> f(x[:, t + 1 + s]) at the positions, [N, ...]; rows past
    the end of the sequence come back as some valid row (those positions are masked by the caller).
    """

    def __init__(self, x: Tensor, positions: Tensor, steps: int, function: Callable[[Tensor], Tensor]) -> None:
        needed = torch.zeros_like(positions)
        for step in range(steps):
            needed[:, 1 + step:] |= positions[:, : max(positions.shape[1] - 1 - step, 0)]
        self.index = torch.full(positions.shape, -1, dtype=torch.long, device=positions.device)
        self.index[needed] = torch.arange(int(needed.sum()), device=positions.device)
        self.values = function(x[needed])  # [M, ...]
        self.positions = positions

    def rows(self, step: int) -> Tensor:
        return self.values[shift_left(self.index, 1 + step)[self.positions].clamp(min=0)]


def unroll_selected(draft: nn.Module, first_hidden: Tensor, input_ids: Tensor, steps: int, embed_tokens: nn.Module,
                    selected: Tensor) -> list[Tensor]:
    """Run an EAGLE-style draft `steps` times on its own outputs from every `selected` [B, T] bool position (the
    positions the loss reads); returns the outputs there, [N, H] per step (row-major, N = selected.sum()).

    Step s at position t reads token t+1+s (0 past the end; those positions never count) and (s = 0)
    `first_hidden` at t or (s > 0) the step s-1 output at t, at RoPE position t+s. Step 0 runs over the whole
    sequence, causal, but pays for queries, attention rows and the MLP only at the selected positions (every position
    adds its keys and values: DecoderLayer.forward's `selected`). Step s > 0 (training-time test) runs the selected
    positions' chains only, row by row: the chain from t sees the step-0 slots <= t and its own s drafted slots, which
    is what a chain drafted from t sees at run time (the prefix features, then its own drafted tokens).
    """
    batch, length = input_ids.shape
    positions = torch.arange(length, device=input_ids.device).expand(batch, -1)
    first = draft(first_hidden, shift_left(input_ids, 1), embed_tokens=embed_tokens, position_ids=positions,
                  selected=selected)
    chains: list[list[Tensor]] = [[] for _ in range(steps - 1)]
    start = 0
    for row, count in enumerate(selected.sum(1).tolist() if steps > 1 else []):
        if not count:
            continue
        where, prefix = visible_prefix(selected[row])  # [n] ascending, [n, span]
        span = prefix.shape[1]
        kv = first.past_key_value
        cache = LayerKV(kv.key[row:row + 1, :, :span], kv.value[row:row + 1, :, :span])
        hidden = first.hidden_states[None, start:start + count]  # [1, n, H]
        own = torch.eye(count, dtype=torch.bool, device=where.device)
        for step in range(1, steps):
            allowed = torch.cat([prefix] + [own] * step, dim=1)  # step-0 slots, then one block of n per chain step
            mask = additive_mask(allowed, hidden.dtype)
            out = draft(hidden, shift_left(input_ids, 1 + step)[row:row + 1, where], embed_tokens=embed_tokens,
                        position_ids=(where + step)[None], attention_mask=mask, past_key_value=cache)
            cache, hidden = out.past_key_value, out.hidden_states
            chains[step - 1].append(hidden[0])
        start += count
    return [first.hidden_states] + [torch.cat(rows) if rows else first.hidden_states[:0] for rows in chains]


class _FrozenTarget:
    """Holds the frozen target outside nn.Module registration (so it is neither trained nor checkpointed)."""

    def __init__(self, target: nn.Module) -> None:
        self.model = target
        self.modules: TargetModules = target_modules(target)


def medusa_lm_head_rows(heads: MedusaHeads, target: nn.Module) -> Tensor | None:
    """The frozen target LM head weight [V, H] shared heads project onto, as a plain tensor (so it is not registered
    as a parameter of the training module: neither trained nor checkpointed); None for heads with projections."""
    if not heads.config.medusa_shared_lm_head:
        return None
    return shared_lm_head_rows(target_modules(target).lm_head).detach()


class MedusaTraining(nn.Module):
    """Medusa-1: frozen target; heads on hs[-1]; CE per head on token t+2+h, weights head_decay**h.

    With shared heads the logits go through the target's frozen LM head (held outside the module's parameters,
    so the optimizer sees only the ResBlocks)."""

    def __init__(self, heads: MedusaHeads, target: nn.Module, config: TrainConfig) -> None:
        super().__init__()
        self.heads = heads
        self._target = _FrozenTarget(target)
        self.last_layer = target.config.get_text_config().num_hidden_layers
        self.feature_layers = [self.last_layer]
        self.decay, self.top_k = config.head_decay, config.eval_top_k
        self.config = config
        self._lm_head_rows = medusa_lm_head_rows(heads, target)
        self._draft_vocab = heads.has_draft_vocab and self._lm_head_rows is not None
        if self._draft_vocab:  # shared heads: CE over the draft vocabulary's rows, gathered once
            self._lm_head_rows = self._lm_head_rows[draft_target_ids(heads.d2t)]  # [Vd, H]: a sixth at 8,192 of 49,152

    def forward(self, batch: dict[str, Any], train: bool = True, generator: torch.Generator | None = None
                ) -> LossOutput:
        (hidden,) = target_hidden_states(self._target.model, batch, [self.last_layer])
        targets = depth_targets(batch["input_ids"], batch["loss_mask"], self.heads.num_heads)
        if self.config.label_source == "target":
            lm_head = self._target.modules.lm_head
            greedy = ShiftedRows(hidden, targets.positions, self.heads.num_heads,
                                 lambda x: apply_head(lm_head, x).argmax(-1))  # the target's token t+2+h
            targets = target_greedy_labels(targets, self.config, greedy.rows)
        selected = hidden[targets.positions].to(self.heads.dtype)  # [N, H]
        if self._draft_vocab:
            targets = DepthTargets(targets.positions, target_to_draft_ids(targets.labels, self.heads.d2t,
                                                                          self.heads.t2d), targets.masks)
        logits = self.heads.compute_logits(selected, self._lm_head_rows)  # [K, N, V or Vd]
        return depth_cross_entropy(list(logits), targets, self.decay, self.top_k)


class Medusa2Training(nn.Module):
    """Medusa-2: LoRA target (peft) + heads; LM loss + weighted head losses (+ KL to the frozen target)."""

    def __init__(self, heads: MedusaHeads, peft_target: nn.Module, config: TrainConfig) -> None:
        super().__init__()
        self.heads = heads
        self.target = peft_target
        self.feature_layers: list[int] = []  # reads the adapted target's own forward
        self.config = config
        self._lm_head_rows = medusa_lm_head_rows(heads, peft_target)  # frozen: LoRA does not adapt the LM head

    def forward(self, batch: dict[str, Any], train: bool = True, generator: torch.Generator | None = None
                ) -> LossOutput:
        config = self.config
        out = self.target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                          output_hidden_states=True, use_cache=False)
        targets = depth_targets(batch["input_ids"], batch["loss_mask"], self.heads.num_heads)
        selected = out.hidden_states[-1][targets.positions].to(self.heads.dtype)  # [N, H]
        heads = depth_cross_entropy(list(self.heads.compute_logits(selected, self._lm_head_rows)), targets,
                                    config.head_decay, config.eval_top_k)
        lm = lm_cross_entropy(out.logits, batch["input_ids"], batch["loss_mask"])
        total = config.heads_loss_weight * heads.loss + config.lm_loss_weight * lm
        extra = {"lm_loss": lm.detach()}
        if config.distill_weight > 0:
            with torch.no_grad(), self.target.disable_adapter():
                reference = self.target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                        use_cache=False).logits
            distill = lm_distillation(out.logits, reference, batch["loss_mask"])
            total = total + config.distill_weight * distill
            extra["distill_loss"] = distill.detach()
        return LossOutput(total, heads.depth, extra)


def eagle_draft_vocab(draft: EagleDraft, lm_head: nn.Module) -> tuple[Tensor, Tensor, Tensor] | None:
    """(LM-head rows of the draft vocabulary [Vd, H], their target ids [Vd], t2d [V]) when the heads have a
    reduced draft vocabulary (--draft_vocab_size), else None. The soft CE then runs over those rows, as the
    runtime drafts over them (and as EAGLE-3 trains): a sixth of the LM-head cost at 8,192 of 49,152."""
    if not draft.has_draft_vocab or lm_head.bias is not None:
        return None
    ids = draft_target_ids(draft.d2t)
    return lm_head.weight.detach()[ids], ids, draft.t2d


def soft_targets_over_draft(config: TrainConfig, lm_head: nn.Module, draft_vocab_size: int) -> bool:
    """Whether the target's soft targets need only the LM-head rows of the draft vocabulary.

    The soft CE runs over the draft vocabulary, so the target's logits over its other rows serve only to find the
    target's own argmax: the labels of --label_source target, and which positions the draft can express. With
    --label_source data the labels say both, and the target's LM head runs over the draft rows only (measured on
    SmolLM2, 8,192 of 49,152 rows: the full head took ~half of a float32 EAGLE training step on CPU)."""
    return (config.label_source == "data" and lm_head.bias is None
            and draft_vocab_size < lm_head.weight.shape[0])


def target_head(lm_head: nn.Module, draft_rows: Tensor | None) -> Callable[[Tensor], Tensor]:
    """The frozen target's logits [..., H] -> [..., V], or over the draft vocabulary only [..., Vd]."""
    if draft_rows is None:
        return lambda x: apply_head(lm_head, x)
    return lambda x: x.to(draft_rows.dtype) @ draft_rows.T


class EagleTraining(nn.Module):
    """EAGLE-1/2: smooth-L1 regression of f_{t+1} + soft CE through the frozen LM head; noisy input features."""

    def __init__(self, draft: EagleDraft, target: nn.Module, config: TrainConfig) -> None:
        super().__init__()
        self.draft = draft
        self._target = _FrozenTarget(target)
        self.last_layer = target.config.get_text_config().num_hidden_layers
        self.feature_layers = [self.last_layer]
        self.config = config
        self._draft_vocab = eagle_draft_vocab(draft, self._target.modules.lm_head)
        self._soft_rows = (self._draft_vocab[0] if self._draft_vocab is not None and soft_targets_over_draft(
            config, self._target.modules.lm_head, self._draft_vocab[1].numel()) else None)

    @property
    def heads(self) -> HeadsModule:
        return self.draft


    def forward(self, batch: dict[str, Any], train: bool = True, generator: torch.Generator | None = None
                ) -> LossOutput:
        config, frozen = self.config, self._target.modules
        (target_hidden,) = target_hidden_states(self._target.model, batch, [self.last_layer])
        features = target_hidden.to(self.draft.fc.weight.dtype)
        if train and config.feature_noise > 0:
            noise = torch.rand(features.shape, generator=generator, device=features.device, dtype=features.dtype)
            features = features + (noise - 0.5) * config.feature_noise
        steps = 1 if train else config.eval_depth
        targets = depth_targets(batch["input_ids"], batch["loss_mask"], steps)
        outputs = unroll_selected(self.draft, features, batch["input_ids"], steps, frozen.embed_tokens,
                                  targets.positions)
        wanted = ShiftedRows(target_hidden, targets.positions, steps, lambda x: x)  # f_{t+1+s}
        vocab, over_draft = self._draft_vocab, self._soft_rows
        with torch.no_grad():
            wanted_logits = ShiftedRows(target_hidden, targets.positions, steps, target_head(frozen.lm_head, over_draft))
        targets = target_greedy_labels(targets, config, lambda d: wanted_logits.rows(d).argmax(-1))
        total = features.new_zeros((), dtype=torch.float32)
        stats, feature_sum, token_sum = [], 0.0, 0.0
        for step, predicted in enumerate(outputs):  # [N, H] at the selected positions
            if vocab is None:
                feature, token, hits = eagle_step_loss(predicted, apply_head(frozen.lm_head, predicted),
                                                       wanted.rows(step), wanted_logits.rows(step),
                                                       targets.labels[step], targets.masks[step], config.eval_top_k)
            else:
                rows, ids, in_draft = vocab
                feature = feature_regression(predicted, wanted.rows(step), targets.masks[step])
                token, hits = eagle3_step_loss(predicted.to(rows.dtype) @ rows.T, wanted_logits.rows(step),
                                               targets.labels[step], targets.masks[step], ids, in_draft,
                                               config.eval_top_k, over_draft=over_draft is not None)
            step_loss = config.feature_loss_weight * feature + config.token_loss_weight * token
            total = total + step_loss
            stats.append((step_loss, *hits))
            feature_sum, token_sum = feature_sum + feature.detach(), token_sum + token.detach()
        return LossOutput(total, DepthStats.stack(stats), {"feature_loss": feature_sum, "token_loss": token_sum})


class _FusedFeaturesTraining(nn.Module):
    """What EAGLE-3, DFlash and P-EAGLE training share: a draft fed several target layers' hidden states, concatenated
    and projected by its `fc` (`features`), and the target's last hidden state for the soft targets."""

    def __init__(self, draft: Eagle3Draft | DFlashDraft | PEagleDraft, target: nn.Module, config: TrainConfig) -> None:
        super().__init__()
        self.draft = draft
        self._target = _FrozenTarget(target)
        self.feature_layers = list(draft.config.target_layers) + [target.config.get_text_config().num_hidden_layers]
        self.config = config

    @property
    def heads(self) -> HeadsModule:
        return self.draft

    def features(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor]:
        """(the draft's projected features [B, T, H], the target's last hidden state [B, T, H])."""
        *layers, last = target_hidden_states(self._target.model, batch, self.feature_layers)
        return self.draft.project(torch.cat(layers, dim=-1).to(self.draft.fc.weight.dtype)), last


class Eagle3Training(_FusedFeaturesTraining):
    """EAGLE-3: three target layers -> fc; soft CE over the draft vocabulary; training-time test unrolls
    `ttt_steps` steps on the draft's own outputs with weights head_decay**s."""

    def __init__(self, draft: Eagle3Draft, target: nn.Module, config: TrainConfig) -> None:
        super().__init__(draft, target, config)
        lm_head = self._target.modules.lm_head
        self._soft_rows = (lm_head.weight.detach()[draft_target_ids(draft.d2t)] if soft_targets_over_draft(
            config, lm_head, draft.config.draft_vocab_size) else None)  # [Vd, H] in draft id order, or None

    def forward(self, batch: dict[str, Any], train: bool = True, generator: torch.Generator | None = None
                ) -> LossOutput:
        config, frozen = self.config, self._target.modules
        first, last = self.features(batch)
        steps = config.ttt_steps if train else config.eval_depth
        targets = depth_targets(batch["input_ids"], batch["loss_mask"], steps)
        outputs = unroll_selected(self.draft, first, batch["input_ids"], steps, frozen.embed_tokens, targets.positions)
        draft_ids = torch.arange(self.draft.config.draft_vocab_size, device=first.device)
        draft_to_target = draft_to_target_ids(draft_ids, self.draft.d2t)
        over_draft = self._soft_rows
        with torch.no_grad():
            target_logits = ShiftedRows(last, targets.positions, steps, target_head(frozen.lm_head, over_draft))
        targets = target_greedy_labels(targets, config, lambda d: target_logits.rows(d).argmax(-1))
        total = first.new_zeros((), dtype=torch.float32)
        stats = []
        for step, (predicted, weight) in enumerate(zip(outputs, depth_weights(steps, config.head_decay),
                                                       strict=True)):
            loss, hits = eagle3_step_loss(self.draft.compute_logits(predicted),
                                          target_logits.rows(step),
                                          targets.labels[step], targets.masks[step], draft_to_target,
                                          self.draft.t2d, config.eval_top_k, over_draft=over_draft is not None)
            total = total + weight * loss
            stats.append((loss, *hits))
        return LossOutput(total, DepthStats.stack(stats), {})


class MTPTraining(nn.Module):
    """MTP: depth d reads h_d and token t+d+1, predicts token t+d+2 through the shared LM head; CE per depth."""

    def __init__(self, heads: MTPHeads, target: nn.Module, config: TrainConfig) -> None:
        super().__init__()
        self.mtp = heads
        self._target = _FrozenTarget(target)
        self.last_layer = target.config.get_text_config().num_hidden_layers
        self.feature_layers = [self.last_layer]
        self.config = config

    @property
    def heads(self) -> HeadsModule:
        return self.mtp

    def forward(self, batch: dict[str, Any], train: bool = True, generator: torch.Generator | None = None
                ) -> LossOutput:
        frozen = self._target.modules
        (hidden,) = target_hidden_states(self._target.model, batch, [self.last_layer])
        hidden = hidden.to(self.mtp.layers[0].eh_proj.weight.dtype)
        input_ids = batch["input_ids"]
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1)
        targets = depth_targets(input_ids, batch["loss_mask"], self.mtp.num_depths)
        logits = []
        for depth in range(self.mtp.num_depths):
            hidden = self.mtp(hidden, shift_left(input_ids, depth + 1), depth=depth,
                              embed_tokens=frozen.embed_tokens, position_ids=positions).hidden_states
            logits.append(self.mtp.compute_logits(hidden[targets.positions], depth=depth,
                                                  lm_head=frozen.lm_head))
        return depth_cross_entropy(logits, targets, self.config.head_decay, self.config.eval_top_k)
def vocabulary_rows(draft: HeadsModule, lm_head: nn.Module) -> tuple[Tensor, Tensor, Tensor]:
    """(LM-head rows [Vd, H], their target ids [Vd], t2d [V] bool) of a DFlash draft's vocabulary: its draft
    vocabulary's rows when it has one, else every row."""
    vocab = eagle_draft_vocab(draft, lm_head)
    if vocab is not None:
        return vocab
    weight = lm_head.weight.detach()
    return weight, torch.arange(weight.shape[0], device=weight.device), torch.ones(
        weight.shape[0], dtype=torch.bool, device=weight.device)


def sample_anchors(loss_mask: Tensor, count: int, train: bool, generator: torch.Generator | None
                   ) -> tuple[Tensor, Tensor]:
    """DFlash block anchors: positions a whose next token a+1 is a label (assistant token), `count` per row.

    loss_mask [B, T] -> (anchors [B, count] int64, valid [B, count] bool). Training draws them at random without
    replacement; evaluation spreads them evenly over the candidates (deterministic). Rows with fewer candidates
    get invalid (masked) anchors.
    """
    candidates = shift_left(loss_mask, 1).bool()  # [B, T]: a with a label at a + 1
    batch, length = candidates.shape
    device = loss_mask.device
    if train:
        scores = torch.rand(batch, length, generator=generator, device=device)
    else:
        order = torch.arange(length, device=device, dtype=torch.float32)
        rank = candidates.cumsum(1).float()
        total = candidates.sum(1, keepdim=True).clamp(min=1).float()
        # evenly spaced: the candidate whose rank is nearest to i * total / count comes first
        scores = (torch.frac(rank * count / total) + order * 1e-9)
    scores = scores.masked_fill(~candidates, float("inf"))
    picked = scores.argsort(dim=1)[:, :count]  # [B, min(count, T)]
    valid = torch.gather(candidates, 1, picked)
    if picked.shape[1] < count:
        pad = count - picked.shape[1]
        picked = torch.cat([picked, picked.new_zeros(batch, pad)], 1)
        valid = torch.cat([valid, valid.new_zeros(batch, pad)], 1)
    return torch.where(valid, picked, torch.zeros_like(picked)), valid


def block_attention_mask(anchors: Tensor, valid: Tensor, block: int, length: int, dtype: torch.dtype) -> Tensor:
    """Additive mask [B, 1, n*B, T + n*B]: block j's slots see the context before its anchor (t < a_j) and every
    slot of block j (bidirectional), nothing else. anchors, valid [B, n]."""
    batch, count = anchors.shape
    device = anchors.device
    context = torch.arange(length, device=device)[None, None] < anchors[..., None]  # [B, n, T]
    context = context & valid[..., None]
    context = context[:, :, None, :].expand(batch, count, block, length).reshape(batch, count * block, length)
    own = torch.eye(count, dtype=torch.bool, device=device).repeat_interleave(block, 0).repeat_interleave(block, 1)
    allowed = torch.cat([context, own[None].expand(batch, -1, -1)], dim=2)
    return additive_mask(allowed, dtype, device)


def dflash_blocks(draft: DFlashDraft, context: Tensor, input_ids: Tensor, anchors: Tensor, valid: Tensor,
                  embed_tokens: nn.Module) -> Tensor:
    """Every block of every sequence in one forward: context [B, T, H] (projected features), input_ids [B, T],
    anchors / valid [B, n] -> pre-norm outputs [B, n, block_size, H] (block j = [token a_j, mask...] at a_j..,
    seeing the context before a_j and itself: what the runtime computes for a root at a_j)."""
    batch_size, length = input_ids.shape
    block, count = draft.block_size, anchors.shape[1]
    positions = torch.arange(length, device=input_ids.device)
    cache = draft.context_cache(context, positions.expand(batch_size, -1))
    slots = anchors[..., None] + torch.arange(block, device=input_ids.device)  # [B, n, B] positions
    ids = draft.block_ids(torch.gather(input_ids, 1, anchors))  # [B, n, B]
    mask = block_attention_mask(anchors, valid, block, length, context.dtype)
    out = draft(ids.reshape(batch_size, -1), embed_tokens=embed_tokens, position_ids=slots.reshape(batch_size, -1),
                context=cache, attention_mask=mask)
    return out.view(batch_size, count, block, -1)


class DFlashTraining(_FusedFeaturesTraining):
    """DFlash: K target layers -> context; `num_anchors` random blocks per sequence drafted in one forward under
    one mask (block j sees the context before its anchor and itself); slot k (1..B-1) predicts token anchor+k with
    the soft CE of EAGLE-3 (the target's distribution, over the draft vocabulary), weighted exp(-(k-1)/gamma).
    Slot 0 (the anchor itself) has no loss. Depth d of the statistics is slot d+1."""

    def forward(self, batch: dict[str, Any], train: bool = True, generator: torch.Generator | None = None
                ) -> LossOutput:
        config, frozen, draft = self.config, self._target.modules, self.draft
        context, last = self.features(batch)  # [B, T, H] each
        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"]
        batch_size, length = input_ids.shape
        block = draft.block_size
        anchors, valid = sample_anchors(loss_mask, config.num_anchors if train else 2 * config.num_anchors, train,
                                        generator)
        out = dflash_blocks(draft, context, input_ids, anchors, valid, frozen.embed_tokens)  # [B, n, B, H]
        slots = anchors[..., None] + torch.arange(block, device=input_ids.device)  # [B, n, B] positions
        rows, ids_in_draft, in_draft = vocabulary_rows(draft, frozen.lm_head)
        total = context.new_zeros((), dtype=torch.float32)
        stats = []
        for k in range(1, block):
            where = slots[..., k]  # [B, n]: the position slot k predicts
            inside = where < length
            at = where.clamp(max=length - 1)
            counted = valid & inside & torch.gather(loss_mask, 1, at).bool()
            labels = torch.gather(input_ids, 1, at)[counted]
            with torch.no_grad():
                target_logits = apply_head(frozen.lm_head, last[torch.arange(batch_size, device=at.device)[:, None]
                                                                .expand_as(at)[counted], at[counted] - 1])
            if config.label_source == "target":
                labels = target_logits.argmax(-1)
            predicted = out[:, :, k][counted]  # [N, H]
            logits = draft.compute_logits(predicted, rows)  # [N, Vd]
            loss, hits = eagle3_step_loss(logits, target_logits, labels, torch.ones_like(labels, dtype=torch.bool),
                                          ids_in_draft, in_draft, config.eval_top_k)
            total = total + math.exp(-(k - 1) / config.position_gamma) * loss
            stats.append((loss, *hits))
        return LossOutput(total, DepthStats.stack(stats), {})


def peagle_kept(candidates: Tensor, depth: int, ratio: float, minimum: float, scores: Tensor) -> tuple[Tensor, Tensor]:
    """Positions depth `depth` trains on: of the n candidate positions of each row, the n * max(ratio^depth, minimum)
    with the lowest `scores` (one score per position for every depth, so deeper sets are nested in shallower ones).
    candidates [B, T] bool, scores [B, T] -> (positions [B, M] int64, valid [B, M] bool)."""
    share = max(ratio ** depth, minimum)
    keep = (candidates.sum(1).float() * share).ceil().long()  # [B]
    width = max(int(keep.max()), 1)
    order = scores.masked_fill(~candidates, float("inf")).argsort(dim=1)[:, :width]
    valid = torch.arange(width, device=candidates.device)[None] < keep[:, None]
    return order, valid


def peagle_entries(draft: PEagleDraft, first: Tensor, input_ids: Tensor, groups: list[tuple[Tensor, Tensor]],
                   embed_tokens: nn.Module) -> Tensor:
    """All depths in one forward. first [B, T, H] (projected features), groups[d] = (positions t [B, M_d], valid
    [B, M_d]) for d >= 1 (groups[0]: every position) -> pre-norm outputs [B, T + sum M_d, H], depth by depth.
    Entry (d, t) sits at position t + d and sees the depth-0 entries <= t and its own chain's masked entries up to
    depth d: what the runtime computes for a root at t + 1."""
    batch_size, device = input_ids.shape[0], input_ids.device
    chain = torch.cat([g[0] for g in groups], 1)  # [B, E]: the position t each entry drafts from
    valid = torch.cat([g[1] for g in groups], 1)
    level = torch.cat([torch.full_like(g[0], d) for d, g in enumerate(groups)], 1)
    allowed = ((level[:, None, :] == 0) & (chain[:, None, :] <= chain[:, :, None])) | (
        (level[:, None, :] >= 1) & (level[:, :, None] >= level[:, None, :]) &
        (chain[:, None, :] == chain[:, :, None]) & valid[:, None, :])
    allowed |= torch.eye(chain.shape[1], dtype=torch.bool, device=device)[None]
    dtype = first.dtype
    mask = additive_mask(allowed, dtype, device)
    masked = sum(g[0].shape[1] for g in groups[1:])
    hidden = torch.cat([first, draft.mask_features(masked)[None].expand(batch_size, -1, -1)], 1)
    ids = torch.cat([shift_left(input_ids, 1),
                     torch.full((batch_size, masked), draft.config.mask_token_id, dtype=torch.long, device=device)], 1)
    out, _ = draft(hidden, ids, embed_tokens=embed_tokens, position_ids=chain + level, attention_mask=mask)
    return out


class PEagleTraining(_FusedFeaturesTraining):
    """P-EAGLE: EAGLE-3 entries (target features) at every position and, for depths d = 1..K-1, masked entries
    (fc(mask_hidden), mask token) at t+d for a nested random subset of n * max(r^d, r_min) positions t, all in one
    forward: entry (d, t) sees the depth-0 entries <= t and the masked entries of its own chain up to depth d.
    Depth d predicts token t+2+d with EAGLE-3's soft CE, weighted head_decay**d. Evaluation keeps every position."""

    def forward(self, batch: dict[str, Any], train: bool = True, generator: torch.Generator | None = None
                ) -> LossOutput:
        config, frozen, draft = self.config, self._target.modules, self.draft
        first, last = self.features(batch)  # [B, T, H] each
        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"]
        batch_size, length = input_ids.shape
        device = input_ids.device
        depths = draft.block_size
        targets = depth_targets(input_ids, loss_mask, depths)
        scores = torch.rand(batch_size, length, generator=generator, device=device)
        groups = [(torch.arange(length, device=device).expand(batch_size, -1),
                   torch.ones(batch_size, length, dtype=torch.bool, device=device))]
        for depth in range(1, depths):
            ratio, minimum = (config.peagle_keep_ratio, config.peagle_min_keep) if train else (1.0, 1.0)
            groups.append(peagle_kept(targets.positions, depth, ratio, minimum, scores))
        out = peagle_entries(draft, first, input_ids, groups, frozen.embed_tokens)
        draft_ids = torch.arange(draft.config.draft_vocab_size, device=device)
        draft_to_target = draft_to_target_ids(draft_ids, draft.d2t)
        rows = torch.arange(batch_size, device=device)[:, None]
        counted_at = []  # per depth: (positions of the labels [B, M], which count [B, M])
        needed = torch.zeros(batch_size, length, dtype=torch.bool, device=device)
        for depth, (where, ok) in enumerate(groups):
            label_at = where + 2 + depth
            at = label_at.clamp(max=length - 1)
            counted = ok & (label_at < length) & torch.gather(loss_mask, 1, at).bool()
            counted_at.append((at, counted))
            needed[rows.expand_as(at)[counted], at[counted] - 1] = True
        # the target's LM head once per needed position (depths share them), not once per depth
        index = torch.full((batch_size, length), -1, dtype=torch.long, device=device)
        index[needed] = torch.arange(int(needed.sum()), device=device)
        with torch.no_grad():
            all_target_logits = apply_head(frozen.lm_head, last[needed])
        total = first.new_zeros((), dtype=torch.float32)
        stats, offset = [], 0
        for (where, _), (at, counted), weight in zip(groups, counted_at, depth_weights(depths, config.head_decay),
                                                     strict=True):
            width = where.shape[1]
            labels = torch.gather(input_ids, 1, at)[counted]
            target_logits = all_target_logits[index[rows.expand_as(at)[counted], at[counted] - 1]]
            if config.label_source == "target":
                labels = target_logits.argmax(-1)
            predicted = out[:, offset: offset + width][counted]
            loss, hits = eagle3_step_loss(draft.compute_logits(predicted), target_logits, labels,
                                          torch.ones_like(labels, dtype=torch.bool), draft_to_target, draft.t2d,
                                          config.eval_top_k)
            total = total + weight * loss
            stats.append((loss, *hits))
            offset += width
        return LossOutput(total, DepthStats.stack(stats), {})


def heads_config(config: TrainConfig, target: nn.Module) -> HeadsConfig:
    """The HeadsConfig of `--method` for this target (ValueError from HeadsConfig names a bad option)."""
    if config.method in ("eagle", "eagle3") and config.num_layers != 1:
        raise ValueError(f"--num_layers {config.num_layers}: {config.method} drafts have one decoder layer")
    options: dict[str, Any] = {"base_model_revision": config.model_revision, "training_data": config.dataset}
    if config.method in ("medusa", "medusa2"):
        kind = "medusa"
        options.update(medusa_num_heads=config.num_heads, medusa_num_layers=config.num_layers,
                       medusa_shared_lm_head=config.medusa_shared_lm_head)
    elif config.method == "eagle3":
        kind = "eagle3"
        options["draft_vocab_size"] = config.draft_vocab_size
        layers = eagle3_layers(config)
        if layers is not None:
            options["target_layers"] = list(layers)
    elif config.method == "mtp":
        kind = "mtp"
        options["mtp_num_depths"] = config.num_heads
    elif config.method in PARALLEL_METHODS:
        kind = config.method
        options.update(parallel_options(config, target))
    else:
        kind = "eagle"
        options["eagle_fc_bias"] = config.eagle_fc_bias
    try:
        return HeadsConfig.for_target(kind, target, base_model_name_or_path=config.model, **options)
    except ValueError as err:
        raise ValueError(f"heads config for --method {config.method} does not fit target {config.model}: "
                         f"{err}") from err


def parallel_options(config: TrainConfig, target: nn.Module) -> dict[str, Any]:
    """HeadsConfig options of --method dflash / peagle, checked against the target (one line naming the flag)."""
    text = target.config.get_text_config()
    layers, vocab = int(text.num_hidden_layers), int(text.vocab_size)
    options: dict[str, Any] = {"block_size": config.block_size, "mask_token_id": config.mask_token_id,
                               "num_draft_layers": config.num_layers}
    ids = target_layer_ids(config)
    if ids is not None:
        if not all(1 <= i <= layers for i in ids):
            raise ValueError(f"--target_layer_ids: expected HF hidden_states indices in [1, {layers}] (the target "
                             f"{config.model} has {layers} layers), got {config.target_layer_ids!r}")
        options["target_layers"] = ids
    if config.mask_token_id >= vocab:
        raise ValueError(f"--mask_token_id: expected an id in [0, {vocab - 1}] (the target's vocabulary) or -1, "
                         f"got {config.mask_token_id}")
    if config.method == "peagle":
        options["draft_vocab_size"] = min(config.draft_vocab_size, vocab)
    return options


def initial_heads(config: TrainConfig, target: nn.Module, assistant_tokens: Callable[[], Iterable[list[int]]]
                  ) -> HeadsModule:
    """Fresh heads (seeded) or, with --init_heads, saved ones checked against the target.

    Medusa projections (unless shared) start as copies of the target's LM head; EAGLE-3's draft vocabulary is the
    draft_vocab_size most frequent assistant tokens of the training split (`assistant_tokens()`).
    """
    if config.init_heads:
        heads = load_heads(config.init_heads, target=target, target_name=config.model)
        expected = "medusa" if config.method == "medusa2" else config.method
        if heads.config.kind != expected:
            raise ValueError(f"--init_heads {config.init_heads}: holds {heads.config.kind!r} heads, "
                             f"--method {config.method} trains {expected!r}")
        if expected == "medusa" and heads.config.medusa_shared_lm_head != config.medusa_shared_lm_head:
            raise ValueError(f"--init_heads {config.init_heads}: medusa_shared_lm_head is "
                             f"{heads.config.medusa_shared_lm_head} there, --medusa_shared_lm_head "
                             f"{config.medusa_shared_lm_head} here")
        return heads.float().train()
    torch.manual_seed(config.seed)
    heads = build_heads(heads_config(config, target))
    if isinstance(heads, MedusaHeads) and not heads.config.medusa_shared_lm_head:
        heads.init_from_lm_head(target_modules(target).lm_head.weight.detach().float())
    # EAGLE-3's lm_head rows; the other kinds draft over these rows of their full projections (heads.draft_vocab).
    own = isinstance(heads, (Eagle3Draft, PEagleDraft))
    size = heads.config.draft_vocab_size if own else config.draft_vocab_size
    if own or 0 < size < heads.config.vocab_size:
        counts = count_tokens(assistant_tokens(), heads.config.vocab_size)
        heads.set_vocab_mapping(*build_vocab_mapping(counts, size))
    return heads.train()


def lora_target(target: nn.Module, config: TrainConfig) -> nn.Module:
    """Wrap the target with LoRA adapters (peft); only the adapters train."""
    from peft import LoraConfig, get_peft_model

    modules = config.lora_target_modules
    lora = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                      target_modules=modules if modules == "all-linear" else modules.split(","),
                      task_type="CAUSAL_LM")
    try:
        return get_peft_model(target, lora)
    except ValueError as err:
        raise ValueError(f"--lora_target_modules {modules!r}: {err}") from err


def build_training_module(config: TrainConfig, target: nn.Module,
                          assistant_tokens: Callable[[], Iterable[list[int]]]) -> nn.Module:
    """The nn.Module to `accelerator.prepare` for --method; its `.heads` is what gets saved."""
    target.requires_grad_(False)
    heads = initial_heads(config, target, assistant_tokens).to(target.device)
    if config.method == "medusa":
        return MedusaTraining(heads, target, config)
    if config.method == "medusa2":
        return Medusa2Training(heads, lora_target(target, config), config)
    if config.method == "eagle":
        return EagleTraining(heads, target, config)
    if config.method == "eagle3":
        return Eagle3Training(heads, target, config)
    if config.method == "dflash":
        return DFlashTraining(heads, target, config)
    if config.method == "peagle":
        return PEagleTraining(heads, target, config)
    return MTPTraining(heads, target, config)
