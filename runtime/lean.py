"""A lean decode/verify forward for Llama-family targets (Llama, Mistral without a window, Qwen2, Qwen3) in bfloat16
or float32 on a CPU: the same weights, the same kernels and the same torch ops per row as transformers' forward,
without its module machinery.

Why: with the AVX512-BF16 dot panels a bf16 decode step of SmolLM2-135M spent 11 ms in the products and 1.4 ms in
attention, and ~7.5 ms elsewhere: transformers' modules, its mask preparation, a `torch.cat` of every layer's
keys and values per step (the DynamicCache grows by concatenation), three product calls where one would do. This
forward runs, per layer: the model's own input norm; ONE panel product for q, k and v (their panels concatenated
once; each module keeps a view of its part, so no weight is copied); the model's own rotary function; the new keys
and values written in place into a cache buffer with room to grow (the DynamicCache layers hold views of it, so
compaction and crops work as before); `kernels.row_attention`; the output product; the post-attention norm; ONE
product for gate and up; the activation per row; the down product. It serves decode steps and verifies (1 to 64 rows
per sequence, batches of sequences), never the prefill, which keeps the model's own forward.

Exactness: every op is the reference's op on the same values, per row: the panel products and the row attention
are batch-invariant, norms, rotary and residual adds are row-wise, and the activation runs on each row's own slice
(so no row takes a vector loop's scalar tail that another call would not). The load-time verify check compares this
forward's logits with transformers' forward, one-token steps and a verify, bit for bit, and turns it off (in one line)
where they differ (runtime.verify_check).

float32 (session 67): exact decoding keeps transformers' numbers, where a verify differs from one-token steps in the
last bits (torch's sdpa sums a block of query rows together), so there the layers call the model's own attention
function (`attention="model"`: sdpa with the same additive mask and GQA switch, on the keys and values written in
place) and hand the activation the gate product as one block, as the model's MLP does; the check then compares steps
AND a verify with transformers' forward bit for bit (runtime.verify_check.lean_matches). What remains saved:
the torch.cat of every layer's whole cache per step, mask preparation, module calls, the fused q/k/v and gate/up
products. SmolLM2-135M, float32, one thread, KV 256: a plain step 1.18x faster, verifies of 2-5 tokens 1.16-1.21x.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from runtime import kernels

# decoder layers whose forward this module reproduces op for op (transformers 5.x)
LAYER_CLASSES = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")
_PANELS = kernels.PANELS_ATTR
# how a layer attends: "rows", the row kernel (batch-invariant: a verify gives its one-token steps' bits; bf16, and
# float32 answers); "model", the model's own attention function on the same tensors (float32 exact decoding: its
# logits are transformers' forward's bit for bit, verifies included, while the keys and values are still written in
# place and the modules' machinery is skipped)
ATTENTION_MODES = ("rows", "model")


@dataclass
class LeanOutput:
    """What TargetModel reads from a forward: logits [B, n, V] and hidden_states (HF indexing: [0] embeddings,
    [i] output of layer i - 1, [-1] the final norm's output; entries not asked for are None)."""

    logits: torch.Tensor
    hidden_states: list[torch.Tensor | None] | dict[int, torch.Tensor]  # a dict from HiddenCapture


def lean_unavailable(model: nn.Module, float32: bool = False, attention: str = "rows") -> str:
    """Why the lean forward cannot serve `model` ('' when it can): a bf16 Llama-family model on a CPU (float32 too
    with `float32`), no sliding window, SiLU MLP, every Linear on the panel kernel, the row attention kernel built.

    float32 with the row kernel is for answering, not for exact decoding: the row kernel sums a row's attention in
    another order than torch's sdpa, so logits differ from transformers' forward in the last bits (a near-tie can
    flip, as between any two engines); data.engines.RuntimeEngine takes it for data, where it answers ~1.2x faster
    (the keys and values written in place instead of a torch.cat of the whole cache per layer and step; the row
    attention kernel). Exact float32 decoding takes `attention="model"` (the model's own attention function, known
    for sdpa, eager and the registered ones), transformers' numbers bit for bit."""
    config = model.config.get_text_config()
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if base is None or layers is None or not all(hasattr(base, name) for name in ("embed_tokens", "norm", "rotary_emb")):
        return f"{type(model).__name__} is not a Llama-family causal LM (model.model.layers / norm / rotary_emb)"
    kinds = {type(layer).__name__ for layer in layers}
    if not kinds <= set(LAYER_CLASSES):
        return f"decoder layers {sorted(kinds)} are not among {list(LAYER_CLASSES)}"
    dtypes = (torch.bfloat16, torch.float32) if float32 else (torch.bfloat16,)
    if model.dtype not in dtypes or model.device.type != "cpu":
        wanted = "bfloat16 or float32" if float32 else "bfloat16"
        return f"the lean forward serves {wanted} on a CPU (this target: {model.dtype} on {model.device})"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True) is not False:
        return "sliding-window attention (the masks of the model's own forward serve it)"
    if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "pretraining_tp", 1) != 1:
        return f"hidden_act {getattr(config, 'hidden_act', None)!r} / pretraining_tp: only silu and tp 1"
    if kernels.library() is None:
        return f"the kernels are unavailable ({kernels.unavailable_reason()})"
    implementation = getattr(model.config, "_attn_implementation", None)
    if attention == "model" and implementation not in ALL_ATTENTION_FUNCTIONS and implementation != "eager":
        return f"attention implementation {implementation!r}: the model's own attention function is not known here"
    linears = [model.get_output_embeddings()]
    for layer in layers:
        attention, mlp = layer.self_attn, layer.mlp
        linears += [attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj, mlp.gate_proj,
                    mlp.up_proj, mlp.down_proj]
    missing = [linear for linear in linears if _PANELS not in linear.__dict__]
    if missing:
        return "not every Linear layer runs on the panel kernel (--weight_layout with +panels)"
    return ""


