"""A matrix product for the few rows of CPU decoding, compiled on the user's machine: y = x @ W.T + b for float32 or
bfloat16 rows and weights, streaming each weight from memory once per 12 rows.

Why: at batch 1 a decode step and a verify forward multiply a handful of rows by weights that do not fit in cache,
so the product is bound by reading the weights. The BLAS does that for one row (matrix-vector) but switches to a
packing matrix-matrix kernel from two rows on, and on this AVX2 VM a 2-token verify then costs ~1.5x a 1-token
step and 8 tokens ~2x (README, "Weight layout"): the arithmetic that made speculation unable to pay here. This
kernel reads the weight once, laid out in panels of 8 output columns ([ceil(N/8), K, 8], zero-padded), and keeps
one vector accumulator per row and panel in registers, so 2-8 rows cost about what one row costs. Measured on the
whole set of SmolLM2-135M's Linear weights (30 layers + the 49,152-row LM head), one thread, 1 / 2 / 4 / 8 / 12
rows: float32 panels 25 / 27 / 31 / 44 / 68 ms, bfloat16 panels 15 / 17 / 26 / 39 / 51 ms, against 38 / 56 / 96 /
106 / 120 ms for float32 `F.linear` on transposed storage (and 4-8x that for torch's bfloat16 products, which it
emulates on CPUs without AVX512-BF16/AMX).

bfloat16: the panels keep the weight's 16 bits (half the bytes to stream), widened to float32 in registers (a
16-bit shift); bfloat16 rows are widened per pass, every product is summed in float32 and the result rounded once to
nearest even, as torch rounds. So a bfloat16 model runs its Linear layers at memory speed on any AVX2 CPU.

AVX512-BF16 (where the compiler targets it and $SPECHEADS_CPU_BF16 does not force the emulated kind): a bfloat16
model's rows and weights go through `vdpbf16ps` on dot panels of 16 columns by k pairs, one instruction per 32
weights instead of four per 8. Measured on SmolLM2-135M's weights, one thread, AVX512-BF16 EPYC: a 1536x576 product
26 us at 1 row (widen-and-FMA 40), 27 us at 4 rows (78), 43 us at 8 (150); the 49,152-row LM head 1.5 ms at 1 row
(2.8); a bf16 decode step 29 -> 20 ms.

Batch-invariant: every output element is the same serial chain of multiply-adds over k whatever the number of rows
in the call (small row counts run several panels side by side for instruction-level parallelism, a count per row
count and weight type measured best on the SmolLM2 weights; never a different summation order; the multiply-add is
an explicit FMA where the CPU has one and `-ffp-contract=off` keeps the compiler from fusing anything else, because
it fused in some kernels and not in others, changing the last bit), so a row's result does not depend on what else
was verified with it.

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

from heads import cache
from heads.loading import cpu_bf16_override

PANEL = 8  # output columns per panel: one 256-bit vector of float32
PASS_ROWS = 12  # rows per pass over the weights (accumulators that fit in 16 vector registers)
PANEL_MAX_ROWS = 16  # products of more rows (prefill) go to the BLAS, which is faster there

SOURCE = r"""
#include <stdlib.h>
#include <string.h>
typedef float v8 __attribute__((vector_size(32)));
typedef unsigned short bf16;  /* the upper half of a float32 */
#if defined(__FMA__) && defined(__AVX2__)
#include <immintrin.h>
#define MADD(acc, s, w) ((acc) = (v8)_mm256_fmadd_ps(_mm256_set1_ps(s), (__m256)(w), (__m256)(acc)))
static inline v8 load_bf16(const bf16 *w) {
  return (v8)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)w)), 16);
}
#else
#define MADD(acc, s, w) ((acc) += (s) * (w))
static inline v8 load_bf16(const bf16 *w) {
  unsigned int u[8]; v8 r;
  for (int j = 0; j < 8; j++) u[j] = (unsigned int)w[j] << 16;
  memcpy(&r, u, 32); return r;
}
#endif
static inline v8 load_f32(const float *w) { v8 r; memcpy(&r, w, 32); return r; }

