"""How the target's Linear weights sit in memory on a CPU: as loaded (`rows`: [out, in] row-major) or `transposed`,
each optionally `+packed` or `+panels`.

`transposed` keeps each weight as a [out, in] view of [in, out] contiguous storage, so `F.linear(x, W)` runs
`x @ W_stored` without a transpose flag and the BLAS picks another kernel for the few-row products of decoding.
`+packed` adds one oneDNN-packed copy of each distinct weight (as many bytes again) that products of two or more
rows (verify forwards) use; a one-row product (a plain decode step) and anything under autograd keep the stored
weight and its kernel. `+panels` instead adds a copy in the 8-column panels of our compiled small-row kernel
(runtime.kernels), which serves every product of 1 to PANEL_MAX_ROWS rows (decode steps and verify forwards alike)
reading the weight once, so a verify of 2-8 tokens costs about what one token costs; more rows (prefill) and
autograd keep the stored weight. Panels are bfloat16 for a bfloat16 model and for float32 weights that are all
bfloat16 values (a bf16 checkpoint loaded in float32: the same products to the last bit from half the bytes), and
bfloat16 panels serve every row count, prefill included (faster than the float32 BLAS even at 64-128 rows; torch
emulates bf16 products on CPUs without AVX512-BF16/AMX, the kernel is 5-10x faster there). `+panels_bf16` rounds
float32 weights to bfloat16 in the panels on request (activations, attention and the KV cache stay float32; the
stored weight is untouched, so `rows` gives the original model back); auto never picks it, since it changes the
weights. SmolLM2-135M, one thread, KV 256, 1 / 2 / 4 / 8 / 16 tokens: float32 transposed+panels 52 / 55 / 64 / 78 /
122 ms, bfloat16 rows+panels 41 / 42 / 53 / 68 / 110 ms, float32 transposed+panels_bf16 37 / 39 / 50 / 65 / 101 ms.
Except for `+panels_bf16`, nothing else changes: same values, same modules, tied weights stay tied (the shared
parameter is re-laid and packed once); output moves by float rounding only.
Measured on this AVX2 VM (SmolLM2-135M, float32, one thread, the cost model's verify timing, KV 256): a 1-token
step 71 ms as loaded, 56-62 ms transposed; verifying 2 / 4 / 8 tokens 84-90 / 123-138 / 137-156 ms transposed,
91-95 / 108-114 / 122-132 ms transposed+packed. Which layout is faster is a property of the CPU and its BLAS, so
`auto` measures it: the storage by a 1-token forward (plain decoding's step, which every drafter falls back to)
in both storages, interleaved, kept `transposed` only when at least 5% faster; then packing by the verify time
of each VERIFY_PROBE size with and without the packed copy: used from the smallest size where it is faster at
every larger size and at least 5% faster summed over them (`+packedN`, packed_min_rows), and only when the copy
leaves a quarter of the available memory free. The choice is cached per model, device and dtype (deterministic
across runs: the kernel decides the rounding). For float32 weights auto then measures `storage+panels` against
that choice on a 1-token step and the VERIFY_PROBE verifies, interleaved, and takes it when it is at least 5% faster
summed over them and not slower (by more than 5%) at 1 token: plain decoding runs on it too (measured here: 1 / 2 /
3 / 4 / 8 tokens 65 / 92 / 105 / 115 / 133 ms transposed+packed3, 53 / 62 / 71 / 75 / 95 ms transposed+panels).
A bfloat16 model on a CPU gets `rows+panels` without measuring, whatever its size: every product then runs the
batch-invariant kernel, so a verify computes what one-token steps compute (with runtime.kernels.row_attention:
speculative output == plain bf16 decoding), and bf16 panels were the measured choice on every CPU tried anyway.
CUDA and float32 models under 10M parameters (weights that sit in cache, where the layout does not matter) stay
`rows` without measuring. Cost curves are keyed by the layout
(runtime.layout.model_fingerprint).
"""

from __future__ import annotations

import hashlib
import os
import re
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch import nn

