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


def measure_curve(run_forward: Callable[[int], None], tokens: Sequence[int], repeats: int = 5,
                  warmup: int = 2, synchronize: Callable[[], None] | None = None) -> list[float]:
    """Median wall time of `run_forward(q)` for each q in `tokens` (after `warmup` untimed calls each).

    Sizes are interleaved across repeats so slow drifts of a shared machine hit every size alike.
    """
    sync = synchronize or (lambda: None)
    for q in tokens:
        for _ in range(warmup):
            run_forward(q)
    sync()
    samples: dict[int, list[float]] = {q: [] for q in tokens}
    for _ in range(repeats):
        for q in tokens:
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