static void store(const v8 *acc, int rows, long p, long N, const float *bias, float *y, long ldy) {
  long n0 = p * 8, width = N - n0 < 8 ? N - n0 : 8;
  for (int m = 0; m < rows; m++) {
    float out[8];
    memcpy(out, &acc[m], 32);
    for (long j = 0; j < width; j++) y[m * ldy + n0 + j] = bias ? out[j] + bias[n0 + j] : out[j];
  }
}

/* Rows x[0..MR) times PP panels at a time; each output is one FMA chain over k in order 0..K-1. */
#define KERNEL(NAME, WT, LOAD, MR, PP)                                                                   \
static void NAME##_##MR(const float *x, long K, const void *all, long N, const float *bias, float *y,     \
                        long ldy, long first, long last) {                                                \
  const WT *panels = (const WT *)all;                                                                    \
  long p = first;                                                                                       \
  for (; p + PP <= last; p += PP) {                                                                      \
    v8 acc[PP][MR];                                                                                      \
    for (int q = 0; q < PP; q++) for (int m = 0; m < MR; m++) acc[q][m] = (v8){0, 0, 0, 0, 0, 0, 0, 0};  \
    const WT *w = panels + p * K * 8;                                                                    \
    for (long k = 0; k < K; k++) {                                                                       \
      for (int q = 0; q < PP; q++) {                                                                     \
        v8 wk = LOAD(w + (q * K + k) * 8);                                                               \
        for (int m = 0; m < MR; m++) MADD(acc[q][m], x[m * K + k], wk);                                  \
      }                                                                                                  \
    }                                                                                                    \
    for (int q = 0; q < PP; q++) store(acc[q], MR, p + q, N, bias, y, ldy);                              \
  }                                                                                                      \
  for (; p < last; p++) {                                                                                \
    v8 acc[MR];                                                                                          \
    for (int m = 0; m < MR; m++) acc[m] = (v8){0, 0, 0, 0, 0, 0, 0, 0};                                  \
    const WT *w = panels + p * K * 8;                                                                    \
    for (long k = 0; k < K; k++) {                                                                       \
      v8 wk = LOAD(w + k * 8);                                                                           \
      for (int m = 0; m < MR; m++) MADD(acc[m], x[m * K + k], wk);                                       \
    }                                                                                                    \
    store(acc, MR, p, N, bias, y, ldy);                                                                  \
  }                                                                                                      \
}
typedef void (*kernel_t)(const float *, long, const void *, long, const float *, float *, long, long, long);

/* panels side by side per row count (1..12), measured best on the SmolLM2 weights (AVX2, one thread): float32
   weights are bound by memory up to 12 rows, bfloat16 weights by arithmetic (the widening) from 4 rows on */
KERNEL(f32, float, load_f32, 1, 8) KERNEL(f32, float, load_f32, 2, 6) KERNEL(f32, float, load_f32, 3, 8)
KERNEL(f32, float, load_f32, 4, 6) KERNEL(f32, float, load_f32, 5, 8) KERNEL(f32, float, load_f32, 6, 8)
KERNEL(f32, float, load_f32, 7, 6) KERNEL(f32, float, load_f32, 8, 8) KERNEL(f32, float, load_f32, 9, 8)
KERNEL(f32, float, load_f32, 10, 8) KERNEL(f32, float, load_f32, 11, 8) KERNEL(f32, float, load_f32, 12, 8)
KERNEL(b16, bf16, load_bf16, 1, 8) KERNEL(b16, bf16, load_bf16, 2, 6) KERNEL(b16, bf16, load_bf16, 3, 4)
KERNEL(b16, bf16, load_bf16, 4, 2) KERNEL(b16, bf16, load_bf16, 5, 2) KERNEL(b16, bf16, load_bf16, 6, 6)
KERNEL(b16, bf16, load_bf16, 7, 1) KERNEL(b16, bf16, load_bf16, 8, 1) KERNEL(b16, bf16, load_bf16, 9, 1)
KERNEL(b16, bf16, load_bf16, 10, 1) KERNEL(b16, bf16, load_bf16, 11, 1) KERNEL(b16, bf16, load_bf16, 12, 1)
static const kernel_t F32[13] = {0, f32_1, f32_2, f32_3, f32_4, f32_5, f32_6, f32_7, f32_8, f32_9, f32_10, f32_11,
                                 f32_12};