from heads import cache
from heads.files import atomic_write_json
from heads.loading import dtype_name
from runtime import kernels
from runtime.timing import device_name, kv_length_within, measure_curve, target_verify_forward

LAYOUTS = ("auto", "rows", "transposed", "rows+packed", "transposed+packed", "rows+panels", "transposed+panels",
           "rows+panels_bf16", "transposed+panels_bf16")
LAYOUT_HELP = ("auto / rows / transposed / rows+packed / transposed+packed / ...+packedN / rows+panels / "
               "transposed+panels / ...+panels_bf16 (runtime.layout)")  # `+packedN`: the packed copy from N rows
MIN_PARAMETERS = 10_000_000
# bfloat16 on a CPU: panels for every product (batch-invariant, and faster than torch's bf16 BLAS; see above)
BF16_LAYOUT = "rows+panels"
MIN_GAIN = 0.05
PACK_BATCH_HINT = 8  # oneDNN's reorder is tuned for this many rows; 8 and 64 measured best here, 1 worst
VERIFY_PROBE = (2, 3, 4, 8)  # verify sizes measured with and without packing under auto
PANEL_PROBE = (1, *VERIFY_PROBE)  # and with panels (their 1-token step is plain decoding's too)
_PACKED = "_specheads_packed"
_PACKED_ROWS = "_specheads_packed_rows"
_PANELS = kernels.PANELS_ATTR
_ROUNDED = "_specheads_panels_rounded"  # panels rounded to bfloat16 on request (`+panels_bf16`)
_LAYOUT = re.compile(r"(rows|transposed)(\+packed([2-9]|[1-9][0-9]+)?|\+panels(_bf16)?)?")


def parse_layout(layout: str) -> tuple[str, int | None, str | None]:
    """'transposed+packed3' -> ('transposed', 3, None); '+packed' alone packs from 2 rows; no packing -> None;
    'rows+panels' -> ('rows', None, 'panels'); 'rows+panels_bf16' -> ('rows', None, 'panels_bf16')."""
    match = _LAYOUT.fullmatch(layout)
    if match is None:
        raise ValueError(f"weight layout must be one of {LAYOUTS[1:]} or `+packedN`, got {layout!r}")
    panels = match[2][1:] if match[2] and match[2].startswith("+panels") else None
    return match[1], (int(match[3] or 2) if match[2] and not panels else None), panels


def layout_name(storage: str, packed_rows: int | None, panels: str | None = None) -> str:
    if panels:
        return f"{storage}+{panels}"
    return storage + ("" if packed_rows is None else "+packed" + ("" if packed_rows == 2 else str(packed_rows)))


def check_layout(layout: str, flag: str = "--weight_layout") -> str:
    if layout != "auto" and _LAYOUT.fullmatch(layout) is None:
        raise ValueError(f"{flag} must be one of {LAYOUTS} (`+packedN`: the packed copy from N rows on), "
                         f"got {layout!r}")
    return layout


def linear_modules(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if isinstance(m, nn.Linear) and m.weight.dim() == 2]


def linear_weights(model: nn.Module) -> list[nn.Parameter]:
    """The distinct 2-D weights of the model's nn.Linear layers (a tied LM head once)."""
    seen: dict[int, nn.Parameter] = {}
    for module in linear_modules(model):
        seen.setdefault(id(module.weight), module.weight)
    return list(seen.values())


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else free physical pages; None where neither is readable."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def packing_fits(model: nn.Module, available: int | None = None) -> tuple[bool, str]:
    """Whether a packed (or panel) copy of every Linear weight (as many bytes again) leaves a quarter of the memory
    now available free; with the reason printed when it does not."""
    needed = sum(w.numel() * w.element_size() for w in linear_weights(model))
    available = available_memory_bytes() if available is None else available
    if available is None or needed <= 0.75 * available:
        return True, ""
    return False, f"a copy of the weights needs {needed / 2**30:.1f} GiB, {available / 2**30:.1f} GiB available"


def _is_transposed(weight: torch.Tensor) -> bool:
    return weight.shape[0] > 1 and weight.shape[1] > 1 and weight.stride() == (1, weight.shape[0])


