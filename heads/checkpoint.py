"""Build, save, load and push head directories (the one implementation; the modules' methods call these).

A head directory holds exactly three files:

- `config.json`: the keys the serving engine for that kind reads (see heads/FORMATS.md) plus our full
  `HeadsConfig` under the key "specheads" (engines ignore it).
- the weights: `medusa_lm_head.safetensors` for Medusa (the FasterDecoding/TGI file name), `model.safetensors`
  for the other kinds. Only the head's own weights: never the target's embedding or LM head.
- `README.md`: the model card (base model, method, training data, measured acceptance from `metrics`).

plus, for Medusa / EAGLE-1/2 / MTP heads given a reduced draft vocabulary (heads.draft_vocab), `draft_vocab.safetensors`
with EAGLE-3's `d2t` / `t2d` tensors: used by our runtime for drafting only, kept out of the weights file so the
engines load the weights as before (they draft over the full vocabulary). EAGLE-3 keeps d2t/t2d in its weights.

Directories are written atomically (a temporary sibling directory renamed into place).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from huggingface_hub import HfApi
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from heads.config import HEAD_CLASSES, OWN_LM_HEAD_KINDS, HeadsConfig
from heads.draft_vocab import validate_vocab_mapping

if TYPE_CHECKING:  # annotations only: heads.base imports this module for save_pretrained / from_pretrained
    from heads.base import HeadsModule

CONFIG_FILE = "config.json"
CARD_FILE = "README.md"
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"


def weights_file(kind: str) -> str:
    """File name of the weights for `kind` (Medusa keeps the name TGI downloads)."""
    return "medusa_lm_head.safetensors" if kind == "medusa" else "model.safetensors"


def build_heads(config: HeadsConfig) -> HeadsModule:
    """A freshly initialised head module of `config.kind`."""
    return HEAD_CLASSES[config.kind](config)


# ---- tensor names on disk ------------------------------------------------------------------------------

def module_to_file_names(kind: str, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Module state dict -> tensors as named on disk (Medusa drops the `heads.` prefix)."""
    if kind == "medusa":
        return {name.removeprefix("heads."): t for name, t in state.items()}
    return dict(state)


