"""Load a target (or draft) causal LM and its tokenizer from a Hub id, a local directory or a GGUF file.

This is the one place the project turns a model name into a `transformers` model. It lives in `heads/`
because every other package (runtime, training, data) needs it and `heads/` imports nothing of ours.

GGUF checkpoints are dequantised by transformers (slow: about a minute for a 135M model), so the first
load saves a converted safetensors copy under the cache directory and later loads read that copy.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from heads import cache

DEFAULT_MODEL = "../shared/models/smollm2-135m-instruct"
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float64": torch.float64, "fp64": torch.float64,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """'bf16' / 'bfloat16' / torch.bfloat16 -> torch.bfloat16; raises naming the accepted values."""
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ValueError(f"--dtype: expected one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


CPU_BF16_ENV = "SPECHEADS_CPU_BF16"
CPU_BF16_CHOICES = ("native", "emulated")


def cpu_bf16_override() -> bool | None:
    """$SPECHEADS_CPU_BF16: 'native' / 'emulated' force the CPU's bf16 decision (--dtype auto, bf16 attention in
    float32, ...) as if the CPU had / lacked AVX512-BF16 or AMX, so one machine can run the code paths of both
    kinds; unset, '' or 'detect' reads the CPU. Anything else is an error naming the variable."""
    value = os.environ.get(CPU_BF16_ENV, "").strip().lower()
    if value in ("", "detect"):
        return None
    if value not in CPU_BF16_CHOICES:
        raise ValueError(f"{CPU_BF16_ENV}={value!r}: expected one of {CPU_BF16_CHOICES} (or unset / 'detect')")
    return value == "native"


def fast_bf16(device: str | torch.device = "cpu") -> bool:
    """True where bf16 matmuls beat fp32: CUDA with bf16 support, or a CPU with AVX512-BF16 or AMX.

    Read from torch's own CPU checks (a hypervisor may hide the flags from /proc/cpuinfo), unless
    $SPECHEADS_CPU_BF16 forces the answer on a CPU (`cpu_bf16_override`). Without them torch emulates bf16 matmuls
    (measured on an AVX2-only VM: 4-8x slower than fp32).
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    forced = cpu_bf16_override()
    if forced is not None:
        return forced
    cpu = torch.cpu
    return any(getattr(cpu, name, lambda: False)() for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def resolve_dtype(name: str | torch.dtype, device: str | torch.device = "cpu", flag: str = "--dtype") -> torch.dtype:
    """`--dtype auto` -> bfloat16 where it is fast (`fast_bf16`), float32 elsewhere; explicit names parsed.

    bfloat16 on a CPU without fast bf16 warns (it runs, slowly); float16 on a CPU is an error (no fast kernels,
    and half-precision softmax/matmul accumulate badly there).
    """
    import warnings

    device = torch.device(device)
    if isinstance(name, str) and name == "auto":
        return torch.bfloat16 if fast_bf16(device) else torch.float32
    try:
        dtype = parse_dtype(name)
    except ValueError:
        raise ValueError(f"{flag}: expected auto or one of {sorted(_DTYPES)}, got {name!r}") from None
    if device.type == "cpu" and dtype == torch.float16:
        raise ValueError(f"{flag} float16 on CPU: no fast float16 kernels here; use {flag} auto, bfloat16 or float32")
    if device.type == "cpu" and dtype == torch.bfloat16 and not fast_bf16(device):
        warnings.warn(f"{flag} bfloat16: this CPU has neither AVX512-BF16 nor AMX, so torch's bf16 matmuls are "
                      f"emulated (several times slower than float32); the runtime's panel layout (--weight_layout auto "
                      f"or +panels) runs them with its own kernel instead; {flag} auto picks float32 here",
                      stacklevel=2)
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16' (the name records, cache keys and flags use)."""
    return str(dtype).removeprefix("torch.")


def describe_dtype(dtype: torch.dtype, requested: str | torch.dtype, device: str | torch.device = "cpu") -> str:
    """One line saying which dtype runs and why, e.g. 'dtype: float32 (auto: no AVX512-BF16/AMX on this CPU)'."""
    name = dtype_name(dtype)
    if requested != "auto":
        return f"dtype: {name}"
    device = torch.device(device)
    where = "CUDA" if device.type == "cuda" else "this CPU"
    why = "fast bf16 on " + where if dtype == torch.bfloat16 else f"no AVX512-BF16/AMX on {where}"
    if device.type == "cuda" and dtype != torch.bfloat16:
        why = "no bf16 support on this GPU"
    if device.type == "cpu" and cpu_bf16_override() is not None:
        why += f", as {CPU_BF16_ENV}={os.environ[CPU_BF16_ENV].strip()} says"
    return f"dtype: {name} (auto: {why})"


@dataclass(frozen=True)
class ModelSource:
    """A resolved model location: a directory or Hub id, and the GGUF file inside it if any."""

    name_or_path: str
    gguf_file: str | None = None


def resolve_source(name_or_path: str) -> ModelSource:
    """Find out whether `name_or_path` is a GGUF file, a directory holding one, a HF directory or a Hub id."""
    path = Path(name_or_path)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"--model {name_or_path}: a file must be a .gguf checkpoint; pass a directory otherwise")
        return ModelSource(str(path.parent), path.name)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(str(path))
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(str(path), ggufs[0].name)
        if len(ggufs) > 1:
            raise ValueError(f"--model {name_or_path}: holds several .gguf files {[g.name for g in ggufs]}; "
                             "pass the file itself")
        raise FileNotFoundError(f"--model {name_or_path}: directory has neither config.json nor a .gguf file")
    if name_or_path.startswith((".", "/")) or name_or_path.count("/") > 1:
        raise FileNotFoundError(f"--model {name_or_path}: no such file or directory")
    return ModelSource(name_or_path)  # a Hub id


