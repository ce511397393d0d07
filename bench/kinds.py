"""Run `bench.drafters` once per prompt kind and compare the drafters kind by kind.

    python -m bench.kinds --config configs/bench_kinds_smollm2.yaml [--kinds summarise,chat] \
        [--methods prompt_lookup] [--max_prompts 1] [--max_new_tokens 32] [--output_dir DIR] [--repeats 3] \
        [--aggregate_only]

The config holds bench.drafters' keys (model, max_prompts, max_new_tokens, methods, dtype, exact, ...; its
`prompts` is replaced per kind) plus `kinds_file` (the JSONL of `python -m bench.prompt_kinds`; built with
--per_kind max_prompts and seed 0 when missing) and `kinds` (a list or comma-separated string; default: every
kind in the file). Any other key is an error naming it and the file. Per kind, the first `max_prompts` rows of
that kind go to `<output_dir>/<kind>/prompts.jsonl`, its bench.drafters config to
`<output_dir>/<kind>/bench_heads.yaml`, and bench.drafters writes its results there (rerunning resumes from its
state.json). Then, per kind x method and over all kinds (`all`): speed-up vs plain decoding (total tokens / total
time, and the median over prompts), vs the fastest plain weight layout where the records give one
(`overall.baseline` of bench.speed's --plain_layouts), tau (accepted tokens per step, bonus included),
identical-to-plain share, tokens/s, input tokens (median, through the chat template: bench.drafters' prompt_tokens),
to `<output_dir>/kinds_summary.json` and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from bench import drafters, prompt_kinds
from bench.prompt_kinds import KINDS, parse_kinds
from bench.report import fmt, ratio, write_json
from bench.report import markdown_table as table
from heads.cli import DEBUG_FLAG, raise_flag_error, read_config_mapping, run_cli
from heads.files import atomic_write_jsonl, atomic_write_text

KIND_KEYS = {"kinds_file", "kinds"}
SUMMARY_FILE = "kinds_summary.json"
DEFAULT_OUTPUT_DIR = "outputs/bench/kinds"
DEFAULT_KINDS_FILE = "outputs/prompts/kinds.jsonl"


# ---------------------------------------------------------------- configuration


# bench.drafters keys that mean nothing here: a kind file's rows have no MT-Bench category to sample by
NOT_FOR_KINDS = {"per_category"}


def drafters_keys() -> set[str]:
    """The run keys bench.drafters accepts in its config (read from it, so they follow its changes) that a kinds
    config may use."""
    return set(drafters.RUN_KEYS) - NOT_FOR_KINDS


def read_config(path: str | Path) -> dict[str, Any]:
    """The kinds config -> dict; unknown keys (not bench.drafters' nor kinds_file/kinds) raise naming key and file."""
    config = read_config_mapping(path, drafters_keys() | KIND_KEYS)
    if "methods" not in config:
        raise ValueError(f"--config {path}: 'methods' is missing (a list of bench.drafters methods)")
    return config


def select_methods(entries: Any, names: str | None, source: str) -> list[dict[str, Any]]:
    """The config's method entries, or those named in `names` (comma-separated), in config order."""
    if not isinstance(entries, list) or not all(isinstance(e, dict) and "name" in e for e in entries):
        raise ValueError(f"{source}: 'methods' must be a list of mappings with a 'name'")
    if not names:
        return entries
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    known = [e["name"] for e in entries]
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise ValueError(f"--methods: {unknown} not in {source}'s methods {known}")
    return [e for e in entries if e["name"] in wanted]


def read_kind_rows(path: str | Path) -> dict[str, list[dict[str, Any]]]:
    """The kinds JSONL -> {kind: rows} in file order; rows need `kind` and `prompt`."""
    path = Path(path)
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row, dict) or not isinstance(row.get("kind"), str) or not isinstance(row.get("prompt"), str):
            raise ValueError(f"kinds_file {path}: line {number} needs string 'kind' and 'prompt'")
        by_kind.setdefault(row["kind"], []).append(row)
    return by_kind


def kind_configs(config: dict[str, Any], rows: dict[str, list[dict[str, Any]]], kinds: list[str],
                 output_dir: Path, source: str) -> dict[str, Path]:
    """Write each kind's prompts.jsonl and bench.drafters config under output_dir/<kind>: {kind: config}."""
    max_prompts = int(config.get("max_prompts", 4))
    base = {k: v for k, v in config.items() if k not in KIND_KEYS | {"prompts", "output_dir", "max_prompts"}}
    paths = {}
    for kind in kinds:
        if not rows.get(kind):
            raise ValueError(f"{source}: kind {kind!r} has no prompt in kinds_file (it has {sorted(rows)})")
        folder = output_dir / kind
        prompts = atomic_write_jsonl(folder / "prompts.jsonl", rows[kind][:max_prompts])
        kind_config = {**base, "prompts": str(prompts), "output_dir": str(folder),
                       "max_prompts": min(max_prompts, len(rows[kind]))}
        paths[kind] = atomic_write_text(folder / "bench_heads.yaml", f"# {kind}: written by bench.kinds from "
                                        f"{source}\n" + yaml.safe_dump(kind_config, sort_keys=False))
    return paths


