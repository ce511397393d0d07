"""The speculators layout (vLLM's own draft-model format, PyPI `speculators`): write it from, and read it into,
our EAGLE-3 heads. `vllm serve DIR` on such a directory reads the verifier and the speculative settings from its
config.json (no --speculative-config).

Written from speculators `src/speculators/config.py` (SpeculatorModelConfig: `speculators_model_type`,
`speculators_version`, `speculators_config` = {algorithm, proposal_methods, default_proposal_method, verifier:
{name_or_path, architectures}}), `proposals/greedy.py` (proposal_type, speculative_tokens, verifier_accept_k,
accept_tolerance), `models/eagle3/config.py` (transformer_layer_config, draft_vocab_size, norm_before_residual,
target_hidden_size, eagle_aux_hidden_state_layer_ids, embed_requires_grad), `models/eagle3/core.py` (weights `fc`,
`layers.{i}`, `norm`, `lm_head`, `embed_tokens`, buffers `d2t`/`t2d`), and from vLLM's reader
`vllm/transformers_utils/configs/speculators/{base,algos}.py` + `model_executor/models/llama_eagle3.py`:

- `speculators_model_type` picks vLLM's method (eagle3, peagle, dflash, dflash2, dspark); only eagle3 is our kind.
- `transformer_layer_config` becomes the draft's HF config; its `vocab_size` is the TARGET vocabulary.
- `norm_before_residual`: vLLM defaults it to TRUE when absent (the speculators library and the EAGLE-3 reference
  behave as false). Our midlayer keeps the un-normalised hidden as residual (false): always written.
- `norm_before_fc`, `fc_norm`, `norm_output` (vLLM defaults false): extra norms we do not have; written false.
- `eagle_aux_hidden_state_layer_ids`: HF `hidden_states` indices (the input of layer k), what vLLM's target
  model captures and what speculators' `resolve_target_layer_ids` means: our `target_layers` as they are.
- weights: `layers.0.*` (our `midlayer.*`), `fc.weight`, `norm.weight`, `lm_head.weight`, `d2t` (int64, target id
  = i + d2t[i]; vLLM loads it as `draft_id_to_target_id`), `t2d` (bool over the target vocabulary; vLLM skips it).
  No `embed_tokens.weight`: vLLM then shares the target's embedding, which is what our heads read.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from heads.config import HeadsConfig

SUPPORTED_TYPES = ("eagle3",)  # what `heads.convert` imports
EXPORT_TYPES = ("eagle3", "dflash", "peagle")  # what `heads.export --to speculators` writes
# The speculators release whose layout this follows (speculators_version in config.json).
SPECULATORS_VERSION = "0.9.0"
ARCHITECTURE = "Eagle3DraftModel"  # speculators' EAGLE-3 model class (vLLM replaces it by Eagle3LlamaForCausalLM)
# Keys vLLM reads with a default that differs from what our head computes when the key is absent.
VLLM_DEFAULTS = {"norm_before_residual": True, "norm_before_fc": False, "fc_norm": False, "norm_output": False}
# What our EAGLE-3 head computes: norm_before_residual per head (HeadsConfig.norm_before_residual), the rest never.
OUR_VALUES = {"norm_before_fc": False, "fc_norm": False, "norm_output": False}
_OURS_TO_FILE = ("midlayer.", "layers.0.")


# Keys of our EAGLE-3 engine config that are not the draft layer's Llama config.
_NOT_LAYER_KEYS = ("architectures", "draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids",
                   "eagle_config", "torch_dtype", "specheads")


def layer_config(config: HeadsConfig, engine_keys: dict[str, Any]) -> dict[str, Any]:
    """`transformer_layer_config`: the draft layer as a Llama config (vocab_size = the target's), from our EAGLE-3
    engine config.json keys (heads.checkpoint.engine_config)."""
    keys = {k: v for k, v in engine_keys.items() if k not in _NOT_LAYER_KEYS}
    keys.update({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
                 "vocab_size": config.vocab_size, "tie_word_embeddings": False, "mlp_bias": False})
    return keys


def speculators_config(config: HeadsConfig, engine_keys: dict[str, Any], *, verifier: str,
                       verifier_architectures: list[str], speculative_tokens: int) -> dict[str, Any]:
    """config.json of the speculators layout for our EAGLE-3 `config`."""
    if config.kind != "eagle3":
        raise ValueError(f"speculators layout: EAGLE-3 heads only, got kind {config.kind!r}")
    if speculative_tokens < 1:
        raise ValueError(f"--speculative_tokens: expected >= 1, got {speculative_tokens}")
    return {
        "architectures": [ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
        "transformer_layer_config": layer_config(config, engine_keys),
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(config.target_layers),
        "norm_before_residual": bool(config.norm_before_residual),
        **OUR_VALUES,
        "embed_requires_grad": False,
        "torch_dtype": config.dtype,
    }


def parallel_config(config: HeadsConfig, layer_keys: dict[str, Any], *, verifier: str,
                    verifier_architectures: list[str], speculative_tokens: int) -> dict[str, Any]:
    """config.json of the speculators layout for our DFlash / P-EAGLE heads, with the keys vLLM's readers
    (`transformers_utils/configs/speculators/algos.py` update_dflash / update_peagle) take.

    DFlash: `aux_hidden_state_layer_ids` (HF hidden_states indices; vLLM derives dflash_config.target_layer_ids =
    ids - 1 itself), `mask_token_id`, `block_size`, `sample_from_anchor` false (slot 0 is the anchor), a Qwen3
    `transformer_layer_config` (our layers have q/k norms) of `num_draft_layers` layers; drafts per step are always
    block_size - 1 (vLLM's block is 1 + num_speculative_tokens slots, and a shorter bidirectional block would see
    less than ours). P-EAGLE: EAGLE-3's keys plus `mask_token_id` (vLLM's pard_token); a Llama layer config of
    `num_draft_layers` layers; drafts per step min(--speculative_tokens, block_size) (causal: a shorter block
    computes the same first depths).
    """
    if config.kind not in ("dflash", "peagle"):
        raise ValueError(f"speculators layout: parallel drafters only, got kind {config.kind!r}")
    if config.num_hidden_layers in config.target_layers:
        raise ValueError(f"--to speculators: these {config.kind} heads read hidden_states[{config.num_hidden_layers}] "
                         f"(the target's final normed state, target_layers {config.target_layers}); vLLM captures the "
                         f"inputs of decoder layers 1..{config.num_hidden_layers - 1} only. Train with "
                         "--target_layer_ids inside that range to serve them with vLLM")
    if speculative_tokens < 1:
        raise ValueError(f"--speculative_tokens: expected >= 1, got {speculative_tokens}")
    tokens = config.block_size - 1 if config.kind == "dflash" else min(speculative_tokens, config.block_size)
    layer = {k: v for k, v in layer_keys.items() if k not in _NOT_LAYER_KEYS}
    layer.update({"num_hidden_layers": config.num_draft_layers, "vocab_size": config.vocab_size,
                  "tie_word_embeddings": False, "mlp_bias": False})
    if config.kind == "dflash":
        layer.update({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"})
    else:
        layer.update({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    out = {
        "architectures": ["DFlashDraftModel" if config.kind == "dflash" else "PEagleDraftModel"],
        "speculators_model_type": config.kind,
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": config.kind,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
        "transformer_layer_config": layer,
        "target_hidden_size": config.hidden_size,
        "block_size": config.block_size,
        "mask_token_id": config.mask_token_id,
        "torch_dtype": config.dtype,
    }
    if config.kind == "dflash":
        out.update({"draft_vocab_size": config.vocab_size, "aux_hidden_state_layer_ids": list(config.target_layers),
                    "sample_from_anchor": False})
    else:
        out.update({"draft_vocab_size": config.draft_vocab_size,
                    "eagle_aux_hidden_state_layer_ids": list(config.target_layers),
                    "norm_before_residual": bool(config.norm_before_residual), "norm_before_fc": False,
                    "embed_requires_grad": False})
    return out


def parallel_file_names(config: HeadsConfig, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Our DFlash / P-EAGLE tensor names are already vLLM's (`fc`, `hidden_norm`, `layers.{i}.*`, `norm`,
    `lm_head`, `mask_hidden`, `d2t`). P-EAGLE's later layers get the `hidden_norm` vLLM's EAGLE-3 layer class builds
    in every layer (only layer 0 uses it): ones, never read."""
    out = dict(tensors)
    if config.kind == "peagle":
        for i in range(1, config.num_draft_layers):
            weight = tensors[f"layers.{i}.input_layernorm.weight"]
            out[f"layers.{i}.hidden_norm.weight"] = weight.new_ones(weight.shape)
    return out