static const kernel_t B16[13] = {0, b16_1, b16_2, b16_3, b16_4, b16_5, b16_6, b16_7, b16_8, b16_9, b16_10, b16_11,
                                 b16_12};

/* AVX512-BF16 (compiled where the CPU has it): bfloat16 rows times bfloat16 weights laid out in dot panels of 16
   output columns by k pairs ([ceil(N/16), K/2, 16, 2]); one vdpbf16ps adds x[2i+1]*w[2i+1] then x[2i]*w[2i] to each
   column's float32 accumulator (products exact, each add rounded to nearest even, denormals flushed), so every
   output is again one fixed chain over k whatever the row count, at a quarter of the widen-and-FMA instructions. */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAS_BF16_DOT 1
#define DOT_KERNEL(MR, PP)                                                                                       \
static void dot_##MR(const bf16 *x, long K, const bf16 *panels, long N, const float *bias, float *y, long ldy,    \
                     long first, long last) {                                                                    \
  long K2 = K / 2, p = first;                                                                                    \
  for (; p < last; p += PP) {                                                                                    \
    int pp = last - p < PP ? (int)(last - p) : PP;                                                               \
    __m512 acc[PP][MR];                                                                                          \
    for (int q = 0; q < PP; q++) for (int m = 0; m < MR; m++) acc[q][m] = _mm512_setzero_ps();                   \
    const bf16 *w = panels + p * K2 * 32;                                                                        \
    if (pp == PP) {                                                                                              \
      for (long k = 0; k < K2; k++) {                                                                            \
        __m512bh xm[MR];                                                                                         \
        for (int m = 0; m < MR; m++) {                                                                           \
          int pair; memcpy(&pair, x + m * K + 2 * k, 4); xm[m] = (__m512bh)_mm512_set1_epi32(pair);              \
        }                                                                                                        \
        for (int q = 0; q < PP; q++) {                                                                           \
          __m512bh wk = (__m512bh)_mm512_loadu_si512(w + (q * K2 + k) * 32);                                     \
          for (int m = 0; m < MR; m++) acc[q][m] = _mm512_dpbf16_ps(acc[q][m], wk, xm[m]);                       \
        }                                                                                                        \
      }                                                                                                          \
    } else {                                                                                                     \
      for (long k = 0; k < K2; k++) {                                                                            \
        __m512bh xm[MR];                                                                                         \
        for (int m = 0; m < MR; m++) {                                                                           \
          int pair; memcpy(&pair, x + m * K + 2 * k, 4); xm[m] = (__m512bh)_mm512_set1_epi32(pair);              \
        }                                                                                                        \
        for (int q = 0; q < pp; q++) {                                                                           \
          __m512bh wk = (__m512bh)_mm512_loadu_si512(w + (q * K2 + k) * 32);                                     \
          for (int m = 0; m < MR; m++) acc[q][m] = _mm512_dpbf16_ps(acc[q][m], wk, xm[m]);                       \
        }                                                                                                        \
      }                                                                                                          \
    }                                                                                                            \
    for (int q = 0; q < pp; q++) {                                                                               \
      long n0 = (p + q) * 16, width = N - n0 < 16 ? N - n0 : 16;                                                 \
      for (int m = 0; m < MR; m++) {                                                                             \
        float out[16]; _mm512_storeu_ps(out, acc[q][m]);                                                         \
        for (long j = 0; j < width; j++) y[m * ldy + n0 + j] = bias ? out[j] + bias[n0 + j] : out[j];           \
      }                                                                                                          \
    }                                                                                                            \
  }                                                                                                              \
}
typedef void (*dot_t)(const bf16 *, long, const bf16 *, long, const float *, float *, long, long, long);
DOT_KERNEL(1, 8) DOT_KERNEL(2, 8) DOT_KERNEL(3, 6) DOT_KERNEL(4, 5) DOT_KERNEL(5, 4) DOT_KERNEL(6, 3)
DOT_KERNEL(7, 3) DOT_KERNEL(8, 2) DOT_KERNEL(9, 1) DOT_KERNEL(10, 1) DOT_KERNEL(11, 1) DOT_KERNEL(12, 1)
static const dot_t DOT[13] = {0, dot_1, dot_2, dot_3, dot_4, dot_5, dot_6, dot_7, dot_8, dot_9, dot_10, dot_11, dot_12};
#else
#define HAS_BF16_DOT 0
#endif
int has_bf16_dot(void) { return HAS_BF16_DOT; }