def _product(h: torch.Tensor, panels: torch.Tensor, width: int, bias: torch.Tensor | None,
             parts: list[tuple[nn.Linear, int]]) -> torch.Tensor:
    """h [M, K] times the weights of `parts` (each Linear with its first output column), [M, width]: on the panel
    kernel, or, for float32 rows beyond PANEL_MAX_ROWS, on the BLAS, module by module (as runtime.layout's Linear
    forward does there, 1.5-2x faster than the panels at 64 rows; the padding columns are then left unwritten and
    never read)."""
    if h.dtype != torch.float32 or h.shape[0] <= kernels.PANEL_MAX_ROWS:
        return kernels.panel_product(h, panels, width, bias)
    if len(parts) == 1:
        return nn.functional.linear(h, parts[0][0].weight, parts[0][0].bias)
    out = h.new_empty(h.shape[0], width)
    for module, first in parts:
        out[:, first:first + module.out_features] = nn.functional.linear(h, module.weight, module.bias)
    return out


def _fused(modules: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None, list[tuple[int, int]]]:
    """One panel tensor for several Linear layers of the same input (q/k/v, gate/up), their panels concatenated along
    the output panels and each module's own entry replaced by a view of its part (no second copy); the fused bias
    (zeros where a module has none, None when none has one) and each module's (first column, out_features)."""
    panels = [module.__dict__[_PANELS] for module in modules]
    width = _columns_per_panel(panels[0])
    fused = torch.cat(panels)
    spans, first, biases = [], 0, []
    for module, part in zip(modules, panels, strict=True):
        count = part.shape[0]
        module.__dict__[_PANELS] = fused[first // width:first // width + count]
        spans.append((first, module.out_features))
        bias = module.bias.detach().float() if module.bias is not None else torch.zeros(module.out_features)
        biases.append(torch.cat([bias, bias.new_zeros(count * width - module.out_features)]))
        first += count * width
    has_bias = any(module.bias is not None for module in modules)
    return fused, (torch.cat(biases).contiguous() if has_bias else None), spans


class _Layer:
    """One decoder layer's lean forward (see the module docstring)."""

    def __init__(self, layer: nn.Module, attention_mode: str = "rows", config=None):
        attention, mlp = layer.self_attn, layer.mlp
        self.module, self.attention_mode, self.config = attention, attention_mode, config
        self.eager = getattr(sys.modules[type(attention).__module__], "eager_attention_forward", None)
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.q_norm, self.k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
        self.rotary = sys.modules[type(attention).__module__].apply_rotary_pos_emb
        self.rotate_half = sys.modules[type(attention).__module__].rotate_half
        self.head_dim, self.scaling = attention.head_dim, attention.scaling
        qkv = [attention.q_proj, attention.k_proj, attention.v_proj]
        self.qkv, self.qkv_bias, self.qkv_spans = _fused(qkv)
        self.qkv_width = _padded(self.qkv)
        self.qkv_parts = [(module, first) for module, (first, _) in zip(qkv, self.qkv_spans, strict=True)]
        self.gate_up, self.gate_up_bias, self.gate_up_spans = _fused([mlp.gate_proj, mlp.up_proj])
        self.gate_up_width = _padded(self.gate_up)
        self.gate_up_parts = [(module, first) for module, (first, _) in
                              zip((mlp.gate_proj, mlp.up_proj), self.gate_up_spans, strict=True)]
        self.o_parts, self.down_parts = [(attention.o_proj, 0)], [(mlp.down_proj, 0)]
        self.act = mlp.act_fn
        self.o_panels, self.o_bias = _panels_and_bias(attention.o_proj)
        self.down_panels, self.down_bias = _panels_and_bias(mlp.down_proj)
        (_, q_out), (k0, _), _ = self.qkv_spans
        # q and k rotated by one pair of elementwise ops where k's columns follow q's (no norm between them)
        self.joint_rotary = self.q_norm is None and k0 == q_out
        self.keys: torch.Tensor | None = None  # cache buffers [B, Hkv, capacity, D]; the cache layer holds views
        self.values: torch.Tensor | None = None

    def _holds(self, cache_layer) -> bool:
        """Whether the cache layer's tensors are views of this layer's buffers (its first rows, all their heads)."""
        held, values = cache_layer.keys, cache_layer.values
        return (self.keys is not None and held.data_ptr() == self.keys.data_ptr()
                and held.stride() == self.keys.stride() and held.shape[0] <= self.keys.shape[0]
                and held.shape[1] == self.keys.shape[1] and values.data_ptr() == self.values.data_ptr()
                and values.stride() == self.values.stride())

    def _append(self, cache_layer, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write key/value [B, Hkv, n, D] after the cache layer's slots, in place where its tensors are views of this
        layer's buffers with room left; otherwise (after a prefill or a batch's stacking) copy them into new buffers
        with room to grow. The cache layer then holds views [B, Hkv, L + n, D]."""
        held, length, n = cache_layer.keys, cache_layer.keys.shape[-2], key.shape[-2]
        rows = held.shape[0]
        if not (self._holds(cache_layer) and length + n <= self.keys.shape[-2]):
            capacity = max(2 * (length + n), length + n + 256)
            self.keys = held.new_empty(*held.shape[:2], capacity, held.shape[-1])
            self.values = held.new_empty(*cache_layer.values.shape[:2], capacity, cache_layer.values.shape[-1])
            self.keys[:, :, :length] = held
            self.values[:, :, :length] = cache_layer.values
        self.keys[:rows, :, length:length + n] = key
        self.values[:rows, :, length:length + n] = value
        cache_layer.keys = self.keys[:rows, :, :length + n]
        cache_layer.values = self.values[:rows, :, :length + n]
        return cache_layer.keys, cache_layer.values

    def select_rows(self, cache_layer, rows: list[int]) -> None:
        """Keep rows `rows` (increasing) of the cache layer, moved up in place inside this layer's buffers (the caller
        checked `_holds`): one copy of the kept rows, where selecting by index would copy them out of the buffers
        and the next step copy them into new ones."""
        length = cache_layer.keys.shape[-2]
        for new, old in enumerate(rows):
            if new != old:  # rows increase, so row `old` >= `new` is still intact when it is copied
                self.keys[new, :, :length] = self.keys[old, :, :length]
                self.values[new, :, :length] = self.values[old, :, :length]
        cache_layer.keys = self.keys[:len(rows), :, :length]
        cache_layer.values = self.values[:len(rows), :, :length]

    def _attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor | None,
                mask: torch.Tensor | None) -> torch.Tensor:
        """[B, n, Hq, D]: the row kernel over the allowed keys, or the model's own attention function (looked up per
        call, so a wrapper the caller installed around the model's forward applies here too) with the additive mask,
        as the model's attention module calls it."""
        if self.attention_mode == "rows":
            return kernels.row_attention(query, keys, values, allowed, self.scaling)
        implementation = self.config._attn_implementation
        function = self.eager if implementation == "eager" else ALL_ATTENTION_FUNCTIONS[implementation]
        return function(self.module, query, keys, values, mask, dropout=0.0, scaling=self.scaling)[0]

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache_layer,
                 allowed: torch.Tensor | None, mask: torch.Tensor | None = None) -> torch.Tensor:
        batch, n, width = x.shape
        h = self.input_norm(x).view(batch * n, width)
        qkv = _product(h, self.qkv, self.qkv_width, self.qkv_bias, self.qkv_parts).view(batch, n, -1)
        (q0, q_out), (k0, k_out), (v0, v_out) = self.qkv_spans
        heads = (batch, n, -1, self.head_dim)
        value = qkv[..., v0:v0 + v_out].view(heads).transpose(1, 2)
        if self.joint_rotary:  # the same elementwise ops on q and k at once: the same bits, half the calls
            both = qkv[..., q0:k0 + k_out].view(heads).transpose(1, 2)
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            both = (both * cos) + (self.rotate_half(both) * sin)
            query_heads = q_out // self.head_dim
            query, key = both[:, :query_heads], both[:, query_heads:]
        else:
            query, key = qkv[..., q0:q0 + q_out].view(heads), qkv[..., k0:k0 + k_out].view(heads)
            if self.q_norm is not None:
                query, key = self.q_norm(query), self.k_norm(key)
            query, key = self.rotary(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
        keys, values = self._append(cache_layer, key, value)
        attended = self._attend(query, keys, values, allowed, mask)  # [B, n, Hq, D]
        x = x + _product(attended.view(batch * n, -1), self.o_panels, width, self.o_bias,
                         self.o_parts).view(batch, n, width)
        h = self.post_norm(x).view(batch * n, width)
        gate_up = _product(h, self.gate_up, self.gate_up_width, self.gate_up_bias, self.gate_up_parts)
        (g0, g_out), (u0, u_out) = self.gate_up_spans
        gate = gate_up[:, g0:g0 + g_out]
        # rows: each row's own slice, so the activation's vector loop and scalar tail fall on the same columns for
        # every row; model: one contiguous block, as the model's MLP hands its activation the gate product (the tail
        # then falls where it falls there: a vector and a scalar exp round differently)
        activated = self.act(gate if self.attention_mode == "rows" else gate.contiguous()) * gate_up[:, u0:u0 + u_out]
        return x + _product(activated, self.down_panels, width, self.down_bias, self.down_parts).view(batch, n, width)


def _panels_and_bias(module: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    bias = None if module.bias is None else module.bias.detach().float().contiguous()
    return module.__dict__[_PANELS], bias


def _columns_per_panel(panels: torch.Tensor) -> int:
    """8 for the panels [P, K, 8], 16 for the dot panels [P, K/2, 16, 2]."""
    return panels.shape[-2] if panels.ndim == 4 else panels.shape[-1]


def _padded(panels: torch.Tensor) -> int:
    """Output columns a panel tensor computes (padding included)."""
    return panels.shape[0] * _columns_per_panel(panels)


class LeanForward:
    """The lean forward of one laid-out bf16 Llama-family model (build it after the weight layout; see
    `lean_unavailable`). Call it with a DynamicCache whose layers hold the committed slots (plus earlier pending
    ones), input_ids and positions [B, n], allowed keys [B, n, L + n] (bool or uint8, slot order) for the row kernel
    (`attention` "rows"), or the additive mask for the model's own attention function ("model")."""

    def __init__(self, model: nn.Module, float32: bool = False, attention: str = "rows"):
        if attention not in ATTENTION_MODES:
            raise ValueError(f"lean forward: attention must be one of {ATTENTION_MODES}, got {attention!r}")
        why_not = lean_unavailable(model, float32, attention)
        if why_not:
            raise ValueError(f"lean forward: {why_not}")
        self.attention = attention
        base = model.model
        self.embed, self.norm, self.rotary_emb = base.embed_tokens, base.norm, base.rotary_emb
        self.lm_head = model.get_output_embeddings()
        self.layers = [_Layer(layer, attention, model.config)
                       for layer in base.layers[:model.config.get_text_config().num_hidden_layers]]
        first = base.layers[0].self_attn.q_proj
        self._probe = (first, first.__dict__[_PANELS], self.lm_head, self.lm_head.__dict__[_PANELS])

    def current(self) -> bool:
        """Whether the model still has the panels this forward was built on (a weight layout change replaces or drops
        them; the caller then builds a new one)."""
        first, view, head, panels = self._probe
        return first.__dict__.get(_PANELS) is view and head.__dict__.get(_PANELS) is panels

    @torch.inference_mode()
    def select_rows(self, cache, rows: list[int]) -> bool:
        """Keep rows `rows` (increasing indices) of `cache` in place inside this forward's buffers, True; False (nothing
        done) where some layer of the cache is not held in them (the caller then selects the usual way)."""
        pairs = list(zip(self.layers, cache.layers, strict=False))
        if len(pairs) != len(cache.layers) or not all(layer._holds(cache_layer) for layer, cache_layer in pairs):
            return False
        for layer, cache_layer in pairs:
            layer.select_rows(cache_layer, rows)
        return True

    @torch.inference_mode()
    def __call__(self, cache, input_ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor | None,
                 hidden_state_indices: tuple[int, ...] = (), logits_to_keep: int = 0,
                 attention_mask: torch.Tensor | None = None) -> LeanOutput:
        """allowed [B, n, L + n] (the row kernel's keys) or, with attention "model", attention_mask: the additive
        [B, 1, n, L + n] mask the model's own forward would be given."""
        if (attention_mask if self.attention == "model" else allowed) is None:
            raise ValueError(f"lean forward ({self.attention} attention): needs "
                             f"{'attention_mask' if self.attention == 'model' else 'allowed'}")
        count = len(self.layers) + 1
        wanted = {index % count for index in hidden_state_indices}
        hidden: list[torch.Tensor | None] = [None] * count
        x = self.embed(input_ids)
        cos, sin = self.rotary_emb(x, positions)
        if self.attention == "rows":
            allowed = allowed.to(torch.uint8).contiguous()
        if 0 in wanted:
            hidden[0] = x
        for index, (layer, cache_layer) in enumerate(zip(self.layers, cache.layers, strict=False)):
            x = layer(x, cos, sin, cache_layer, allowed, attention_mask)
            if index + 1 in wanted and index + 1 < count - 1:
                hidden[index + 1] = x
        x = self.norm(x)
        if count - 1 in wanted:
            hidden[count - 1] = x
        logits = self.lm_head(x[:, -logits_to_keep:] if logits_to_keep else x)
        return LeanOutput(logits=logits, hidden_states=hidden)