def to_file_names(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Our EAGLE-3 tensor names -> the speculators names (`midlayer.` -> `layers.0.`)."""
    old, new = _OURS_TO_FILE
    return {(new + k[len(old):] if k.startswith(old) else k): t for k, t in tensors.items()}


def from_file_names(tensors: dict[str, Tensor], source: str) -> dict[str, Tensor]:
    """Speculators tensor names -> ours; the verifier's copies and a shipped embedding are dropped."""
    old, new = _OURS_TO_FILE
    extra = sorted(k for k in tensors if k.startswith("layers.") and not k.startswith(new))
    if extra:
        raise ValueError(f"--source {source}: only one-layer EAGLE-3 drafts are supported, found {extra[:3]}")
    dropped = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")
    return {(old + k[len(new):] if k.startswith(new) else k): t for k, t in tensors.items() if k not in dropped}


def check_source_config(data: dict[str, Any], source: str) -> dict[str, Any]:
    """Validate a speculators config.json for import; returns its transformer_layer_config.

    Refuses (one line each) another speculators_model_type, an absent norm_before_residual (ambiguous: vLLM reads
    true, speculators false; either value is imported as stated), and any other norm flag our head does not compute.
    """
    kind = data.get("speculators_model_type")
    if kind not in SUPPORTED_TYPES:
        raise ValueError(f"--source {source}: speculators_model_type {kind!r} is not supported; supported: "
                         f"{list(SUPPORTED_TYPES)}")
    layer = data.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError(f"--source {source}: speculators config.json has no transformer_layer_config mapping")
    if layer.get("model_type", "llama") != "llama":
        raise ValueError(f"--source {source}: transformer_layer_config model_type {layer.get('model_type')!r}: only "
                         "Llama draft layers are supported (our EAGLE-3 midlayer is a Llama layer)")
    if "norm_before_residual" not in data:
        raise ValueError(f"--source {source}: config.json has no norm_before_residual; vLLM reads that as true, "
                         "the speculators library as false: add the key with the value the head was trained with")
    for key, ours in OUR_VALUES.items():
        if bool(data.get(key, ours)) != ours:
            raise ValueError(f"--source {source}: {key} is {data[key]!r}; our EAGLE-3 head computes {key}={ours} "
                             "and cannot represent this checkpoint")
    if data.get("embed_requires_grad"):
        raise ValueError(f"--source {source}: embed_requires_grad is true: the checkpoint trained its own embedding, "
                         "and our EAGLE-3 heads always read the target's (importing would change the draft)")
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"--source {source}: transformer_layer_config num_hidden_layers "
                         f"{layer['num_hidden_layers']}: only one-layer EAGLE-3 drafts are supported")
    return layer
