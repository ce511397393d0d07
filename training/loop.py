"""Pieces of the training loop that are not the loop itself: schedule, data position, one optimizer step,
evaluation. `training/train_heads.py` calls them in order.

Loss scaling (why the numbers are the same however a global batch is split): every loss function returns
sums; one optimizer step divides them by the number of depth-0 labels in the whole global batch (all
processes, all accumulation micro-batches), counted before the forward passes. With DDP averaging gradients
over processes and Accelerate dividing by the accumulation steps, the backpropagated loss of a micro-batch is
`sum * num_processes * accumulation_steps / global_labels`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader

from training.evaluation import as_tensor, depth_metrics, from_tensor, sum_stats
from training.losses import DepthStats, LossOutput, label_count


def cosine_with_warmup(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0) -> float:
    """LR multiplier after `step` optimizer steps: linear 0->1 over warmup, then cosine 1->min_lr_ratio."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def total_steps(max_steps: int, num_epochs: float, batches_per_epoch: int, accumulation: int) -> int:
    """--max_steps, or enough optimizer steps for --num_epochs over `batches_per_epoch` micro-batches."""
    if max_steps > 0:
        return max_steps
    return max(1, math.ceil(num_epochs * batches_per_epoch / accumulation))


def warmup_steps(warmup: int, warmup_ratio: float, horizon: int) -> int:
    """The schedule's warmup: the larger of --warmup_steps and --warmup_ratio of the horizon (the planned steps, or
    the horizon --fit_train_minutes fitted)."""
    return max(warmup, int(warmup_ratio * horizon))


def steps_within_budget(total: int, done: int, elapsed: float, per_step: float, budget: float) -> int:
    """Optimizer steps that fit in `budget` seconds of the loop when `done` steps took `elapsed` seconds and each
    further step takes `per_step`: never more than `total` (the planned steps), never fewer than `done`."""
    if per_step <= 0:
        return total
    return max(done, min(total, done + int((budget - elapsed) / per_step)))


@dataclass
class MicroBatch:
    epoch: int
    index: int  # micro-batch number within the epoch (per process)
    batch: dict[str, Any]


def micro_batches(accelerator: Accelerator, loader: DataLoader, epoch: int, start: int) -> Iterator[MicroBatch]:
    """Endless micro-batches from (epoch, start): the same order an uninterrupted run sees (seeded sampler,
    reshuffled per epoch via set_epoch; the first `start` batches of `epoch` skipped)."""
    while True:
        loader.set_epoch(epoch)
        source = accelerator.skip_first_batches(loader, start) if start else loader
        for index, batch in enumerate(source, start=start):
            yield MicroBatch(epoch, index, batch)
        epoch, start = epoch + 1, 0


@dataclass
class StepResult:
    loss: float
    stats: DepthStats    # globally reduced per-depth sums
    labels: int          # depth-0 labels in the global batch
    extra: dict[str, float]
    grad_norm: float | None


class NonFiniteLossError(FloatingPointError):
    """Raised when a loss or gradient is NaN/inf; the message names the step, micro-batch and dataset rows."""


def _rows(accelerator: Accelerator, batch: dict[str, Any]) -> list[int]:
    return sorted(accelerator.gather(batch["rows"]).tolist())


def _check_finite(accelerator: Accelerator, value: torch.Tensor, what: str, step: int, micro: int,
                  batch: dict[str, Any]) -> None:
    bad = accelerator.reduce((~torch.isfinite(value.detach())).float().reshape(1), "sum")
    if bad.item() > 0:
        rows = _rows(accelerator, batch)
        raise NonFiniteLossError(f"non-finite {what} at optimizer step {step + 1}, micro-batch {micro} "
                                 f"(dataset rows {rows}); stopping. The last good checkpoint is kept; lower "
                                 "--learning_rate or inspect those rows.")


def train_step(accelerator: Accelerator, module: nn.Module, optimizer: torch.optim.Optimizer,
               micro: list[MicroBatch], step: int, max_grad_norm: float, noise_seed: int) -> StepResult:
    """One optimizer step over the accumulation micro-batches of this process.

    `noise_seed` seeds the per-micro-batch generator handed to the module (EAGLE feature noise), so noise
    depends only on (seed, step, micro-batch, process) and a resumed run draws the same noise.
    """
    local_labels = sum(label_count(m.batch["loss_mask"]) for m in micro)
    global_labels = accelerator.reduce(torch.as_tensor(local_labels, device=accelerator.device).reshape(1)
                                       .double(), "sum").item()
    scale = accelerator.num_processes * accelerator.gradient_accumulation_steps / max(global_labels, 1.0)
    loss_sum = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    stats: list[DepthStats] = []
    extra: dict[str, torch.Tensor] = {}
    for i, item in enumerate(micro):
        generator = torch.Generator(device=accelerator.device)
        generator.manual_seed(noise_seed + 1_000_003 * step + 7919 * i + 104_729 * accelerator.process_index)
        with accelerator.accumulate(module):
            output: LossOutput = module(item.batch, train=True, generator=generator)
            _check_finite(accelerator, output.loss, "loss", step, i, item.batch)
            accelerator.backward(output.loss * scale)
            grad_norm = None
            if accelerator.sync_gradients:
                if max_grad_norm > 0:
                    grad_norm = accelerator.clip_grad_norm_(module.parameters(), max_grad_norm)
                    if grad_norm is not None:  # DeepSpeed clips inside its engine and may return None
                        _check_finite(accelerator, torch.as_tensor(grad_norm), "gradient norm", step, i,
                                      item.batch)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        loss_sum += output.loss.detach().double()
        stats.append(output.depth)
        for key, value in output.extra.items():
            extra[key] = extra.get(key, 0.0) + value.detach().double()
    reduced = accelerator.reduce(torch.cat([loss_sum.reshape(1), as_tensor(sum_stats(stats)).flatten()]), "sum")
    depth = from_tensor(reduced[1:].reshape(4, -1))
    extra_values = {k: accelerator.reduce(v.reshape(1), "sum").item() / max(global_labels, 1.0)
                    for k, v in sorted(extra.items())}
    return StepResult(reduced[0].item() / max(global_labels, 1.0), depth, int(global_labels), extra_values,
                      None if grad_norm is None else float(grad_norm))


@torch.no_grad()
def evaluate(accelerator: Accelerator, module: nn.Module, loader: DataLoader, top_k: int) -> dict[str, float]:
    """Per-depth metrics on the held-out split (each process holds an equal shard; sums are all-reduced)."""
    module.eval()
    stats = []
    for batch in loader:
        batch = {k: (v.to(accelerator.device) if isinstance(v, torch.Tensor) else
                     {n: t.to(accelerator.device) for n, t in v.items()}) for k, v in batch.items()}
        stats.append(module(batch, train=False, generator=None).depth)
    module.train()
    total = accelerator.reduce(as_tensor(sum_stats(stats)), "sum")
    return depth_metrics(from_tensor(total), top_k)


def shard_rows(rows: list[int], process_index: int, num_processes: int) -> list[int | None]:
    """Equal-length shard of `rows` for one process; None marks a padding row (loss mask zeroed), so every
    process runs the same number of forwards (FSDP/DeepSpeed need that) and no row is counted twice."""
    per_process = math.ceil(len(rows) / num_processes)
    shard: list[int | None] = list(rows[process_index::num_processes])
    return shard + [None] * (per_process - len(shard))