static float widen(bf16 h) { unsigned int u = (unsigned int)h << 16; float f; memcpy(&f, &u, 4); return f; }
static bf16 narrow(float f) {  /* round to nearest even, as torch rounds float32 to bfloat16; NaN stays NaN */
  unsigned int u; memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40);
  return (bf16)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

/* y[M, N] = x[M, K] @ W.T (+ bias) with W as panels of float32 (weight_bf16 = 0) or bfloat16 values; x and y are
   float32, or bfloat16 when io_bf16 (widened per pass, products summed in float32, rounded once on the way out).
   Rows go in equal passes of at most 12; returns 0, or -1 when a pass buffer cannot be allocated. */
int panel_linear(const void *x, long M, long K, const void *panels, int weight_format, long N, const float *bias,
                 void *y, int io_bf16, int threads) {
  int weight_bf16 = weight_format != 0, dot = weight_format == 2;
  const kernel_t *table = weight_bf16 ? B16 : F32;
  long passes = (M + 11) / 12, panel_count = dot ? (N + 15) / 16 : (N + 7) / 8;
  float *xs = 0, *ys = 0;
  if (dot && (!HAS_BF16_DOT || !io_bf16 || K % 2)) return -2;
  if (io_bf16 && !((xs = malloc(12 * K * sizeof(float))) && (ys = malloc(12 * N * sizeof(float))))) {
    free(xs); return -1;
  }
  for (long i = 0, m0 = 0; i < passes; i++) {
    long rows = (M - m0) / (passes - i);
    const float *xp = (const float *)x + m0 * K;
    float *yp = (float *)y + m0 * N;
#if HAS_BF16_DOT
    if (dot) {
      const bf16 *xb = (const bf16 *)x + m0 * K;
      if (threads <= 1) {
        DOT[rows](xb, K, (const bf16 *)panels, N, bias, ys, N, 0, panel_count);
      } else {
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (long t = 0; t < threads; t++) {
          long first = panel_count * t / threads, last = panel_count * (t + 1) / threads;
          DOT[rows](xb, K, (const bf16 *)panels, N, bias, ys, N, first, last);
        }
      }
      for (long j = 0; j < rows * N; j++) ((bf16 *)y)[m0 * N + j] = narrow(ys[j]);
      m0 += rows;
      continue;
    }
#endif
    if (io_bf16) {
      for (long j = 0; j < rows * K; j++) xs[j] = widen(((const bf16 *)x)[m0 * K + j]);
      xp = xs; yp = ys;
    }
    if (threads <= 1) {
      table[rows](xp, K, panels, N, bias, yp, N, 0, panel_count);
    } else {
      #pragma omp parallel for num_threads(threads) schedule(static)
      for (long t = 0; t < threads; t++) {
        long first = panel_count * t / threads, last = panel_count * (t + 1) / threads;
        table[rows](xp, K, panels, N, bias, yp, N, first, last);
      }
    }
    if (io_bf16) for (long j = 0; j < rows * N; j++) ((bf16 *)y)[m0 * N + j] = narrow(ys[j]);
    m0 += rows;
  }
  free(xs); free(ys);
  return 0;
}

/* Attention of a few query rows, each row on its own: for every (batch, query row, head) the allowed keys are visited
   in increasing slot order; score = (q . k) * scale with q . k summed in float32 over the head dimension in a fixed
   order (8-lane chunks of d accumulated in order by multiply-adds, then the 8 lanes added in a fixed tree); softmax in float32 (max;
   exp by one fixed polynomial; the sum in slot order); out = sum of p * v in slot order (8 lanes of the head
   dimension at a time), divided by the sum. A row's result depends only on its query and the ordered list of
   keys/values it attends to: not on the other rows, their masks or where masked slots sit. Keys and values are read
   in their cache layout, each widened once per call and shared by the query heads of its KV head, so a step costs
   one pass over the cache. q [B, Hq, Q, D], k [B, Hkv, L, D], v [B, Hkv, L, DV] (strides in elements, the last
   dimension contiguous), allowed [B, Q, L] bytes, out float32 [B, Q, Hq, DV]. Returns -1 when out of memory. */
