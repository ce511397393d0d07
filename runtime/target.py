"""The target adapter: the ONLY code that touches transformers internals (cache class, mask format, kwargs).

`TargetModel` wraps an unmodified Hugging Face causal LM and keeps its KV cache. The cache always holds the
*committed prefix* (every committed token except the last one, the "root") followed, between a forward and
the next `commit`, by the slots of the tree nodes just forwarded:

    prefill(prompt)                       cache = prompt                      (logits of the last token)
    forward(tokens, tree)                 cache = prefix + tree nodes         (logits of every node)
    commit(keep)                          cache = prefix + kept nodes         (one compaction routine)

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
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from runtime.kv_cache import compact_cache
from runtime.masks import tree_attention_mask
from runtime.tree import Tree

SUPPORTED_ATTENTION = ("sdpa", "eager")
MODES = ("tree", "chain", "plain")
_LAYER_TYPES_WITH_WINDOW = {"full_attention": False, "sliding_attention": True}


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
        self._cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.cache: DynamicCache | None = None
        self.prefix_len = 0  # committed tokens in the cache
        self.num_pending = 0  # tree nodes in the cache after the prefix (forwarded, not yet committed)

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
        kwargs = {self._cache_kwarg: self.cache}
        if self.mode == "tree" or self._takes_positions:
            kwargs["position_ids"] = positions[None].to(self.device)
        step = "prefill" if self.prefix_len == 0 else ("verify" if self.flag == "--model" else "draft")
        try:
            out = self.model(input_ids=tokens[None].to(self.device), attention_mask=self._mask(tree, start),
                             use_cache=True, output_hidden_states=list(hidden_state_indices) or False,
                             logits_to_keep=logits_to_keep, **kwargs)
        except Exception as error:  # any model failure becomes one line naming the model and the step
            raise TargetError(f"{self.describe()}: {step} forward of {tokens.numel()} tokens at positions "
                              f"{int(positions.min())}..{int(positions.max())} failed ({self.mode} mode): "
                              f"{type(error).__name__}: {_first_line(error)}") from error
        self.num_pending = tree.num_nodes
        hidden = {i: out.hidden_states[i][0] for i in hidden_state_indices}
        return ForwardOutput(logits=out.logits[0], hidden=hidden)

    @torch.inference_mode()
    def commit(self, keep: list[int]) -> None:
        """Keep the forwarded tree nodes `keep` (increasing ids, e.g. an accepted path) as committed tokens."""
        if self.mode != "tree" and keep != list(range(len(keep))):
            raise ValueError(f"{self.describe()} runs in {self.mode} mode: only a chain prefix can be kept, got {keep}")
        if self.mode == "plain" and len(keep) != self.num_pending:
            raise ValueError(f"{self.describe()} runs in plain mode: forwarded tokens cannot be rolled back")
        try:
            compact_cache(self.cache, self.prefix_len, self.num_pending, keep)
        except ValueError:
            raise
        except Exception as error:
            raise TargetError(f"{self.describe()}: KV cache compaction ({self.mode} mode) failed: "
                              f"{type(error).__name__}: {_first_line(error)}") from error
        self.prefix_len += len(keep)
        self.num_pending = 0

    def prefill(self, input_ids: torch.Tensor, hidden_state_indices: tuple[int, ...] = ()) -> ForwardOutput:
        """Start a new sequence: forward the whole prompt [T] into a fresh cache and commit it.

        Returns the logits of the last prompt token [1, V] and hidden states {index: [T, H]}.
        """
        input_ids = self.check_prompt(input_ids)
        self.cache = DynamicCache()  # no config: sliding layers keep every key (rollback must stay possible)
        self.prefix_len = 0
        self.num_pending = 0
        out = self.forward(input_ids, Tree.chain(input_ids.numel() - 1), hidden_state_indices=hidden_state_indices,
                           logits_to_keep=1)
        self.commit(list(range(input_ids.numel())))
        return out


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "(no message)"