def layout_of(model: nn.Module) -> str:
    """'rows' / 'transposed' (how the Linear weights are stored), '+packed' when a packed copy serves products of
    two or more rows ('+packedN': of N or more)."""
    weights = linear_weights(model)
    storage = "transposed" if weights and all(_is_transposed(w) for w in weights) else "rows"
    packed_rows = next((m.__dict__[_PACKED_ROWS] for m in linear_modules(model) if _PACKED in m.__dict__), None)
    modules = [m for m in linear_modules(model) if _PANELS in m.__dict__]
    panels = None if not modules else "panels_bf16" if modules[0].__dict__.get(_ROUNDED) else "panels"
    return layout_name(storage, packed_rows, panels)


def _packed_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear.forward with the packed copy from the module's packed row count on; fewer rows (one row: a decode
    step) and autograd keep the stored weight, so plain decoding runs exactly the kernels it ran before packing."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows < module.__dict__[_PACKED_ROWS] or torch.is_grad_enabled() or x.dtype != module.weight.dtype:
        return nn.functional.linear(x, module.weight, module.bias)
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, x.shape[-1]), module.__dict__[_PACKED], module.bias,
                                             "none", [], "")
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _panels_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear.forward through the panel kernel without autograd: float32 panels for 1 to PANEL_MAX_ROWS rows (more
    rows, prefill, go to the BLAS, faster there), bfloat16 panels for every row count (faster than the float32 BLAS
    even at 64-128 rows, and 5x faster than torch's bf16 products on CPUs without AVX512-BF16/AMX, which it
    emulates; rounded panels must serve prefill too, so the whole forward uses the rounded weights); anything else
    (autograd, another dtype) keeps the stored weight."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    panels = module.__dict__[_PANELS]
    if (x.dtype not in (module.weight.dtype, torch.float32) or torch.is_grad_enabled() or rows == 0
            or (panels.ndim == 4 and x.dtype != torch.bfloat16)):
        return nn.functional.linear(x, module.weight, module.bias)
    if panels.dtype != torch.bfloat16 and rows > kernels.PANEL_MAX_ROWS:
        return nn.functional.linear(x, module.weight, module.bias)
    return kernels.panel_linear(x, panels, module.out_features, module.bias)


def _unpack(model: nn.Module) -> None:
    for module in linear_modules(model):
        for key in (_PACKED, _PACKED_ROWS, _PANELS, _ROUNDED):
            module.__dict__.pop(key, None)
        if getattr(module.__dict__.get("forward"), "__func__", None) in (_packed_forward, _panels_forward):
            del module.__dict__["forward"]


def _attach(model: nn.Module, key: str, make, forward, **extra) -> None:
    """Give every Linear `make(weight)` under `key` (one copy per distinct weight: tied weights share it), `extra`
    entries, and `forward` in place of nn.Linear.forward. A Linear whose forward someone else replaced (e.g.
    accelerate's offload hooks) is left as it is."""
    copies: dict[int, torch.Tensor] = {}
    for module in linear_modules(model):
        if "forward" in module.__dict__:
            continue
        if id(module.weight) not in copies:
            copies[id(module.weight)] = make(module.weight.detach())
        module.__dict__[key] = copies[id(module.weight)]
        module.__dict__.update(extra)
        module.forward = forward.__get__(module)


def _pack(model: nn.Module, min_rows: int) -> None:
    weights = linear_weights(model)
    if not weights:
        return
    weight = weights[0]
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        raise ValueError(f"--weight_layout +packed needs a CPU target with oneDNN (mkldnn); this one is on "
                         f"{weight.device} (mkldnn available: {torch.backends.mkldnn.is_available()})")
    try:
        _attach(model, _PACKED, lambda w: torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT),
                _packed_forward, **{_PACKED_ROWS: min_rows})
    except RuntimeError as error:
        _unpack(model)
        raise ValueError(f"--weight_layout +packed: oneDNN cannot pack {weight.dtype} weights on this CPU "
                         f"({str(error).splitlines()[0]})") from None