def file_to_module_names(kind: str, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    if kind == "medusa":
        return {f"heads.{name}": t for name, t in tensors.items()}
    return dict(tensors)


# ---- engine-facing config keys ---------------------------------------------------------------------------

def _llama_keys(config: HeadsConfig) -> dict[str, Any]:
    """The Llama config keys a draft with one decoder layer declares (vLLM/SGLang/EAGLE read these)."""
    rope = dict(config.rope_parameters)
    keys: dict[str, Any] = {
        "model_type": "llama", "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim, "num_hidden_layers": 1, "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps, "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size, "rope_theta": rope["rope_theta"], "tie_word_embeddings": False,
        "attention_bias": config.attention_bias, "torch_dtype": config.dtype,
    }
    if rope.get("rope_type", "default") != "default":
        keys["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    keys["rope_parameters"] = rope
    return keys


def draft_layer_keys(config: HeadsConfig) -> dict[str, Any]:
    """The Llama config keys of the draft's decoder layer geometry (exports build engine configs from them)."""
    return _llama_keys(config)


def engine_config(config: HeadsConfig) -> dict[str, Any]:
    """Top-level config.json keys for our native layout of `config.kind` (see heads/FORMATS.md)."""
    if config.kind == "medusa":
        return {"medusa_num_heads": config.medusa_num_heads, "medusa_num_layers": config.medusa_num_layers,
                "base_model_name_or_path": config.base_model_name_or_path,
                "hidden_size": config.hidden_size, "vocab_size": config.vocab_size}
    if config.kind == "eagle":
        # Never "bias": true (vLLM reads it as attention biases; the reference defaults to an fc bias anyway), and a
        # head with an fc bias declares SGLang's architecture, which vLLM refuses instead of dropping fc.bias.
        if config.eagle_fc_bias:
            return {"architectures": ["LlamaForCausalLMEagle"], **_llama_keys(config)}
        return {"architectures": ["LlamaForCausalLM"], **_llama_keys(config), "bias": False}
    if config.kind == "eagle3":
        return {"architectures": ["LlamaForCausalLMEagle3"], **_llama_keys(config),
                "draft_vocab_size": config.draft_vocab_size, "target_hidden_size": config.hidden_size,
                # vLLM reads the top-level ids as hidden_states indices; SGLang reads eagle_config's ids
                # as "output of layer id" and adds 1, so they are one less.
                "eagle_aux_hidden_state_layer_ids": list(config.target_layers),
                "eagle_config": {"use_aux_hidden_state": True,
                                 "eagle_aux_hidden_state_layer_ids": [i - 1 for i in config.target_layers]},
                # vLLM's EAGLE-3 layer reads it (default false); written only when set, so that the usual heads
                # keep the config SGLang and the reference read
                **({"norm_before_residual": True} if config.norm_before_residual else {})}
    if config.kind in ("dflash", "peagle"):
        # our own layout (`python -m heads.export --to speculators` writes the one vLLM loads)
        return {"architectures": ["SpecheadsDFlash" if config.kind == "dflash" else "SpecheadsPEagle"],
                "block_size": config.block_size, "mask_token_id": config.mask_token_id,
                "num_hidden_layers": config.num_draft_layers,
                "aux_hidden_state_layer_ids": list(config.target_layers)}
    return {"architectures": ["SpecheadsMTP"], "mtp_num_depths": config.mtp_num_depths}


# ---- atomic writes -------------------------------------------------------------------------------------

@contextmanager
def atomic_directory(directory: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it replaces `directory` (old content removed)."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        yield tmp
        if directory.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{directory.name}.old-", dir=directory.parent))
            os.replace(directory, old / "d")
            os.replace(tmp, directory)
            shutil.rmtree(old)
        else:
            os.replace(tmp, directory)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


# ---- model card ----------------------------------------------------------------------------------------

_METHOD = {"medusa": "Medusa heads", "eagle": "EAGLE-1/2 draft layer", "eagle3": "EAGLE-3 draft layer",
           "mtp": "multi-token prediction (DeepSeek-V3 style) modules", "dflash": "DFlash block-diffusion drafter",
           "peagle": "P-EAGLE parallel EAGLE-3 drafter"}


def model_card(config: HeadsConfig) -> str:
    """README.md text: YAML front matter + what the head is, what it was trained on, how well it drafts."""
    lines = ["---", f"base_model: {config.base_model_name_or_path}", "library_name: specheads",
             "tags:", "- speculative-decoding", f"- {config.kind}", "---", "",
             f"# {_METHOD[config.kind]} for {config.base_model_name_or_path}", "",
             f"- Method: {_METHOD[config.kind]} (`kind: {config.kind}`)",
             f"- Base model: `{config.base_model_name_or_path}`"
             + (f" (revision `{config.base_model_revision}`)" if config.base_model_revision else ""),
             f"- Target hidden_states indices feeding the head: {config.target_layers}",
             f"- Training data: {config.training_data or 'not recorded'}",
             f"- Format version: {config.format_version}, weights dtype {config.dtype}", ""]
    if config.kind == "medusa":
        lines.append(f"- {config.medusa_num_heads} heads x {config.medusa_num_layers} residual blocks"
                     + (", shared target LM head" if config.medusa_shared_lm_head else ""))
    if config.kind == "eagle3":
        lines.append(f"- Draft vocabulary: {config.draft_vocab_size} of {config.vocab_size} target ids (d2t/t2d)")
    elif config.draft_vocab_size:
        lines.append(f"- Draft vocabulary: {config.draft_vocab_size} of {config.vocab_size} target ids "
                     f"({DRAFT_VOCAB_FILE}, drafting only)")
    if config.kind == "mtp":
        lines.append(f"- Depths: {config.mtp_num_depths}")
    lines += ["", "## Measured acceptance", ""]
    if config.metrics:
        lines += ["| metric | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in sorted(config.metrics.items())]
    else:
        lines.append("Not measured yet.")
    lines += ["", "## Use", "", "```python", "from heads.checkpoint import load_heads",
              "heads = load_heads(\"<this repo>\", target=target_model)", "```", "",
              "Layout and engine compatibility: see specheads' heads/FORMATS.md.", ""]
    return "\n".join(lines)


# ---- save / load ---------------------------------------------------------------------------------------

def _tensor_dtype(heads: HeadsModule) -> str:
    floats = [p.dtype for p in heads.parameters() if p.is_floating_point()]
    return str(floats[0]).replace("torch.", "") if floats else heads.config.dtype


def save_heads(heads: HeadsModule, directory: str | Path) -> Path:
    """Write config.json, the weights file and README.md into `directory` (atomically). Returns the path."""
    config = heads.config
    config.dtype = _tensor_dtype(heads)
    separate_vocab = config.kind not in OWN_LM_HEAD_KINDS and heads.has_draft_vocab
    if config.kind in OWN_LM_HEAD_KINDS or separate_vocab:
        validate_vocab_mapping(heads.d2t.cpu(), heads.t2d.cpu(), config.vocab_size, config.draft_vocab_size,
                               "save_heads")
    tensors = {name: t.detach().to("cpu").contiguous().clone()
               for name, t in module_to_file_names(config.kind, heads.state_dict()).items()}
    directory = Path(directory)
    with atomic_directory(directory) as tmp:
        save_file(tensors, str(tmp / weights_file(config.kind)), metadata={"format": "pt"})
        if separate_vocab:
            save_file({"d2t": heads.d2t.cpu().contiguous(), "t2d": heads.t2d.cpu().contiguous()},
                      str(tmp / DRAFT_VOCAB_FILE), metadata={"format": "pt"})
        write_json(tmp / CONFIG_FILE, {**engine_config(config), "specheads": config.to_dict()})
        (tmp / CARD_FILE).write_text(model_card(config))
    return directory


def resolve_directory(directory_or_repo: str | Path, revision: str | None = None) -> Path:
    """A local directory as is; otherwise a Hub repo id downloaded with huggingface_hub."""
    path = Path(directory_or_repo)
    if path.is_dir():
        return path
    text = str(directory_or_repo)
    if text.startswith((".", "/")) or text.count("/") != 1:
        raise FileNotFoundError(f"--heads {text}: no such directory (and not a Hub repo id 'owner/name')")
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(huggingface_hub.snapshot_download(text, revision=revision))
    except (HfHubHTTPError, LocalEntryNotFoundError) as err:
        raise FileNotFoundError(f"--heads {text}: not a local directory and not downloadable from the Hub "
                                f"({type(err).__name__}: {err})") from err


def read_config(directory: Path) -> HeadsConfig:
    """Parse `directory/config.json`; clear errors for missing files, foreign layouts and bad keys."""
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; a head directory needs config.json")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from err
    if "specheads" not in data:
        raise ValueError(f"{path}: no 'specheads' section; this is not a specheads head directory. Import "
                         "Medusa/EAGLE/EAGLE-3 checkpoints first: python -m heads.convert --source DIR "
                         "--base_model NAME --output_dir OUT")
    return HeadsConfig.from_dict(data["specheads"], source=str(path))


def read_safetensors(path: Path) -> dict[str, Tensor]:
    """Load a safetensors file; ValueError naming the file if it is corrupt or truncated."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing weights file")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, RuntimeError) as err:
        raise ValueError(f"{path}: corrupt or truncated safetensors file ({err})") from err


def check_state(heads: HeadsModule, tensors: dict[str, Tensor], source: str) -> None:
    """Names and shapes of `tensors` (module names) must equal the module's; ValueError naming `source`."""
    expected = heads.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{source}: tensors do not match a {heads.config.kind!r} head built from its config: "
                         f"missing {missing[:8]}, unexpected {unexpected[:8]}")
    wrong = [f"{n}: expected {list(expected[n].shape)}, got {list(t.shape)}" for n, t in tensors.items()
             if tuple(t.shape) != tuple(expected[n].shape)]
    if wrong:
        raise ValueError(f"{source}: wrong tensor shapes: {'; '.join(wrong[:8])}")


def load_heads(directory_or_repo: str | Path, target: Any = None, *, target_name: str | None = None,
               revision: str | None = None, device: str | torch.device | None = None,
               dtype: torch.dtype | None = None, allow_base_model_mismatch: bool = False) -> HeadsModule:
    """Load a head directory (or Hub repo id) written by `save_heads`, dispatching on its kind.

    With `target` (a transformers model or config) the head must fit it: hidden size, vocabulary and
    layer count must match, and the base model name must match `target_name` (default: the target's
    `_name_or_path`) unless `allow_base_model_mismatch`. Errors name both models.
    """
    directory = resolve_directory(directory_or_repo, revision)
    config = read_config(directory)
    if target is not None:
        check_compatible(config, target, target_name=target_name,
                         allow_base_model_mismatch=allow_base_model_mismatch, source=str(directory))
    wfile = directory / weights_file(config.kind)
    tensors = file_to_module_names(config.kind, read_safetensors(wfile))
    heads = build_heads(config)
    check_state(heads, tensors, str(wfile))
    if config.kind in OWN_LM_HEAD_KINDS:
        validate_vocab_mapping(tensors["d2t"], tensors["t2d"], config.vocab_size, config.draft_vocab_size,
                               str(wfile))
    heads.load_state_dict(tensors, strict=True)
    if config.kind not in OWN_LM_HEAD_KINDS and config.draft_vocab_size:
        vocab = read_safetensors(directory / DRAFT_VOCAB_FILE)
        if set(vocab) != {"d2t", "t2d"}:
            raise ValueError(f"{directory / DRAFT_VOCAB_FILE}: expected tensors d2t and t2d, got {sorted(vocab)}")
        validate_vocab_mapping(vocab["d2t"], vocab["t2d"], config.vocab_size, config.draft_vocab_size,
                               str(directory / DRAFT_VOCAB_FILE))
        heads.set_vocab_mapping(vocab["d2t"], vocab["t2d"])
    floats = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(floats) == 1:
        heads.to(next(iter(floats)))
    if dtype is not None:
        heads.to(dtype)
    if device is not None:
        heads.to(device)
    return heads.eval()


def _same_model(a: str, b: str) -> bool:
    """Same base model: equal names, the same local directory, or equal last path components."""
    if a.rstrip("/") == b.rstrip("/"):
        return True
    pa, pb = Path(a), Path(b)
    if pa.exists() and pb.exists() and pa.resolve() == pb.resolve():
        return True
    return pa.name.lower() == pb.name.lower() and pa.name != ""


def check_compatible(config: HeadsConfig, target: Any, *, target_name: str | None = None,
                     allow_base_model_mismatch: bool = False, source: str = "heads") -> None:
    """Raise ValueError naming both models if the head cannot run on `target` (model or config)."""
    target_config = getattr(target, "config", target)
    text = getattr(target_config, "get_text_config", None)
    if callable(text):
        target_config = text()
    name = target_name or getattr(target_config, "_name_or_path", "") or "<unnamed target>"
    head_name = config.base_model_name_or_path
    problems = []
    for field in ("hidden_size", "vocab_size", "num_hidden_layers"):
        want, have = getattr(config, field), getattr(target_config, field, None)
        if want != have:
            problems.append(f"{field} {want} (head) vs {have} (target)")
    if not allow_base_model_mismatch and name != "<unnamed target>" and not _same_model(head_name, name):
        problems.append(f"base model {head_name!r} (head) vs {name!r} (target)")
    if problems:
        raise ValueError(f"{source}: head trained for {head_name!r} cannot run on target {name!r}: "
                         + "; ".join(problems))


# ---- Hub -----------------------------------------------------------------------------------------------

def push_directory(directory: str | Path, repo_id: str, *, private: bool = False, token: str | None = None,
                   revision: str | None = None, commit_message: str | None = None) -> str:
    """Upload exactly the files of `directory` to the model repo `repo_id` (created if needed)."""
    directory = Path(directory)
    read_config(directory)  # refuse to publish something we could not load back
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    info = api.upload_folder(repo_id=repo_id, folder_path=str(directory), repo_type="model", revision=revision,
                             commit_message=commit_message or f"Upload specheads {directory.name}")
    return str(getattr(info, "commit_url", info))


def push_to_hub(heads: HeadsModule, repo_id: str, **kwargs: Any) -> str:
    """save_heads into a temporary directory, then push_directory it. Returns the commit URL."""
    with tempfile.TemporaryDirectory(prefix="specheads-push-") as tmp:
        directory = save_heads(heads, Path(tmp) / "heads")
        return push_directory(directory, repo_id, **kwargs)
