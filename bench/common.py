"""What every measurement tool shares: prompt reading, the one way to build a target, timed runs (warm-up, fastest
of R) and the environment record.

- Prompts: `read_questions` / `read_prompts` (any file or dataset data.prompts reads; the user turns of each
  conversation, MT-Bench's question_id and category kept).
- Targets: `load_target` builds every target the tools decode from a model name, through
  `runtime.build.load_target` (flags checked, the load-time verify check, the weight-layout choice, the dtype line);
  a model built in memory goes through `runtime.verify_check.prepare_target`, the same check.
- Timing: `run_ours` (our decode loop) and `run_hf` (transformers' `generate`) give a `Run` (new tokens, wall
  seconds, our loop's stats); `warm_up` runs every runner once untimed on a short budget, `fastest_of` runs every
  runner R times, interleaved, and keeps each one's fastest run.
- Environment: `environment(target)` (library versions, threads, device, dtype, weight layout, the CPU) and the CPU's
  kind (`cpu_kind`, `cpu_tag`: its name and whether its bf16 is native).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import platform
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import transformers

from data.prompts import read_conversations
from heads.loading import dtype_name, fast_bf16
from runtime.build import load_target as build_target
from runtime.config import DecodeConfig, GenerateArguments
from runtime.layout import as_loaded, layout_of
from runtime.loop import GenerationStats, generate
from runtime.proposers.base import Proposer
from runtime.target import TargetModel

# ---------------------------------------------------------------- prompts


@dataclass(frozen=True)
class Question:
    """One conversation of the prompt file: its id (the file's question_id, else its position) and user turns."""

    question_id: int | str
    category: str
    turns: list[str]


def _row_metadata(source: str) -> list[dict[str, Any]]:
    """question_id / category of each row of a JSONL prompt file (MT-Bench has both); [] for other sources."""
    path = Path(source)
    if not (path.is_file() and path.suffix == ".jsonl"):
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                return []
            rows.append(row if isinstance(row, dict) else {})
    return rows


def read_questions(source: str, max_prompts: int, per_category: int = 0) -> list[Question]:
    """The user turns of each of the first `max_prompts` conversations in `source`; with `per_category` > 0, of the
    first `per_category` conversations of each category (MT-Bench's `category`, categories in order of first
    appearance, at most `max_prompts` in all): a sample of every kind of prompt the file holds, not of its first."""
    if per_category < 0:
        raise ValueError(f"--per_category must be >= 0, got {per_category}")
    if per_category:
        return sample_per_category(read_questions(source, 0), per_category, max_prompts, source)
    conversations, skipped = read_conversations(source, max_rows=max_prompts or None)
    for row in skipped[:5]:
        print(f"[bench] --prompts {source}: skipped row {row.line}: {row.reason}", file=sys.stderr)
    if not conversations:
        raise ValueError(f"--prompts {source}: no usable prompt ({len(skipped)} rows skipped)")
    metadata = [] if skipped else _row_metadata(source)  # rows line up with conversations only if none skipped
    questions = []
    for i, conversation in enumerate(conversations):
        meta = metadata[i] if i < len(metadata) else {}
        questions.append(Question(question_id=meta.get("question_id", i), category=str(meta.get("category", "")),
                                  turns=[m["content"] for m in conversation if m["role"] == "user"]))
    return questions


def sample_per_category(questions: list[Question], per_category: int, max_prompts: int, source: str
                        ) -> list[Question]:
    """The first `per_category` questions of each category, category by category in order of first appearance,
    at most `max_prompts` (0 = no cap) in all."""
    if not all(q.category for q in questions):
        raise ValueError(f"--per_category: --prompts {source} has rows without a 'category' (MT-Bench's JSONL has "
                         "one on every row)")
    by_category: dict[str, list[Question]] = {}
    for question in questions:
        by_category.setdefault(question.category, []).append(question)
    sample = [q for group in by_category.values() for q in group[:per_category]]
    return sample[:max_prompts] if max_prompts else sample


def read_prompts(source: str, max_prompts: int, per_category: int = 0) -> list[str]:
    """The first user turn of each of the first `max_prompts` conversations in `source` (of each category's first
    `per_category`, when > 0: `read_questions`)."""
    return [question.turns[0] for question in read_questions(source, max_prompts, per_category)]


# ---------------------------------------------------------------- targets


def load_target(args: GenerateArguments | None = None, log=None, use_cache: bool = True,
                **flags: Any) -> tuple[TargetModel, Any]:
    """(TargetModel, tokenizer) of `args` (or of GenerateArguments(**flags): model=, dtype=, exact=, weight_layout=,
    device=, ...), always through runtime.build.load_target: flags checked before anything loads, the load-time
    verify check, the weight layout, the dtype line on `log` (stderr)."""
    if args is None:
        args = GenerateArguments(**flags)
    elif flags:
        args = dataclasses.replace(args, **flags)
    return build_target(args, log=log, use_cache=use_cache)


# ---------------------------------------------------------------- timed runs

R = TypeVar("R")


@dataclass(frozen=True)
class Run:
    """One generation of one runner on one prompt."""

    tokens: list[int]  # new tokens
    seconds: float  # wall time of the whole call (prefill included)
    stats: GenerationStats | None = None  # our loop only

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0


def run_ours(target: TargetModel, proposer: Proposer, input_ids: torch.Tensor, config: DecodeConfig) -> Run:
    """Our decode loop; input_ids [T]."""
    stats = GenerationStats()
    tokens: list[int] = []
    for step in generate(target, proposer, input_ids, config, stats):
        tokens.extend(step.tolist())
    return Run(tokens=tokens, seconds=stats.total_time, stats=stats)


def hf_generation_config(model, config: DecodeConfig) -> transformers.GenerationConfig:
    """The model's own generation config with our max_new_tokens, EOS and sampling settings."""
    gen = copy.deepcopy(model.generation_config)
    sampling = config.sampling
    if sampling.is_greedy:
        gen.update(do_sample=False, temperature=None, top_k=None, top_p=None)
    else:
        gen.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or None,
                   top_p=sampling.top_p)
    gen.update(max_new_tokens=config.max_new_tokens, min_new_tokens=None, max_length=None)
    if config.eos_token_ids is not None:
        gen.update(eos_token_id=list(config.eos_token_ids) or None)
    if gen.pad_token_id is None:
        eos = gen.eos_token_id
        gen.pad_token_id = eos[0] if isinstance(eos, list) else eos
    return gen


