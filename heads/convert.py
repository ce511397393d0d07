"""Import public Medusa / EAGLE-1/2 / EAGLE-3 checkpoint directories into our head format.

    python -m heads.convert --source DIR --base_model MODEL --output_dir OUT [--base_model_revision REV]

Recognised layouts (detected from config.json and tensor names; see heads/FORMATS.md):
- speculators (vLLM's format, `speculators_model_type` in config.json; heads/speculators.py): eagle3 with
  `layers.0.*`, `fc`, `norm`, `lm_head`, `d2t`/`t2d`; geometry from `transformer_layer_config`; ids from
  `eagle_aux_hidden_state_layer_ids` (hidden_states indices). Other speculators_model_types and norm flags our
  head does not compute are refused.
- SpecForge output (`specforge/export/to_sglang.py`: `LlamaForCausalLMEagle3`, `midlayer.*`, no embedding) and
  the EAGLE-3 reference: the EAGLE-3 rules below (`model.safetensors`, sharded `model.safetensors.index.json`, or
  `pytorch_model.bin`).
- Medusa, FasterDecoding/TGI: `medusa_num_heads`, `medusa_num_layers`; medusa_lm_head.safetensors (or .pt)
  with `{h}.{l}.linear.weight/bias`, `{h}.{L}.weight` (absent -> shared target LM head).
- Medusa, vLLM: `num_heads`, `num_hidden_layers`; `blocks.{h}.layers.{l}.weight/bias`, `lm_heads.{h}.weight`.
- EAGLE-3 (EAGLE reference / vLLM / SGLang): `midlayer.*`, `fc.weight` [H, 3H], `norm.weight`,
  `lm_head.weight`, `d2t`, `t2d` (absent -> identity when draft_vocab_size == vocab_size). Target layers from
  `eagle_aux_hidden_state_layer_ids` (hidden_states indices), else `eagle_config` ids + 1 (SGLang), else the
  engines' default (2, L//2, L-3).
- EAGLE-1/2 (EAGLE reference): `fc.weight` [H, 2H] (+ `fc.bias`), `layers.0.*` without input_layernorm.
An `embed_tokens.weight` shipped with a checkpoint is dropped (we always use the target's embedding).
The target's config (`--base_model`) supplies the target geometry; the draft layer geometry is read from the
source config.json where present.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import AutoConfig

from heads import speculators
from heads.base import HeadsModule
from heads.checkpoint import build_heads, check_state, file_to_module_names, read_safetensors, save_heads
from heads.cli import parse_flags, run_cli
from heads.config import HeadsConfig
from heads.draft_vocab import validate_vocab_mapping
from heads.loading import model_path

_LAYER_KEYS = ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
               "max_position_embeddings")


@dataclass
class ConvertFlags:
    source: str = field(default="", metadata={"help": "Directory of a public Medusa/EAGLE/EAGLE-3 checkpoint."})
    base_model: str = field(default="", metadata={"help": "The target model it drafts for (Hub id / dir / GGUF)."})
    base_model_revision: str = field(default="", metadata={"help": "Revision of the base model, recorded."})
    output_dir: str = field(default="", metadata={"help": "Where to write our head directory."})


def read_source_tensors(source: Path) -> dict[str, Tensor]:
    """Tensors of a checkpoint directory: model.safetensors, medusa_lm_head.safetensors or a .bin/.pt file."""
    for name in ("model.safetensors", "medusa_lm_head.safetensors"):
        if (source / name).is_file():
            return read_safetensors(source / name)
    index = source / "model.safetensors.index.json"
    if index.is_file():  # sharded save_pretrained output
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as err:
            raise ValueError(f"{index}: not a safetensors index (expected a weight_map): {err}") from err
        tensors: dict[str, Tensor] = {}
        for shard in shards:
            tensors.update(read_safetensors(source / shard))
        return tensors
    for name in ("pytorch_model.bin", "medusa_lm_head.pt"):
        if (source / name).is_file():
            try:
                state = torch.load(source / name, map_location="cpu", weights_only=True)
            except (RuntimeError, EOFError, OSError) as err:
                raise ValueError(f"{source / name}: corrupt or unreadable checkpoint ({err})") from err
            return {k: v for k, v in state.items() if isinstance(v, Tensor)}
    raise FileNotFoundError(f"--source {source}: no model.safetensors, medusa_lm_head.safetensors, "
                            "pytorch_model.bin or medusa_lm_head.pt")


def detect_layout(source_config: dict, tensors: dict[str, Tensor]) -> str:
    """One of 'speculators', 'medusa_fasterdecoding', 'medusa_vllm', 'eagle3', 'eagle'."""
    if "speculators_model_type" in source_config or "speculators_config" in source_config:
        return "speculators"
    if "medusa_num_heads" in source_config:
        return "medusa_fasterdecoding"
    if any(k.startswith("blocks.") for k in tensors) and any(k.startswith("lm_heads.") for k in tensors):
        return "medusa_vllm"
    if any(k.startswith("midlayer.") for k in tensors):
        return "eagle3"
    if "fc.weight" in tensors and any(k.startswith("layers.0.") for k in tensors):
        return "eagle"
    raise ValueError(f"unrecognised checkpoint: config keys {sorted(source_config)[:12]}, tensors "
                     f"{sorted(tensors)[:12]}; expected a Medusa, EAGLE-1/2 or EAGLE-3 layout (heads/FORMATS.md)")


def _layer_options(source_config: dict) -> dict[str, Any]:
    options = {k: source_config[k] for k in _LAYER_KEYS if source_config.get(k) is not None}
    if "rope_parameters" in source_config and isinstance(source_config["rope_parameters"], dict):
        options["rope_parameters"] = dict(source_config["rope_parameters"])
    elif "rope_theta" in source_config:
        rope = {"rope_type": "default", "rope_theta": float(source_config["rope_theta"])}
        scaling = source_config.get("rope_scaling")
        if isinstance(scaling, dict):
            rope.update(scaling)
            rope["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
        options["rope_parameters"] = rope
    if "attention_bias" in source_config:
        options["attention_bias"] = bool(source_config["attention_bias"])
    return options


def import_checkpoint(source: str | Path, target_config: Any, base_model_name_or_path: str,
                      base_model_revision: str | None = None) -> HeadsModule:
    """Read a public checkpoint directory into a head module for `target_config` (validated, not saved)."""
    source = Path(source)
    config_path = source / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"--source {source}: missing config.json")
    try:
        source_config = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"--source {source}: config.json is not valid JSON ({err})") from err
    if "speculators_model_type" in source_config or "speculators_config" in source_config:
        layer = speculators.check_source_config(source_config, str(source))  # before reading weights: one line
    tensors = read_source_tensors(source)
    tensors.pop("embed_tokens.weight", None)
    layout = detect_layout(source_config, tensors)
    common = dict(base_model_revision=base_model_revision or None)
    num_layers = getattr(target_config, "get_text_config", lambda: target_config)().num_hidden_layers
    if layout == "speculators":
        target_hidden = int(source_config.get("target_hidden_size") or layer.get("hidden_size", 0))
        vocab = int(getattr(target_config, "get_text_config", lambda: target_config)().vocab_size)
        if int(layer.get("vocab_size", vocab)) != vocab:
            raise ValueError(f"--source {source}: transformer_layer_config vocab_size {layer['vocab_size']} is not "
                             f"the target's vocabulary ({vocab})")
        # The draft layer's keys are those of an EAGLE-3 config.json; the target geometry is checked below.
        ids = source_config.get("eagle_aux_hidden_state_layer_ids")
        if ids and len(ids) > 3 and num_layers in ids:  # speculators' datagen ids carry the final layer too; its
            ids = [i for i in ids if i != num_layers]  # resolve_target_layer_ids strips it for the draft
        source_config = {**layer, "draft_vocab_size": source_config.get("draft_vocab_size"),
                         "eagle_aux_hidden_state_layer_ids": ids, "target_hidden_size": target_hidden,
                         "norm_before_residual": bool(source_config["norm_before_residual"])}
        tensors = speculators.from_file_names(tensors, str(source))
        layout = "eagle3"

    if layout == "medusa_fasterdecoding":
        heads_n, layers_n = int(source_config["medusa_num_heads"]), int(source_config.get("medusa_num_layers", 1))
        shared = f"0.{layers_n}.weight" not in tensors
        config = HeadsConfig.for_target("medusa", target_config, base_model_name_or_path, medusa_num_heads=heads_n,
                                        medusa_num_layers=layers_n, medusa_shared_lm_head=shared, **common)
        module_tensors = file_to_module_names("medusa", tensors)
    elif layout == "medusa_vllm":
        heads_n, layers_n = int(source_config["num_heads"]), int(source_config.get("num_hidden_layers", 1))
        if not source_config.get("medusa_fc_bias", False):
            raise ValueError(f"--source {source}: vLLM Medusa blocks without bias cannot be represented "
                             "(our residual blocks have a bias, as FasterDecoding's do)")
        config = HeadsConfig.for_target("medusa", target_config, base_model_name_or_path, medusa_num_heads=heads_n,
                                        medusa_num_layers=layers_n, **common)
        module_tensors = {}
        # original_lm_head: one projection (lm_heads.0) read by every head; each head gets its own copy here
        shared = source_config.get("original_lm_head", False)
        projections = [tensors.get(f"lm_heads.{0 if shared else h}.weight") for h in range(heads_n)]
        if any(p is None for p in projections):
            raise ValueError(f"--source {source}: vLLM Medusa layout without lm_heads.{{h}}.weight for every head "
                             "(or lm_heads.0.weight with original_lm_head)")
        for h in range(heads_n):
            for layer in range(layers_n):
                module_tensors[f"heads.{h}.{layer}.linear.weight"] = tensors.pop(f"blocks.{h}.layers.{layer}.weight")
                module_tensors[f"heads.{h}.{layer}.linear.bias"] = tensors.pop(f"blocks.{h}.layers.{layer}.bias")
            tensors.pop(f"lm_heads.{h}.weight", None)
            module_tensors[f"heads.{h}.{layers_n}.weight"] = projections[h]
        module_tensors.update(tensors)  # leftovers (e.g. token_map) are reported by check_state
    elif layout == "eagle3":
        vocab = int(target_config.vocab_size)
        draft_vocab = int(tensors["lm_head.weight"].shape[0]) if "lm_head.weight" in tensors else vocab
        layers = source_config.get("eagle_aux_hidden_state_layer_ids")
        if not layers and isinstance(source_config.get("eagle_config"), dict):
            sglang_ids = source_config["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
            layers = [i + 1 for i in sglang_ids] if sglang_ids else None
        layers = list(layers) if layers else [2, num_layers // 2, num_layers - 3]
        config = HeadsConfig.for_target("eagle3", target_config, base_model_name_or_path,
                                        draft_vocab_size=draft_vocab, target_layers=layers,
                                        norm_before_residual=bool(source_config.get("norm_before_residual", False)),
                                        **_layer_options(source_config), **common)
        if "d2t" not in tensors:
            if draft_vocab != vocab:
                raise ValueError(f"--source {source}: draft vocabulary {draft_vocab} < target vocabulary {vocab} "
                                 "but the checkpoint has no d2t mapping")
            tensors["d2t"] = torch.zeros(draft_vocab, dtype=torch.int64)
        if "t2d" not in tensors:
            t2d = torch.zeros(vocab, dtype=torch.bool)
            t2d[tensors["d2t"].to(torch.int64) + torch.arange(draft_vocab)] = True
            tensors["t2d"] = t2d
        tensors["d2t"] = tensors["d2t"].to(torch.int64)
        tensors["t2d"] = tensors["t2d"].to(torch.bool)
        validate_vocab_mapping(tensors["d2t"], tensors["t2d"], vocab, draft_vocab, str(source))
        module_tensors = tensors
    else:
        if any(k.startswith("layers.0.input_layernorm") for k in tensors):
            raise ValueError(f"--source {source}: layers.0 has an input_layernorm; EAGLE-1/2 layer 0 has none")
        extra = sorted(k for k in tensors if k.startswith("layers.") and not k.startswith("layers.0."))
        if extra:
            raise ValueError(f"--source {source}: only one-layer EAGLE drafts are supported, found {extra[:3]}")
        config = HeadsConfig.for_target("eagle", target_config, base_model_name_or_path,
                                        eagle_fc_bias="fc.bias" in tensors, **_layer_options(source_config),
                                        **common)
        module_tensors = tensors
    heads = build_heads(config)
    check_state(heads, module_tensors, str(source))
    heads.load_state_dict(module_tensors, strict=True)
    floats = {t.dtype for t in module_tensors.values() if t.is_floating_point()}
    if len(floats) == 1:
        heads.to(next(iter(floats)))
    return heads.eval()


def main(argv: list[str] | None = None) -> None:
    torch.set_num_threads(1)
    flags = parse_flags(ConvertFlags, argv)
    if not flags.source or not flags.base_model or not flags.output_dir:
        raise ValueError("--source, --base_model and --output_dir are required")
    target_config = AutoConfig.from_pretrained(model_path(flags.base_model),
                                               revision=flags.base_model_revision or None)
    heads = import_checkpoint(flags.source, target_config, flags.base_model, flags.base_model_revision or None)
    out = save_heads(heads, flags.output_dir)
    print(f"imported {flags.source} ({heads.config.kind}) for {flags.base_model} -> {out}")


if __name__ == "__main__":
    run_cli(main)
