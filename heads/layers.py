"""The one Llama-style decoder layer every draft head uses (EAGLE-1/2, EAGLE-3, MTP), and its parts.

Weight names follow Hugging Face Llama (`self_attn.q_proj`, `mlp.gate_proj`, `input_layernorm`,
`post_attention_layernorm`) so checkpoints trained elsewhere load by name. The layer takes everything the
runtime needs to draft trees explicitly:

- `position_ids` [B, S] int64 (RoPE positions; for a tree: prefix length + depth),
- `attention_mask`: additive float [B or 1, 1, S, past + S] (0 = visible, large negative = hidden) in the
  activations' dtype, or None for plain causal attention over past + S,
- `past_key_value`: a `LayerKV` (key/value [B, KVH, past, D], after RoPE) or None,

and returns `(output [B, S, H], LayerKV with past + S entries)`. The layer never keeps state; the caller owns
the cache and may trim it (`LayerKV.crop`) or keep accepted slots (`LayerKV.select`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from heads.config import HeadsConfig


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 like Hugging Face's LlamaRMSNorm. [..., H] -> [..., H]."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inverse_frequencies(config: HeadsConfig) -> tuple[Tensor, float]:
    """(inv_freq [head_dim // 2] float32, attention scaling) for the config's `rope_parameters`.

    The default type is computed here; scaled types (llama3, linear, yarn, ...) use transformers' own
    initialisers so the draft layer rotates exactly as the target does.
    """
    params = config.rope_parameters
    rope_type = params.get("rope_type", "default")
    dim = config.head_dim
    if rope_type == "default":
        base = float(params["rope_theta"])
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)), 1.0
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_parameters.rope_type: unsupported {rope_type!r}; "
                         f"known: {sorted(ROPE_INIT_FUNCTIONS)}")
    llama = LlamaConfig(hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
                        head_dim=dim, max_position_embeddings=config.max_position_embeddings,
                        rope_parameters=dict(params))
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](llama, None)
    return inv_freq.to(torch.float32), float(scaling)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for explicit positions: position_ids [B, S] -> (cos, sin) each [B, S, head_dim]."""

    def __init__(self, config: HeadsConfig) -> None:
        super().__init__()
        # A plain attribute, not a buffer: `module.to(bf16)` must not round the frequencies.
        self.inv_freq, self.scaling = rope_inverse_frequencies(config)

    def forward(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        if self.inv_freq.device != position_ids.device:
            self.inv_freq = self.inv_freq.to(position_ids.device)
        freqs = position_ids[..., None].to(torch.float32) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, heads, S, D] rotated by cos/sin [B, S, D]."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


@dataclass(frozen=True)
class LayerKV:
    """One draft layer's cache: key, value [B, KVH, T, D] (keys already rotated)."""

    key: Tensor
    value: Tensor

    @property
    def length(self) -> int:
        return self.key.shape[-2]

    def crop(self, length: int) -> LayerKV:
        """Keep the first `length` slots."""
        return LayerKV(self.key[..., :length, :], self.value[..., :length, :])

    def select(self, slots: Tensor) -> LayerKV:
        """Keep the slots `slots` [T'] (int64), in that order (e.g. prefix + accepted tree nodes)."""
        return LayerKV(self.key.index_select(-2, slots), self.value.index_select(-2, slots))


def visible_prefix(selected_row: Tensor) -> tuple[Tensor, Tensor]:
    """For one row's selected positions (bool [T]): (their indices [n], ascending; bool [n, span] where query i may
    see slot j <= its position), span = the last selected position + 1 (the keys any of them reads)."""
    where = selected_row.nonzero().squeeze(1)
    span = int(where[-1]) + 1
    return where, torch.arange(span, device=where.device)[None, :] <= where[:, None]


def additive_mask(allowed: Tensor, dtype: torch.dtype, device: torch.device | str | None = None) -> Tensor:
    """Boolean [q, kv] or [B, q, kv] -> additive float mask [1, 1, q, kv] or [B, 1, q, kv] in `dtype` on `device`
    (default: allowed's), 0 allowed, finfo.min masked: the one such conversion (draft layers, trees, training)."""
    device = allowed.device if device is None else device
    allowed = allowed.to(device)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None] if mask.ndim == 2 else mask[:, None]


def causal_mask(batch: int, query_length: int, past_length: int, dtype: torch.dtype,
                device: torch.device | None = None) -> Tensor:
    """Additive mask [B, 1, S, past + S]: query i sees every past slot and new slots j <= i."""
    allowed = torch.ones(query_length, past_length + query_length, dtype=torch.bool, device=device)
    return additive_mask(allowed.tril(diagonal=past_length), dtype).expand(batch, 1, -1, -1)


class Attention(nn.Module):
    """GQA self-attention with RoPE; q/k/v read `input_size` features (H, or 2H for EAGLE-3). With `qk_norm`
    (Qwen3, DFlash) queries and keys get a per-head RMSNorm (`q_norm`, `k_norm`) before RoPE."""

    def __init__(self, config: HeadsConfig, input_size: int, qk_norm: bool = False) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(input_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = qk_norm

    def key_value(self, x: Tensor, cos: Tensor, sin: Tensor) -> LayerKV:
        """Keys (normed, rotated) and values of x [B, S, input_size] -> LayerKV [B, KVH, S, D]: what a slot
        contributes to the cache (DFlash projects the target's context features with it)."""
        batch, length, _ = x.shape
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            k = self.k_norm(k)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return LayerKV(apply_rope(k.transpose(1, 2), cos, sin), v)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attention_mask: Tensor | None,
                past_key_value: LayerKV | None, last: int | None = None) -> tuple[Tensor, LayerKV]:
        """-> (output [B, S, H], cache with past + S slots); with `last`, the output of the last `last` rows only
        (every row still adds its keys and values to the cache: what feeding committed entries needs)."""
        batch, length, _ = x.shape
        rows = length if last is None else last
        if not 0 < rows <= length:
            raise ValueError(f"Attention: last must be in 1..{length}, got {last}")
        q = self.q_proj(x[:, length - rows:]).view(batch, rows, self.num_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
        q = apply_rope(q.transpose(1, 2), cos[:, length - rows:], sin[:, length - rows:])
        own = self.key_value(x, cos, sin)
        k, v = own.key, own.value
        if past_key_value is not None:
            k = torch.cat([past_key_value.key, k], dim=-2)
            v = torch.cat([past_key_value.value, v], dim=-2)
        new_kv = LayerKV(k, v)
        past = k.shape[-2] - length
        if attention_mask is None:
            attention_mask = causal_mask(batch, rows, past + length - rows, q.dtype, q.device)
        elif attention_mask.dim() != 4 or attention_mask.shape[-1] != past + length or \
                attention_mask.shape[-2] != length:
            raise ValueError(f"attention_mask: expected [B, 1, {length}, {past + length}] (past {past} + "
                             f"{length} new), got {list(attention_mask.shape)}")
        elif attention_mask.dtype == torch.bool:
            raise ValueError("attention_mask: pass an additive float mask (0 / finfo.min), not a bool mask")
        else:
            attention_mask = attention_mask[..., length - rows:, :]
        # grouped-query heads read their KV head in the kernel (no repeated copy of the whole cache per call)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask.to(q.dtype),
                                             scale=self.head_dim ** -0.5,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        out = out.transpose(1, 2).reshape(batch, rows, self.num_heads * self.head_dim)
        return self.o_proj(out), new_kv

    def forward_selected(self, x: Tensor, cos: Tensor, sin: Tensor, selected: Tensor) -> tuple[Tensor, LayerKV]:
        """Causal self-attention over x [B, T, input_size] (no cache, no padding mask: right padding only follows
        every position that counts) with outputs at the `selected` [B, T] bool positions only -> ([N, H] in row-major
        order of the selected positions, LayerKV of all T slots). What training needs where the loss reads a
        subset of the positions (the answers, not the prompts or the padding): every position adds its keys and
        values, only the selected ones pay for queries, attention rows and o_proj (and, in DecoderLayer, the MLP)."""
        kv = self.key_value(x, cos, sin)
        q = self.q_proj(x[selected]).view(-1, self.num_heads, self.head_dim)  # [N, heads, D]
        if self.qk_norm:
            q = self.q_norm(q)
        q = apply_rope(q.transpose(0, 1)[None], cos[selected][None], sin[selected][None])[0]  # [heads, N, D]
        counts = selected.sum(1).tolist()
        outs, start = [], 0
        for row, count in enumerate(counts):  # each row attends over its own keys up to its last selected position
            if not count:
                continue
            allowed = visible_prefix(selected[row])[1]  # [count, span]
            span = allowed.shape[1]
            out = F.scaled_dot_product_attention(q[None, :, start:start + count], kv.key[row:row + 1, :, :span],
                                                 kv.value[row:row + 1, :, :span], attn_mask=allowed[None, None],
                                                 scale=self.head_dim ** -0.5,
                                                 enable_gqa=self.num_heads != self.num_kv_heads)
            outs.append(out[0].transpose(0, 1).reshape(count, self.num_heads * self.head_dim))
            start += count
        if not outs:
            return self.o_proj(q.new_zeros(0, self.num_heads * self.head_dim)), kv
        return self.o_proj(torch.cat(outs)), kv


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). [..., H] -> [..., H]."""

    def __init__(self, config: HeadsConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Llama-style pre-norm decoder layer in three variants (`mode`):

    - "llama": input_layernorm -> attention -> residual -> post_attention_layernorm -> MLP -> residual
      (MTP blocks; equal to transformers' LlamaDecoderLayer).
    - "eagle": as "llama" but without input_layernorm (EAGLE-1/2 layer 0).
    - "eagle3": attention reads cat(input_layernorm(inputs_embeds), hidden_norm(hidden_states)) = 2H
      features; the residual is the un-normalised hidden_states (EAGLE-3 `midlayer`), or hidden_norm(hidden_states)
      with config.norm_before_residual (speculators' variant).

    `qk_norm=True` adds Qwen3's per-head q/k RMSNorm ("llama" + qk_norm = a Qwen3 decoder layer, DFlash's).
    """

    MODES = ("llama", "eagle", "eagle3")

    def __init__(self, config: HeadsConfig, mode: str = "llama", qk_norm: bool = False) -> None:
        super().__init__()
        if mode not in self.MODES:
            raise ValueError(f"DecoderLayer mode: expected one of {self.MODES}, got {mode!r}")
        self.mode = mode
        hidden = config.hidden_size
        self.self_attn = Attention(config, 2 * hidden if mode == "eagle3" else hidden, qk_norm=qk_norm)
        self.mlp = MLP(config)
        if mode != "eagle":
            self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        if mode == "eagle3":
            self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.norm_before_residual = mode == "eagle3" and config.norm_before_residual
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)

    def forward(self, hidden_states: Tensor, position_ids: Tensor, attention_mask: Tensor | None = None,
                past_key_value: LayerKV | None = None, inputs_embeds: Tensor | None = None,
                last: int | None = None, selected: Tensor | None = None) -> tuple[Tensor, LayerKV]:
        """hidden_states [B, S, H], position_ids [B, S] -> (output [B, S, H], LayerKV [B, KVH, past+S, D]).

        `inputs_embeds` [B, S, H] is required in mode "eagle3" and refused otherwise. `last`: compute the output
        of the last `last` rows only ([B, last, H]); the others only add their keys and values to the cache, so
        feeding n committed entries costs their K/V projections, not n attention + MLP rows. `selected` [B, S]
        bool (causal, no cache or mask): the output at those positions only, [N, H] in row-major order
        (Attention.forward_selected; training, where the loss reads the answers' positions).
        """
        if position_ids.shape != hidden_states.shape[:2]:
            raise ValueError(f"position_ids: expected shape {list(hidden_states.shape[:2])}, "
                             f"got {list(position_ids.shape)}")
        residual = hidden_states
        if self.mode == "eagle3":
            if inputs_embeds is None:
                raise ValueError("DecoderLayer(mode='eagle3') needs inputs_embeds")
            normed = self.hidden_norm(hidden_states)
            residual = normed if self.norm_before_residual else hidden_states
            x = torch.cat([self.input_layernorm(inputs_embeds), normed], dim=-1)
        elif inputs_embeds is not None:
            raise ValueError(f"DecoderLayer(mode={self.mode!r}) takes no inputs_embeds")
        elif self.mode == "llama":
            x = self.input_layernorm(hidden_states)
        else:
            x = hidden_states
        cos, sin = self.rotary(position_ids, x.dtype)
        if selected is not None:
            if attention_mask is not None or past_key_value is not None or last is not None:
                raise ValueError("DecoderLayer: `selected` runs plain causal attention without a cache, a mask or "
                                 "`last`")
            if selected.shape != hidden_states.shape[:2] or selected.dtype != torch.bool:
                raise ValueError(f"selected: expected a bool tensor of shape {list(hidden_states.shape[:2])}, "
                                 f"got {selected.dtype} {list(selected.shape)}")
            attn, new_kv = self.self_attn.forward_selected(x, cos, sin, selected)
            hidden_states = residual[selected] + attn
            return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states)), new_kv
        attn, new_kv = self.self_attn(x, cos, sin, attention_mask, past_key_value, last)
        hidden_states = residual[:, residual.shape[1] - attn.shape[1]:] + attn
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states, new_kv


def context_key_value(layer: DecoderLayer, context: Tensor, position_ids: Tensor) -> LayerKV:
    """Keys/values a layer's attention makes of `context` [B, C, H] (already normalised: DFlash's
    hidden_norm(fc(target features))) at `position_ids` [B, C]: the context part of that layer's cache."""
    cos, sin = layer.rotary(position_ids, context.dtype)
    return layer.self_attn.key_value(context, cos, sin)
