"""A matrix product for the few rows of CPU decoding, compiled on the user's machine: y = x @ W.T + b for 1 to
PANEL_MAX_ROWS rows of float32, streaming each weight from memory once per 12 rows.

Why: at batch 1 a decode step and a verify forward multiply a handful of rows by weights that do not fit in cache,
so the product is bound by reading the weights. The BLAS does that for one row (matrix-vector) but switches to a
packing matrix-matrix kernel from two rows on, and on this AVX2 VM a 2-token verify then costs ~1.5x a 1-token
step and 8 tokens ~2x (README, "Weight layout"): the arithmetic that made speculation unable to pay here. This
kernel reads the weight once, laid out in panels of 8 output columns ([ceil(N/8), K, 8], zero-padded), and keeps
one vector accumulator per row and panel in registers, so 2-8 rows cost about what one row costs. Measured on the
whole set of SmolLM2-135M's Linear weights (30 layers + the 49,152-row LM head), one thread: 1 / 2 / 4 / 8 / 12
rows 32 / 33 / 45 / 61 / 74 ms, against 41 / 58 / 95 / 111 / 122 ms for `F.linear` on transposed storage (and
58 / 63 / 75 / 84 / 94 ms for oneDNN's packed weights, another run); after widening the side-by-side panels for 3-8
rows (below), 26 / 27 / 38 / 59 / 76 ms on a quieter machine.

Batch-invariant: every output element is the same serial chain of multiply-adds over k whatever the number of rows
in the call (small row counts run several panels side by side for instruction-level parallelism: 8 panels for one
row, 6 for two, 4 for three, 3 for four or five, 2 for six to eight; never a different summation order; the
multiply-add is an explicit FMA where the CPU has one and `-ffp-contract=off` keeps the compiler from fusing
anything else, because it fused in some kernels and not in others, changing the last bit), so a row's result does
not depend on what else was verified with it.

The C source below is compiled once per machine with the system C compiler (`$CC`, else `cc`) and
`-O3 -march=native` into `$SPECHEADS_CACHE/kernels/` (atomic; keyed by the source, the flags, the compiler and the
CPU). Where there is no compiler, or it fails, `library()` is None and `unavailable_reason()` says why; the
weight layout (runtime.layout) then does not offer `+panels`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

PANEL = 8  # output columns per panel: one 256-bit vector of float32
PASS_ROWS = 12  # rows per pass over the weights (accumulators that fit in 16 vector registers)
PANEL_MAX_ROWS = 16  # products of more rows (prefill) go to the BLAS, which is faster there

SOURCE = r"""
#include <string.h>
typedef float v8 __attribute__((vector_size(32)));
#if defined(__FMA__) && defined(__AVX__)
#include <immintrin.h>
#define MADD(acc, s, w) ((acc) = (v8)_mm256_fmadd_ps(_mm256_set1_ps(s), (__m256)(w), (__m256)(acc)))
#else
#define MADD(acc, s, w) ((acc) += (s) * (w))
#endif

/* Rows x[0..MR) times PP panels at a time; each output is one FMA chain over k in order 0..K-1. */
#define KERNEL(MR, PP)                                                                                   \
static void kernel_##MR(const float *x, long K, const float *panels, long N, const float *bias, float *y, \
                        long ldy, long first, long last) {                                                \
  long p = first;                                                                                       \
  for (; p + PP <= last; p += PP) {                                                                      \
    v8 acc[PP][MR];                                                                                      \
    for (int q = 0; q < PP; q++) for (int m = 0; m < MR; m++) acc[q][m] = (v8){0, 0, 0, 0, 0, 0, 0, 0};  \
    const float *w = panels + p * K * 8;                                                                 \
    for (long k = 0; k < K; k++) {                                                                       \
      for (int q = 0; q < PP; q++) {                                                                     \
        v8 wk; memcpy(&wk, w + (q * K + k) * 8, 32);                                                     \
        for (int m = 0; m < MR; m++) MADD(acc[q][m], x[m * K + k], wk);                                     \
      }                                                                                                  \
    }                                                                                                    \
    for (int q = 0; q < PP; q++) store(acc[q], MR, p + q, N, bias, y, ldy);                              \
  }                                                                                                      \
  for (; p < last; p++) {                                                                                \
    v8 acc[MR];                                                                                          \
    for (int m = 0; m < MR; m++) acc[m] = (v8){0, 0, 0, 0, 0, 0, 0, 0};                                  \
    const float *w = panels + p * K * 8;                                                                 \
    for (long k = 0; k < K; k++) {                                                                       \
      v8 wk; memcpy(&wk, w + k * 8, 32);                                                                 \
      for (int m = 0; m < MR; m++) MADD(acc[m], x[m * K + k], wk);                                          \
    }                                                                                                    \
    store(acc, MR, p, N, bias, y, ldy);                                                                  \
  }                                                                                                      \
}

static void store(const v8 *acc, int rows, long p, long N, const float *bias, float *y, long ldy) {
  long n0 = p * 8, width = N - n0 < 8 ? N - n0 : 8;
  for (int m = 0; m < rows; m++) {
    float out[8];
    memcpy(out, &acc[m], 32);
    for (long j = 0; j < width; j++) y[m * ldy + n0 + j] = bias ? out[j] + bias[n0 + j] : out[j];
  }
}

