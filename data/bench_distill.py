"""Benchmark distillation throughput: prompts/s and generated tokens/s per batch size, same prompts each time.

    python -m data.bench_distill --model ../shared/models/smollm2-135m-instruct \\
        --prompts ../shared/data/sharegpt_prompts.jsonl --max_prompts 64 --batch_sizes 1,8,16 \\
        --max_new_tokens 64 --output outputs/bench_distill.json

Each batch size is a full `data.distill` run (reading, generation, tokenisation, shard writing, merge)
into a temporary directory; the time measured is the generation time recorded in its manifest.
"""

from __future__ import annotations

import json
import platform
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from data.distill import DistillConfig, run
from data.runfiles import parse_config
from heads.files import atomic_write_json


@dataclass
class BenchConfig:
    model: str = "../shared/models/smollm2-135m-instruct"
    prompts: str = "../shared/data/sharegpt_prompts.jsonl"
    max_prompts: int = 64
    batch_sizes: str = "1,8,16"
    max_new_tokens: int = 64
    max_length: int = 1024
    plain_format: bool = False
    dtype: str = "auto"
    num_threads: int = 1
    output: str = "outputs/bench_distill.json"


def main(argv: list[str] | None = None) -> dict:
    bench = parse_config(BenchConfig, argv)
    torch.set_num_threads(bench.num_threads)
    results = []
    for batch_size in [int(b) for b in bench.batch_sizes.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            config = DistillConfig(model=bench.model, prompts=bench.prompts, output_dir=str(Path(tmp) / "out"),
                                   max_prompts=bench.max_prompts, max_new_tokens=bench.max_new_tokens,
                                   batch_size=batch_size, shard_size=bench.max_prompts, max_length=bench.max_length,
                                   plain_format=bench.plain_format, dtype=bench.dtype, num_threads=bench.num_threads)
            wall = time.perf_counter()
            manifest = run(config)
            wall = time.perf_counter() - wall
        seconds = manifest["generation_seconds"]
        answers = manifest["assistant_turns"]
        results.append({"batch_size": batch_size, "conversations": manifest["conversations_written"],
                        "skipped": manifest["conversations_skipped"], "answers": answers,
                        "generated_tokens": manifest["tokens"]["generated"], "generation_seconds": seconds,
                        "prompts_per_second": round(answers / seconds, 3),
                        "generated_tokens_per_second": round(manifest["tokens"]["generated"] / seconds, 2),
                        "wall_seconds_incl_load": round(wall, 2)})
        print(json.dumps(results[-1]))
    base = next((r for r in results if r["batch_size"] == 1), results[0])["generated_tokens_per_second"]
    for result in results:
        result["speedup_vs_batch_1"] = round(result["generated_tokens_per_second"] / base, 2)
    report = {"config": asdict(bench), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
              "machine": platform.processor() or platform.machine(), "results": results}
    atomic_write_json(Path(bench.output), report)
    print(f"{'batch':>5} {'prompts/s':>10} {'gen tok/s':>10} {'speedup':>8}")
    for result in results:
        print(f"{result['batch_size']:>5} {result['prompts_per_second']:>10.3f} "
              f"{result['generated_tokens_per_second']:>10.2f} {result['speedup_vs_batch_1']:>8.2f}")
    print(f"saved {bench.output}")
    return report


if __name__ == "__main__":
    from heads.cli import run_cli

    run_cli(main)
