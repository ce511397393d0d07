"""Compare several drafters (trained heads at several tree sizes, prompt lookup) on the same prompts, in one run.

    python -m bench.drafters --config configs/bench_heads_smollm2.yaml

`bench.speed` measures one method against plain decoding; running it once per method repeats the plain and
transformers baselines every time. This driver runs, per prompt (interleaved, after one untimed warm-up of
every runner): plain decoding through our loop, transformers' `model.generate` (the greedy reference), then
every method of the config. For each method it writes `<output_dir>/<name>.json` in bench.speed's format
(per-prompt and overall tau, acceptance per depth, draft/verify/prefill shares, speed-up vs plain and vs
transformers, greedy identity), and `<output_dir>/summary.json` with one row per method (including how an
auto tree size was chosen). Config keys (YAML): model, prompts, max_prompts, per_category (the first N prompts of
each category, as bench.speed --per_category), max_new_tokens, output_dir,
num_threads, warmup_tokens, repeats (every runner R times per prompt, interleaved, fastest kept), methods: a list of {name, heads | method: prompt_lookup | method: hybrid + heads, and HeadsOptions
fields: tree_size, tree, eagle_tree, tree_depth, tree_top_k, max_tree_size, cost_kv_length, confidence_gate; prompt lookup
takes num_speculative_tokens (default 5; "auto": transformers' schedule; "cost": the length that pays per step)}. Each drafter's per-step budget is its own size.

Results are rewritten after every prompt, with `<output_dir>/state.json` (the run's identity, records and step
statistics): rerunning the same configuration reads the finished prompts back and measures only the rest.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    fastest_of,
    hf_generation_config,
    load_target,
    read_prompts,
    run_hf,
    run_ours,
    warm_up,
)
from bench.report import fmt, overall_record, prompt_record, write_json
from heads.cli import DEBUG_FLAG, raise_flag_error, read_config_mapping, run_cli
from heads.loading import dtype_name
from runtime.build import encode_prompt, lookup_step_costs
from runtime.config import DecodeConfig, GenerateArguments, SpeculationConfig
from runtime.layout import layout_of
from runtime.loop import GenerationStats, StepStats
from runtime.proposers import Autoregressive, PromptLookupProposer
from runtime.proposers.factory import HeadsOptions, hybrid_from_heads, proposer_from_heads

RUN_KEYS = {"model", "prompts", "max_prompts", "per_category", "max_new_tokens", "output_dir", "num_threads",
            "warmup_tokens", "repeats", "methods", "dtype", "exact", "weight_layout"}
_OPTION_KEYS = {f.name for f in dataclasses.fields(HeadsOptions)}


@dataclass
class MethodSpec:
    """One drafter to compare: heads with options, or prompt lookup."""

    name: str
    heads: str | None = None
    method: str = "heads"
    options: HeadsOptions = field(default_factory=HeadsOptions)
    num_speculative_tokens: int | str = 5  # prompt lookup: draft length, "auto" or "cost" (heads size themselves)


def parse_methods(entries: list[dict[str, Any]], source: str) -> list[MethodSpec]:
    """methods: [{name, heads | method: prompt_lookup | hybrid, HeadsOptions fields...}] -> specs (ValueError naming `source`)."""
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{source}: 'methods' must be a non-empty list")
    specs = []
    for entry in entries:
        if not isinstance(entry, dict) or "name" not in entry:
            raise ValueError(f"{source}: every method needs a 'name', got {entry!r}")
        unknown = sorted(set(entry) - {"name", "heads", "method", "num_speculative_tokens"} - _OPTION_KEYS)
        if unknown:
            raise ValueError(f"{source}: method {entry['name']!r}: unknown key(s) {unknown}")
        method = entry.get("method", "heads")
        if method not in ("heads", "prompt_lookup", "hybrid"):
            raise ValueError(f"{source}: method {entry['name']!r}: 'method' must be heads, prompt_lookup or hybrid")
        if method in ("heads", "hybrid") and not entry.get("heads"):
            raise ValueError(f"{source}: method {entry['name']!r}: needs 'heads' (directory or Hub id)")
        options = HeadsOptions(**{k: (str(v) if k == "tree_size" else v) for k, v in entry.items()
                                  if k in _OPTION_KEYS})
        length = entry.get("num_speculative_tokens", 5)
        if not (length in ("cost", "auto") or (isinstance(length, int) and length >= 0)):
            raise ValueError(f"{source}: method {entry['name']!r}: num_speculative_tokens must be an int >= 0, "
                             f"'auto' or 'cost', got {length!r}")
        specs.append(MethodSpec(entry["name"], entry.get("heads"), method, options, length))
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"{source}: method names must be unique, got {names}")
    return specs


def read_config(path: Path) -> tuple[dict[str, Any], list[MethodSpec]]:
    """The bench YAML -> (run keys, method specs); FileNotFoundError/ValueError naming --config and the key."""
    config = read_config_mapping(path, RUN_KEYS)
    return config, parse_methods(config.get("methods"), f"--config {path}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.error = raise_flag_error
    parser.add_argument("--config", required=True, help="YAML with the run keys and the methods list")
    parser.add_argument("--max_prompts", type=int, default=None, help="override the config's max_prompts")
    parser.add_argument("--output_dir", default=None, help="override the config's output_dir")
    parser.add_argument("--dtype", default=None, help="override the config's dtype (default auto: bfloat16 where "
                        "fast, float32 elsewhere)")
    parser.add_argument("--exact", action="store_true", default=None, help="float32, where greedy output is "
                        "token-identical to plain decoding (overrides dtype)")
    parser.add_argument("--weight_layout", default=None, help="override the config's weight_layout (default auto: "
                        "runtime.layout)")
    parser.add_argument(DEBUG_FLAG, action="store_true", help="show Python tracebacks of errors")
    args = parser.parse_args(argv)
    config, specs = read_config(Path(args.config))
    model_name = config.get("model", "../shared/models/smollm2-135m-instruct")
    max_prompts = args.max_prompts or int(config.get("max_prompts", 8))
    output_dir = Path(args.output_dir or config.get("output_dir", "outputs/bench/heads"))
    torch.set_num_threads(int(config.get("num_threads", 1)))
    decode = DecodeConfig(max_new_tokens=int(config.get("max_new_tokens", 128)))
    # plain decoding and every drafter share the target (its dtype line printed once)
    target, tokenizer = load_target(model=model_name, dtype=str(args.dtype or config.get("dtype", "auto")),
                                    exact=bool(args.exact or config.get("exact", False)),
                                    weight_layout=str(args.weight_layout or config.get("weight_layout", "auto")))
    model = target.model
    dtype = dtype_name(model.dtype)
    encoded = [encode_prompt(tokenizer, p) for p in read_prompts(config.get("prompts",
                                                                           "../shared/data/mt_bench_question.jsonl"),
                                                                max_prompts, int(config.get("per_category", 0)))]
    proposers, built_info, speculations = {}, {}, {}
    for spec in specs:  # sizes are chosen here (verify curve cached on disk, draft time measured)
        if spec.method == "prompt_lookup":  # the draft length as runtime.generate reads --num_speculative_tokens
            lookup = GenerateArguments(model=model_name, method="prompt_lookup",
                                       num_speculative_tokens=str(spec.num_speculative_tokens))
            speculation = speculations[spec.name] = lookup.speculation()
            by_cost = lookup.draft_length() == "cost"
            proposers[spec.name] = PromptLookupProposer(
                step_costs=lookup_step_costs(target, speculation.max_speculative_tokens) if by_cost else None)
            length = (f"length by cost, k <= {speculation.max_speculative_tokens}" if by_cost else
                      f"transformers' schedule from k = {speculation.num_speculative_tokens}, k <= "
                      f"{speculation.max_speculative_tokens}" if speculation.adaptive else
                      f"k = {speculation.num_speculative_tokens}")
            built_info[spec.name] = {"description": f"prompt lookup (n-gram 1..3, {length})"}
            continue
        if spec.method == "hybrid":  # prompt lookup (up to max_lookup tokens, as runtime.generate's default) + heads
            built = hybrid_from_heads(spec.heads, target, spec.options, sampling=decode.sampling, target_name=model_name,
                                      max_lookup=GenerateArguments.max_speculative_tokens)
        else:
            built = proposer_from_heads(spec.heads, target, spec.options, sampling=decode.sampling,
                                        target_name=model_name)
        proposers[spec.name] = built.proposer
        speculations[spec.name] = SpeculationConfig(num_speculative_tokens=built.size,  # 0: auto turned it off
                                                    max_speculative_tokens=max(built.size, 1))
        built_info[spec.name] = {"description": built.description, "size": built.size, "notes": built.notes,
                                 "auto_rows": built.plan.rows if built.plan else None}
        print(f"[drafters] {spec.name}: {built.description}", file=sys.stderr)
    gen_config = hf_generation_config(model, decode)

    def limited(config: DecodeConfig, name: str) -> DecodeConfig:
        return dataclasses.replace(config, speculation=speculations[name])

    def run_all(ids: torch.Tensor, config: DecodeConfig, hf_config) -> dict[str, Any]:
        """Plain decoding, transformers' generate, then every method (keys "plain", "hf", "method:<name>")."""
        return {"plain": run_ours(target, Autoregressive(), ids, config), "hf": run_hf(model, ids, hf_config, None),
                **{f"method:{name}": run_ours(target, proposer, ids, limited(config, name))
                   for name, proposer in proposers.items()}}

    warm_up(decode, int(config.get("warmup_tokens", 16)),  # untimed warm-up of every runner
            lambda short: run_all(encoded[0], short, hf_generation_config(model, short)))
    repeats = int(config.get("repeats", 1))
    records: dict[str, list] = {name: [] for name in proposers}
    stats: dict[str, list] = {name: [] for name in proposers}
    plain_stats: list = []  # the plain runs' steps give the cost model's 1-token step time
    run_key = {"model": model_name, "dtype": dtype, "weight_layout": layout_of(model),
               "max_new_tokens": decode.max_new_tokens, "repeats": repeats,
               "prompts": [ids.tolist() for ids in encoded], "methods": {n: _spec_record(specs, n) for n in proposers},
               "speculation": {n: dataclasses.asdict(v) for n, v in speculations.items()}}
    done = resume_state(output_dir / STATE_FILE, run_key, records, stats, plain_stats)
    if done:
        print(f"[drafters] resuming: {done} of {len(encoded)} prompts read back from {output_dir / STATE_FILE}",
              file=sys.stderr)
    def write_results() -> dict[str, Any]:
        """Per-method JSON and summary.json over the prompts done so far (rewritten after every prompt)."""
        summary = []
        for name in proposers:
            overall = overall_record(records[name], stats[name], plain_stats, dtype)
            result = {"config": {"model": model_name, "dtype": dtype, "method": name,
                                 "spec": _spec_record(specs, name),
                                 "max_prompts": max_prompts, "max_new_tokens": decode.max_new_tokens,
                                 "repeats": repeats, "num_threads": torch.get_num_threads(), **built_info[name]},
                      "overall": overall, "prompts": records[name]}
            write_json(output_dir / f"{name}.json", result)
            summary.append({"method": name, "description": built_info[name]["description"],
                            "size": built_info[name].get("size"), "tau": overall["tau"],
                            "acceptance_per_depth": overall["acceptance_per_depth"],
                            "plain_tokens_per_second": overall["plain"]["tokens_per_second"],
                            "method_tokens_per_second": overall["method"]["tokens_per_second"],
                            "speedup_total": overall["speedup_total"], "speedup_median": overall["speedup_median"],
                            "draft_share": overall["draft_share"], "verify_share": overall["verify_share"],
                            "overhead_share": overall["overhead_share"],
                            "predicted_speedup": overall["predicted_speedup"],
                            "realised_over_predicted": overall["realised_over_predicted"],
                            "greedy_identical": overall["greedy_identical"],
                            "identical_prompts": overall["greedy_identical_count"],
                            "identical_to_plain_prompts": overall["identical_to_plain_count"],
                            **_predicted(built_info[name].get("auto_rows"), built_info[name].get("size"))})
        payload = {"model": model_name, "dtype": dtype, "prompts": len(records[next(iter(proposers))]),
                   "max_new_tokens": decode.max_new_tokens, "methods": summary}
        write_json(output_dir / "summary.json", payload)
        write_json(output_dir / STATE_FILE, {"run": run_key, "records": records, "plain_stats": [
            dataclasses.asdict(s) for s in plain_stats], "stats": {n: [dataclasses.asdict(s) for s in stats[n]]
                                                                   for n in proposers}})
        return payload

    for i, ids in enumerate(encoded):
        if i < done:
            continue
        # every runner R times, interleaved; keep each one's fastest run
        runs = fastest_of(repeats, lambda ids=ids: run_all(ids, decode, gen_config))
        plain, hf = runs["plain"], runs["hf"]
        plain_stats.append(plain.stats)
        for name in proposers:
            run = runs[f"method:{name}"]
            records[name].append(prompt_record(i, ids.numel(), {"plain": plain, "hf": hf, "method": run}, True))
            stats[name].append(run.stats)
            r = records[name][-1]
            print(f"[drafters] prompt {i + 1}/{len(encoded)} {name}: tau {r['tau']:.2f}, speed-up "
                  f"{r['speedup']:.2f}, identical {r['greedy_identical']}", file=sys.stderr)
        write_results()
    payload = write_results()
    print_summary(payload)
    return payload