# Files of a GGUF directory that go into its converted copy besides the weights: the tokenizer's (read by
# _load_tokenizer) and those copied as they are.
_COPIED_FILES = ("generation_config.json", "chat_template.jinja")
_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", *_COPIED_FILES)
_EDGE_BYTES = 4 << 20


def _converted_path(source: ModelSource) -> Path:
    """The cached copy of a GGUF checkpoint, keyed by content, not by path: the GGUF's size and its first and last
    4 MiB, and the side files the copy takes (a corrected tokenizer.json changes the key; the same files under
    another path or checkout share one copy)."""
    directory = Path(source.name_or_path)
    gguf = directory / source.gguf_file
    size = gguf.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(gguf, "rb") as f:
        digest.update(f.read(_EDGE_BYTES))
        f.seek(max(size - _EDGE_BYTES, 0))
        digest.update(f.read(_EDGE_BYTES))
    for name in _SIDE_FILES:
        if (directory / name).is_file():
            digest.update(f"|{name}|".encode() + (directory / name).read_bytes())
    return cache.entry("converted", f"{gguf.stem}-{digest.hexdigest()[:16]}")


def _convert_gguf(source: ModelSource) -> Path:
    """Dequantise a GGUF checkpoint once and keep a safetensors copy: built by one process while the others wait
    (heads.cache: safe under `accelerate launch`), trusted only when complete, rebuilt when cut short."""
    return cache.build_directory(_converted_path(source), lambda tmp: _write_converted(source, tmp),
                                 f"the converted copy of {Path(source.name_or_path) / source.gguf_file}")