def panels_unavailable(model: nn.Module) -> str:
    """Why the panel kernel cannot serve this model ('' when it can): float32 or bfloat16 on a CPU, compiled."""
    weights = linear_weights(model)
    if weights and (weights[0].device.type != "cpu" or weights[0].dtype not in kernels.PANEL_DTYPES):
        return (f"the panel kernel needs float32 or bfloat16 weights on a CPU; these are {weights[0].dtype} on "
                f"{weights[0].device}")
    return "" if kernels.library() is not None else f"the panel kernel is unavailable ({kernels.unavailable_reason()})"


def _panel_copy(weight: torch.Tensor, rounded: bool) -> torch.Tensor:
    """Panels in bfloat16 when the weight is bfloat16, when every float32 value is one (a bf16 checkpoint loaded in
    float32: the same numbers in half the bytes, so the same products to the last bit), or when rounding is asked
    for (`+panels_bf16`); float32 panels otherwise. A bfloat16 model's weights (bfloat16 rows) take the AVX512-BF16
    dot panels where the CPU has them (`kernels.bf16_dot`: a quarter of the instructions, 1.5x faster at one row
    and 2-3x at 4-8 rows on SmolLM2's weights)."""
    if weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0 and kernels.bf16_dot():
        return kernels.pack_panels(weight, dot=True)
    if weight.dtype == torch.float32 and (rounded or torch.equal(weight.to(torch.bfloat16).float(), weight)):
        weight = weight.to(torch.bfloat16)
    return kernels.pack_panels(weight)


def _add_panels(model: nn.Module, rounded: bool) -> None:
    why_not = panels_unavailable(model)
    if why_not:
        raise ValueError(f"--weight_layout +panels: {why_not}")
    weights = linear_weights(model)
    if rounded and weights and weights[0].dtype != torch.float32:
        raise ValueError(f"--weight_layout +panels_bf16 rounds float32 weights to bfloat16; these are "
                         f"{weights[0].dtype} (use +panels)")
    _attach(model, _PANELS, lambda weight: _panel_copy(weight, rounded), _panels_forward,
            **({_ROUNDED: True} if rounded else {}))


def match_panels(drafter: nn.Module, target_model: nn.Module) -> None:
    """Give a drafter's own Linear layers (heads, a reduced LM head) panels where the target it drafts for has them,
    so its few-row products run on the same kernel: measured on SmolLM2-135M's long EAGLE-3 head, float32, one
    thread, a 1-token draft 2.4 -> 1.4 ms and a 3-token tree 13.5 -> 8.3 ms. A float32 drafter's panels are rounded
    to bfloat16 whatever the target's (`+panels_bf16`): a draft only proposes tokens that the target then verifies,
    so the output is the same, and a 1-token draft, bound by reading its weights (an EAGLE layer and an 8,192-row LM
    head: ~35 MB in float32), reads half the bytes. Nothing when the target has no panels; a layer that already has
    them (one shared with the target) is left as it is."""
    panels = parse_layout(layout_of(target_model))[2]
    weights = linear_weights(drafter)
    if panels and weights and not panels_unavailable(drafter):
        _add_panels(drafter, rounded=weights[0].dtype == torch.float32)


@torch.no_grad()
def set_layout(model: nn.Module, layout: str) -> None:
    """Re-lay every Linear weight as `rows` or `transposed` (values unchanged; one weight copied at a time) and, for
    `...+packed[N]`, add a oneDNN-packed copy of each weight that products of N (default 2) or more rows use; for
    `...+panels`, a panel copy that products of 1 to PANEL_MAX_ROWS rows use (runtime.kernels; bfloat16 panels, for
    bf16 weights or float32 ones that are all bf16 values, serve every row count); `...+panels_bf16` rounds float32
    weights to bfloat16 in the panels (half the bytes; activations, attention and the cache stay float32), the
    stored weight left as it is."""
    storage, packed, panels = parse_layout(layout)
    _unpack(model)
    for weight in linear_weights(model):
        if storage == "transposed" and not _is_transposed(weight):
            weight.data = weight.data.t().contiguous().t()
        elif storage == "rows" and not weight.data.is_contiguous():
            weight.data = weight.data.contiguous()
    if packed is not None:
        _pack(model, packed)
    if panels:
        _add_panels(model, rounded=panels == "panels_bf16")


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