STATE_FILE = "state.json"  # what a restarted run reads back: the run's identity, records and step statistics


def resume_state(path: Path, run_key: dict[str, Any], records: dict[str, list], stats: dict[str, list],
                 plain_stats: list) -> int:
    """Fill records / stats / plain_stats from an earlier run of the same configuration; returns the prompts done.

    A state written by another configuration (model, dtype, prompts, methods, sizes) is not reused: the run starts
    over and overwrites it."""
    if not path.is_file():
        return 0
    state = json.loads(path.read_text())
    if state.get("run") != json.loads(json.dumps(run_key)):
        print(f"[drafters] {path} is from another configuration: starting over", file=sys.stderr)
        return 0
    for name in records:
        records[name].extend(state["records"][name])
        stats[name].extend(_stats_from_dict(s) for s in state["stats"][name])
    plain_stats.extend(_stats_from_dict(s) for s in state["plain_stats"])
    return len(plain_stats)


def _stats_from_dict(values: dict[str, Any]) -> GenerationStats:
    return GenerationStats(**{**values, "steps": [StepStats(**step) for step in values["steps"]]})


def _predicted(rows: list[dict[str, float]] | None, size: int | None) -> dict[str, Any]:
    """The cost model's predictions for an auto size: plain rate, chosen rate, and whether auto turns it off."""
    if not rows:
        return {}
    plain, *options = rows
    best = max(options, key=lambda r: r["tokens_per_second"])
    return {"predicted_plain_tokens_per_second": plain["tokens_per_second"],
            "predicted_tokens_per_second": best["tokens_per_second"], "predicted_expected_tau": best["expected_tau"],
            "auto_turns_off": best["tokens_per_second"] <= plain["tokens_per_second"],
            "chosen": {k: v for k, v in best.items() if k in ("size", "depth", "top_k")} if size else {"size": 0}}


