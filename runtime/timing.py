"""Timing primitives shared by the cost model and the weight-layout choice: median wall time per forward size
(interleaved repeats), one verify forward of q tree tokens through the target adapter, the device key timings
are cached under, and the KV length that fits a target's context.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from runtime.target import TargetModel
from runtime.tree import Tree

SMALL_SIZES = 8  # forwards of up to this many tokens are timed SMALL_FACTOR times as often as larger ones
SMALL_FACTOR = 3


def measure_curve(run_forward: Callable[[int], None], tokens: Sequence[int], repeats: int = 5,
                  warmup: int = 2, synchronize: Callable[[], None] | None = None,
                  small_factor: int = SMALL_FACTOR) -> list[float]:
    """Median wall time of `run_forward(q)` for each q in `tokens` (after `warmup` untimed calls each): sizes up to
    SMALL_SIZES over `repeats * small_factor` runs, larger ones over `repeats`.

    Sizes are interleaved across rounds so slow drifts of a shared machine hit every size alike. Why more runs for
    small sizes: the decisions read their ratios (a 2-token verify over a 1-token step is the head's and prompt
    lookup's break-even), a few percent apart, and each costs ~40 ms. Measured on a 2-core AVX2 VM (60 interleaved
    rounds at KV 256): the 2-token ratio ranged 0.990-1.225 between blocks of 5 runs by the median (as measured
    before; a curve cached from one such block said 1.015 where a quiet minute measured 1.10), 1.035-1.140 between
    blocks of 15. Why the median and not the fastest run (1.033-1.091 between blocks of 15, steadier): decoding runs
    on the same noisy machine, and its steps' ratio is the typical one: on 8 MT-Bench answers the hybrid's 2-token
    verifies took 1.03-1.04 of plain decoding's 1-token steps by the median, 1.08-1.10 by the fastest, so the
    fastest run over-prices small drafts where the machine is shared.
    """
    if repeats < 1 or small_factor < 1:
        raise ValueError(f"measure_curve: need repeats >= 1 and small_factor >= 1, got {repeats}, {small_factor}")
    sync = synchronize or (lambda: None)
    for q in tokens:
        for _ in range(warmup):
            run_forward(q)
    sync()
    samples: dict[int, list[float]] = {q: [] for q in tokens}
    for round_ in range(repeats * small_factor):
        for q in tokens:
            if q > SMALL_SIZES and round_ % small_factor:
                continue
            sync()
            start = time.perf_counter()
            run_forward(q)
            sync()
            samples[q].append(time.perf_counter() - start)
    return [statistics.median(samples[q]) for q in tokens]


def measurement_tree(num_tokens: int) -> Tree:
    """A bushy tree of `num_tokens` nodes (binary heap shape); cost does not depend on the shape."""
    return Tree.from_parents([-1] + [(i - 1) // 2 for i in range(1, num_tokens)])


def kv_length_within(target: TargetModel, kv_length: int, tokens: int) -> int:
    """`kv_length`, shortened so that it plus `tokens` verified tokens fits the target's context."""
    if target.max_positions is None:
        return kv_length
    return max(1, min(kv_length, target.max_positions - tokens))


def target_verify_forward(target: TargetModel, kv_length: int, hidden_state_indices: tuple[int, ...] = (),
                          seed: int = 0) -> Callable[[int], None]:
    """A `run_forward(q)` doing one verify forward of q tree tokens through the runtime's target adapter.

    A random `kv_length`-token prefix is prefilled once; each call forwards q tree nodes (tree mask, positions
    prefix_len + depth, logits at every node, the requested hidden states) exactly as the decode loop's
    verify does, then drops them again (`commit([])`).
    """
    gen = torch.Generator().manual_seed(seed)
    target.prefill(torch.randint(target.vocab_size, (max(kv_length, 1),), generator=gen))
    trees: dict[int, tuple[torch.Tensor, Tree]] = {}

    def run(q: int) -> None:
        if q not in trees:
            tree = measurement_tree(q) if target.mode == "tree" else Tree.chain(q - 1)  # chain-mode targets
            trees[q] = (torch.randint(target.vocab_size, (q,), generator=gen), tree)
        tokens, tree = trees[q]
        target.forward(tokens, tree, hidden_state_indices=hidden_state_indices)
        target.commit([])

    return run


def device_name(device: torch.device | str) -> str:
    """'NVIDIA H200' / 'cpu-1threads' (CPU timings depend on the thread count)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type}-{torch.get_num_threads()}threads"
