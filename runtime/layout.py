"""How the target's Linear weights sit in memory on a CPU: as loaded (`rows`: [out, in] row-major) or `transposed`.

`transposed` keeps each weight as a [out, in] view of [in, out] contiguous storage, so `F.linear(x, W)` runs
`x @ W_stored` without a transpose flag and the BLAS picks another kernel for the few-row products of decoding.
Nothing else changes: same values, same modules, tied weights stay tied (the shared parameter is re-laid once).
Measured on this AVX2 VM (SmolLM2-135M, float32, one thread, the other core busy; the cost model's verify timing
in both layouts): a 1-token step 79-84 -> 69-73 ms, verifying 2 / 3 tokens 13-18% faster, 4 or more tokens 8-15% slower;
the 49k-row LM head alone 10.2 -> 5.7 ms at one row. Which layout is faster is a property of the CPU and its BLAS,
so `auto` measures it: a 1-token forward (plain decoding's step, which every drafter falls back to) in both
layouts, interleaved, and keeps `transposed` only when it is at least 5% faster. The choice is cached per model,
device and dtype (deterministic across runs: the kernel decides the rounding). CUDA and models under 10M
parameters (weights that sit in cache, where the layout does not matter) stay `rows` without measuring.
Cost curves are keyed by the layout (runtime.cost_model.model_fingerprint).
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

LAYOUTS = ("auto", "rows", "transposed", "rows+packed", "transposed+packed")
MIN_PARAMETERS = 10_000_000
MIN_GAIN = 0.05
PACK_BATCH_HINT = 8  # oneDNN's reorder is tuned for this many rows; 8 and 64 measured best here, 1 worst
VERIFY_PROBE = (2, 4, 8)  # token counts whose summed verify time decides `+packed` under auto
_PACKED = "_specheads_packed"


def check_layout(layout: str, flag: str = "--weight_layout") -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"{flag} must be one of {LAYOUTS}, got {layout!r}")
    return layout


def linear_modules(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if isinstance(m, nn.Linear) and m.weight.dim() == 2]


def linear_weights(model: nn.Module) -> list[nn.Parameter]:
    """The distinct 2-D weights of the model's nn.Linear layers (a tied LM head once)."""
    seen: dict[int, nn.Parameter] = {}
    for module in linear_modules(model):
        seen.setdefault(id(module.weight), module.weight)
    return list(seen.values())


def _is_transposed(weight: torch.Tensor) -> bool:
    return weight.shape[0] > 1 and weight.shape[1] > 1 and weight.stride() == (1, weight.shape[0])


def layout_of(model: nn.Module) -> str:
    """'rows' / 'transposed' (how the Linear weights are stored), '+packed' when a packed copy serves products of
    two or more rows."""
    weights = linear_weights(model)
    storage = "transposed" if weights and all(_is_transposed(w) for w in weights) else "rows"
    packed = any(_PACKED in module.__dict__ for module in linear_modules(model))
    return storage + ("+packed" if packed else "")


def _packed_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear.forward with the packed copy for 2+ rows; one row (a decode step) and autograd keep the stored
    weight, so plain decoding runs exactly the kernels it ran before packing."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows < 2 or torch.is_grad_enabled() or x.dtype != module.weight.dtype:
        return nn.functional.linear(x, module.weight, module.bias)
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, x.shape[-1]), module.__dict__[_PACKED], module.bias,
                                             "none", [], "")
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _unpack(model: nn.Module) -> None:
    for module in linear_modules(model):
        module.__dict__.pop(_PACKED, None)
        if getattr(module.__dict__.get("forward"), "__func__", None) is _packed_forward:
            del module.__dict__["forward"]


def _pack(model: nn.Module) -> None:
    weights = linear_weights(model)
    if not weights:
        return
    weight = weights[0]
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        raise ValueError(f"--weight_layout +packed needs a CPU target with oneDNN (mkldnn); this one is on "
                         f"{weight.device} (mkldnn available: {torch.backends.mkldnn.is_available()})")
    packed: dict[int, torch.Tensor] = {}
    for module in linear_modules(model):
        key = id(module.weight)
        if key not in packed:
            try:
                packed[key] = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), PACK_BATCH_HINT)
            except RuntimeError as error:
                _unpack(model)
                raise ValueError(f"--weight_layout +packed: oneDNN cannot pack {module.weight.dtype} weights on this "
                                 f"CPU ({str(error).splitlines()[0]})") from None
        module.__dict__[_PACKED] = packed[key]
        module.forward = _packed_forward.__get__(module)