def _spec_record(specs: list[MethodSpec], name: str) -> dict[str, Any]:
    spec = next(s for s in specs if s.name == name)
    return {"heads": spec.heads, "method": spec.method, **dataclasses.asdict(spec.options)}


def print_summary(payload: dict[str, Any]) -> None:
    """One line per method: tau, tokens/s, speed-up vs plain, draft/verify/overhead shares, greedy identity, the
    speed-up predicted from the measured tau and step times (pred) and realised / pred, and the auto choice's
    prediction from the heads' accuracy table (auto_pred)."""
    print(f"{payload['model']}: {payload['prompts']} prompts x {payload['max_new_tokens']} new tokens")
    print(f"{'method':<22} {'size':>4} {'tau':>5} {'plain/s':>8} {'method/s':>9} {'speedup':>7} {'draft':>6} "
          f"{'verify':>6} {'ovhd':>5} {'ident':>5} {'=plain':>6} {'pred':>5} {'r/p':>5} {'auto_pred':>9}")
    for m in payload["methods"]:
        size = "-" if m["size"] is None else str(m["size"])
        ident = {True: "yes", False: "NO", None: "-"}[m["greedy_identical"]]
        if m.get("identical_prompts") is not None and not m["greedy_identical"]:
            ident = f"{m['identical_prompts']}/{payload['prompts']}"
        same = m.get("identical_to_plain_prompts")
        same = "-" if same is None else f"{same}/{payload['prompts']}"
        predicted = "-"
        if "predicted_tokens_per_second" in m:  # the cost model's speed-up for the auto choice
            predicted = f"{m['predicted_tokens_per_second'] / m['predicted_plain_tokens_per_second']:.2f}"
        print(f"{m['method']:<22} {size:>4} {m['tau']:>5.2f} {m['plain_tokens_per_second']:>8.2f} "
              f"{m['method_tokens_per_second']:>9.2f} {m['speedup_total']:>7.2f} {m['draft_share']:>6.2f} "
              f"{m['verify_share']:>6.2f} {m['overhead_share']:>5.2f} {ident:>5} {same:>6} "
              f"{fmt(m['predicted_speedup'], '5.2f')} {fmt(m['realised_over_predicted'], '5.2f')} {predicted:>9}")


if __name__ == "__main__":
    run_cli(main)
