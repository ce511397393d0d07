"""`HeadsConfig`: everything needed to rebuild a draft head and to check it against its target.

A head is always built from the TARGET's config (`HeadsConfig.for_target`): hidden size, vocabulary, layer
count, attention geometry and RoPE settings are copied from it, so a head never disagrees with the model it
drafts for. The config round-trips through JSON (`to_dict` / `from_dict`) and is validated on construction.

Fields named like the target's (`hidden_size`, `vocab_size`, `num_hidden_layers`, `model_type`) describe the
TARGET; the draft decoder layer (EAGLE, EAGLE-3, MTP) uses the same hidden size and attention geometry.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

FORMAT_VERSION = 1
KINDS = ("medusa", "eagle", "eagle3", "mtp", "dflash", "peagle")
# kinds whose draft reads several target layers (EAGLE-3 style `fc` over their concatenation)
MULTI_LAYER_KINDS = ("eagle3", "dflash", "peagle")
# kinds with their own reduced-vocabulary lm_head and d2t/t2d saved in the weights
OWN_LM_HEAD_KINDS = ("eagle3", "peagle")
# kinds drafting a whole block in one forward (heads/parallel.py)
PARALLEL_KINDS = ("dflash", "peagle")
# the largest block: a parallel draft is verified in one forward of at most this many drafted tokens (the runtime's
# --max_tree_size default)
MAX_BLOCK_SIZE = 64
# kind -> head module class, filled as each class is defined (heads.base.HeadsModule.__init_subclass__)
HEAD_CLASSES: dict[str, type] = {}


def default_target_layers(kind: str, num_hidden_layers: int) -> list[int]:
    """HF `hidden_states` indices feeding the head (hs[0] = embeddings, hs[i] = output of layer i-1,
    hs[L] = after the final norm).

    Medusa, EAGLE-1/2 and MTP read hs[L]. EAGLE-3 reads (2, L//2, L-3) as vLLM and SGLang do by default (the
    inputs of those decoder layers) when these are distinct and inside [1, L-1]; for shallow targets
    (L < 8) it spreads (1, L//2, L-1) instead (engines then read the ids from config.json).
    """
    n = num_hidden_layers
    if kind not in MULTI_LAYER_KINDS:
        return [n]
    engine_default = [2, n // 2, n - 3]
    if len(set(engine_default)) == 3 and all(1 <= i <= n - 1 for i in engine_default):
        return engine_default
    return [min(max(i, 1), max(n - 1, 1)) for i in (1, n // 2, n - 1)]


def _rope_from_target(target_config: Any) -> dict:
    """The target's RoPE parameters as a transformers-5 `rope_parameters` dict (full-attention layers)."""
    params = getattr(target_config, "rope_parameters", None)
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        # Hybrid models (Gemma3) keep one dict per layer type; the draft layer is a full-attention layer.
        params = params.get("full_attention") or next(iter(params.values()))
    if isinstance(params, dict) and "rope_theta" in params:
        out = dict(params)
        out.setdefault("rope_type", "default")
        return out
    theta = getattr(target_config, "rope_theta", None) or 10000.0
    return {"rope_type": "default", "rope_theta": float(theta)}


@dataclass
class HeadsConfig:
    """Configuration of one head directory. See the module docstring for the meaning of target fields."""

    kind: str
    base_model_name_or_path: str
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    model_type: str = "llama"
    base_model_revision: str | None = None
    target_layers: list[int] = field(default_factory=list)
    format_version: int = FORMAT_VERSION
    # draft decoder layer geometry (copied from the target)
    num_attention_heads: int = 1
    num_key_value_heads: int = 1
    head_dim: int = 0
    intermediate_size: int = 0
    rms_norm_eps: float = 1e-6
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    max_position_embeddings: int = 2048
    attention_bias: bool = False
    # Medusa
    medusa_num_heads: int = 5
    medusa_num_layers: int = 1
    medusa_shared_lm_head: bool = False  # project through the target's frozen LM head (only ResBlocks train)
    # EAGLE-1/2: vLLM's loader has no fc bias, SGLang's and the EAGLE reference's always have one (the SGLang /
    # reference exports write zeros), so bias-free heads export everywhere.
    eagle_fc_bias: bool = False
    # Draft vocabulary (heads.draft_vocab): EAGLE-3's lm_head rows (0 -> vocab_size); Medusa/EAGLE-1/2/MTP: 0 = draft
    # over the full target vocabulary, else the size of the d2t/t2d saved in draft_vocab.safetensors
    draft_vocab_size: int = 0
    # EAGLE-3: the midlayer's residual is hidden_norm(hidden) instead of hidden (speculators' and vLLM's
    # norm_before_residual; many published speculators checkpoints are trained with it)
    norm_before_residual: bool = False
    # MTP
    mtp_num_depths: int = 1
    # Parallel drafters (heads/parallel.py). DFlash: a block of `block_size` slots [last token, mask x (B-1)] drafts
    # B-1 tokens; P-EAGLE: `block_size` depths drafted in one causal forward. `mask_token_id` fills the masked
    # slots (-1: the last vocabulary id); `num_draft_layers` decoder layers.
    block_size: int = 0
    mask_token_id: int = -1
    num_draft_layers: int = 1
    # bookkeeping
    dtype: str = "float32"
    training_data: str | None = None
    metrics: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"HeadsConfig.kind: expected one of {KINDS}, got {self.kind!r}")
        if self.format_version != FORMAT_VERSION:
            raise ValueError(f"HeadsConfig.format_version: this specheads reads format {FORMAT_VERSION}, "
                             f"got {self.format_version!r}; upgrade specheads or convert the checkpoint")
        for name in ("hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"HeadsConfig.{name}: expected a positive int, got {value!r}")
        if not self.base_model_name_or_path:
            raise ValueError("HeadsConfig.base_model_name_or_path: must name the target model")
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.intermediate_size == 0:
            self.intermediate_size = 4 * self.hidden_size
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"HeadsConfig.num_key_value_heads={self.num_key_value_heads} must divide "
                             f"num_attention_heads={self.num_attention_heads}")
        if not self.target_layers:
            self.target_layers = default_target_layers(self.kind, self.num_hidden_layers)
        self.target_layers = [int(i) for i in self.target_layers]
        if self.kind in MULTI_LAYER_KINDS:
            # Engines capture the input of decoder layer i (= hs[i]) for i in [1, L-1]; the parallel drafters may
            # also read hs[L] (the final normed state, what offline last-layer shards hold; not exportable to vLLM).
            top = self.num_hidden_layers if self.kind in PARALLEL_KINDS else max(self.num_hidden_layers - 1, 1)
            count_ok = len(self.target_layers) == 3 if self.kind == "eagle3" else len(self.target_layers) >= 1
            if not count_ok or not all(1 <= i <= top for i in self.target_layers):
                raise ValueError(f"HeadsConfig.target_layers: kind {self.kind!r} takes "
                                 f"{'3' if self.kind == 'eagle3' else '1 or more'} hidden_states indices in "
                                 f"[1, {top}], got {self.target_layers}")
        elif self.target_layers != [self.num_hidden_layers]:
            raise ValueError(f"HeadsConfig.target_layers: kind {self.kind!r} reads the last hidden state "
                             f"[{self.num_hidden_layers}], got {self.target_layers}")
        if "rope_theta" not in self.rope_parameters:
            raise ValueError(f"HeadsConfig.rope_parameters: needs 'rope_theta', got {self.rope_parameters}")
        self.rope_parameters.setdefault("rope_type", "default")
        if self.kind == "medusa" and (self.medusa_num_heads < 1 or self.medusa_num_layers < 0):
            raise ValueError(f"HeadsConfig: medusa_num_heads >= 1 and medusa_num_layers >= 0 expected, got "
                             f"{self.medusa_num_heads}, {self.medusa_num_layers}")
        if self.kind == "medusa" and self.medusa_shared_lm_head and self.medusa_num_layers < 1:
            raise ValueError("HeadsConfig: medusa_shared_lm_head needs medusa_num_layers >= 1 (with no residual "
                             "block a head would be the target's own LM head and predict token t+1)")
        if self.norm_before_residual and self.kind not in OWN_LM_HEAD_KINDS:
            raise ValueError(f"HeadsConfig.norm_before_residual: an EAGLE-3 option, not for kind {self.kind!r}")
        if self.kind in PARALLEL_KINDS:
            self._check_parallel()
        if self.kind in OWN_LM_HEAD_KINDS:
            if self.draft_vocab_size == 0:
                self.draft_vocab_size = self.vocab_size
            if not 0 < self.draft_vocab_size <= self.vocab_size:
                raise ValueError(f"HeadsConfig.draft_vocab_size: expected 1..vocab_size={self.vocab_size}, "
                                 f"got {self.draft_vocab_size}")
        if not 0 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"HeadsConfig.draft_vocab_size: expected 0 (full vocabulary) .. vocab_size="
                             f"{self.vocab_size}, got {self.draft_vocab_size}")
        if self.kind == "mtp" and self.mtp_num_depths < 1:
            raise ValueError(f"HeadsConfig.mtp_num_depths: expected >= 1, got {self.mtp_num_depths}")

    def _check_parallel(self) -> None:
        if self.block_size == 0:
            self.block_size = 8 if self.kind == "dflash" else 4
        if not 2 <= self.block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"--block_size: expected 2..{MAX_BLOCK_SIZE} (a block drafts at most the verify budget "
                             f"of {MAX_BLOCK_SIZE} tokens), got {self.block_size}")
        if self.mask_token_id == -1:
            self.mask_token_id = self.vocab_size - 1
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"--mask_token_id: expected an id in [0, {self.vocab_size - 1}] (the target's "
                             f"vocabulary) or -1, got {self.mask_token_id}")
        if not 1 <= self.num_draft_layers <= 16:
            raise ValueError(f"--num_layers: a parallel drafter takes 1..16 decoder layers, got {self.num_draft_layers}")

    @property
    def draft_tokens(self) -> int:
        """Tokens a parallel drafter drafts per forward: DFlash block_size - 1 (slot 0 is the last token), P-EAGLE
        block_size (one per depth)."""
        return self.block_size - 1 if self.kind == "dflash" else self.block_size

    # ---- construction ---------------------------------------------------------------------------------
    @classmethod
    def for_target(cls, kind: str, target_config: Any, base_model_name_or_path: str | None = None,
                   **options: Any) -> HeadsConfig:
        """Build a head config from a transformers config of the target (or the model itself).

        `options` set kind-specific fields (e.g. `medusa_num_heads=4`, `draft_vocab_size=32000`,
        `mtp_num_depths=2`, `target_layers=[...]`, `base_model_revision=...`).
        """
        target_config = getattr(target_config, "config", target_config)
        text = getattr(target_config, "get_text_config", None)
        if callable(text):
            target_config = text()
        name = base_model_name_or_path or getattr(target_config, "_name_or_path", "") or ""
        if not name:
            raise ValueError("HeadsConfig.for_target: pass base_model_name_or_path (the target config has no "
                             "_name_or_path)")
        hidden = int(target_config.hidden_size)
        heads = int(target_config.num_attention_heads)
        kv = getattr(target_config, "num_key_value_heads", None) or heads
        head_dim = getattr(target_config, "head_dim", None) or hidden // heads
        inter = getattr(target_config, "intermediate_size", None) or getattr(target_config, "n_inner", None)
        eps = getattr(target_config, "rms_norm_eps", None) or getattr(target_config, "layer_norm_epsilon",
                                                                      None) or 1e-6
        maxpos = getattr(target_config, "max_position_embeddings", None) or getattr(target_config,
                                                                                    "n_positions", 2048)
        values: dict[str, Any] = dict(
            kind=kind, base_model_name_or_path=str(name), hidden_size=hidden,
            vocab_size=int(target_config.vocab_size), num_hidden_layers=int(target_config.num_hidden_layers),
            model_type=str(getattr(target_config, "model_type", "llama")), num_attention_heads=heads,
            num_key_value_heads=int(kv), head_dim=int(head_dim), intermediate_size=int(inter or 4 * hidden),
            rms_norm_eps=float(eps), rope_parameters=_rope_from_target(target_config),
            max_position_embeddings=int(maxpos),
        )
        dtype = getattr(target_config, "dtype", None)
        if dtype is not None:
            values["dtype"] = str(dtype).replace("torch.", "")
        values.update(options)
        return cls(**values)

    # ---- JSON ------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict, source: str = "config") -> HeadsConfig:
        """Parse a dict written by `to_dict`; missing required keys / unknown keys raise naming `source`."""
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a JSON object for the head config, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [k for k in required if k not in data]
        if missing:
            raise ValueError(f"{source}: head config is missing required key(s) {missing}")
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"{source}: unknown head config key(s) {unknown}")
        if "format_version" in data and data["format_version"] != FORMAT_VERSION:
            raise ValueError(f"{source}: unknown format_version {data['format_version']!r}; this specheads "
                             f"reads format {FORMAT_VERSION}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, source: str = "config") -> HeadsConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{source}: not valid JSON ({err})") from err
        return cls.from_dict(data, source)