typedef int i8 __attribute__((vector_size(32)));
#if defined(__FMA__) && defined(__AVX2__)
#define VMADD(acc, a, b) ((acc) = (v8)_mm256_fmadd_ps((__m256)(a), (__m256)(b), (__m256)(acc)))
#else
#define VMADD(acc, a, b) ((acc) = (acc) + (a) * (b))
#endif
static inline float hsum8(v8 s) {  /* lanes added pairwise in a fixed tree: (0+4, 1+5, 2+6, 3+7), then (0+2, 1+3), 0+1 */
  float l[8]; memcpy(l, &s, 32);
  float a0 = l[0] + l[4], a1 = l[1] + l[5], a2 = l[2] + l[6], a3 = l[3] + l[7];
  float b0 = a0 + a2, b1 = a1 + a3;
  return b0 + b1;
}
static inline v8 select8(i8 m, v8 a, v8 b) {  /* a where m, else b */
  i8 ai, bi; memcpy(&ai, &a, 32); memcpy(&bi, &b, 32);
  i8 r = (m & ai) | (~m & bi); v8 o; memcpy(&o, &r, 32); return o;
}
static inline v8 exp8(v8 x) {  /* e^x for x <= 0 (0 below -87.3): 2^n * P(r), n = round(x / ln 2), |r| <= ln2/2 */
  const v8 lo = {-87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f}, zero = {0, 0, 0, 0, 0, 0, 0, 0};
  i8 under = x < lo;
  x = select8(under, lo, select8(x > zero, zero, x));
  i8 n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, i8);  /* x <= 0: truncation rounds half down */
  v8 nf = __builtin_convertvector(n, v8);
  v8 r = (x - nf * 0.693359375f) - nf * -2.12194440e-4f;
  v8 y = r * 1.9875691500e-4f + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f; y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f; y = y * r + 5.0000001201e-1f; y = (y * r) * r + r + 1.0f;
  i8 bits = (n + 127) << 23;
  v8 pow2; memcpy(&pow2, &bits, 32);
  return select8(under, zero, y * pow2);
}
/* src row (float32 or bfloat16) -> float32 dst[DP], zero past D */
static void widen_row(const void *src, long offset, long D, long DP, int is_bf16, float *dst) {
  long d = 0;
  if (!is_bf16) {
    memcpy(dst, (const float *)src + offset, sizeof(float) * D);
    d = D;
  } else {
    const bf16 *h = (const bf16 *)src + offset;
    for (; d + 8 <= D; d += 8) { v8 w = load_bf16(h + d); memcpy(dst + d, &w, 32); }
    for (; d < D; d++) dst[d] = widen(h[d]);
  }
  for (; d < DP; d++) dst[d] = 0.0f;
}
int row_attention(const void *q, long qsb, long qsh, long qst, const void *k, const void *v, long ksb, long ksh,
                  long kst, long vsb, long vsh, long vst, int is_bf16, const unsigned char *allowed, long B, long Hq,
                  long Hkv, long Q, long L, long D, long DV, float scale, float *out, int threads) {
  long group = Hq / Hkv, tasks = B * Hkv, LP = (L + 7) / 8 * 8, DP = (D + 7) / 8 * 8, VP = (DV + 7) / 8 * 8;
  long rows = group * Q;  /* the (query head, query row) pairs that share one KV head */
  int failed = 0;
  #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (long task = 0; task < tasks; task++) {
    long b = task / Hkv, g = task % Hkv;
    float *qf = malloc(sizeof(float) * rows * DP), *p = malloc(sizeof(float) * rows * LP);
    float *kf = aligned_alloc(32, sizeof(float) * (DP > VP ? DP : VP));
    v8 *acc = aligned_alloc(32, sizeof(v8) * rows * (VP / 8));
    float *total = calloc(rows, sizeof(float));
    if (!qf || !p || !kf || !acc || !total) {
      failed = 1; free(qf); free(p); free(kf); free(acc); free(total); continue;
    }
    const unsigned char *mask = allowed + b * Q * L;
    for (long r = 0; r < rows; r++) {  /* r = (query head h - g * group) * Q + query row i */
      long h = g * group + r / Q, i = r % Q;
      widen_row(q, b * qsb + h * qsh + i * qst, D, DP, is_bf16, qf + r * DP);
    }
    for (long j = 0; j < L; j++) {  /* scores: key j widened once for every row that may see it */
      int seen = 0;
      for (long i = 0; i < Q && !seen; i++) seen = mask[i * L + j];
      if (!seen) continue;
      widen_row(k, b * ksb + g * ksh + j * kst, D, DP, is_bf16, kf);
      for (long r = 0; r < rows; r++) {
        if (!mask[(r % Q) * L + j]) continue;
        const float *qr = qf + r * DP;
        v8 s = {0, 0, 0, 0, 0, 0, 0, 0};
        for (long d = 0; d < DP; d += 8) VMADD(s, load_f32(qr + d), load_f32(kf + d));
        p[r * LP + j] = hsum8(s) * scale;
      }
    }
    for (long r = 0; r < rows; r++) {  /* softmax numerators per row, in float32 */
      const unsigned char *m = mask + (r % Q) * L;
      float *pr = p + r * LP, top = -__builtin_inff();
      for (long j = 0; j < L; j++) if (m[j] && pr[j] > top) top = pr[j];
      for (long j = 0; j < LP; j++) pr[j] = (j < L && m[j]) ? pr[j] - top : -100.0f;
      for (long j = 0; j < LP; j += 8) { v8 e = exp8(load_f32(pr + j)); memcpy(pr + j, &e, 32); }
    }
    memset(acc, 0, sizeof(v8) * rows * (VP / 8));
    for (long j = 0; j < L; j++) {  /* values: value j widened once, added to every row that sees it, slot order */
      int seen = 0;
      for (long i = 0; i < Q && !seen; i++) seen = mask[i * L + j];
      if (!seen) continue;
      widen_row(v, b * vsb + g * vsh + j * vst, DV, VP, is_bf16, kf);
      for (long r = 0; r < rows; r++) {
        if (!mask[(r % Q) * L + j]) continue;
        float w = p[r * LP + j];
        total[r] = total[r] + w;
        v8 *ar = acc + r * (VP / 8);
        for (long d = 0; d < VP / 8; d++) ar[d] = ar[d] + w * load_f32(kf + 8 * d);
      }
    }
    for (long r = 0; r < rows; r++) {
      long h = g * group + r / Q, i = r % Q;
      float *o = out + ((b * Q + i) * Hq + h) * DV;
      const float *a = (const float *)(acc + r * (VP / 8));
      for (long d = 0; d < DV; d++) o[d] = total[r] > 0.0f ? a[d] / total[r] : 0.0f;
    }
    free(qf); free(p); free(kf); free(acc); free(total);
  }
  return failed ? -1 : 0;
}
"""
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-fopenmp")


def source_key() -> str:
    """A short fingerprint of the kernels' source (measurements of them are cached under it)."""
    return hashlib.sha256(SOURCE.encode()).hexdigest()[:8]


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


