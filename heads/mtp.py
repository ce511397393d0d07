"""Multi-token prediction modules in the DeepSeek-V3 shape.

Alignment: depth d (0-based) takes h_d at position t (h_0 = target hidden_states[-1] at t; h_{d+1} = the
output of depth d) and the embedding of token t+d+1, and predicts token t+d+2 via its own final norm and the
target's LM head (passed as `lm_head=`, never saved).

Per depth (`layers.{d}`): h' = eh_proj(cat(enorm(embed), hnorm(h))) (2H -> H, no bias) -> one Llama-style
decoder block (`block`, with input norm) -> output h_{d+1}; logits = lm_head(norm(h_{d+1})).
Each depth owns its decoder cache (a LayerKV); positions are those of the input token rows.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from heads.base import DraftOutput, HeadsModule
from heads.config import HeadsConfig
from heads.layers import DecoderLayer, LayerKV, RMSNorm


class MTPLayer(nn.Module):
    """One MTP depth: enorm, hnorm, eh_proj, block, norm."""

    def __init__(self, config: HeadsConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.enorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = DecoderLayer(config, mode="llama")
        self.norm = RMSNorm(hidden, config.rms_norm_eps)


class MTPHeads(HeadsModule, kind="mtp"):
    """`mtp_num_depths` MTP modules sharing the target's embedding and LM head."""

    def __init__(self, config: HeadsConfig) -> None:
        if config.kind != "mtp":
            raise ValueError(f"MTPHeads needs kind 'mtp', got {config.kind!r}")
        super().__init__(config)
        self.layers = nn.ModuleList([MTPLayer(config) for _ in range(config.mtp_num_depths)])

    @property
    def num_depths(self) -> int:
        return self.config.mtp_num_depths

    def forward(self, hidden_states: Tensor, input_ids: Tensor, *, depth: int, embed_tokens: nn.Module,
                position_ids: Tensor, attention_mask: Tensor | None = None,
                past_key_value: LayerKV | None = None, last: int | None = None) -> DraftOutput:
        """Depth `depth`: h_d [B, S, H] and tokens t+d+1 [B, S] -> h_{d+1} [B, S, H] (+ that depth's cache; the last
        `last` rows only, when given: heads.layers.DecoderLayer.forward)."""
        if not 0 <= depth < self.num_depths:
            raise ValueError(f"MTPHeads: depth must be in [0, {self.num_depths}), got {depth}")
        layer = self.layers[depth]
        embeds = embed_tokens(input_ids).to(hidden_states.dtype)
        x = layer.eh_proj(torch.cat([layer.enorm(embeds), layer.hnorm(hidden_states)], dim=-1))
        out, kv = layer.block(x, position_ids, attention_mask, past_key_value, last=last)
        return DraftOutput(out, kv)

    def compute_logits(self, hidden_states: Tensor, *, depth: int, lm_head: nn.Module) -> Tensor:
        """h_{d+1} [..., H] -> logits [..., V] for token t+d+2."""
        return lm_head(self.layers[depth].norm(hidden_states))