@torch.inference_mode()
def run_hf(model, input_ids: torch.Tensor, gen_config: transformers.GenerationConfig, seed: int | None,
           **assisted: Any) -> Run:
    """transformers' `model.generate` (plain, or assisted with `assistant_model=` / `prompt_lookup_num_tokens=`) as a
    user runs it: on the weights as loaded (a re-laid target, runtime.layout, is put back for the call, untimed)."""
    ids = input_ids[None].to(model.device)  # [1, T]
    if seed is not None:
        torch.manual_seed(seed)
    with as_loaded(model):
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen_config, **assisted)
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
        seconds = time.perf_counter() - start
    return Run(tokens=out[0, ids.shape[1]:].tolist(), seconds=seconds)


def warm_up(config: DecodeConfig, tokens: int, *runners: Callable[[DecodeConfig], Any]) -> None:
    """Every runner once, untimed, with at most `tokens` new tokens (first calls pay for allocation and lazy
    initialisation); tokens 0 = no warm-up."""
    if tokens <= 0:
        return
    short = dataclasses.replace(config, max_new_tokens=min(tokens, config.max_new_tokens))
    for runner in runners:
        runner(short)


def fastest(best: R | None, run: R) -> R:
    """The faster of two runs of one runner (`best` may be None; a tie keeps `best`)."""
    return best if best is not None and best.seconds <= run.seconds else run


def fastest_of(repeats: int, run_all: Callable[[], Mapping[str, R]]) -> dict[str, R]:
    """`run_all` (every runner once, in its order) `repeats` times, so the runners interleave: each runner's
    fastest run (its tokens and stats with it); robust to a noisy shared machine."""
    runs: dict[str, R] = {}
    for _ in range(repeats):
        for name, run in run_all().items():
            runs[name] = fastest(runs.get(name), run)
    return runs


# ---------------------------------------------------------------- environment


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_kind() -> str:
    """The CPU's model name and whether the runtime treats its bf16 as native (AVX512-BF16/AMX) or not (AVX2), as
    heads.loading.fast_bf16 decides it ($SPECHEADS_CPU_BF16 may force it), e.g. 'AMD EPYC, native bf16 (...)'."""
    name = next((line.split(":", 1)[1].strip() for line in _cpuinfo().splitlines() if line.startswith("model name")),
                platform.processor() or platform.machine())
    return f"{name}, {'native bf16 (AVX512-BF16/AMX)' if fast_bf16('cpu') else 'no native bf16 (AVX2)'}"


def cpu_tag() -> str:
    """'avx512bf16' where the CPU's bf16 is native, else 'avx2' (result file names)."""
    return "avx512bf16" if fast_bf16("cpu") else "avx2"


def environment(target: TargetModel) -> dict[str, Any]:
    """Where a measurement ran: library versions, torch threads, device, the target's dtype and weight layout, and
    the CPU (`cpu_kind`)."""
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "num_threads": torch.get_num_threads(),
            "device": str(target.device), "machine": platform.machine(),
            "dtype": dtype_name(target.model.dtype), "weight_layout": layout_of(target.model), "cpu": cpu_kind()}