def build(cache_folder: Path | None = None) -> Path:
    """Compile SOURCE (once per source, flags, compiler and CPU; one process at a time, the others wait and reuse
    it) and return the shared library's path; RuntimeError naming the compiler and its first error line when that
    fails."""
    compiler = os.environ.get("CC", "cc")
    version = _compiler_version(compiler)
    if not version:
        raise RuntimeError(f"no C compiler: `{compiler} --version` failed (set $CC to one)")
    key = hashlib.sha256("\0".join([SOURCE, " ".join(FLAGS), version, _cpu_key()]).encode()).hexdigest()[:16]
    name = f"panel_linear-{key}.so"
    if cache_folder is None:
        path = cache.entry("kernels", name)
    else:
        cache_folder.mkdir(parents=True, exist_ok=True)
        path = cache_folder / name
    if path.is_file():
        return path
    with cache.lock(path):
        if path.is_file():  # another process built it while this one waited
            return path
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            source = Path(tmp) / "panel_linear.c"
            source.write_text(SOURCE)
            built = Path(tmp) / name
            result = subprocess.run([compiler, *FLAGS, "-o", str(built), str(source)], capture_output=True, text=True)
            if result.returncode != 0:
                first = next((line for line in result.stderr.splitlines() if "error" in line), result.stderr.strip())
                raise RuntimeError(f"`{compiler}` could not compile the panel kernel: {first[:300]}")
            os.replace(built, path)  # atomic: readers see the whole library or none
    return path