def _write_converted(source: ModelSource, out: Path) -> None:
    """Write the dequantised model (config, generation config, model.safetensors), its tokenizer and side files into
    `out`. The weights are written with safetensors directly: transformers' save_pretrained writes nothing on a rank
    other than 0 of an initialised process group, and any rank may be the one that builds the cache entry."""
    quantized = AutoModelForCausalLM.from_pretrained(source.name_or_path, gguf_file=source.gguf_file,
                                                     dtype=torch.float32)
    # transformers refuses to save a GGUF-loaded model; write a plain one from its config and weights.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(quantized).__name__]
    config.dtype = torch.float32
    weights: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in quantized.state_dict().items():
        if tensor.data_ptr() in seen:  # a tied weight (the LM head): stored once, re-tied on load
            continue
        seen.add(tensor.data_ptr())
        weights[name] = tensor.detach().contiguous()
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.to_json_file(str(out / "config.json"))
    quantized.generation_config.to_json_file(str(out / "generation_config.json"))
    _load_tokenizer(source).save_pretrained(out)
    for extra in _COPIED_FILES:
        if (Path(source.name_or_path) / extra).is_file():
            shutil.copy(Path(source.name_or_path) / extra, out / extra)
    (out / "SOURCE").write_text(str((Path(source.name_or_path) / source.gguf_file).resolve()) + "\n")
    del quantized


def _load_tokenizer(source: ModelSource) -> PreTrainedTokenizerBase:
    directory = Path(source.name_or_path)
    if source.gguf_file and not (directory / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(source.name_or_path, gguf_file=source.gguf_file)
    return AutoTokenizer.from_pretrained(source.name_or_path)


def model_path(name_or_path: str) -> str:
    """A directory or Hub id that `from_pretrained` reads without GGUF (converting a GGUF once if needed)."""
    source = resolve_source(name_or_path)
    return str(_convert_gguf(source)) if source.gguf_file else source.name_or_path


def _hub_error(name_or_path: str, error: OSError) -> FileNotFoundError:
    """A Hub id that did not load (offline, unknown id, gated) -> one error naming the flag and the way out."""
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return FileNotFoundError(f"--model {name_or_path}: not a local file or directory, and the Hugging Face Hub did "
                             f"not provide it ({reason}); pass a local model directory or .gguf file, or check the id")


def _is_hub_id(name_or_path: str) -> bool:
    return not Path(name_or_path).exists()


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """The tokenizer of a model given as Hub id, directory or GGUF (reads the converted copy for GGUF)."""
    path = model_path(name_or_path)
    try:
        return AutoTokenizer.from_pretrained(path)
    except OSError as error:
        if not _is_hub_id(path):
            raise
        raise _hub_error(name_or_path, error) from error


def load_model(
    name_or_path: str,
    dtype: str | torch.dtype = "auto",
    attn_implementation: str = "sdpa",
    device: str | torch.device = "cpu",
    revision: str | None = None,
    dtype_flag: str = "--dtype",
) -> PreTrainedModel:
    """Load a causal LM in eval mode from a Hub id, a local directory or a GGUF file (cached conversion).

    dtype: 'auto' (bfloat16 where fast, float32 elsewhere: `resolve_dtype`), a name or a torch.dtype;
    dtype_flag: the flag named in dtype errors and warnings (e.g. --target_dtype).
    """
    path = model_path(name_or_path)
    kwargs = {"dtype": resolve_dtype(dtype, device, dtype_flag), "attn_implementation": attn_implementation}
    if revision is not None:
        kwargs["revision"] = revision
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except OSError as error:
        if not _is_hub_id(path):
            raise
        raise _hub_error(name_or_path, error) from error
    except ValueError as err:
        if "does not support" not in str(err) or attn_implementation != "sdpa":
            raise
        # no sdpa for this class (e.g. ALiBi or state-space families): load eager and say so; the runtime's
        # verify check (runtime/verify_check.py) then decides what the model supports
        import warnings

        warnings.warn(f"--attn_implementation sdpa: {type(err).__name__} for --model {name_or_path} (no sdpa "
                      f"attention for this model class); loaded with eager attention", stacklevel=2)
        model = AutoModelForCausalLM.from_pretrained(path, **{**kwargs, "attn_implementation": "eager"})
    return model.to(device).eval()


def load_model_and_tokenizer(name_or_path: str, **kwargs) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """`load_model` plus `load_tokenizer` for the same source."""
    return load_model(name_or_path, **kwargs), load_tokenizer(name_or_path)
