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

LAYOUTS = ("auto", "rows", "transposed")
MIN_PARAMETERS = 10_000_000
MIN_GAIN = 0.05


def check_layout(layout: str, flag: str = "--weight_layout") -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"{flag} must be one of {LAYOUTS}, got {layout!r}")
    return layout


def linear_weights(model: nn.Module) -> list[nn.Parameter]:
    """The distinct 2-D weights of the model's nn.Linear layers (a tied LM head once)."""
    seen: dict[int, nn.Parameter] = {}
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.weight.dim() == 2:
            seen.setdefault(id(module.weight), module.weight)
    return list(seen.values())


def _is_transposed(weight: torch.Tensor) -> bool:
    return weight.shape[0] > 1 and weight.shape[1] > 1 and weight.stride() == (1, weight.shape[0])


def layout_of(model: nn.Module) -> str:
    """'transposed' when the model's Linear weights are stored transposed, else 'rows'."""
    weights = linear_weights(model)
    return "transposed" if weights and all(_is_transposed(w) for w in weights) else "rows"


@torch.no_grad()
def set_layout(model: nn.Module, layout: str) -> None:
    """Re-lay every Linear weight as `rows` or `transposed` (values unchanged; one weight copied at a time)."""
    if layout not in ("rows", "transposed"):
        raise ValueError(f"set_layout: layout must be 'rows' or 'transposed', got {layout!r}")
    for weight in linear_weights(model):
        if layout == "transposed" and not _is_transposed(weight):
            weight.data = weight.data.t().contiguous().t()
        elif layout == "rows" and not weight.data.is_contiguous():
            weight.data = weight.data.contiguous()


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
    """Median seconds of a 1-token forward of `target` in each layout (interleaved rounds); leaves it `rows`."""
    from runtime.cost_model import kv_length_within, measure_curve, target_verify_forward

    run = target_verify_forward(target, kv_length_within(target, kv_length, 1))
    samples: dict[str, list[float]] = {"rows": [], "transposed": []}
    for _ in range(rounds):
        for layout in samples:
            set_layout(target.model, layout)
            samples[layout].append(measure_curve(run, [1], repeats=repeats)[0])
    set_layout(target.model, "rows")
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
    if use_cache and path.is_file():
        seconds = json.loads(path.read_text())["seconds"]
    else:
        seconds = measure_layouts(target)
        if use_cache:
            from heads.files import atomic_write_json

            atomic_write_json(path, {"seconds": seconds})
    layout = "transposed" if seconds["transposed"] < (1 - MIN_GAIN) * seconds["rows"] else "rows"
    set_layout(model, layout)
    print(f"weight layout: {layout} (auto: a 1-token step {seconds['rows'] * 1e3:.1f} ms as loaded, "
          f"{seconds['transposed'] * 1e3:.1f} ms transposed)", file=log or sys.stderr)
    return layout