def _open(path: Path) -> ctypes.CDLL:
    """Load the built library; a cached file that does not load (cut short, from another system) is rebuilt once,
    with one line saying so."""
    try:
        return ctypes.CDLL(str(path))
    except OSError as error:
        cache.say(f"the compiled panel kernel {path} does not load ({str(error).splitlines()[0][:200]}); rebuilding it")
        with cache.lock(path):
            path.unlink(missing_ok=True)
        return ctypes.CDLL(str(build()))


@lru_cache(maxsize=1)
def _load() -> tuple[ctypes.CDLL | None, str]:
    try:
        library = _open(build())
    except (RuntimeError, OSError) as error:
        return None, str(error)
    pointer, long = ctypes.c_void_p, ctypes.c_long
    flag = ctypes.c_int
    library.panel_linear.argtypes = [pointer, long, long, pointer, flag, long, pointer, pointer, flag, flag]
    library.panel_linear.restype = ctypes.c_int
    library.row_attention.argtypes = [pointer, long, long, long, pointer, pointer, long, long, long, long, long, long,
                                      flag, pointer, long, long, long, long, long, long, long, ctypes.c_float, pointer,
                                      flag]
    library.row_attention.restype = ctypes.c_int
    library.has_bf16_dot.argtypes = []
    library.has_bf16_dot.restype = ctypes.c_int
    return library, ""


def library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use; None where it cannot be built (see unavailable_reason)."""
    return _load()[0]


def unavailable_reason() -> str:
    return _load()[1]


PANEL_DTYPES = (torch.float32, torch.bfloat16)
PANELS_ATTR = "_specheads_panels"  # a Linear's panels (module.__dict__ key; runtime.layout attaches them)
DOT_PANEL = 16  # output columns per dot panel: one 512-bit vector of float32


def bf16_dot() -> bool:
    """Whether bfloat16 rows times bfloat16 weights run the AVX512-BF16 dot kernel here: the kernel was compiled with
    it (the CPU has AVX512-BF16) and $SPECHEADS_CPU_BF16 does not force the emulated CPU kind's code paths."""
    lib = library()
    return lib is not None and bool(lib.has_bf16_dot()) and cpu_bf16_override() is not False


