"""EAGLE-1/2 and EAGLE-3 draft models (Li et al., 2024 / 2025).

EAGLE-1/2 (`EagleDraft`). Alignment: the input at position t is (feature f_t = target hidden_states[-1] at t,
embedding of token t+1); the output at t is the predicted feature f_{t+1}; the target's LM head on it gives
logits for token t+2. Drafting continues by feeding the draft's own output feature with the embedding of the
token just drafted, at position t+1 (one more RoPE position). Structure: fc(cat(embed, feature)) (2H -> H,
bias per `eagle_fc_bias`) -> one decoder layer without input norm -> output feature (no final norm: the
target's LM head reads it directly, as the target's LM head reads its post-norm hidden state).

EAGLE-3 (`Eagle3Draft`). Alignment: at position t, `project(cat(hs[l_low], hs[l_mid], hs[l_high]) at t)`
(3H -> H, no bias) with the embedding of token t+1 -> `midlayer` (attention over cat(input_layernorm(embed),
hidden_norm(hidden)) = 2H) -> pre-norm output; `compute_logits` = lm_head(norm(output)) over the reduced
vocabulary gives token t+2 (draft ids; `d2t` maps to target ids). Later steps feed the draft's own pre-norm
output instead of the projected target features.

Both take the target's embedding as `embed_tokens=` (never saved) and an explicit position_ids / additive
4D mask / LayerKV cache (see heads.layers).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from heads.base import DraftOutput, HeadsModule, OwnLMHeadDraft
from heads.config import HeadsConfig
from heads.layers import DecoderLayer, LayerKV, RMSNorm


class EagleDraft(HeadsModule, kind="eagle"):
    """EAGLE-1/2 draft: `fc` + `layers.0` (EAGLE reference names)."""

    def __init__(self, config: HeadsConfig) -> None:
        if config.kind != "eagle":
            raise ValueError(f"EagleDraft needs kind 'eagle', got {config.kind!r}")
        super().__init__(config)
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=config.eagle_fc_bias)
        self.layers = nn.ModuleList([DecoderLayer(config, mode="eagle")])

    def forward(self, hidden_states: Tensor, input_ids: Tensor, *, embed_tokens: nn.Module,
                position_ids: Tensor, attention_mask: Tensor | None = None,
                past_key_value: LayerKV | None = None, last: int | None = None,
                selected: Tensor | None = None) -> DraftOutput:
        """hidden_states [B, S, H] features f_t; input_ids [B, S] tokens t+1 -> features f_{t+1} [B, S, H] (the
        last `last` rows only, or [N, H] at the `selected` [B, S] bool positions, when given:
        DecoderLayer.forward)."""
        embeds = embed_tokens(input_ids).to(hidden_states.dtype)
        x = self.fc(torch.cat([embeds, hidden_states], dim=-1))
        out, kv = self.layers[0](x, position_ids, attention_mask, past_key_value, last=last, selected=selected)
        return DraftOutput(out, kv)

    def compute_logits(self, hidden_states: Tensor, lm_head: nn.Module) -> Tensor:
        """Predicted features [..., H] -> logits [..., V] through the target's LM head."""
        return lm_head(hidden_states)


class Eagle3Draft(OwnLMHeadDraft, kind="eagle3"):
    """EAGLE-3 draft: `fc`, `midlayer`, `norm`, `lm_head` (reduced vocab) and buffers `d2t`, `t2d`."""

    def __init__(self, config: HeadsConfig) -> None:
        if config.kind != "eagle3":
            raise ValueError(f"Eagle3Draft needs kind 'eagle3', got {config.kind!r}")
        super().__init__(config)
        hidden = config.hidden_size
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        self.midlayer = DecoderLayer(config, mode="eagle3")
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        # d2t / t2d buffers: registered by HeadsModule (the first draft_vocab_size ids until set_vocab_mapping).

    def project(self, target_hidden_states: Tensor | Sequence[Tensor]) -> Tensor:
        """Three target layers' features: [B, S, 3H] or a sequence of 3 x [B, S, H] (low, mid, high) -> [B, S, H]."""
        if not isinstance(target_hidden_states, Tensor):
            if len(target_hidden_states) != 3:
                raise ValueError(f"Eagle3Draft.project: expected 3 hidden states, got {len(target_hidden_states)}")
            target_hidden_states = torch.cat(list(target_hidden_states), dim=-1)
        if target_hidden_states.shape[-1] != 3 * self.config.hidden_size:
            raise ValueError(f"Eagle3Draft.project: expected last dim {3 * self.config.hidden_size}, "
                             f"got {target_hidden_states.shape[-1]}")
        return self.fc(target_hidden_states)

    def forward(self, hidden_states: Tensor, input_ids: Tensor, *, embed_tokens: nn.Module,
                position_ids: Tensor, attention_mask: Tensor | None = None,
                past_key_value: LayerKV | None = None, last: int | None = None,
                selected: Tensor | None = None) -> DraftOutput:
        """hidden_states [B, S, H] (projected target features, or the draft's previous pre-norm output);
        input_ids [B, S] tokens t+1 -> pre-norm output [B, S, H] (feed it back, or `compute_logits`; the last
        `last` rows only, or [N, H] at the `selected` [B, S] bool positions, when given)."""
        embeds = embed_tokens(input_ids).to(hidden_states.dtype)
        out, kv = self.midlayer(hidden_states, position_ids, attention_mask, past_key_value,
                                inputs_embeds=embeds, last=last, selected=selected)
        return DraftOutput(out, kv)
