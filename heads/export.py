"""Export a head directory to the layout a serving engine loads (names, file, config keys).

    python -m heads.export --heads DIR --to {vllm,sglang,tgi,eagle} --output_dir OUT [--target MODEL]

| kind   | tgi                   | vllm                                   | sglang                           | eagle      |
|--------|-----------------------|----------------------------------------|----------------------------------|------------|
| medusa | native (FasterDecoding)| renamed: blocks.{h}.layers.{l}, lm_heads.{h} | -                           | -          |
| eagle  | -                     | native names, fc without bias          | LlamaForCausalLMEagle, fc.bias   | native     |
| eagle3 | -                     | native                                 | native                           | native     |

Medusa heads that share the target's LM head have no projection of their own. TGI loads them as they are with
one residual block per head (its MedusaHeadV2 applies the target's LM head); for TGI with more blocks (a copy
per head) and for vLLM (`original_lm_head: true`, one copy) `--target` (the base model) is required and its LM
head weight is written into the export.
heads/FORMATS.md lists what each engine's loader requires.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from heads.checkpoint import (
    CARD_FILE,
    CONFIG_FILE,
    atomic_directory,
    engine_config,
    load_heads,
    model_card,
    module_to_file_names,
    weights_file,
    write_json,
)
from heads.cli import parse_flags
from heads.config import HeadsConfig

ENGINES = ("vllm", "sglang", "tgi", "eagle")
SUPPORTED = {"medusa": ("tgi", "vllm"), "eagle": ("eagle", "vllm", "sglang"),
             "eagle3": ("vllm", "sglang", "eagle"), "mtp": ()}


@dataclass
class ExportFlags:
    heads: str = field(default="", metadata={"help": "Head directory (written by save_pretrained / training)."})
    to: str = field(default="vllm", metadata={"help": f"Target layout: one of {ENGINES}."})
    output_dir: str = field(default="", metadata={"help": "Where to write the exported directory."})
    target: str = field(default="", metadata={"help": "Base model (Hub id / dir / GGUF); needed for Medusa heads "
                                                      "that share the target LM head (vLLM; TGI with > 1 block)."})


@dataclass(frozen=True)
class Exported:
    """What to write: tensors (file names), the weights file name and the config.json dict."""

    tensors: dict[str, Tensor]
    weights_file: str
    config: dict


def _medusa_tensors(heads, to: str, lm_head_weight: Tensor | None) -> tuple[dict[str, Tensor], HeadsConfig]:
    """FasterDecoding tensor names and the config to describe them, for engine `to`.

    Heads with projections: as saved. Shared-LM-head heads (no `{h}.{L}.weight`): TGI loads them as they are when
    medusa_num_layers == 1 (MedusaHeadV1 fails on the missing projection, the MedusaHeadV2 fallback reads only
    `{h}.0.linear.*` and applies the target's own LM head); for TGI with more blocks, each head gets a copy of the
    target's LM head weight (`--target`); vLLM gets one copy, see `plan_export`.
    """
    config = heads.config
    tensors = module_to_file_names("medusa", heads.state_dict())
    if not config.medusa_shared_lm_head or (to == "tgi" and config.medusa_num_layers == 1):
        return tensors, config
    copies = config.medusa_num_heads if to == "tgi" else 1
    if lm_head_weight is None:
        why = (f"TGI loads shared-LM-head Medusa (its MedusaHeadV2) only with medusa_num_layers 1, these heads "
               f"have {config.medusa_num_layers}" if to == "tgi" else
               "vLLM's Medusa loader does not read the target's LM head (with original_lm_head it loads one copy "
               "from lm_heads.0.weight)")
        raise ValueError(f"--target: these Medusa heads share the target's LM head and {why}; pass --target "
                         "<base model> to copy its LM head weight into the export")
    dtype = next(iter(tensors.values())).dtype
    for h in range(copies):
        tensors[f"{h}.{config.medusa_num_layers}.weight"] = lm_head_weight.detach().to(dtype).clone()
    return tensors, replace(config, medusa_shared_lm_head=copies == 1, metrics=dict(config.metrics))


def plan_export(heads, to: str, lm_head_weight: Tensor | None = None) -> Exported:
    """The exported files of loaded `heads` for engine `to` (pure: nothing written)."""
    config = heads.config
    if to not in ENGINES:
        raise ValueError(f"--to: expected one of {ENGINES}, got {to!r}")
    if to not in SUPPORTED[config.kind]:
        raise ValueError(f"--to {to}: no {to} layout for kind {config.kind!r}; supported: "
                         f"{SUPPORTED[config.kind] or 'none (our runtime only)'}")
    native = {"specheads": config.to_dict()}
    if config.kind == "medusa":
        tensors, config = _medusa_tensors(heads, to, lm_head_weight)
        if to == "tgi":
            return Exported(tensors, weights_file("medusa"),
                            {**engine_config(config), "specheads": config.to_dict()})
        layers = config.medusa_num_layers
        renamed = {}
        for h in range(config.medusa_num_heads):
            for l in range(layers):  # noqa: E741
                renamed[f"blocks.{h}.layers.{l}.weight"] = tensors[f"{h}.{l}.linear.weight"]
                renamed[f"blocks.{h}.layers.{l}.bias"] = tensors[f"{h}.{l}.linear.bias"]
            if not config.medusa_shared_lm_head:
                renamed[f"lm_heads.{h}.weight"] = tensors[f"{h}.{layers}.weight"]
        vllm_config = {"model_type": "medusa", "architectures": ["MedusaModel"],
                       "hidden_size": config.hidden_size, "vocab_size": config.vocab_size,
                       "num_heads": config.medusa_num_heads, "num_hidden_layers": layers,
                       "truncated_vocab_size": config.vocab_size, "medusa_fc_bias": True,
                       "base_model_name_or_path": config.base_model_name_or_path}
        if config.medusa_shared_lm_head:  # every head reads the one copy of the target's LM head
            renamed["lm_heads.0.weight"] = tensors[f"0.{layers}.weight"]
            vllm_config["original_lm_head"] = True
        return Exported(renamed, "model.safetensors", vllm_config)
    tensors = module_to_file_names(config.kind, heads.state_dict())
    if config.kind == "eagle3":
        return Exported(tensors, "model.safetensors", {**engine_config(config), **native})
    # EAGLE-1/2
    base = engine_config(config)
    if to == "eagle":
        return Exported(tensors, "model.safetensors", {**base, **native})
    if to == "vllm":
        bias = tensors.pop("fc.bias", None)
        if bias is not None and bool(bias.ne(0).any()):
            raise ValueError("--to vllm: vLLM's EAGLE-1/2 loader builds fc without a bias, but this head's fc.bias "
                             "is non-zero; train with eagle_fc_bias=False (or export --to sglang/eagle)")
        return Exported(tensors, "model.safetensors", {**base, "bias": False})
    # sglang: fc always has a bias there; a head trained without one gets zeros (same function).
    if "fc.bias" not in tensors:
        weight = tensors["fc.weight"]
        tensors["fc.bias"] = torch.zeros(weight.shape[0], dtype=weight.dtype)
    return Exported(tensors, "model.safetensors", {**base, "architectures": ["LlamaForCausalLMEagle"],
                                                   "bias": True})


def export_heads(heads_dir: str | Path, to: str, output_dir: str | Path, target: str | None = None) -> Path:
    """Load `heads_dir`, write its `to` layout into `output_dir` (atomically) with a model card."""
    heads = load_heads(heads_dir)
    lm_head_weight = None
    if target:
        from heads.checkpoint import check_compatible
        from heads.loading import load_model

        model = load_model(target)
        check_compatible(heads.config, model, target_name=target, source=str(heads_dir))
        lm_head_weight = model.get_output_embeddings().weight
    plan = plan_export(heads, to, lm_head_weight)
    output_dir = Path(output_dir)
    with atomic_directory(output_dir) as tmp:
        save_file({k: v.detach().contiguous().clone() for k, v in plan.tensors.items()},
                  str(tmp / plan.weights_file), metadata={"format": "pt"})
        write_json(tmp / CONFIG_FILE, plan.config)
        card = model_card(heads.config) + f"\nExported for {to} with `python -m heads.export --to {to}`.\n"
        (tmp / CARD_FILE).write_text(card)
    return output_dir


def main(argv: list[str] | None = None) -> None:
    torch.set_num_threads(1)
    flags = parse_flags(ExportFlags, argv)
    if not flags.heads or not flags.output_dir:
        raise ValueError("--heads and --output_dir are required")
    out = export_heads(flags.heads, flags.to, flags.output_dir, flags.target or None)
    print(f"exported {flags.heads} for {flags.to} -> {out}: {sorted(p.name for p in out.iterdir())}")


if __name__ == "__main__":
    from heads.cli import run_cli

    run_cli(main)
