"""Train draft heads (Medusa-1/2, EAGLE-1/2, EAGLE-3, MTP) for a target model on its distilled data.

    accelerate launch training/train_heads.py --config configs/medusa_smollm2.yaml [--flag value ...]
    python training/train_heads.py --config configs/eagle3_smollm2.yaml --max_steps 50

Reads top to bottom in the order things happen: config -> accelerator -> refuse incompatible resumes ->
target + data -> heads -> optimizer -> (resume) -> loop (step, log, evaluate, checkpoint) -> heads directory
with the measured per-depth accuracy and expected acceptance length in its model card -> optional Hub push.
`--eval_only --init_heads DIR` stops after the heads: their held-out metrics, nothing trained or written but
<output_dir>/eval_metrics.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `accelerate launch training/train_heads.py` puts training/ first on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin
from torch import nn
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from heads.checkpoint import push_directory
from heads.cli import run_cli
from heads.files import atomic_write_text
from heads.loading import describe_dtype, fast_bf16, load_model, parse_dtype
from training.batching import Collator, IndexedRows, limit_by_tokens, split_rows
from training.checkpoints import (
    TrainerState,
    check_compatible,
    finalize_checkpoint,
    read_state,
    resolve_resume,
    temporary_checkpoint_path,
)
from training.config import TrainConfig, parse_config, save_config
from training.data_source import (
    TrainingData,
    assistant_token_counts,
    check_feature_layers,
    concatenate,
    load_parts,
    load_training_data,
    offline_features,
)
from training.evaluation import depth_metrics, per_depth
from training.loop import (
    NonFiniteLossError,
    cosine_with_warmup,
    evaluate,
    micro_batches,
    shard_rows,
    steps_within_budget,
    total_steps,
    train_step,
    warmup_steps,
)
from training.methods import build_training_module

# Distributed objects that only process exit may free (see the __main__ block).
_KEEP_UNTIL_EXIT: list[Any] = []


def resolve_mixed_precision(mixed_precision: str | None) -> str | None:
    """--mixed_precision auto -> bf16 where bf16 is fast on this machine's device (CUDA with bf16, a CPU with
    AVX512-BF16 or AMX: heads.loading.fast_bf16), no elsewhere (torch emulates bf16 there, several times slower
    than float32). Measured on an AVX512-BF16 CPU, the main job's EAGLE head: 6.75 samples/s in bf16 autocast
    against 3.82 in float32, the same held-out top-1 after 30 steps (.147 / .146)."""
    if mixed_precision != "auto":
        return mixed_precision
    return "bf16" if fast_bf16("cuda" if torch.cuda.is_available() else "cpu") else "no"


def make_accelerator(config: TrainConfig) -> Accelerator:
    """Accelerator with standard accumulation (one group = gradient_accumulation_steps micro-batches, never
    cut at epoch ends) and a seeded sampler (same data order on resume).

    Several launched processes on a machine without a GPU run as multi-CPU DDP (gloo); without `cpu=True`
    Accelerate would start them as independent single-process runs writing the same directory.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    accelerator = Accelerator(
        cpu=world_size > 1 and not torch.cuda.is_available(),
        mixed_precision=resolve_mixed_precision(config.mixed_precision),
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=config.gradient_accumulation_steps,
                                                                sync_with_dataloader=False),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=config.seed),
        log_with=None if config.report_to == "none" else config.report_to,
        project_dir=config.output_dir,
    )
    if accelerator.num_processes != world_size:
        raise ValueError(f"launched {world_size} processes (WORLD_SIZE) but Accelerate formed a group of "
                         f"{accelerator.num_processes}; check the accelerate config (distributed_type)")
    return accelerator