def run_drafters(config: Path) -> Any:
    """bench.drafters on one kind's config, in this process."""
    return drafters.main(["--config", str(config)])


# ---------------------------------------------------------------- aggregation


def _fastest_plain_tps(overall: dict[str, Any]) -> float | None:
    """The fastest plain decoding of the run: bench.speed's overall.baseline (the layout in use and the forced
    ones), when the run measured it; None otherwise (bench.drafters does not)."""
    baseline = overall.get("baseline")
    if not isinstance(baseline, dict):
        return None
    rates = [baseline.get("tokens_per_second") or 0.0]
    rates += [v.get("tokens_per_second") or 0.0 for v in (baseline.get("forced") or {}).values()]
    return max(rates) or None


def method_row(kind: str, method: str, records: list[dict[str, Any]], fastest_plain: float | None,
               extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """One table row from bench.speed per-prompt records (of one kind, or of every kind for `all`)."""
    totals = {runner: (sum(r[runner]["new_tokens"] for r in records), sum(r[runner]["seconds"] for r in records))
              for runner in ("plain", "method")}
    plain_tps, method_tps = (ratio(*totals[runner]) or 0.0 for runner in ("plain", "method"))
    steps = sum(r["steps"] for r in records)
    identical = [r.get("identical_to_plain") for r in records]
    greedy = [r.get("greedy_identical") for r in records]
    speedups = [r["speedup"] for r in records if r.get("speedup") is not None]
    return {"kind": kind, "method": method, "prompts": len(records),
            "prompt_tokens_median": statistics.median(r["prompt_tokens"] for r in records),
            "tau": sum(r["tau"] * r["steps"] for r in records) / steps if steps else 1.0,
            "speedup": ratio(method_tps, plain_tps),
            "speedup_median": statistics.median(speedups) if speedups else None,
            "speedup_min": min(speedups) if speedups else None,
            "speedup_vs_fastest_plain": ratio(method_tps, fastest_plain) if fastest_plain else None,
            "identical_to_plain": None if None in identical else sum(identical),
            "identical_to_plain_share": None if None in identical else sum(identical) / len(records),
            "greedy_identical": None if None in greedy else sum(greedy),
            "plain_tokens_per_second": plain_tps, "method_tokens_per_second": method_tps,
            "new_tokens": totals["method"][0], **(extra or {})}


def aggregate(kind_dirs: dict[str, Path], methods: list[str] | None = None) -> dict[str, Any]:
    """Per kind x method rows and one `all` row per method, from each kind's bench.drafters results
    (summary.json and <method>.json in its folder); only `methods` when given."""
    rows, records_by_method, fastest_by_method = [], {}, {}
    header: dict[str, Any] = {}
    for kind, folder in kind_dirs.items():
        summary_path = Path(folder) / "summary.json"
        if not summary_path.is_file():
            raise FileNotFoundError(f"{kind}: no {summary_path} (run the kind first)")
        summary = json.loads(summary_path.read_text())
        header = header or {k: summary.get(k) for k in ("model", "dtype", "max_new_tokens")}
        for entry in summary["methods"]:
            name = entry["method"]
            if methods is not None and name not in methods:
                continue
            result = json.loads((Path(folder) / f"{name}.json").read_text())
            records = result["prompts"]
            if not records:
                continue
            fastest = _fastest_plain_tps(result["overall"])
            rows.append(method_row(kind, name, records, fastest, {
                "description": entry.get("description"), "size": entry.get("size")}))
            records_by_method.setdefault(name, []).extend(records)
            fastest_by_method.setdefault(name, []).append(
                (fastest, sum(r["plain"]["seconds"] for r in records), rows[-1]["plain_tokens_per_second"]))
    overall = []
    for name, records in records_by_method.items():
        # the fastest plain rate over every kind: plain seconds rescaled kind by kind (only if every kind has it)
        parts = fastest_by_method[name]
        fastest = None
        if all(f for f, _, _ in parts):
            tokens = sum(r["plain"]["new_tokens"] for r in records)
            fastest = tokens / sum(seconds * plain / f for f, seconds, plain in parts)
        overall.append(method_row("all", name, records, fastest))
    return {**header, "kinds": list(kind_dirs), "methods": list(records_by_method), "rows": rows,
            "overall": overall}


def markdown_table(summary: dict[str, Any]) -> str:
    """Rows kind x method, then `all`; and speed-up (tau) by kind, one column per method."""
    columns = ["kind", "method", "prompts", "input tokens (median)", "tau", "speed-up", "median", "worst prompt",
               "vs fastest plain",
               "=plain", "plain tok/s", "method tok/s"]
    rows = []
    for row in summary["rows"] + summary["overall"]:
        same = "-" if row["identical_to_plain"] is None else f"{row['identical_to_plain']}/{row['prompts']}"
        rows.append([row["kind"], row["method"], row["prompts"], f"{row['prompt_tokens_median']:g}",
                     f"{row['tau']:.2f}", fmt(row["speedup"]), fmt(row["speedup_median"]), fmt(row.get("speedup_min")),
                     fmt(row["speedup_vs_fastest_plain"]), same, f"{row['plain_tokens_per_second']:.1f}",
                     f"{row['method_tokens_per_second']:.1f}"])
    methods = summary["methods"]
    cells = {(r["kind"], r["method"]): f"{fmt(r['speedup'])} ({r['tau']:.2f})"
             for r in summary["rows"] + summary["overall"]}
    by_kind = [[kind, *(cells.get((kind, m), "-") for m in methods)] for kind in [*summary["kinds"], "all"]]
    return "\n".join([table(columns, rows, right=[False, False] + [True] * 9), "", "speed-up vs plain (tau) by kind:", "",
                      table(["kind", *methods], by_kind, right=[False] + [True] * len(methods))])


# ---------------------------------------------------------------- command


def main(argv: list[str] | None = None, run_kind: Callable[[Path], Any] = run_drafters) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.error = raise_flag_error
    parser.add_argument("--config", required=True, help="bench.drafters keys plus kinds_file / kinds")
    parser.add_argument("--kinds", default=None, help=f"override the config's kinds (comma-separated, of "
                        f"{','.join(KINDS)})")
    parser.add_argument("--methods", default=None, help="run only these of the config's methods (comma-separated "
                        "names)")
    parser.add_argument("--max_prompts", type=int, default=None, help="override: prompts per kind")
    parser.add_argument("--max_new_tokens", type=int, default=None, help="override the config's max_new_tokens")
    parser.add_argument("--output_dir", default=None, help="override the config's output_dir")
    parser.add_argument("--repeats", type=int, default=None, help="override: runs of every runner per prompt, "
                        "interleaved, the fastest kept (bench.drafters' repeats)")
    parser.add_argument("--aggregate_only", action="store_true", help="aggregate the kinds' existing results, "
                        "run nothing")
    parser.add_argument(DEBUG_FLAG, action="store_true", help="show Python tracebacks of errors")
    args = parser.parse_args(argv)
    source = f"--config {args.config}"
    config = read_config(args.config)
    for key in ("max_prompts", "max_new_tokens", "output_dir", "repeats"):
        if getattr(args, key) is not None:
            config[key] = getattr(args, key)
    if int(config.get("max_prompts", 4)) < 1:
        raise ValueError(f"{source}: max_prompts must be >= 1, got {config['max_prompts']}")
    if int(config.get("repeats", 1)) < 1:
        flag = "--repeats" if args.repeats is not None else f"{source}: repeats"
        raise ValueError(f"{flag}: expected >= 1, got {config['repeats']}")
    config["methods"] = select_methods(config["methods"], args.methods, source)
    drafters.parse_methods(config["methods"], source)  # bench.drafters' own checks, before any kind runs
    output_dir = Path(config.get("output_dir", DEFAULT_OUTPUT_DIR))
    kinds_file = Path(config.get("kinds_file", DEFAULT_KINDS_FILE))
    if not kinds_file.is_file() and not args.aggregate_only:
        per_kind = int(config.get("max_prompts", 4))
        print(f"[kinds] {kinds_file} is missing: building it (--per_kind {per_kind} --seed 0)", file=sys.stderr)
        prompt_kinds.main(["--output", str(kinds_file), "--per_kind", str(per_kind),
                           "--model", str(config.get("model", prompt_kinds.DEFAULT_MODEL))])
    if not kinds_file.is_file():
        raise FileNotFoundError(f"{source}: kinds_file {kinds_file}: no such file")
    rows = read_kind_rows(kinds_file)
    kinds = parse_kinds(args.kinds if args.kinds is not None else config.get("kinds"),
                        "--kinds" if args.kinds is not None else f"{source}: kinds")
    kinds = [k for k in kinds if args.kinds is not None or config.get("kinds") or k in rows]
    if args.aggregate_only:
        folders = {kind: output_dir / kind for kind in kinds}
    else:
        configs = kind_configs(config, rows, kinds, output_dir, source)
        for i, (kind, path) in enumerate(configs.items()):
            print(f"[kinds] {kind} ({i + 1}/{len(configs)}): bench.drafters --config {path}", file=sys.stderr)
            run_kind(path)
        folders = {kind: path.parent for kind, path in configs.items()}
    summary = {"config": str(args.config), "kinds_file": str(kinds_file),
               **aggregate(folders, [m["name"] for m in config["methods"]])}
    write_json(output_dir / SUMMARY_FILE, summary)
    print(f"{summary.get('model')} ({summary.get('dtype')}), {summary.get('max_new_tokens')} new tokens, "
          f"speed-up = tokens/s over plain decoding's in the same run; {output_dir / SUMMARY_FILE}")
    print(markdown_table(summary))
    return summary


if __name__ == "__main__":
    run_cli(main)