def _cache_path(fingerprint: str, device: str, dtype: str) -> Path:
    key = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{fingerprint}__{device}__{dtype}")
    return cache.entry("layouts", f"{key}.json")


def measure_layouts(target, kv_length: int = 256, rounds: int = 3, repeats: int = 5) -> dict[str, float]:
    """Median seconds of a 1-token forward of `target` in each storage (interleaved rounds); leaves it `rows`."""
    measured = measure_verify(target, ["rows", "transposed"], (1,), kv_length, rounds, repeats)
    return {layout: seconds[0] for layout, seconds in measured.items()}


def measure_verify(target, layouts: list[str], sizes: tuple[int, ...], kv_length: int = 256, rounds: int = 3,
                   repeats: int = 5) -> dict[str, list[float]]:
    """Median seconds of a forward over each of `sizes` tokens in each layout (interleaved rounds); leaves the model
    in layouts[0]. Empty when one of the layouts cannot be set on this model (oneDNN or the kernel refuses)."""
    run = target_verify_forward(target, kv_length_within(target, kv_length, max(sizes)))
    samples: dict[str, list[list[float]]] = {layout: [] for layout in layouts}
    try:
        for _ in range(rounds):
            for layout in samples:
                set_layout(target.model, layout)
                samples[layout].append(measure_curve(run, list(sizes), repeats=repeats, small_factor=1))
    except ValueError:
        return {}
    finally:
        set_layout(target.model, layouts[0])
    return {layout: [statistics.median(size) for size in zip(*rounds_, strict=True)]
            for layout, rounds_ in samples.items()}


def measure_packing(target, storage: str, **kwargs) -> dict[str, list[float]]:
    """Verifying each of VERIFY_PROBE tokens on `storage` with and without the packed copy."""
    return measure_verify(target, [storage, f"{storage}+packed"], VERIFY_PROBE, **kwargs)


def measure_panels(target, layout: str, **kwargs) -> dict[str, list[float]]:
    """A 1-token step and verifying each of VERIFY_PROBE tokens on `layout` and on its storage with panels."""
    return measure_verify(target, [layout, parse_layout(layout)[0] + "+panels"], PANEL_PROBE, **kwargs)


def panels_win(base: list[float], panels: list[float]) -> bool:
    """Panels when their 1-token step (plain decoding's, which every drafter falls back to) is at least MIN_GAIN
    faster: plain decoding must run on the fastest one-row layout, whatever verifies cost; else when at least
    MIN_GAIN faster summed over PANEL_PROBE and not slower by more than MIN_GAIN at 1 token."""
    if panels[0] <= (1 - MIN_GAIN) * base[0]:
        return True
    return sum(panels) <= (1 - MIN_GAIN) * sum(base) and panels[0] <= (1 + MIN_GAIN) * base[0]


def packed_min_rows(probe: tuple[int, ...], stored: list[float], packed: list[float]) -> int | None:
    """The smallest probe size p from which the packed copy is faster at every probe size >= p and at least
    MIN_GAIN faster summed over them; None when there is no such size."""
    rows, base_sum, packed_sum = None, 0.0, 0.0
    for size, base, fast in reversed(list(zip(probe, stored, packed, strict=True))):
        if fast >= base:
            break
        base_sum, packed_sum = base_sum + base, packed_sum + fast
        if packed_sum < (1 - MIN_GAIN) * base_sum:
            rows = size
    return rows