def held_out(config: TrainConfig, data: TrainingData, counts: list[int]) -> tuple[list[int], TrainingData, list[int]]:
    """(training rows of --dataset, the held-out data, its evaluated rows).

    Without --eval_dataset, --eval_samples seeded rows of --dataset are held out; with it, every --dataset row
    may train and the first --eval_samples rows of --eval_dataset are evaluated (target online, or from
    --eval_features). Then
    --max_train_tokens keeps a seeded subset of the training rows (counts[i]: assistant tokens of row i).
    """
    if config.eval_dataset:
        parts = load_parts(config, held_out=True)
        features = offline_features(config, parts, held_out=True) if config.eval_features else None
        eval_data = TrainingData(concatenate(parts), features, data.pad_token_id)
        train_rows = list(range(len(data.rows)))
        eval_rows = list(range(min(config.eval_samples, len(eval_data.rows))))
    else:
        eval_data = data
        train_rows, eval_rows = split_rows(len(data.rows), config.eval_samples, config.seed)
    train_rows = limit_by_tokens(counts, train_rows, config.max_train_tokens, config.seed)
    return train_rows, eval_data, eval_rows


def loaders(config: TrainConfig, data: TrainingData, accelerator: Accelerator, train_rows: list[int],
            eval_data: TrainingData, eval_rows: list[int]) -> tuple[DataLoader, DataLoader]:
    """(training loader, to be prepared; this process's equal-size evaluation shard loader)."""
    global_batch = config.per_device_batch_size * accelerator.num_processes
    if len(train_rows) < global_batch:
        raise ValueError(f"--dataset {config.dataset}: {len(train_rows)} training rows, fewer than one global "
                         f"batch ({config.per_device_batch_size} x {accelerator.num_processes} processes)")
    collate = Collator(data.pad_token_id, config.max_length)
    train = DataLoader(IndexedRows(data.rows, train_rows, data.features, all_tokens=config.loss_tokens == "all"),
                       batch_size=config.per_device_batch_size,
                       shuffle=True, drop_last=True, collate_fn=collate, num_workers=config.dataloader_num_workers)
    shard = shard_rows(eval_rows, accelerator.process_index, accelerator.num_processes)
    held_out = DataLoader(IndexedRows(eval_data.rows, shard, eval_data.features, filler=eval_rows[0]),
                          batch_size=config.per_device_batch_size, collate_fn=collate)
    return train, held_out


def heads_metrics(eval_metrics: dict[str, float], config: TrainConfig, step: int) -> dict[str, Any]:
    """What goes into the heads' config.json/model card: per-depth accuracy and expected acceptance length."""
    return {
        "top1_accuracy_per_depth": [round(v, 4) for v in per_depth(eval_metrics, "top1")],
        f"top{config.eval_top_k}_accuracy_per_depth": [round(v, 4)
                                                      for v in per_depth(eval_metrics, f"top{config.eval_top_k}")],
        "expected_acceptance_length": round(eval_metrics["eval/acceptance_length"], 4),
        "eval_tokens": int(eval_metrics["eval/tokens"]),
        "training_method": config.method,
        "training_steps": step,
    }


