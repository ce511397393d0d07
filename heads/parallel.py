"""Parallel drafters: DFlash and P-EAGLE draft a whole block of tokens in ONE drafter forward.

DFlash (`DFlashDraft`, arXiv 2602.06036; the layout of speculators' `models/dflash` and vLLM's
`DFlashQwen3ForCausalLM`). Features of K target layers (HF hidden_states indices `target_layers`) are
concatenated and projected, `context = hidden_norm(fc(cat(hs[l_1..l_K])))` [C, H], once per committed position.
A block of `block_size` = B slots holds [last committed token (the anchor), mask_token_id x (B-1)] at positions
anchor .. anchor+B-1, embedded with the target's embedding. Every layer (a Qwen3 decoder layer: q/k norms)
attends from the block's queries to keys/values made of the context (`k_norm(k_proj(context))`, `v_proj(context)`,
positions 0 .. anchor-1, no input norm) followed by the block's own keys/values, bidirectionally within the block.
`norm` + the target's LM head on slot k (1..B-1) give token anchor+k: B-1 drafts from one forward. Slot 0 has no
prediction. The drafts never see each other's tokens, so every slot's top-k can fill a Medusa-style tree.

P-EAGLE (`PEagleDraft`; vLLM's `PeagleLlamaForCausalLM` = its EAGLE-3 model with parallel drafting). An EAGLE-3
drafter of `num_draft_layers` layers: `layers.0` is EAGLE-3's midlayer (attention over cat(input_layernorm(embed),
hidden_norm(hidden))), the others Llama layers; `norm` + its own reduced-vocabulary `lm_head` (`d2t`/`t2d`).
Committed entry s reads (fc(cat(hs[l_1..l_K]) at s), embedding of token s+1) as in EAGLE-3; its output at the
last committed entry (s = T-1, token T = the root) gives depth 0. Depths 1..block_size-1 are entries at positions
T .. T+block_size-2 reading (fc(`mask_hidden`), embedding of mask_token_id): a learnt vector standing in for the
target features the drafter does not have. All of them run in one causal forward; output at T-1+d gives token
T+1+d (depth d). Again no draft sees a drafted token, so per-depth top-k fills a Medusa-style tree.

Both take the target's embedding as `embed_tokens=` (never saved); DFlash also takes the target's `lm_head=`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from heads.base import HeadsModule, OwnLMHeadDraft
from heads.config import HeadsConfig
from heads.layers import DecoderLayer, LayerKV, RMSNorm, context_key_value


def _concat(features: Tensor | Sequence[Tensor], config: HeadsConfig, name: str) -> Tensor:
    """K target layers' features: [..., K*H] or K x [..., H] -> [..., K*H] (checked)."""
    count = len(config.target_layers)
    if not isinstance(features, Tensor):
        if len(features) != count:
            raise ValueError(f"{name}.project: expected {count} hidden states, got {len(features)}")
        features = torch.cat(list(features), dim=-1)
    if features.shape[-1] != count * config.hidden_size:
        raise ValueError(f"{name}.project: expected last dim {count * config.hidden_size}, got {features.shape[-1]}")
    return features


def visible_mask(batch: int, query_length: int, key_length: int, dtype: torch.dtype,
                 device: torch.device | None = None) -> Tensor:
    """Additive mask [B, 1, S, keys] with every key visible (a DFlash block over its context)."""
    return torch.zeros(batch, 1, query_length, key_length, dtype=dtype, device=device)