def choose_layout(target, requested: str = "auto", use_cache: bool = True, log=None) -> str:
    """Apply `requested` (auto: measured, see the module docstring) to target.model; returns the layout used."""
    check_layout(requested)
    model = target.model
    if requested != "auto":
        set_layout(model, requested)
        return layout_of(model)
    device = next(model.parameters()).device
    if device.type == "cpu" and model.dtype == torch.bfloat16 and not panels_unavailable(model):
        set_layout(model, BF16_LAYOUT)
        print(f"weight layout: {BF16_LAYOUT} (auto: bfloat16 on a CPU: the batch-invariant panel kernel serves every "
              f"product, so a verify computes what one-token steps compute)", file=log or sys.stderr)
        return BF16_LAYOUT
    if device.type != "cpu" or sum(p.numel() for p in model.parameters()) < MIN_PARAMETERS:
        set_layout(model, "rows")
        return "rows"
    set_layout(model, "rows")
    path = _cache_path(model_fingerprint(model), device_name(device), dtype_name(model.dtype))
    with cache.lock(path) if use_cache else nullcontext():  # one process measures, the others read its record
        cached = (cache.read_json(path) or {}) if use_cache else {}
        cached = cached if isinstance(cached, dict) else {}
        seconds = cached.get("seconds") or measure_layouts(target)
        storage = "transposed" if seconds["transposed"] < (1 - MIN_GAIN) * seconds["rows"] else "rows"
        verify = cached.get("verify_seconds") if cached.get("probe") == list(VERIFY_PROBE) else None
        fits, why_not = packing_fits(model)
        if verify is None and fits:  # not measured (nor cached) while a packed copy would not fit: measured later
            verify = measure_packing(target, storage)
        packed = f"{storage}+packed"
        rows = packed_min_rows(VERIFY_PROBE, verify[storage], verify[packed]) if fits and verify else None
        layout = layout_name(storage, rows)
        no_panels = panels_unavailable(model) if fits else why_not  # '' when the panel kernel can serve this model
        panels = cached.get("panel_seconds") if cached.get("panel_probe") == list(PANEL_PROBE) else None
        if panels is not None and layout not in panels:
            panels = None  # measured against another choice (the machine measured differently since)
        if panels is None and not no_panels:
            panels = measure_panels(target, layout) or None
        record = {"seconds": seconds}
        record |= {"probe": list(VERIFY_PROBE), "verify_seconds": verify} if verify is not None else {}
        record |= {"panel_probe": list(PANEL_PROBE), "panel_seconds": panels} if panels is not None else {}
        if use_cache and any(cached.get(key) != value for key, value in record.items()):
            atomic_write_json(path, record)
    with_panels = f"{storage}+panels"
    if not no_panels and panels and panels_win(panels[layout], panels[with_panels]):
        chosen = with_panels
    else:
        chosen = layout
    set_layout(model, chosen)
    if not fits:
        packing = f"; not packed, no panels: {why_not}"
    else:
        packing = ("; oneDNN cannot pack these weights" if not verify else
                   f"; verifying {'/'.join(map(str, VERIFY_PROBE))} tokens {_ms(verify[storage])} ms, "
                   f"{_ms(verify[packed])} ms packed")
        packing += (f"; no panels: {no_panels}" if no_panels else
                    f"; 1/{'/'.join(map(str, VERIFY_PROBE))} tokens {_ms(panels[layout])} ms as {layout}, "
                    f"{_ms(panels[with_panels])} ms with panels" if panels else "; the panel kernel failed here")
    print(f"weight layout: {chosen} (auto: a 1-token step {seconds['rows'] * 1e3:.1f} ms as loaded, "
          f"{seconds['transposed'] * 1e3:.1f} ms transposed{packing})", file=log or sys.stderr)
    return chosen


def _ms(seconds: list[float]) -> str:
    return "/".join(f"{t * 1e3:.0f}" for t in seconds)


def model_fingerprint(model) -> str:
    """name_or_path plus a hash of the config: two models with the same shapes cost the same; '-transposed' when
    the Linear weights are stored transposed, '-rows+packed' / '-transposed+packed3' with a packed copy
    (runtime.layout): the layout changes the kernels and so the cost."""
    digest = hashlib.sha256(model.config.to_json_string(use_diff=False).encode()).hexdigest()[:12]
    name = Path(str(getattr(model.config, "_name_or_path", "") or model.config.model_type)).name
    layout = layout_of(model)
    return f"{name}-{digest}" + ("" if layout == "rows" else f"-{layout}")
