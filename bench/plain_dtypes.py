"""Plain decoding speed per dtype, and llama.cpp's on the same weights: what halving the bytes buys.

    python -m bench.plain_dtypes --model ../shared/models/smollm2-135m-instruct --max_prompts 4 \\
        --llama_bench PATH/llama-bench --gguf bfloat16=smollm2-bf16.gguf float32=smollm2-f32.gguf \\
        --output_json results/plain_dtypes_smollm2.json

Our plain loop (no drafter) runs the same prompts in each `--dtypes` entry on the layout auto picks, one thread,
interleaved over `--repeats` rounds (fastest run of each kept); `llama-bench -t 1 -p 0 -n N` runs each `--gguf` file
(convert the target's plain HF directory with llama.cpp's convert_hf_to_gguf.py, so the weights are the same).
Prints and writes tokens/s per dtype, our bf16 / float32 ratio and ours / llama.cpp per dtype.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from bench.common import environment, fastest_of, load_target, read_prompts, run_ours, warm_up
from bench.report import check_writable, ratio, write_json
from heads.cli import parse_flags, run_cli
from runtime import kernels
from runtime.build import encode_prompt
from runtime.config import DecodeConfig
from runtime.proposers import Autoregressive


@dataclass
class PlainDtypesArguments:
    """Flags of `python -m bench.plain_dtypes`."""

    model: str = field(default="../shared/models/smollm2-135m-instruct", metadata={"help": "target model"})
    dtypes: str = field(default="float32,bfloat16", metadata={"help": "comma-separated dtypes of our plain loop"})
    prompts: str = field(default="../shared/data/mt_bench_question.jsonl", metadata={"help": "prompt file"})
    max_prompts: int = field(default=4, metadata={"help": "prompts (first turns)"})
    max_new_tokens: int = field(default=128, metadata={"help": "new tokens per prompt (and llama-bench -n)"})
    repeats: int = field(default=2, metadata={"help": "rounds; the fastest run of each prompt and dtype is kept"})
    llama_bench: str = field(default="", metadata={"help": "llama.cpp's llama-bench binary; empty = skip llama.cpp"})
    gguf: list[str] = field(default_factory=list, metadata={
        "help": "DTYPE=FILE.gguf entries (space-separated): llama.cpp runs of the same weights, compared with our DTYPE"})
    output_json: str = field(default="outputs/bench/plain_dtypes.json", metadata={"help": "results (JSON)"})


def parse_gguf(entries: list[str]) -> dict[str, str]:
    """['bfloat16=a.gguf', ...] -> {'bfloat16': 'a.gguf'}; one-line errors naming --gguf."""
    out = {}
    for entry in entries:
        dtype, sep, path = entry.partition("=")
        if not sep or not dtype or not path:
            raise ValueError(f"--gguf {entry!r}: expected DTYPE=FILE.gguf")
        out[dtype] = path
    return out


def llama_bench(binary: str, gguf: str, new_tokens: int) -> float:
    """Generated tokens/s of `llama-bench -t 1 -p 0 -n new_tokens` on `gguf` (its JSON average)."""
    done = subprocess.run([binary, "-m", gguf, "-t", "1", "-p", "0", "-n", str(new_tokens), "-o", "json"],
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"--llama_bench {binary} on {gguf} failed: {done.stderr.strip().splitlines()[-1:]}")
    return float(json.loads(done.stdout)[0]["avg_ts"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_flags(PlainDtypesArguments, argv)
    ggufs = parse_gguf(args.gguf)
    check_writable(args.output_json, "--output_json")
    torch.set_num_threads(1)
    config = DecodeConfig(max_new_tokens=args.max_new_tokens, eos_token_ids=())  # every run the same length
    targets = {dtype: load_target(model=args.model, dtype=dtype) for dtype in args.dtypes.split(",")}
    prompts = read_prompts(args.prompts, args.max_prompts)
    totals = {dtype: [0, 0.0] for dtype in targets}  # tokens, seconds
    for prompt in prompts:
        runners = {}
        for dtype, (target, tokenizer) in targets.items():
            ids = encode_prompt(tokenizer, prompt)
            runners[dtype] = lambda decode, target=target, ids=ids: run_ours(target, Autoregressive(), ids, decode)
        warm_up(config, 8, *runners.values())
        for dtype, run in fastest_of(args.repeats, lambda runners=runners: {d: r(config) for d, r in runners.items()}
                                     ).items():
            totals[dtype][0] += len(run.tokens)
            totals[dtype][1] += run.seconds
    ours = {dtype: tokens / seconds for dtype, (tokens, seconds) in totals.items()}
    llama = {dtype: llama_bench(args.llama_bench, path, args.max_new_tokens)
             for dtype, path in ggufs.items()} if args.llama_bench else {}
    result = {"config": vars(args), "environment": environment(next(iter(targets.values()))[0]),
              "ours_tokens_per_second": ours, "llama_cpp_tokens_per_second": llama,
              "bf16_over_float32": ratio(ours.get("bfloat16", 0.0), ours.get("float32", 0.0)),
              "ours_over_llama_cpp": {d: ratio(ours[d], llama[d]) for d in llama if d in ours},
              "forward": {dtype: "lean" if target.lean_forward() is not None else "transformers"
                          for dtype, (target, _) in targets.items()},
              "bf16_kernel": "avx512bf16 dot panels" if kernels.bf16_dot() else "widen + FMA panels"}
    write_json(args.output_json, result)
    for dtype, speed in ours.items():
        line = f"{dtype}: our plain loop {speed:.1f} tok/s"
        if dtype in llama:
            line += f", llama.cpp {llama[dtype]:.1f} tok/s (ours / llama.cpp {result['ours_over_llama_cpp'][dtype]:.2f})"
        print(line)
    print(f"bf16 / float32 (ours): {result['bf16_over_float32'] or 0:.2f} (forward per dtype {result['forward']}, bf16 "
          f"products on {result['bf16_kernel']}); wrote {args.output_json}", file=sys.stderr)
    return result


if __name__ == "__main__":
    run_cli(main)