class DFlashDraft(HeadsModule, kind="dflash"):
    """DFlash drafter: `fc`, `hidden_norm`, `layers.{i}` (Qwen3 layers), `norm`; the target's embedding and LM head."""

    def __init__(self, config: HeadsConfig) -> None:
        if config.kind != "dflash":
            raise ValueError(f"DFlashDraft needs kind 'dflash', got {config.kind!r}")
        super().__init__(config)
        hidden = config.hidden_size
        self.fc = nn.Linear(len(config.target_layers) * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(config, mode="llama", qk_norm=True)
                                     for _ in range(config.num_draft_layers)])
        self.norm = RMSNorm(hidden, config.rms_norm_eps)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def project(self, target_hidden_states: Tensor | Sequence[Tensor]) -> Tensor:
        """Target features [..., K*H] (or K x [..., H]) -> context features hidden_norm(fc(.)) [..., H]."""
        return self.hidden_norm(self.fc(_concat(target_hidden_states, self.config, "DFlashDraft")))

    def context_cache(self, context: Tensor, position_ids: Tensor) -> list[LayerKV]:
        """Context features [B, C, H] at position_ids [B, C] -> each layer's keys/values of them."""
        return [context_key_value(layer, context, position_ids) for layer in self.layers]

    def block_ids(self, anchor_ids: Tensor) -> Tensor:
        """Anchor tokens [...] -> block input ids [..., B]: the anchor then B-1 mask tokens."""
        block = anchor_ids.new_full((*anchor_ids.shape, self.block_size), self.config.mask_token_id)
        block[..., 0] = anchor_ids
        return block

    def forward(self, input_ids: Tensor, *, embed_tokens: nn.Module, position_ids: Tensor,
                context: Sequence[LayerKV], attention_mask: Tensor | None = None) -> Tensor:
        """Block ids [B, S] at position_ids [B, S] over each layer's context keys/values (`context_cache`, C slots)
        -> pre-norm outputs [B, S, H]. attention_mask: additive [B, 1, S, C + S]; None = every slot visible."""
        if len(context) != len(self.layers):
            raise ValueError(f"DFlashDraft: expected {len(self.layers)} context caches, got {len(context)}")
        x = embed_tokens(input_ids).to(self.fc.weight.dtype)
        if attention_mask is None:
            attention_mask = visible_mask(x.shape[0], x.shape[1], context[0].length + x.shape[1], x.dtype, x.device)
        for layer, kv in zip(self.layers, context, strict=True):
            x, _ = layer(x, position_ids, attention_mask, kv)
        return x

    def compute_logits(self, hidden_states: Tensor, lm_head: nn.Module | Tensor) -> Tensor:
        """Pre-norm outputs [..., H] -> logits through the target's LM head (a module, or its rows [V', H])."""
        normed = self.norm(hidden_states)
        if isinstance(lm_head, Tensor):
            return normed.to(lm_head.dtype) @ lm_head.T
        return lm_head(normed.to(lm_head.weight.dtype))


class PEagleDraft(OwnLMHeadDraft, kind="peagle"):
    """P-EAGLE drafter: `fc`, `layers.0` (EAGLE-3 midlayer), `layers.{1..}` (Llama layers), `norm`, `lm_head`
    (reduced vocabulary), `mask_hidden` [K*H], buffers `d2t`/`t2d`."""

    def __init__(self, config: HeadsConfig) -> None:
        if config.kind != "peagle":
            raise ValueError(f"PEagleDraft needs kind 'peagle', got {config.kind!r}")
        super().__init__(config)
        hidden, count = config.hidden_size, len(config.target_layers)
        self.fc = nn.Linear(count * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(config, mode="eagle3")] +
                                    [DecoderLayer(config, mode="llama") for _ in range(config.num_draft_layers - 1)])
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.mask_hidden = nn.Parameter(torch.randn(count * hidden, generator=torch.Generator().manual_seed(0)))

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def project(self, target_hidden_states: Tensor | Sequence[Tensor]) -> Tensor:
        """Target features [..., K*H] (or K x [..., H]) -> fc(.) [..., H]."""
        return self.fc(_concat(target_hidden_states, self.config, "PEagleDraft"))

    def mask_features(self, count: int) -> Tensor:
        """fc(mask_hidden) repeated: [count, H], the features of masked entries."""
        return self.fc(self.mask_hidden)[None].expand(count, -1)

    def forward(self, hidden_states: Tensor, input_ids: Tensor, *, embed_tokens: nn.Module, position_ids: Tensor,
                attention_mask: Tensor | None = None, past_key_values: Sequence[LayerKV] | None = None
                ) -> tuple[Tensor, list[LayerKV]]:
        """hidden_states [B, S, H] (projected features or `mask_features`), input_ids [B, S] (token s+1, or the mask
        token) -> (pre-norm output [B, S, H], each layer's cache with past + S slots)."""
        embeds = embed_tokens(input_ids).to(hidden_states.dtype)
        caches = list(past_key_values) if past_key_values is not None else [None] * len(self.layers)
        x, first = self.layers[0](hidden_states, position_ids, attention_mask, caches[0], inputs_embeds=embeds)
        new = [first]
        for layer, kv in zip(self.layers[1:], caches[1:], strict=True):
            x, kv = layer(x, position_ids, attention_mask, kv)
            new.append(kv)
        return x, new