@torch.no_grad()
def set_layout(model: nn.Module, layout: str) -> None:
    """Re-lay every Linear weight as `rows` or `transposed` (values unchanged; one weight copied at a time) and, for
    `...+packed`, add a oneDNN-packed copy of each weight that products of two or more rows use."""
    if layout not in LAYOUTS[1:]:
        raise ValueError(f"set_layout: layout must be one of {LAYOUTS[1:]}, got {layout!r}")
    storage, _, packed = layout.partition("+")
    _unpack(model)
    for weight in linear_weights(model):
        if storage == "transposed" and not _is_transposed(weight):
            weight.data = weight.data.t().contiguous().t()
        elif storage == "rows" and not weight.data.is_contiguous():
            weight.data = weight.data.contiguous()
    if packed:
        _pack(model)


@contextmanager
def as_loaded(model: nn.Module) -> Iterator[None]:
    """The model's Linear weights as loaded (`rows`) inside the block, its layout restored after: transformers'
    own `generate` as a user runs it, next to our loop on the re-laid weights."""
    layout = layout_of(model)
    if layout == "rows":
        yield
        return
    set_layout(model, "rows")
    try:
        yield
    finally:
        set_layout(model, layout)


def _cache_path(fingerprint: str, device: str, dtype: str):
    import re

    from heads.loading import cache_dir

    key = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{fingerprint}__{device}__{dtype}")
    return cache_dir() / "layouts" / f"{key}.json"


def measure_layouts(target, kv_length: int = 256, rounds: int = 3, repeats: int = 5) -> dict[str, float]:
    """Median seconds of a 1-token forward of `target` in each storage (interleaved rounds); leaves it `rows`."""
    from runtime.cost_model import kv_length_within, measure_curve, target_verify_forward

    run = target_verify_forward(target, kv_length_within(target, kv_length, 1))
    samples: dict[str, list[float]] = {"rows": [], "transposed": []}
    for _ in range(rounds):
        for layout in samples:
            set_layout(target.model, layout)
            samples[layout].append(measure_curve(run, [1], repeats=repeats)[0])
    set_layout(target.model, "rows")
    return {layout: statistics.median(values) for layout, values in samples.items()}


def measure_packing(target, storage: str, kv_length: int = 256, rounds: int = 3,
                    repeats: int = 5) -> dict[str, float]:
    """Median seconds of verifying VERIFY_PROBE tokens (summed) on `storage` with and without the packed copy
    (interleaved rounds); leaves the model in `storage`. Empty when oneDNN cannot pack this model."""
    from runtime.cost_model import kv_length_within, measure_curve, target_verify_forward

    run = target_verify_forward(target, kv_length_within(target, kv_length, max(VERIFY_PROBE)))
    samples: dict[str, list[float]] = {storage: [], f"{storage}+packed": []}
    try:
        for _ in range(rounds):
            for layout in samples:
                set_layout(target.model, layout)
                samples[layout].append(sum(measure_curve(run, list(VERIFY_PROBE), repeats=repeats)))
    except ValueError:
        return {}
    finally:
        set_layout(target.model, storage)
    return {layout: statistics.median(values) for layout, values in samples.items()}


def choose_layout(target, requested: str = "auto", use_cache: bool = True, log=None) -> str:
    """Apply `requested` (auto: measured, see the module docstring) to target.model; returns the layout used."""
    check_layout(requested)
    model = target.model
    if requested != "auto":
        set_layout(model, requested)
        return requested
    device = next(model.parameters()).device
    if device.type != "cpu" or sum(p.numel() for p in model.parameters()) < MIN_PARAMETERS:
        set_layout(model, "rows")
        return "rows"
    from runtime.cost_model import device_name, model_fingerprint

    set_layout(model, "rows")
    path = _cache_path(model_fingerprint(model), device_name(device), str(model.dtype).removeprefix("torch."))
    cached = json.loads(path.read_text()) if use_cache and path.is_file() else {}
    seconds = cached.get("seconds") or measure_layouts(target)
    storage = "transposed" if seconds["transposed"] < (1 - MIN_GAIN) * seconds["rows"] else "rows"
    verify = cached.get("verify_seconds")
    if verify is None:
        verify = measure_packing(target, storage)
    if use_cache and (cached.get("seconds") != seconds or cached.get("verify_seconds") != verify):
        from heads.files import atomic_write_json

        atomic_write_json(path, {"seconds": seconds, "verify_seconds": verify})
    packed = f"{storage}+packed"
    layout = packed if packed in verify and verify[packed] < (1 - MIN_GAIN) * verify[storage] else storage
    set_layout(model, layout)
    probe = "+".join(map(str, VERIFY_PROBE))
    packing = (f"; verifying {probe} tokens {verify[storage] * 1e3:.0f} ms, {verify[packed] * 1e3:.0f} ms packed"
               if packed in verify else "; oneDNN cannot pack these weights")
    print(f"weight layout: {layout} (auto: a 1-token step {seconds['rows'] * 1e3:.1f} ms as loaded, "
          f"{seconds['transposed'] * 1e3:.1f} ms transposed{packing})", file=log or sys.stderr)
    return layout
