"""The target adapter: the ONLY code that touches transformers internals (cache class, mask format, kwargs).

`TargetModel` wraps an unmodified Hugging Face causal LM and keeps its KV cache. The cache always holds the
*committed prefix* (every committed token except the last one, the "root") followed, between a forward and
the next `commit`, by the slots of the tree nodes just forwarded:

    prefill(prompt)                       cache = prompt                      (logits of the last token)
    forward(tokens, tree)                 cache = prefix + tree nodes         (logits of every node)
    commit(keep)                          cache = prefix + kept nodes         (one compaction routine)

A batch of B sequences (`prefill_rows`, `forward_rows`, `commit_rows`, `select_rows`) keeps one cache
[B, H, slots, D]: row b's committed prefix in slots 0..row_lengths[b]-1, holes after it up to the longest row,
and each forward's tree nodes after the `slots` committed-region slots. The per-row 4D mask hides holes and
padding (runtime/masks.rows_attention_mask), position_ids are per row, and the one compaction routine moves each
row's kept nodes right after its own prefix (runtime/kv_cache.compact_rows). One sequence is the batch of one
without holes, through the same calls.

Every forward passes an additive float 4D mask in the model dtype and explicit `position_ids =
prefix_len + depth` (omitting either is silently wrong). Sliding-window models get a windowed mask per
layer type (a dict keyed by `config.layer_types` for hybrid models, one windowed tensor for Mistral-style
configs) and a `DynamicCache()` without config, which keeps every key so rejected slots can be dropped.
Only `sdpa` and `eager` attention are accepted: flash-attention kernels ignore custom 4D masks and flex
attention breaks with them on CPU.

Modes (chosen per loaded model by the load-time self-check, runtime/verify_check.py):
- "tree": the above, any candidate tree in one forward;
- "chain": no custom mask; the model's own causal path (a 2D attention mask of ones, position_ids when the
  forward takes them) over a chain of draft tokens, and rollback by cropping the cache (the accepted nodes of
  a chain are always its first ones). For models whose attention ignores or rejects 4D masks;
- "plain": the chain path one token at a time, nothing ever rolled back (plain decoding only).
A model error inside a forward or the compaction is re-raised as `TargetError` (a ValueError: the CLIs print
it as one line, exit code 2) naming the model, its class and the step.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from heads.loading import fast_bf16
from runtime import kernels
from runtime.kv_cache import compact_rows
from runtime.lean import LeanForward, LeanOutput, lean_unavailable
from runtime.masks import rows_attention_mask, tree_attention_mask
from runtime.tree import Tree

SUPPORTED_ATTENTION = ("sdpa", "eager")
MODES = ("tree", "chain", "plain")
_LAYER_TYPES_WITH_WINDOW = {"full_attention": False, "sliding_attention": True}


_FORCE_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"
# a grouped prefill (TargetModel.group_prefill): at most this many prompts, of at most this many padded tokens in all,
# per forward (its logits are kept at every prompt's last position for every row: prompts^2 rows of the LM head)
PREFILL_GROUP_PROMPTS, PREFILL_GROUP_TOKENS = 8, 1024


@contextmanager
def _grouped_kv_in_kernel(enabled: bool) -> Iterator[None]:
    """transformers' sdpa integration copies every grouped K/V head out to all its query heads (a copy of the whole
    cache, per layer and forward) whenever a mask is passed, because the fast CUDA kernels take no mask with GQA;
    torch's CPU kernel takes both, so on CPU the masked verify forward asks the kernel for GQA instead (transformers
    reads the switch on every call). Measured on SmolLM2-135M (9 query heads over 3 KV heads, KV 256, panel
    weights): verifying 2 / 4 / 8 tokens 53 / 67 / 87 ms -> 49 / 62 / 80 ms; same values (tests: tree forward ==
    per-path forwards, greedy identity)."""
    if not enabled or os.environ.get(_FORCE_GQA) is not None:
        yield
        return
    os.environ[_FORCE_GQA] = "1"
    try:
        yield
    finally:
        os.environ.pop(_FORCE_GQA, None)


@contextmanager
def _sdpa_replaced(enabled: bool, wrap: Callable) -> Iterator[None]:
    """Around one of our forwards, transformers' sdpa entry replaced by `wrap(original)` (restored afterwards); a
    no-op when not enabled or when that wrapper is already installed."""
    original = ALL_ATTENTION_FUNCTIONS.get("sdpa")
    if not enabled or original is None or getattr(original, "_specheads_wrap", None) is wrap:
        yield
        return
    replacement = wrap(original)
    replacement._specheads_wrap = wrap
    ALL_ATTENTION_FUNCTIONS["sdpa"] = replacement
    try:
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = original


def _sdpa_in_float32(original: Callable) -> Callable:
    """A bfloat16 model on a CPU without AVX512-BF16/AMX: torch's sdpa kernel emulates bfloat16 (283 us per layer
    for one query over 257 keys of SmolLM2-135M, one thread, against 55 us in float32), so around our own forwards
    transformers' sdpa entry is wrapped to widen q/k/v (and an additive mask) to float32 and round the output back
    once: 88 us with the copies, ~6 ms of a 46 ms decode step; a more exact softmax, not a less exact one."""
    def sdpa_in_float32(module, query, key, value, attention_mask, **kwargs):
        if attention_mask is not None and attention_mask.is_floating_point():
            attention_mask = attention_mask.float()
        out, weights = original(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)
        return out.to(query.dtype), weights

    return sdpa_in_float32


# attention arguments the row kernel does not implement: with any of them the model's own attention runs
_UNSUPPORTED_ATTENTION_KWARGS = ("softcap", "s_aux", "sinks", "position_bias")


def row_attention_applies(query: torch.Tensor, key: torch.Tensor, attention_mask, dropout: float = 0.0,
                          **kwargs) -> bool:
    """Whether `kernels.row_attention` computes this attention call exactly as asked: a decode or verify call (at
    most 64 query rows) on the CPU in float32 or bfloat16, with one additive mask for all heads, no dropout and none
    of softcapping, sinks or a position bias."""
    return (attention_mask is not None and attention_mask.is_floating_point() and attention_mask.ndim == 4
            and attention_mask.shape[1] == 1 and query.shape[2] <= kernels.ROW_ATTENTION_MAX_QUERIES
            and query.device.type == "cpu" and query.dtype in kernels.PANEL_DTYPES and key.dtype == query.dtype
            and not dropout and all(kwargs.get(name) is None for name in _UNSUPPORTED_ATTENTION_KWARGS)
            and kernels.library() is not None)


def _attention_by_rows(original: Callable) -> Callable:
    """Batch-invariant attention around our own forwards: every decode step and verify (up to 64 query rows; not the
    prefill, which plain and speculative decoding share) runs `kernels.row_attention`, which reduces each query row
    alone over the keys its mask allows, in slot order. So a k-token verify computes, row by row, the same bits as
    the one-token steps that would have produced the same tokens (the Linear layers are batch-invariant through the
    panel kernel, norms and rotary are per row): in bfloat16 a verified draft no longer flips a near-tie, and
    speculative output equals plain decoding's. Calls it does not implement (a long prefill, softcapping, sinks,
    ...) go to the model's own attention. The allowed keys of each mask are derived once per forward, not per
    layer (every layer of a forward gets the same mask object, one per layer type)."""
    allowed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(mask) -> (mask, its allowed keys [B, Q, L])

    def attention_by_rows(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        if not row_attention_applies(query, key, attention_mask, dropout, **kwargs):
            return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        if id(attention_mask) not in allowed:  # the mask is kept alive with it, so its id is not reused meanwhile
            allowed[id(attention_mask)] = (attention_mask, (attention_mask[:, 0] == 0).to(torch.uint8))
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return kernels.row_attention(query, key, value, allowed[id(attention_mask)][1], scale), None

    return attention_by_rows


class TargetError(ValueError):
    """A model error inside a target forward or KV compaction, as one line naming the model and the step."""


@dataclass(frozen=True)
class ForwardOutput:
    """What one target forward returns: logits and the requested hidden states at the forwarded tokens."""

    logits: torch.Tensor  # [n, V] (n = forwarded tokens, or 1 for prefill)
    hidden: dict[int, torch.Tensor]  # HF hidden_states index -> [n, H]


def context_limit(config) -> int | None:
    """The model's maximum number of positions (max_position_embeddings / n_positions), None if unknown."""
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def attention_windows(config) -> dict[str, int | None] | int | None:
    """Sliding windows by layer type: dict {layer_type: window or None} for models with `layer_types`,
    one window (int) for Mistral-style configs, None for full attention everywhere."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        unknown = sorted(set(layer_types) - set(_LAYER_TYPES_WITH_WINDOW))
        if unknown:
            raise ValueError(f"--model: layer types {unknown} are not supported by tree verification "
                             f"(supported: {sorted(_LAYER_TYPES_WITH_WINDOW)})")
        windows = {}
        for kind in dict.fromkeys(layer_types):
            if _LAYER_TYPES_WITH_WINDOW[kind] and not isinstance(window, int):
                raise ValueError(f"--model: layer type {kind!r} but config.sliding_window={window!r}")
            windows[kind] = window if _LAYER_TYPES_WITH_WINDOW[kind] else None
        return windows
    return window if isinstance(window, int) and window > 0 else None


def check_attention_backend(model: PreTrainedModel, flag: str = "--attn_implementation") -> str:
    """Raise unless the model runs an attention backend that honours custom additive 4D masks."""
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in SUPPORTED_ATTENTION:
        raise ValueError(f"{flag} {impl}: an attention backend that ignores custom masks (or breaks with them) "
                         f"cannot verify candidate trees; load the model with {flag} sdpa or eager")
    return impl


_FINAL_NORM_NAMES = ("norm", "final_layernorm", "ln_f", "final_layer_norm", "final_norm")


def hidden_state_modules(model: torch.nn.Module, num_layers: int) -> tuple[list[torch.nn.Module], torch.nn.Module] | None:
    """(decoder layers, final norm) of a transformers causal LM, or None where they are not found: the layer list
    is the one ModuleList of `num_layers` modules under the base model, the norm a module of a usual name beside it."""
    base = getattr(model, getattr(model, "base_model_prefix", "") or "model", None) or getattr(model, "model", None)
    if base is None:
        return None
    lists = [m for m in base.children() if isinstance(m, torch.nn.ModuleList) and len(m) == num_layers]
    norms = [getattr(base, name) for name in _FINAL_NORM_NAMES if isinstance(getattr(base, name, None), torch.nn.Module)]
    if len(lists) != 1 or not norms:
        return None
    return list(lists[0]), norms[0]


class HiddenCapture:
    """The hidden states {index: [B, n, H]} of one forward (transformers' indexing: index i < L is the input of
    decoder layer i, index L the final norm's output), caught by hooks on just those modules instead of
    output_hidden_states, which costs every step: measured on SmolLM2-135M (float32, KV 1,260, one thread) a
    1-token step asking for the last layer took 2.5-6 ms more (5-10%) than one asking for nothing; with the hook,
    nothing. `check` compares both ways once per set of indices on a short input; where they differ (a model whose
    layers are not what these hooks assume) output_hidden_states stays."""

    def __init__(self, model: torch.nn.Module, num_layers: int):
        self.modules = hidden_state_modules(model, num_layers)
        self.num_layers = num_layers
        self.checked: dict[tuple[int, ...], bool] = {}

    def usable(self, indices: tuple[int, ...]) -> bool | None:
        """True/False once checked for these indices; None before the check."""
        if self.modules is None or any(not -self.num_layers - 1 <= i <= self.num_layers for i in indices):
            return False
        return self.checked.get(indices)

    @contextmanager
    def catching(self, indices: tuple[int, ...]) -> Iterator[dict[int, torch.Tensor]]:
        layers, norm = self.modules
        caught: dict[int, torch.Tensor] = {}
        handles = []
        for index in indices:
            if index % (self.num_layers + 1) == self.num_layers:
                handles.append(norm.register_forward_hook(
                    lambda module, args, output, i=index: caught.__setitem__(i, output)))
            else:
                handles.append(layers[index % (self.num_layers + 1)].register_forward_pre_hook(
                    lambda module, args, kwargs, i=index: caught.__setitem__(
                        i, args[0] if args else kwargs["hidden_states"]), with_kwargs=True))
        try:
            yield caught
        finally:
            for handle in handles:
                handle.remove()


class TargetModel:
    """A causal LM plus its KV cache, driven with tree masks. Also used by the draft-model proposer."""

    def __init__(self, model: PreTrainedModel, flag: str = "--model", mode: str = "tree"):
        if mode not in MODES:
            raise ValueError(f"TargetModel mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.model = model
        self.flag = flag
        self.config = model.config.get_text_config()
        self.max_positions = context_limit(self.config)
        if mode == "tree":  # the chain path leaves masks (windows included) to the model itself
            check_attention_backend(model)
            self.windows = attention_windows(self.config)
        else:
            self.windows = None
        self._takes_positions = "position_ids" in inspect.signature(model.forward).parameters
        self.num_layers = int(self.config.num_hidden_layers)
        self.dtype = model.dtype
        self.device = model.device
        cpu_sdpa = self.device.type == "cpu" and getattr(model.config, "_attn_implementation", None) == "sdpa"
        self._gqa_in_kernel = cpu_sdpa
        self._float32_attention = cpu_sdpa and self.dtype in (torch.bfloat16, torch.float16) and not fast_bf16(self.device)
        # bfloat16 rounds a k-token verify's attention differently from one-token steps unless each row is reduced
        # alone: the row kernel makes verify == steps bit for bit (float32 keeps torch's faster sdpa)
        self._rows_attention = cpu_sdpa and self.dtype == torch.bfloat16 and kernels.library() is not None
        self._cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        # decode steps and verifies through runtime.lean (set by the load-time verify check when that forward gives
        # transformers' logits bit for bit on this model; rebuilt after a weight layout change)
        self.lean_wanted = False
        self.lean_attention = "rows"  # runtime.lean.ATTENTION_MODES: the row kernel, or the model's own attention
        # prefill_rows forwards prompts of similar lengths together, right-padded (products of more rows run faster,
        # but a row's bits then depend on its group: for answers, not for exact decoding; see _prefill_groups)
        self.group_prefill = False
        self._lean: LeanForward | None = None
        self._capture = HiddenCapture(model, self.num_layers)
        self.cache: DynamicCache | None = None
        self.row_lengths: list[int] = [0]  # committed tokens in the cache, per row (one row per sequence)
        self.slots = 0  # committed-region slots of the cache: the longest row (rows shorter than it have holes)
        self.num_pending = 0  # tree slots in the cache after the committed region (forwarded, not yet committed)

    @property
    def prefix_len(self) -> int:
        """Committed tokens in the cache of a single sequence (ValueError for a batch of several rows)."""
        if len(self.row_lengths) != 1:
            raise ValueError(f"prefix_len of a batch of {len(self.row_lengths)} rows: use row_lengths")
        return self.row_lengths[0]

    @property
    def batch_size(self) -> int:
        return len(self.row_lengths)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    def eos_token_ids(self) -> tuple[int, ...]:
        """EOS ids from the model's generation config (an int or a list there, as `model.generate` reads
        them), () if none."""
        eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if eos is None:
            return ()
        return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))

    def check_prompt(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Validate a prompt [T] (or [1, T]); returns it as int64 [T]."""
        if input_ids.ndim == 2 and input_ids.shape[0] == 1:
            input_ids = input_ids[0]
        if input_ids.ndim != 1:
            raise ValueError(f"input_ids: expected one sequence [T] or [1, T], got shape {tuple(input_ids.shape)}")
        if input_ids.numel() == 0:
            raise ValueError("prompt: empty (0 tokens); at least one token is needed")
        if self.max_positions is not None and input_ids.numel() > self.max_positions:
            raise ValueError(f"prompt: {input_ids.numel()} tokens is longer than the context of {self.flag} "
                             f"({self.max_positions} positions, max_position_embeddings)")
        return input_ids.long()

    def check_hidden_indices(self, indices: tuple[int, ...]) -> None:
        """HF hidden_states has num_layers + 1 entries: [0] embeddings, [i] output of layer i-1, [-1] final norm."""
        for index in indices:
            if not -(self.num_layers + 1) <= index <= self.num_layers:
                raise ValueError(f"hidden_state_indices: {index} out of range for a {self.num_layers}-layer "
                                 f"model (valid: {-(self.num_layers + 1)}..{self.num_layers})")

    def describe(self) -> str:
        """'--model NAME (ClassName)' for error lines."""
        name = getattr(self.model.config, "_name_or_path", "") or "(built in memory)"
        return f"{self.flag} {name} ({type(self.model).__name__})"

    def _check_mode(self, tree: Tree, start: int) -> None:
        if self.mode == "tree":
            return
        n = tree.num_nodes
        if not torch.equal(tree.parents[max(start, 1):], torch.arange(max(start, 1) - 1, n - 1)):
            raise ValueError(f"{self.describe()} runs in {self.mode} mode (no tree attention): drafts must be "
                             f"chains, got a tree with parents {tree.parents.tolist()[:16]}")
        if self.mode == "plain" and n - start > 1 and self.prefix_len > 0:
            raise ValueError(f"{self.describe()} runs in plain mode: one token per forward after the prompt, "
                             f"got {n - start}")

    def _mask(self, tree: Tree, start: int) -> torch.Tensor | dict[str, torch.Tensor]:
        if self.mode != "tree":  # the model's own causal mask; [1, kv_len] of ones says "no padding"
            return torch.ones(1, self.prefix_len + tree.num_nodes, dtype=torch.long, device=self.device)
        if isinstance(self.windows, dict):
            return {kind: tree_attention_mask(tree, self.prefix_len, self.dtype, start, window, self.device)
                    for kind, window in self.windows.items()}
        return tree_attention_mask(tree, self.prefix_len, self.dtype, start, self.windows, self.device)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, tree: Tree, start: int = 0, hidden_state_indices: tuple[int, ...] = (),
                logits_to_keep: int = 0) -> ForwardOutput:
        """Forward tree nodes start..N-1 (tokens [N - start]) in ONE call; nodes 0..start-1 must already be in
        the cache (forwarded earlier, not committed). Returns logits [N - start, V] (the last `logits_to_keep`
        rows if > 0) and hidden states {index: [N - start, H]}.
        """
        if self.cache is None:
            raise ValueError("forward before prefill: call prefill(prompt) first")
        if start != self.num_pending:
            raise ValueError(f"forward(start={start}) but {self.num_pending} tree nodes are in the cache")
        if tokens.shape != (tree.num_nodes - start,):
            raise ValueError(f"tokens: expected shape [{tree.num_nodes - start}], got {tuple(tokens.shape)}")
        positions = self.prefix_len + tree.depth[start:]  # [n]
        if self.max_positions is not None and int(positions.max()) >= self.max_positions:
            raise ValueError(f"position {int(positions.max())} is beyond the context of {self.flag} "
                             f"({self.max_positions} positions)")
        self.check_hidden_indices(hidden_state_indices)
        self._check_mode(tree, start)
        out = self._call(tokens[None], self._mask(tree, start), positions[None], hidden_state_indices, logits_to_keep)
        self.num_pending = tree.num_nodes
        return ForwardOutput(logits=out.logits[0], hidden={i: out.hidden_states[i][0] for i in hidden_state_indices})

    def _call(self, input_ids: torch.Tensor, mask, positions: torch.Tensor, hidden_state_indices: tuple[int, ...],
              logits_to_keep: int | torch.Tensor = 0):
        """The one call into the model: input_ids/positions [B, n], mask [B, 1, n, kv] (or per layer type)."""
        kwargs = {self._cache_kwarg: self.cache}
        if self.mode == "tree" or self._takes_positions:
            kwargs["position_ids"] = positions.to(self.device)
        step = "prefill" if self.slots == 0 else ("verify" if self.flag == "--model" else "draft")
        lean = self.lean_forward() if (self.slots > 0 and input_ids.shape[1] <= kernels.ROW_ATTENTION_MAX_QUERIES
                                       and not isinstance(mask, dict)) else None
        try:
            if lean is not None and lean.attention == "rows":
                return lean(self.cache, input_ids.to(self.device), positions.to(self.device), mask[:, 0] == 0,
                            hidden_state_indices, logits_to_keep)
            with _grouped_kv_in_kernel(self._gqa_in_kernel), _sdpa_replaced(self._float32_attention, _sdpa_in_float32), \
                    _sdpa_replaced(self._rows_attention and self.slots > 0, _attention_by_rows):
                if lean is not None:  # the model's own attention function, called as its modules would call it
                    return lean(self.cache, input_ids.to(self.device), positions.to(self.device), None,
                                hidden_state_indices, logits_to_keep, attention_mask=mask)
                if hidden_state_indices and self._hooks_serve(hidden_state_indices):
                    with self._capture.catching(hidden_state_indices) as caught:
                        out = self.model(input_ids=input_ids.to(self.device), attention_mask=mask, use_cache=True,
                                         logits_to_keep=logits_to_keep, **kwargs)
                    return LeanOutput(logits=out.logits, hidden_states={i: caught[i] for i in hidden_state_indices})
                return self.model(input_ids=input_ids.to(self.device), attention_mask=mask, use_cache=True,
                                  output_hidden_states=list(hidden_state_indices) or False,
                                  logits_to_keep=logits_to_keep, **kwargs)
        except Exception as error:  # any model failure becomes one line naming the model and the step
            raise TargetError(f"{self.describe()}: {step} forward of {input_ids.numel()} tokens at positions "
                              f"{int(positions.min())}..{int(positions.max())} failed ({self.mode} mode): "
                              f"{type(error).__name__}: {_first_line(error)}") from error

    def _hooks_serve(self, indices: tuple[int, ...]) -> bool:
        """Whether HiddenCapture gives these hidden states here: checked once per set of indices against
        output_hidden_states, bit for bit, on a 4-token forward into a cache of its own."""
        usable = self._capture.usable(indices)
        if usable is None:
            probe = torch.arange(4, device=self.device)[None] % self.vocab_size
            try:
                reference = self.model(input_ids=probe, use_cache=True, output_hidden_states=True,
                                       **{self._cache_kwarg: DynamicCache()})
                with self._capture.catching(indices) as caught:
                    self.model(input_ids=probe, use_cache=True, **{self._cache_kwarg: DynamicCache()})
                usable = all(i in caught and torch.equal(caught[i], reference.hidden_states[i]) for i in indices)
                why = "they differ from transformers' output_hidden_states"
            except Exception as error:  # any surprise: transformers' own path
                usable, why = False, f"{type(error).__name__}: {_first_line(error)}"
            if not usable:  # correct either way, but every step then pays for all the hidden states: say so once
                print(f"hidden states {list(indices)}: hooks not used ({why}); output_hidden_states serves them "
                      f"(slower)", file=sys.stderr)
            self._capture.checked[indices] = usable
        return usable

    def lean_forward(self) -> LeanForward | None:
        """The lean forward for this model's current weight layout when it is wanted and can serve (else None)."""
        if not self.lean_wanted or self.mode != "tree":
            return None
        if self._lean is None or not self._lean.current() or self._lean.attention != self.lean_attention:
            # a float32 target is served once a check wanted it (exact decoding: "model"; answers: "rows")
            float32, attention = self.dtype == torch.float32, self.lean_attention
            self._lean = None if lean_unavailable(self.model, float32, attention) else \
                LeanForward(self.model, float32, attention)
        return self._lean

    @torch.inference_mode()
    def forward_rows(self, tokens: list[torch.Tensor], trees: list[Tree],
                     hidden_state_indices: tuple[int, ...] = ()) -> list[ForwardOutput]:
        """Forward the tree of every row (tokens[b] [N_b] for trees[b]) in ONE call. Returns per row logits
        [N_b, V] and hidden states {index: [N_b, H]}. One row is `forward` itself."""
        if len(tokens) != self.batch_size or len(trees) != self.batch_size:
            raise ValueError(f"forward_rows: {len(tokens)} token rows and {len(trees)} trees for a batch of "
                             f"{self.batch_size} rows")
        if self.batch_size == 1:
            return [self.forward(tokens[0], trees[0], hidden_state_indices=hidden_state_indices)]
        if self.cache is None:
            raise ValueError("forward before prefill: call prefill_rows(prompts) first")
        if self.num_pending:
            raise ValueError(f"forward_rows with {self.num_pending} tree slots still in the cache: commit first")
        n = max(tree.num_nodes for tree in trees)
        input_ids = torch.zeros(self.batch_size, n, dtype=torch.long)  # [B, N]; padding is masked off
        positions = torch.tensor(self.row_lengths)[:, None].repeat(1, n)  # [B, N]; padding at the row's root position
        for b, (row, tree) in enumerate(zip(tokens, trees, strict=True)):
            if row.shape != (tree.num_nodes,):
                raise ValueError(f"row {b} tokens: expected shape [{tree.num_nodes}], got {tuple(row.shape)}")
            input_ids[b, :tree.num_nodes] = row
            positions[b, :tree.num_nodes] += tree.depth
        if self.max_positions is not None and int(positions.max()) >= self.max_positions:
            raise ValueError(f"position {int(positions.max())} is beyond the context of {self.flag} "
                             f"({self.max_positions} positions)")
        self.check_hidden_indices(hidden_state_indices)
        if isinstance(self.windows, dict):
            mask = {kind: rows_attention_mask(trees, self.row_lengths, self.slots, self.dtype, window, self.device)
                    for kind, window in self.windows.items()}
        else:
            mask = rows_attention_mask(trees, self.row_lengths, self.slots, self.dtype, self.windows, self.device)
        out = self._call(input_ids, mask, positions, hidden_state_indices)
        self.num_pending = n
        return [ForwardOutput(logits=out.logits[b, :tree.num_nodes],
                              hidden={i: out.hidden_states[i][b, :tree.num_nodes] for i in hidden_state_indices})
                for b, tree in enumerate(trees)]

    @torch.inference_mode()
    def commit(self, keep: list[int]) -> None:
        """Keep the forwarded tree nodes `keep` (increasing ids, e.g. an accepted path) as committed tokens."""
        if self.mode != "tree" and keep != list(range(len(keep))):
            raise ValueError(f"{self.describe()} runs in {self.mode} mode: only a chain prefix can be kept, got {keep}")
        if self.mode == "plain" and len(keep) != self.num_pending:
            raise ValueError(f"{self.describe()} runs in plain mode: forwarded tokens cannot be rolled back")
        self.commit_rows([keep])

    @torch.inference_mode()
    def commit_rows(self, keeps: list[list[int]]) -> None:
        """Keep the forwarded tree nodes keeps[b] of every row b as its committed tokens (one compaction)."""
        try:
            self.row_lengths = compact_rows(self.cache, self.row_lengths, self.slots, self.num_pending, keeps)
        except ValueError:
            raise
        except Exception as error:
            raise TargetError(f"{self.describe()}: KV cache compaction ({self.mode} mode) failed: "
                              f"{type(error).__name__}: {_first_line(error)}") from error
        self.slots = max(self.row_lengths)
        self.num_pending = 0

    def prefill(self, input_ids: torch.Tensor, hidden_state_indices: tuple[int, ...] = ()) -> ForwardOutput:
        """Start a new sequence: forward the whole prompt [T] into a fresh cache and commit it.

        Returns the logits of the last prompt token [1, V] and hidden states {index: [T, H]}.
        """
        input_ids = self.check_prompt(input_ids)
        self.cache = DynamicCache()  # no config: sliding layers keep every key (rollback must stay possible)
        self.row_lengths, self.slots, self.num_pending = [0], 0, 0
        out = self.forward(input_ids, Tree.chain(input_ids.numel() - 1), hidden_state_indices=hidden_state_indices,
                           logits_to_keep=1)
        self.commit(list(range(input_ids.numel())))
        return out

    @torch.inference_mode()
    def prefill_rows(self, prompts: list[torch.Tensor], hidden_state_indices: tuple[int, ...] = ()) -> list[ForwardOutput]:
        """Start a batch: prefill each prompt (its own forward, so no row pays for another's padding), then
        stack the caches into one [B, H, longest prompt, D] (holes after shorter prompts). One prompt is
        `prefill` itself. Returns per row what `prefill` returns. With `group_prefill`: `_prefill_groups`."""
        if not prompts:
            raise ValueError("prompts: an empty batch; at least one prompt is needed")
        if len(prompts) > 1 and self.mode != "tree":
            raise ValueError(f"{self.describe()} runs in {self.mode} mode: a batch of rows of different lengths "
                             f"needs tree mode (per-row masks); decode its prompts one at a time")
        if len(prompts) == 1:
            return [self.prefill(prompts[0], hidden_state_indices)]
        for index, prompt in enumerate(prompts):  # every prompt checked before any compute
            try:
                self.check_prompt(prompt)
            except ValueError as error:
                raise ValueError(f"prompt {index} of the batch: {error}") from error
        if self.group_prefill and self.windows is None:
            return self._prefill_groups(prompts, hidden_state_indices)
        outputs, caches, lengths = [], [], []
        for prompt in prompts:
            outputs.append(self.prefill(prompt, hidden_state_indices))
            caches.append(self.cache)
            lengths.append(self.row_lengths[0])
        slots = max(lengths)
        for layer, *others in zip(self.cache.layers, *(c.layers for c in caches[:-1]), strict=True):
            rows = [*others, layer]  # the last prompt's cache object becomes the batch's
            layer.keys = torch.cat([_pad_slots(r.keys, slots) for r in rows])
            layer.values = torch.cat([_pad_slots(r.values, slots) for r in rows])
        self.row_lengths, self.slots, self.num_pending = lengths, max(lengths), 0
        return outputs

    def _prefill_groups(self, prompts: list[torch.Tensor], hidden_state_indices: tuple[int, ...]
                        ) -> list[ForwardOutput]:
        """prefill_rows in groups of prompts of similar lengths (sorted; at most PREFILL_GROUP_PROMPTS prompts and
        PREFILL_GROUP_TOKENS padded tokens per group), each group ONE forward of its prompts right-padded to its
        longest: causal attention keeps a prompt's tokens from seeing the padding after it, so each row is its prompt
        alone up to float rounding, and the padding's slots become the batch's holes. 64 of SmolLM2-135M's ShareGPT
        prompts (64 tokens on average) prefilled in 17.2 s instead of 21.5 s in float32 on an AVX2 CPU (the products
        were already at the BLAS's speed; the groups save each forward's fixed costs)."""
        prompts = [self.check_prompt(prompt) for prompt in prompts]
        order = sorted(range(len(prompts)), key=lambda b: prompts[b].numel())
        groups: list[list[int]] = [[]]
        for b in order:  # ascending lengths: the newest prompt is its group's longest
            if groups[-1] and (len(groups[-1]) == PREFILL_GROUP_PROMPTS
                               or (len(groups[-1]) + 1) * prompts[b].numel() > PREFILL_GROUP_TOKENS):
                groups.append([])
            groups[-1].append(b)
        outputs: dict[int, ForwardOutput] = {}
        caches = []
        for group in groups:
            rows = [prompts[b] for b in group]
            counts = [row.numel() for row in rows]
            self.cache = DynamicCache()
            self.row_lengths, self.slots, self.num_pending = [0] * len(rows), 0, 0
            trees = [Tree.chain(n - 1) for n in counts]
            longest = max(counts)
            input_ids = torch.zeros(len(rows), longest, dtype=torch.long)
            for b, row in enumerate(rows):
                input_ids[b, :row.numel()] = row
            mask = rows_attention_mask(trees, self.row_lengths, 0, self.dtype, None, self.device)
            out = self._call(input_ids, mask, torch.arange(longest).repeat(len(rows), 1), hidden_state_indices,
                             logits_to_keep=torch.tensor(counts) - 1)  # [G, G, V]: row b's own at [b, b]
            for b, (index, n) in enumerate(zip(group, counts, strict=True)):
                outputs[index] = ForwardOutput(logits=out.logits[b, b:b + 1],
                                               hidden={i: out.hidden_states[i][b, :n] for i in hidden_state_indices})
            caches.append(self.cache)
        # the rows back in the prompts' order, padded to the longest prompt, as the per-prompt prefills' are stacked
        where = {b: (g, r) for g, group in enumerate(groups) for r, b in enumerate(group)}
        lengths = [prompt.numel() for prompt in prompts]
        slots = max(lengths)
        for index, layer in enumerate(caches[-1].layers):
            for name in ("keys", "values"):
                parts = [getattr(caches[g].layers[index], name)[r:r + 1] for g, r in map(where.get, range(len(prompts)))]
                setattr(layer, name, torch.cat([_pad_slots(part, slots) for part in parts]))
        self.cache, self.row_lengths, self.slots, self.num_pending = caches[-1], lengths, slots, 0
        return [outputs[b] for b in range(len(prompts))]

    def kv_bytes(self, rows: int, slots: int) -> int:
        """Estimated KV-cache bytes of `rows` rows x `slots` slots (keys and values of every layer)."""
        heads = getattr(self.config, "num_key_value_heads", None) or self.config.num_attention_heads
        head_dim = getattr(self.config, "head_dim", None) or self.config.hidden_size // self.config.num_attention_heads
        return 2 * self.num_layers * rows * slots * heads * head_dim * torch.finfo(self.dtype).bits // 8

    def check_batch_memory(self, prompt_lengths: list[int], new_tokens: int, tree_tokens: int = 64) -> None:
        """Refuse a batch whose KV cache (longest prompt + new tokens + a tree per row) and verify logits would not
        fit in the free memory of the device, with the estimate, before anything is allocated."""
        rows, slots = len(prompt_lengths), max(prompt_lengths) + new_tokens + tree_tokens
        need = self.kv_bytes(rows, slots) + rows * tree_tokens * self.vocab_size * 4  # + fp32 logits of one verify
        free = available_memory(self.device)
        if free is not None and need > free:
            raise ValueError(f"batch of {rows} prompts (longest {max(prompt_lengths)} tokens, {new_tokens} new): "
                             f"needs ~{need / 2**30:.2f} GiB of KV cache and logits, {free / 2**30:.2f} GiB free on "
                             f"{self.device}; decode fewer prompts at once or fewer new tokens")

    def select_rows(self, rows: list[int]) -> None:
        """Keep only rows `rows` (indices into the current batch, increasing), e.g. when the others finished:
        a finished row stops costing compute. Slots beyond the longest remaining row are dropped."""
        if self.num_pending:
            raise ValueError("select_rows with tree slots in the cache: commit first")
        if not rows or any(b <= a for a, b in zip(rows[:-1], rows[1:], strict=True)) or not 0 <= rows[0] <= rows[-1] < self.batch_size:
            raise ValueError(f"select_rows: expected increasing row indices in [0, {self.batch_size}), got {rows}")
        if rows == list(range(self.batch_size)):
            return
        lean = self.lean_forward()
        if lean is None or not lean.select_rows(self.cache, rows):  # the lean forward's buffers: moved in place
            self.cache.batch_select_indices(torch.tensor(rows, device=self.device))
        self.row_lengths = [self.row_lengths[r] for r in rows]
        surplus = self.slots - max(self.row_lengths)
        if surplus > 0:
            self.cache.crop(-surplus)
        self.slots = max(self.row_lengths)


def available_memory(device: torch.device) -> int | None:
    """Free bytes on `device` (CUDA: mem_get_info; CPU: available physical pages), None if unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _pad_slots(tensor: torch.Tensor, slots: int) -> torch.Tensor:
    """[1, H, S, D] -> [1, H, slots, D], zeros after S (holes: masked off, never attended)."""
    return torch.nn.functional.pad(tensor, (0, 0, 0, slots - tensor.shape[-2]))


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "(no message)"