/* panels side by side per row count: 8-16 accumulators, measured best on the SmolLM2 weights (AVX2) */
KERNEL(1, 8) KERNEL(2, 6) KERNEL(3, 4) KERNEL(4, 3) KERNEL(5, 3) KERNEL(6, 2)
KERNEL(7, 2) KERNEL(8, 2) KERNEL(9, 1) KERNEL(10, 1) KERNEL(11, 1) KERNEL(12, 1)

typedef void (*kernel_t)(const float *, long, const float *, long, const float *, float *, long, long, long);
static const kernel_t KERNELS[13] = {0, kernel_1, kernel_2, kernel_3, kernel_4, kernel_5, kernel_6,
                                     kernel_7, kernel_8, kernel_9, kernel_10, kernel_11, kernel_12};

/* y[M, N] = x[M, K] @ W.T (+ bias), W given as panels; rows split into equal passes of at most 12. */
void panel_linear(const float *x, long M, long K, const float *panels, long N, const float *bias, float *y,
                  int threads) {
  long passes = (M + 11) / 12, panel_count = (N + 7) / 8;
  for (long i = 0, m0 = 0; i < passes; i++) {
    long rows = (M - m0) / (passes - i);
    if (threads <= 1) {
      KERNELS[rows](x + m0 * K, K, panels, N, bias, y + m0 * N, N, 0, panel_count);
    } else {
      #pragma omp parallel for num_threads(threads) schedule(static)
      for (long t = 0; t < threads; t++) {
        long first = panel_count * t / threads, last = panel_count * (t + 1) / threads;
        KERNELS[rows](x + m0 * K, K, panels, N, bias, y + m0 * N, N, first, last);
      }
    }
    m0 += rows;
  }
}
"""
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-fopenmp")


def _cpu_key() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return platform.machine() + "\n" + "\n".join(sorted(set(lines)))


def _compiler_version(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def build(cache: Path | None = None) -> Path:
    """Compile SOURCE (once per source, flags, compiler and CPU) and return the shared library's path;
    RuntimeError naming the compiler and its first error line when that fails."""
    from heads.loading import cache_dir

    compiler = os.environ.get("CC", "cc")
    version = _compiler_version(compiler)
    if not version:
        raise RuntimeError(f"no C compiler: `{compiler} --version` failed (set $CC to one)")
    key = hashlib.sha256("\0".join([SOURCE, " ".join(FLAGS), version, _cpu_key()]).encode()).hexdigest()[:16]
    folder = (cache or cache_dir()) / "kernels"
    path = folder / f"panel_linear-{key}.so"
    if path.is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        source = Path(tmp) / "panel_linear.c"
        source.write_text(SOURCE)
        built = Path(tmp) / path.name
        result = subprocess.run([compiler, *FLAGS, "-o", str(built), str(source)], capture_output=True, text=True)
        if result.returncode != 0:
            first = next((line for line in result.stderr.splitlines() if "error" in line), result.stderr.strip())
            raise RuntimeError(f"`{compiler}` could not compile the panel kernel: {first[:300]}")
        os.replace(built, path)  # atomic: another process may be building the same file
    return path


@lru_cache(maxsize=1)
def _load() -> tuple[ctypes.CDLL | None, str]:
    try:
        library = ctypes.CDLL(str(build()))
    except (RuntimeError, OSError) as error:
        return None, str(error)
    pointer, long = ctypes.c_void_p, ctypes.c_long
    library.panel_linear.argtypes = [pointer, long, long, pointer, long, pointer, pointer, ctypes.c_int]
    library.panel_linear.restype = None
    return library, ""


def library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use; None where it cannot be built (see unavailable_reason)."""
    return _load()[0]


def unavailable_reason() -> str:
    return _load()[1]


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] weight (any strides) -> contiguous float32 panels [ceil(N/8), K, 8], zero rows padding N."""
    out_features, in_features = weight.shape
    padded = -(-out_features // PANEL) * PANEL
    rows = weight.detach().to(torch.float32)
    if padded != out_features:
        rows = torch.cat([rows, rows.new_zeros(padded - out_features, in_features)])
    return rows.reshape(padded // PANEL, PANEL, in_features).transpose(1, 2).contiguous()


def panel_linear(x: torch.Tensor, panels: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] float32 on CPU (at most PANEL_MAX_ROWS rows, or any number: passes of 12) times the weight
    whose panels these are; the result of F.linear up to float rounding."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"the panel kernel is unavailable: {unavailable_reason()}")
    in_features = x.shape[-1]
    if panels.shape[1] != in_features or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"panel_linear: x {tuple(x.shape)} {x.dtype} on {x.device} does not fit panels "
                         f"{tuple(panels.shape)} (float32 CPU, same in_features)")
    flat = x.reshape(-1, in_features).contiguous()
    out = torch.empty(flat.shape[0], out_features, dtype=torch.float32)
    if bias is not None:
        bias = bias.detach().to(torch.float32).contiguous()
    lib.panel_linear(flat.data_ptr(), flat.shape[0], in_features, panels.data_ptr(), out_features,
                     None if bias is None else bias.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out.reshape(*x.shape[:-1], out_features)
