"""What the measurement tools write and print: JSON records (atomic), the per-prompt and overall records of a decode
bench, markdown tables, number formatting and matplotlib figures.

- Files: `write_json` / `write_jsonl` (atomic: a reader never sees half a file; heads.files), `check_writable`
  (fail before an hour of generation, naming the flag).
- Records: `prompt_record` (one prompt, every runner), `overall_record` (totals over prompts: tau, acceptance per
  depth from `GenerationStats.merged`, speed-ups, identity), `efficiency` (time shares and the cost model's
  predicted speed-up), `verify_cost_from_steps` (the verify cost curve measured in a run's own steps).
- Tables: `markdown_table`, `fmt` ('-' for None).
- Plots: `pyplot()` (matplotlib on the Agg backend, imported only when a plot is asked for) and `save_figure`.
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from heads.files import atomic_write_json, atomic_write_jsonl
from runtime.cost_model import predicted_speedup
from runtime.loop import GenerationStats

PLOT_SUFFIXES = (".png", ".pdf", ".svg")

# ---------------------------------------------------------------- files


def write_json(path: str | Path, value: Any, indent: int | None = 2) -> Path:
    """`value` as JSON at `path`, atomically (parents created)."""
    return atomic_write_json(path, value, indent=indent)


def write_jsonl(path: str | Path, rows: Iterable[Any]) -> Path:
    """One JSON line per row at `path`, atomically (parents created)."""
    return atomic_write_jsonl(path, rows)


def check_writable(path: str | Path, flag: str) -> None:
    """Raise ValueError naming `flag` unless a file can be written at `path` (its folder is created)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path}: is a directory; expected a file name")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as err:
        raise ValueError(f"{flag} {path}: cannot write there ({err.strerror or err})") from None


# ---------------------------------------------------------------- numbers


def share(part: float, whole: float) -> float:
    return part / whole if whole > 0 else 0.0


def ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def ratio_or_none(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else ratio(a, b)


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values that are not None (None when there are none)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def fmt(value: float | None, spec: str = ".2f") -> str:
    """`value` formatted with `spec`, '-' for None."""
    return "-" if value is None else format(value, spec)


# ---------------------------------------------------------------- decode records


def efficiency(method_stats: list[GenerationStats], plain_stats: list[GenerationStats]) -> dict[str, float | None]:
    """Time shares of the method's calls (draft, target forward, overhead = the rest of each step, prefill) and
    the speed-up the cost model predicts from its measured tau and per-step times (`predicted_speedup`)."""
    total = sum(s.total_time for s in method_stats)
    steps = sum(len(s.steps) for s in method_stats)
    plain_steps = sum(len(s.steps) for s in plain_stats)
    tau = sum(step.accepted_length for s in method_stats for step in s.steps) / steps if steps else 1.0
    predicted = None
    if steps and plain_steps:
        calls = len(method_stats)
        predicted = predicted_speedup(
            tau, sum(s.verify_time for s in method_stats) / steps, sum(s.draft_time for s in method_stats) / steps,
            sum(s.verify_time for s in plain_stats) / plain_steps,
            prefill_seconds=sum(s.prefill_time for s in method_stats) / calls,
            plain_prefill_seconds=sum(s.prefill_time for s in plain_stats) / len(plain_stats),
            new_tokens=(steps * tau + calls) / calls)
    return {"draft_share": share(sum(s.draft_time for s in method_stats), total),
            "verify_share": share(sum(s.verify_time for s in method_stats), total),
            "overhead_share": share(sum(s.overhead_time for s in method_stats), total),
            "prefill_share": share(sum(s.prefill_time for s in method_stats), total),
            "predicted_speedup": predicted}


def prompt_record(index: int, prompt_length: int, runs: dict[str, Any], greedy: bool) -> dict[str, Any]:
    """Per-prompt JSON record from the runs (bench.common.Run) of every runner on that prompt: "plain" and "method"
    (our loop), "hf" (transformers' generate) and optionally "hf_assisted"."""
    method = runs["method"]
    stats = method.stats
    record: dict[str, Any] = {
        "index": index, "prompt_tokens": prompt_length,
        "tau": stats.tau, "steps": len(stats.steps), "stop_reason": stats.stop_reason,
        "acceptance_per_depth": stats.acceptance_per_depth,
        **efficiency([stats], [runs["plain"].stats] if runs["plain"].stats else []),
    }
    for name, run in runs.items():
        record[name] = {"new_tokens": len(run.tokens), "seconds": run.seconds,
                        "tokens_per_second": run.tokens_per_second}
    record["speedup"] = ratio(method.tokens_per_second, runs["plain"].tokens_per_second)
    record["realised_over_predicted"] = ratio_or_none(record["speedup"], record["predicted_speedup"])
    record["speedup_vs_hf"] = ratio(method.tokens_per_second, runs["hf"].tokens_per_second)
    reference = runs["hf"].tokens
    record["greedy_identical"] = method.tokens == reference if greedy else None
    record["plain_identical"] = runs["plain"].tokens == reference if greedy else None
    # the method against our plain loop on the same weights and kernels: in bfloat16 transformers' generate runs
    # other kernels (the BLAS on the weights as loaded), so this is the identity a bf16 user can expect
    record["identical_to_plain"] = method.tokens == runs["plain"].tokens if greedy else None
    if "hf_assisted" in runs:
        assisted = runs["hf_assisted"]
        record["hf_assisted"]["speedup_vs_hf"] = ratio(assisted.tokens_per_second, runs["hf"].tokens_per_second)
        record["hf_assisted"]["greedy_identical"] = assisted.tokens == reference if greedy else None
    return record


def overall_record(records: list[dict[str, Any]], method_stats: list[GenerationStats],
                   plain_stats: list[GenerationStats] | None = None, dtype: str = "") -> dict[str, Any]:
    """Totals over prompts: tau over all steps, total tokens / total time, medians of per-prompt ratios, time
    shares and the cost model's predicted speed-up (from the plain runs' steps; None without them)."""
    merged = GenerationStats.merged(method_stats)
    overall: dict[str, Any] = {
        "prompts": len(records), "dtype": dtype, "tau": merged.tau,
        "acceptance_per_depth": merged.acceptance_per_depth,
        **efficiency(method_stats, plain_stats or []),
    }
    runners = [name for name in ("plain", "hf", "method", "hf_assisted") if name in records[0]]
    for name in runners:
        tokens = sum(r[name]["new_tokens"] for r in records)
        seconds = sum(r[name]["seconds"] for r in records)
        overall[name] = {"new_tokens": tokens, "seconds": seconds, "tokens_per_second": ratio(tokens, seconds)}
    tps = {name: overall[name]["tokens_per_second"] or 0.0 for name in runners}
    overall["speedup_median"] = median(r["speedup"] for r in records)
    overall["speedup_total"] = ratio(tps["method"], tps["plain"])
    overall["realised_over_predicted"] = ratio_or_none(overall["speedup_total"], overall["predicted_speedup"])
    overall["speedup_vs_hf_median"] = median(r["speedup_vs_hf"] for r in records)
    overall["speedup_vs_hf_total"] = ratio(tps["method"], tps["hf"])
    if "hf_assisted" in overall:
        overall["hf_assisted"]["speedup_vs_hf_median"] = median(r["hf_assisted"]["speedup_vs_hf"] for r in records)
        overall["hf_assisted"]["speedup_vs_hf_total"] = ratio(tps["hf_assisted"], tps["hf"])
        flags = [r["hf_assisted"]["greedy_identical"] for r in records]
        overall["hf_assisted"]["greedy_identical"] = None if None in flags else all(flags)
    for key in ("greedy_identical", "plain_identical", "identical_to_plain"):
        flags = [r.get(key) for r in records]
        overall[key] = None if None in flags else all(flags)
        overall[key + "_count"] = None if None in flags else sum(flags)
    return overall


def verify_cost_from_steps(stats: list[GenerationStats]) -> dict[str, list[float] | list[int]]:
    """The verify cost curve measured in the run itself: median target-forward seconds per number of forwarded
    tokens (root + drafted nodes) over every step of `stats`, and relative to a 1-token forward."""
    samples: dict[int, list[float]] = {}
    for s in stats:
        for step in s.steps:
            samples.setdefault(step.drafted_nodes + 1, []).append(step.verify_time)
    tokens = sorted(samples)
    medians = [statistics.median(samples[q]) for q in tokens]
    base = medians[0] if tokens and tokens[0] == 1 else None
    return {"tokens": tokens, "median_seconds": medians, "steps": [len(samples[q]) for q in tokens],
            "relative": [m / base for m in medians] if base else []}


# ---------------------------------------------------------------- tables


def markdown_table(columns: Sequence[str], rows: Iterable[Sequence[Any]], right: Sequence[bool] = ()) -> str:
    """A markdown table: the header, the rule ('---:' for the columns `right` marks, '---' for the others) and one
    line per row (cells as str)."""
    rule = "|" + "".join("---:|" if i < len(right) and right[i] else "---|" for i in range(len(columns)))
    lines = ["| " + " | ".join(columns) + " |", rule]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------- plots


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only; matplotlib is the optional `plots` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path, dpi: int = 110) -> None:
    """Write `fig` to `path` (folder created) and close it."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