def resource_metrics(accelerator: Accelerator, steps: int, global_batch: int, seconds: float) -> dict[str, float]:
    """Training throughput of this run (evaluation and checkpoints included) and peak memory of this process."""
    metrics = {"train/seconds": seconds, "train/samples_per_second": steps * global_batch / max(seconds, 1e-9),
               "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if accelerator.device.type == "cuda":
        metrics["peak_gpu_memory_mb"] = torch.cuda.max_memory_allocated(accelerator.device) / 2**20
    return metrics


def log_line(config: TrainConfig, record: dict[str, Any]) -> None:
    """Append one JSON line to <output_dir>/metrics.jsonl (main process)."""
    with open(Path(config.output_dir) / "metrics.jsonl", "a") as handle:
        handle.write(json.dumps(record) + "\n")


def save_checkpoint(accelerator: Accelerator, config: TrainConfig, state: TrainerState) -> None:
    tmp = temporary_checkpoint_path(config.output_dir, state.step)
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        path = finalize_checkpoint(tmp, config, state, config.save_total_limit)
        accelerator.print(f"saved checkpoint {path} (step {state.step})")
    accelerator.wait_for_everyone()


def target_dtype_request(target_dtype: str, mixed_precision: str) -> str:
    """--target_dtype as load_model takes it. Heads train in float32, so a reduced-precision target needs
    --mixed_precision bf16/fp16 (autocast): an explicit one without it is an error, auto then picks float32."""
    if mixed_precision != "no":
        return target_dtype
    if target_dtype == "auto":
        return "float32"
    if parse_dtype(target_dtype) != torch.float32:
        raise ValueError(f"--target_dtype {target_dtype}: heads train in float32, so a reduced-precision "
                         "target needs --mixed_precision bf16/fp16 (autocast)")
    return target_dtype


def evaluate_heads(config: TrainConfig, accelerator: Accelerator, module: nn.Module,
                   eval_loader: DataLoader) -> dict[str, Any]:
    """--eval_only: the --init_heads heads' held-out metrics, printed and written to <output_dir>/eval_metrics.json."""
    metrics = evaluate(accelerator, module, eval_loader, config.eval_top_k)  # no_grad, eval mode
    result = {"heads": config.init_heads, "eval_dataset": config.eval_dataset or config.dataset, **metrics}
    if accelerator.is_main_process:
        text = json.dumps(result, indent=1)
        atomic_write_text(Path(config.output_dir) / "eval_metrics.json", text + "\n")
        print(text)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    # 1. Configuration and processes. Nothing is written before the compatibility checks pass.
    config = parse_config(argv)
    torch.set_num_threads(config.num_threads or 1)
    accelerator = make_accelerator(config)
    checkpoint = None if config.eval_only else resolve_resume(config)
    check_compatible(config, checkpoint)
    requested = target_dtype_request(config.target_dtype, accelerator.mixed_precision)

    # 2. Target, data, heads.
    target = load_model(config.model, dtype=requested, attn_implementation=config.attn_implementation,
                        device=accelerator.device, revision=config.model_revision, dtype_flag="--target_dtype")
    if config.mixed_precision == "auto":
        accelerator.print(f"--mixed_precision auto: {accelerator.mixed_precision} (bf16 autocast only where this "
                          f"device runs bf16 natively)", file=sys.stderr)
    fallback = " (auto with --mixed_precision no)" if requested != config.target_dtype else ""
    accelerator.print("target_" + describe_dtype(target.dtype, requested, accelerator.device) + fallback,
                      file=sys.stderr)
    data = load_training_data(config, target)
    counts = assistant_token_counts(data.rows)
    train_rows, eval_data, eval_rows = held_out(config, data, counts)
    accelerator.print(f"training on {len(train_rows)} rows ({sum(counts[r] for r in train_rows)} assistant tokens); "
                      f"evaluating {len(eval_rows)} held-out rows of {config.eval_dataset or config.dataset}")
    train_loader, eval_loader = loaders(config, data, accelerator, train_rows, eval_data, eval_rows)
    module = build_training_module(config, target, lambda: data.assistant_tokens(train_rows))
    check_feature_layers(data.features, module.feature_layers, config.method, "--features", config.features)
    if eval_data is not data:
        check_feature_layers(eval_data.features, module.feature_layers, config.method, "--eval_features",
                             config.eval_features)
    if config.eval_only:
        return evaluate_heads(config, accelerator, module, eval_loader)
    trainable = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2),
                                  weight_decay=config.weight_decay)
    # planned: the configured horizon, which --fit_train_minutes may shorten (`steps`), never lengthen
    planned = steps = total_steps(config.max_steps, config.num_epochs, len(train_loader) // accelerator.num_processes,
                                  config.gradient_accumulation_steps)
    warmup = warmup_steps(config.warmup_steps, config.warmup_ratio, steps)
    # The lambda reads `warmup` and `steps` when it is called: --fit_train_minutes sets both to the fitted horizon.
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: cosine_with_warmup(s, warmup, steps, config.min_lr_ratio))
    module, optimizer, train_loader = accelerator.prepare(module, optimizer, train_loader)
    if accelerator.num_processes > 1:
        _KEEP_UNTIL_EXIT.append(module)
    accelerator.register_for_checkpointing(scheduler)

    # 3. Resume: weights, optimizer, scheduler, RNG states; then the exact data position.
    state = TrainerState(step=0, epoch=0, batch=0, samples=0)
    if checkpoint is not None:
        accelerator.load_state(str(checkpoint))
        state = read_state(checkpoint)
        if config.fit_train_minutes and state.total_steps:
            steps, warmup = state.total_steps, state.warmup_steps or warmup  # as fitted before the interruption
        accelerator.print(f"resumed from {checkpoint} at step {state.step}")
    if accelerator.is_main_process:
        save_config(config, config.output_dir)
    if config.report_to != "none":
        accelerator.init_trackers(config.project_name, config=dataclasses.asdict(config),
                                  init_kwargs={"wandb": {"name": config.run_name or Path(config.output_dir).name,
                                                         "dir": config.output_dir}})

    # 4. The loop.
    batches = micro_batches(accelerator, train_loader, state.epoch, state.batch)
    global_batch = config.per_device_batch_size * config.gradient_accumulation_steps * accelerator.num_processes
    progress = tqdm(total=steps, initial=state.step, disable=not (accelerator.is_main_process and config.progress_bar),
                    desc=config.method, dynamic_ncols=True)
    eval_metrics: dict[str, float] = {}
    started, started_step = time.perf_counter(), state.step
    earlier_seconds = state.train_seconds  # the loop's time in the runs this one resumes: budgets count it
    module.train()
    limits = {flag: minutes for flag, minutes in (("--max_train_minutes", config.max_train_minutes),
                                                    ("--fit_train_minutes", config.fit_train_minutes)) if minutes}
    budget = min(limits.values(), default=0.0) * 60
    fit_at = min(10, planned) if config.fit_train_minutes else None
    first_step_done = started  # the clock after this loop's first step (the steps after it measure the rate)

    def main_process_value(value: float) -> float:  # every process acts at the same step on the main one's clock
        tensor = torch.tensor([value], device=accelerator.device)
        if accelerator.num_processes > 1:
            tensor = accelerator.reduce(tensor * float(accelerator.is_main_process), reduction="sum")
        return float(tensor.item())

    def over_budget() -> bool:
        return bool(budget) and bool(main_process_value(
            float(earlier_seconds + time.perf_counter() - started >= budget)))

    while state.step < steps and not over_budget():
        micro = [next(batches) for _ in range(config.gradient_accumulation_steps)]
        result = train_step(accelerator, module, optimizer, micro, state.step, config.max_grad_norm, config.seed)
        scheduler.step()
        now = time.perf_counter()
        state = TrainerState(step=state.step + 1, epoch=micro[-1].epoch, batch=micro[-1].index + 1,
                             samples=state.samples + global_batch, total_steps=state.total_steps,
                             warmup_steps=state.warmup_steps, train_seconds=earlier_seconds + now - started)
        rate = (state.step - started_step) * global_batch / (now - started)
        if state.step == started_step + 1:
            first_step_done = now
        elif fit_at is not None and state.step >= fit_at and state.step - started_step >= min(10, planned):
            # Fit again every eighth of the horizon until three quarters of it: the rate measured over more steps
            # (evaluations included) moves the end by a few percent, and the cosine bends with it.
            per_step = (now - first_step_done) / (state.step - started_step - 1)
            fitted = int(main_process_value(float(steps_within_budget(
                planned, state.step, state.train_seconds, per_step, 0.95 * config.fit_train_minutes * 60))))
            if fitted != steps:
                accelerator.print(f"--fit_train_minutes {config.fit_train_minutes:g}: {per_step:.3f} s per step at "
                                  f"step {state.step}, so the schedule ends at step {fitted} of the {planned} planned")
            steps = fitted
            if state.step < warmup:  # warmup is a share of the horizon the run will have, not of the planned one
                warmup = warmup_steps(config.warmup_steps, config.warmup_ratio, steps)
            state = dataclasses.replace(state, total_steps=steps, warmup_steps=warmup)
            fit_at = state.step + max(10, steps // 8)
            fit_at = fit_at if fit_at <= 0.75 * steps else None
            progress.total = steps
            if accelerator.is_main_process:
                log_line(config, {"step": state.step, "fit_train_minutes": config.fit_train_minutes,
                                  "seconds_per_step": per_step, "planned_steps": planned, "fitted_steps": steps,
                                  "warmup_steps": warmup})
        train = depth_metrics(result.stats, config.eval_top_k, prefix="train")
        progress.update(1)
        progress.set_postfix(loss=f"{result.loss:.4f}", top1=f"{train['train/top1_d0']:.3f}",
                             samples_s=f"{rate:.2f}")
        if config.eval_steps and state.step % config.eval_steps == 0 and state.step < steps:
            eval_metrics = evaluate(accelerator, module, eval_loader, config.eval_top_k)
        if state.step == 1 or state.step == steps or state.step % max(config.logging_steps, 1) == 0 or \
                (config.eval_steps and state.step % config.eval_steps == 0):
            record = {"step": state.step, "epoch": state.epoch, "loss": result.loss,
                      "lr": scheduler.get_last_lr()[0], "samples_per_second": rate, "labels": result.labels,
                      **{f"train/{k}": v for k, v in result.extra.items()}, **train}
            if result.grad_norm is not None:
                record["grad_norm"] = result.grad_norm
            if config.eval_steps and state.step % config.eval_steps == 0 and state.step < steps:
                record.update(eval_metrics)
            accelerator.log(record, step=state.step)
            if accelerator.is_main_process:
                log_line(config, record)
        if config.save_steps and (state.step % config.save_steps == 0 or state.step == steps):
            save_checkpoint(accelerator, config, state)
    progress.close()
    if state.step < steps:
        flag = min(limits, key=limits.get)
        accelerator.print(f"{flag} {limits[flag]:g}: stopped at step {state.step} of {steps}")

    train_seconds = time.perf_counter() - started

    # 5. Final evaluation, heads directory (+ adapter / merged target for Medusa-2), Hub.
    eval_metrics = evaluate(accelerator, module, eval_loader, config.eval_top_k)
    final = {"step": state.step, **eval_metrics, **resource_metrics(accelerator, state.step - started_step,
                                                                   global_batch, train_seconds),
             "train/rows": len(train_rows), "train/assistant_tokens": sum(counts[r] for r in train_rows)}
    accelerator.log(final, step=state.step)
    heads_dir = Path(config.heads_dir or Path(config.output_dir) / "heads")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        log_line(config, final)
        unwrapped = accelerator.unwrap_model(module)
        heads = unwrapped.heads
        heads.config.metrics = heads_metrics(eval_metrics, config, state.step)
        heads.save_pretrained(heads_dir)
        if config.method == "medusa2":
            unwrapped.target.save_pretrained(heads_dir / "adapter")
            if config.save_merged:
                # merged in float32 (the LoRA weights are float32 whatever the target's dtype: peft refuses to
                # merge float32 deltas into bf16 weights), saved in the target's dtype
                base_dtype = next(unwrapped.target.get_base_model().parameters()).dtype
                merged = unwrapped.target.float().merge_and_unload().to(base_dtype)
                merged.save_pretrained(Path(config.output_dir) / "merged")
        accelerator.print(f"heads saved to {heads_dir}: top-1 per depth "
                          f"{heads.config.metrics['top1_accuracy_per_depth']}, expected acceptance length "
                          f"{heads.config.metrics['expected_acceptance_length']}; "
                          f"{final['train/samples_per_second']:.2f} samples/s, peak RSS {final['peak_rss_mb']:.0f} MB")
        if config.push_to_hub:
            url = push_directory(heads_dir, config.push_to_hub, private=config.hub_private)
            accelerator.print(f"pushed {heads_dir} to {url}")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return final


if __name__ == "__main__":
    run_cli(main, errors=(NonFiniteLossError,))
    # Freeing a DDP module on gloo while the process group's worker thread still finishes the last collective
    # can deadlock on the GIL (seen with torch 2.13 CPU, about one run in three): everything is saved and
    # the trackers are closed, so leave without tearing the process group down.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