def pack_panels(weight: torch.Tensor, dot: bool = False) -> torch.Tensor:
    """[N, K] weight (any strides) -> contiguous panels [ceil(N/8), K, 8], zero rows padding N; bfloat16 weights stay
    bfloat16 (half the bytes to stream), every other dtype becomes float32. `dot` (bfloat16 weights with an even K,
    where `bf16_dot()`): dot panels [ceil(N/16), K/2, 16, 2] for bfloat16 rows only, each k pair of 16 columns one
    512-bit load (ValueError where they cannot serve)."""
    out_features, in_features = weight.shape
    if dot:
        if weight.dtype != torch.bfloat16 or in_features % 2 or not bf16_dot():
            raise ValueError(f"dot panels need bfloat16 weights with an even in_features on a CPU with AVX512-BF16; "
                             f"got {weight.dtype} [{out_features}, {in_features}] (bf16_dot: {bf16_dot()})")
        padded = -(-out_features // DOT_PANEL) * DOT_PANEL
        rows = weight.detach()
        if padded != out_features:
            rows = torch.cat([rows, rows.new_zeros(padded - out_features, in_features)])
        return rows.reshape(padded // DOT_PANEL, DOT_PANEL, in_features // 2, 2).transpose(1, 2).contiguous()
    padded = -(-out_features // PANEL) * PANEL
    rows = weight.detach().to(weight.dtype if weight.dtype in PANEL_DTYPES else torch.float32)
    if padded != out_features:
        rows = torch.cat([rows, rows.new_zeros(padded - out_features, in_features)])
    return rows.reshape(padded // PANEL, PANEL, in_features).transpose(1, 2).contiguous()


def panel_linear(x: torch.Tensor, panels: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] float32 or bfloat16 on CPU (any number of rows: passes of 12) times the weight whose panels these
    are (float32 or bfloat16); products summed in float32 in a fixed order, the result in x's dtype: F.linear's up
    to float rounding (bfloat16: rounded once, to nearest even, like torch)."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"the panel kernel is unavailable: {unavailable_reason()}")
    in_features = x.shape[-1]
    dot = panels.ndim == 4
    panel_in = panels.shape[1] * 2 if dot else panels.shape[1]
    if (panel_in != in_features or x.dtype not in PANEL_DTYPES or panels.dtype not in PANEL_DTYPES
            or x.device.type != "cpu" or (dot and x.dtype != torch.bfloat16)):
        raise ValueError(f"panel_linear: x {tuple(x.shape)} {x.dtype} on {x.device} does not fit panels "
                         f"{tuple(panels.shape)} {panels.dtype} (float32 or bfloat16 on a CPU, same in_features; "
                         "bfloat16 rows for dot panels)")
    flat = x.reshape(-1, in_features).contiguous()
    if bias is not None:
        bias = bias.detach().to(torch.float32).contiguous()
    return panel_product(flat, panels, out_features, bias).reshape(*x.shape[:-1], out_features)


def panel_product(flat: torch.Tensor, panels: torch.Tensor, out_features: int,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """The C call behind `panel_linear`, without its checks (for callers that made them once: runtime.lean): flat
    [M, K] contiguous on a CPU in a dtype the panels take, bias contiguous float32 or None; returns [M, N]."""
    out = torch.empty(flat.shape[0], out_features, dtype=flat.dtype)
    dot = panels.ndim == 4
    failed = _load()[0].panel_linear(flat.data_ptr(), flat.shape[0], flat.shape[1], panels.data_ptr(),
                                     2 if dot else int(panels.dtype == torch.bfloat16), out_features,
                                     None if bias is None else bias.data_ptr(), out.data_ptr(),
                                     int(flat.dtype == torch.bfloat16), torch.get_num_threads())
    if failed == -2:
        raise ValueError("panel_linear: dot panels need bfloat16 rows, an even in_features and a kernel built with "
                         "AVX512-BF16")
    if failed:
        raise MemoryError(f"panel_linear: no memory for a pass buffer of 12 x {max(flat.shape[1], out_features)}")
    return out


ROW_ATTENTION_MAX_QUERIES = 64  # decode and verify; a prefill of more rows goes to the model's own attention


def row_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """Batch-invariant attention (the C `row_attention` above): query [B, Hq, Q, D], key [B, Hkv, L, D], value
    [B, Hkv, L, DV]
    (float32 or bfloat16, the same dtype; Hq a multiple of Hkv), allowed [B, Q, L] bool. Each query row is reduced
    alone over its allowed keys in slot order, so a row's output is the same bits whatever else is in the call.
    Returns [B, Q, Hq, DV] in the query's dtype (rounded once from float32, as torch rounds)."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"the attention kernel is unavailable: {unavailable_reason()}")
    batch, heads, queries, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    if (query.dtype not in PANEL_DTYPES or key.dtype != query.dtype or value.dtype != query.dtype
            or heads % kv_heads or key.shape[0] != batch or allowed.shape != (batch, queries, length)
            or key.shape[-1] != dim or value.shape[:3] != key.shape[:3]
            or any(t.device.type != "cpu" for t in (query, key, value))):
        raise ValueError(f"row_attention: query {tuple(query.shape)} {query.dtype}, key {tuple(key.shape)} "
                         f"{key.dtype}, value {value.dtype}, allowed {tuple(allowed.shape)}: expected float32 or "
                         "bfloat16 on a CPU, Hq a multiple of Hkv, allowed [B, Q, L]")
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    flags = allowed.to(torch.uint8).contiguous()
    out = torch.empty(batch, queries, heads, value.shape[-1], dtype=torch.float32)
    failed = lib.row_attention(query.data_ptr(), *query.stride()[:3], key.data_ptr(), value.data_ptr(),
                               *key.stride()[:3], *value.stride()[:3], int(query.dtype == torch.bfloat16),
                               flags.data_ptr(), batch, heads, kv_heads, queries, length, dim, value.shape[-1], scale,
                               out.data_ptr(),
                               torch.get_num_threads())
    if failed:
        raise MemoryError(f"row_attention: no memory for the scores of {length} keys")
    return out.to(query.dtype)
