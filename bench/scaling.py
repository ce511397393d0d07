"""Data-scaling curve: train each method on growing subsets of one dataset, evaluate on one held-out set.

    python -m bench.scaling --config configs/scaling_smollm2.yaml

For every method and every size N (assistant tokens; `--max_tokens` caps the sizes per method), `training/train_heads.py` runs with the method's recipe,
`--max_train_tokens N` (nested seeded subsets: the rows of a smaller size are among those of every larger one),
the same epochs for every size (so optimizer steps grow with the tokens: one steps-per-token rule) and the same
`--eval_dataset`. `--jobs J` trains J runs at once (one process and thread each), smallest sizes first. Each run
lives in `<output_dir>/<method>_<N>` (its output in `<method>_<N>.log`); a run whose final metrics are on disk is not
run again (kill and rerun to resume). After every run the results JSON is rewritten atomically; at the end a PNG
shows held-out tau and per-depth top-1 against the data size. `--extra_runs` adds finished runs trained elsewhere
on a larger dataset of the same sources (the long recipe's 1M-token run) when they were held out on the same set.
A run whose directory is gone (a fresh checkout) keeps its row from the existing results JSON when that JSON was
written with the same data, held-out set, recipes and flags (`--keep_results`, on by default), so one more run does
not retrain the whole curve.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.report import markdown_table as table
from bench.report import pyplot, save_figure, write_json
from heads.cli import parse_flags, run_cli
from training.config import CONFIG_FILE, METHODS, load_saved_config
from training.evaluation import per_depth


def _help(text: str, default: Any = None) -> Any:
    return field(default=default, metadata={"help": text})


@dataclass
class ScalingConfig:
    """Flags of `python -m bench.scaling` (also the keys of configs/scaling_*.yaml)."""

    dataset: str = _help("Training dataset (python -m data.distill, either mode).", "")
    features: str | None = _help("Hidden-state shards of --dataset (python -m data.hidden_states); unset = online.")
    eval_dataset: str = _help("Held-out dataset every run is evaluated on (the target's own answers).", "")
    eval_features: str | None = _help("Hidden-state shards of --eval_dataset; unset = evaluation runs the target.")
    methods: str = _help("Comma-separated methods, each trained with its recipe (see --recipes).", "eagle,eagle3,medusa")
    recipes: str = _help("Recipe per method: a pattern with {method}.", "configs/{method}_smollm2.yaml")
    token_sizes: str = _help("Comma-separated training sizes in assistant tokens, increasing.", "10000,30000,100000")
    max_tokens: str = _help("Per-method cap on the sizes, e.g. 'eagle3=80000,medusa=80000' (larger sizes are not run "
                            "for that method); empty = every size for every method.", "")
    jobs: int = _help("Training runs at once (each one process, one thread); runs start smallest size first.", 1)
    num_epochs: float = _help("Epochs over each subset (the same for every size).", 1.0)
    more_epochs: str = _help("Comma-separated further epoch counts: a size x epochs grid (each size also trained for "
                             "each of these epochs, a run of its own with its own learning-rate schedule); empty = "
                             "--num_epochs only.", "")
    more_epochs_max_tokens: int = _help("The --more_epochs runs only at sizes up to this many tokens; 0 = every "
                                        "size.", 0)
    eval_samples: int = _help("Held-out rows evaluated per run.", 80)
    eval_top_k: int = _help("k of the top-k accuracy.", 3)
    extra_flags: str = _help("More flags for every run, e.g. '--learning_rate 3e-4'.", "")
    extra_runs: str = _help("Comma-separated METHOD=RUN_DIR: finished train_heads runs of another recipe (a larger "
                            "dataset of the same sources, the same steps-per-token rule) held out on --eval_dataset; "
                            "added to the results, table and plot with their dataset named.", "")
    output_dir: str = _help("Run directories go here.", "outputs/scaling/smollm2")
    results_json: str = _help("Results (rewritten after every run).", "results/scaling_smollm2.json")
    plot: str = _help("PNG of tau and top-1 per depth vs data size; empty = none.", "results/scaling_smollm2.png")
    keep_results: bool = _help("A run whose directory holds no finished run keeps its row from the existing "
                               "--results_json if that file was written with the same dataset, held-out set, recipes "
                               "and flags (false: retrain it).", True)

    def __post_init__(self) -> None:
        for name in ("dataset", "eval_dataset"):
            if not getattr(self, name):
                raise ValueError(f"--{name} is required")
        sizes = self.sizes()
        if not sizes or any(n < 1 for n in sizes) or sizes != sorted(sizes):
            raise ValueError(f"--token_sizes: expected increasing positive integers, got {self.token_sizes!r}")
        if self.jobs < 1:
            raise ValueError(f"--jobs: expected >= 1, got {self.jobs}")
        if self.num_epochs <= 0 or any(e <= 0 for e in self.epoch_list()):
            raise ValueError(f"--num_epochs / --more_epochs: expected positive numbers, got {self.num_epochs}, "
                             f"{self.more_epochs!r}")
        self.caps()
        self.extra_run_list()
        if "{method}" not in self.recipes:
            raise ValueError(f"--recipes: expected a pattern containing {{method}}, got {self.recipes!r}")
        for method in self.method_list():
            if not Path(self.recipes.format(method=method)).is_file():
                raise FileNotFoundError(f"--recipes: no recipe {self.recipes.format(method=method)} for method {method}")

    def caps(self) -> dict[str, int]:
        caps = {m: int(n) for m, n in method_items(self.max_tokens, "--max_tokens", "TOKENS", str.isdigit)}
        return {m: n for m, n in caps.items() if m in self.method_list()}  # a config's caps outlive --methods

    def runs(self) -> list[tuple[str, int, float]]:
        """(method, size, epochs) in the order they start: smallest size first, then fewest epochs."""
        caps, limit = self.caps(), self.more_epochs_max_tokens
        return [(m, n, e) for n in self.sizes() for e in self.epoch_list() for m in self.method_list()
                if n <= caps.get(m, n) and (e == self.num_epochs or not limit or n <= limit)]

    def epoch_list(self) -> list[float]:
        """--num_epochs, then --more_epochs (duplicates dropped)."""
        try:
            more = [float(x) for x in self.more_epochs.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--more_epochs: expected comma-separated numbers, got {self.more_epochs!r}") from None
        return list(dict.fromkeys([float(self.num_epochs), *more]))

    def run_dir(self, method: str, size: int, epochs: float) -> Path:
        """<output_dir>/<method>_<size>, with _e<epochs> for the --more_epochs runs."""
        suffix = "" if epochs == self.num_epochs else f"_e{epochs:g}"
        return Path(self.output_dir) / f"{method}_{size}{suffix}"

    def sizes(self) -> list[int]:
        try:
            return [int(x) for x in self.token_sizes.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--token_sizes: expected comma-separated integers, got {self.token_sizes!r}") from None

    def method_list(self) -> list[str]:
        return [m.strip() for m in self.methods.split(",") if m.strip()]

    def extra_run_list(self) -> list[tuple[str, Path]]:
        return [(m, Path(d)) for m, d in method_items(self.extra_runs, "--extra_runs", "RUN_DIR", bool)]


def method_items(spec: str, flag: str, value_name: str, valid: Callable[[str], bool]) -> list[tuple[str, str]]:
    """'METHOD=VALUE,...' -> [(method, value)], each method one of METHODS and each value passing `valid`."""
    items = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        method, _, value = item.partition("=")
        if method not in METHODS or not valid(value):
            raise ValueError(f"{flag}: expected METHOD={value_name} with METHOD one of {list(METHODS)}, got {item!r}")
        items.append((method, value))
    return items


def final_record(run_dir: Path) -> dict[str, Any] | None:
    """The last line of a finished run's metrics.jsonl (the one with training throughput), else None."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    finished = [r for r in records if "train/seconds" in r]
    return finished[-1] if finished else None


def summarise(method: str, size: int, record: dict[str, Any], top_k: int, dataset: str, run_dir: Path, kind: str
              ) -> dict[str, Any]:
    """One results row; `kind` is "curve" (a run of this curve) or "extra" (an --extra_runs run). The run's epochs,
    learning rate and draft layers come from its saved config (None where the directory holds none)."""
    settings = load_saved_config(run_dir)
    recipe = {name: getattr(settings, name, None) for name in ("num_epochs", "learning_rate", "num_layers")}
    return {"method": method, "kind": kind, "dataset": dataset, "run_dir": str(run_dir), "requested_tokens": size,
            "epochs": recipe["num_epochs"], "learning_rate": recipe["learning_rate"],
            "num_layers": recipe["num_layers"],
            "train_tokens": record.get("train/assistant_tokens"),
            "train_rows": record.get("train/rows"), "steps": record["step"],
            "top1_per_depth": [round(v, 4) for v in per_depth(record, "top1")],
            f"top{top_k}_per_depth": [round(v, 4) for v in per_depth(record, f"top{top_k}")],
            "expected_tau": round(record["eval/acceptance_length"], 4), "eval_tokens": int(record["eval/tokens"]),
            "train_seconds": round(record["train/seconds"], 1),
            "samples_per_second": round(record["train/samples_per_second"], 3)}


def train_command(config: ScalingConfig, method: str, size: int, run_dir: Path, epochs: float) -> list[str]:
    script = Path(__file__).resolve().parents[1] / "training" / "train_heads.py"
    command = [sys.executable, str(script), "--config", config.recipes.format(method=method),
               "--dataset", config.dataset, "--eval_dataset", config.eval_dataset,
               "--eval_samples", str(config.eval_samples), "--eval_top_k", str(config.eval_top_k),
               "--max_train_tokens", str(size), "--max_steps", "-1", "--num_epochs", f"{epochs:g}",
               "--eval_steps", "0", "--save_steps", "0", "--output_dir", str(run_dir),
               "--heads_dir", str(run_dir / "heads"), "--progress_bar", "false", "--resume_from", "none"]
    if config.features:
        command += ["--features", config.features]
    if config.eval_features:
        command += ["--eval_features", config.eval_features]
    return command + config.extra_flags.split()


def write_results(config: ScalingConfig, runs: list[dict[str, Any]]) -> None:
    write_json(Path(config.results_json), {"config": asdict(config), "runs": runs})


def series_label(row: dict[str, Any], config: ScalingConfig) -> str:
    """The plot's line a row belongs to: its method, and its epochs when the grid has several; an --extra_runs row
    is its own point, named by its run directory."""
    if row["kind"] == "extra":
        return f"{row['method']} {Path(row['run_dir']).name}"
    several = len(config.epoch_list()) > 1
    if not several or not row.get("epochs"):
        return row["method"]
    return f"{row['method']}, {row['epochs']:g} epoch{'' if row['epochs'] == 1 else 's'}"


def plot(config: ScalingConfig, runs: list[dict[str, Any]]) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    series: dict[str, list[dict[str, Any]]] = {}
    for row in runs:
        series.setdefault(series_label(row, config), []).append(row)
    for label, mine in series.items():
        mine = sorted(mine, key=lambda r: r["train_tokens"])
        tokens = [r["train_tokens"] for r in mine]
        marker = "s" if mine[0]["kind"] == "extra" else "o"
        left.plot(tokens, [r["expected_tau"] for r in mine], marker=marker, label=label)
        right.plot(tokens, [r["top1_per_depth"][0] for r in mine], marker=marker, label=f"{label}, depth 0")
        if len(mine[0]["top1_per_depth"]) > 1 and mine[0]["kind"] == "curve" and len(series) <= 4:
            right.plot(tokens, [r["top1_per_depth"][1] for r in mine], marker="x", linestyle="--",
                       label=f"{label}, depth 1")
    for axis, label in ((left, "expected tau (greedy chain, held out)"), (right, "held-out top-1")):
        axis.set_xscale("log")
        axis.set_xlabel("training assistant tokens")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    datasets = ", ".join(dict.fromkeys(Path(r["dataset"]).name for r in runs))
    fig.suptitle(f"data scaling: {datasets}, held out on {Path(config.eval_dataset).name}")
    fig.tight_layout()
    save_figure(fig, config.plot, dpi=110)


def markdown_table(runs: list[dict[str, Any]], top_k: int) -> str:
    """The results as a Markdown table (one row per run), as printed at the end."""
    def depths(values: list[float]) -> str:
        return " ".join(f"{v:.3f}".lstrip("0") for v in values)

    def number(value: float | None) -> str:
        return "" if value is None else f"{value:g}"

    columns = ["method", "data", "training assistant tokens", "epochs", "learning rate", "layers", "steps",
               "held-out top-1 per depth", f"top-{top_k} per depth", "expected tau", "train s"]
    return table(columns, [[r["method"], Path(r["dataset"]).name, f"{r['train_tokens']:,}", number(r.get("epochs")),
                            number(r.get("learning_rate")), number(r.get("num_layers")), r["steps"],
                            depths(r["top1_per_depth"]), depths(r[f"top{top_k}_per_depth"]),
                            f"{r['expected_tau']:.3f}", f"{r['train_seconds']:.0f}"] for r in runs])


# What a curve run's numbers depend on besides its method and size: a kept row must agree on all of them.
SAME_RUN_KEYS = ("dataset", "features", "eval_dataset", "eval_features", "recipes", "num_epochs", "eval_samples",
                 "eval_top_k", "extra_flags")


def kept_rows(config: ScalingConfig) -> dict[tuple[str, str], dict[str, Any]]:
    """Rows of the existing --results_json still valid for this config, keyed (kind, run directory).

    Curve rows count only when the file's config agrees on SAME_RUN_KEYS; --extra_runs rows only on the held-out
    set, as their own data and recipe are theirs."""
    path = Path(config.results_json)
    if not config.keep_results or not path.is_file():
        return {}
    previous = json.loads(path.read_text())
    before = previous.get("config", {})
    valid = {"curve": all(before.get(key) == getattr(config, key) for key in SAME_RUN_KEYS),
             "extra": all(before.get(key) == getattr(config, key) for key in ("eval_dataset", "eval_top_k"))}
    return {(row["kind"], row["run_dir"]): row for row in previous.get("runs", [])
            if valid.get(row.get("kind")) and "run_dir" in row}


def run_one(config: ScalingConfig, method: str, size: int, epochs: float,
            kept: dict[tuple[str, str], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Train (unless finished on disk, or kept from the results JSON) and summarise one (method, size, epochs) run."""
    run_dir = config.run_dir(method, size, epochs)
    record = final_record(run_dir)
    row = (kept or {}).get(("curve", str(run_dir)))
    if record is None and row is not None:
        print(f"[scaling] {run_dir.name}: {run_dir} is gone; its row is kept from {config.results_json}", flush=True)
        return row
    if record is None:
        print(f"[scaling] {method}, {size} assistant tokens, {epochs:g} epochs -> {run_dir}", flush=True)
        started = time.perf_counter()
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:  # the run's own output, beside it
            subprocess.run(train_command(config, method, size, run_dir, epochs), check=True, stdout=log,
                           stderr=subprocess.STDOUT)
        record = final_record(run_dir)
        if record is None:
            raise ValueError(f"{run_dir}: training finished without final metrics")
        print(f"[scaling] {run_dir.name}: {time.perf_counter() - started:.0f} s", flush=True)
    row = summarise(method, size, record, config.eval_top_k, config.dataset, run_dir, "curve")
    print(f"[scaling] {method:7s} {row['train_tokens']:>8} tokens {epochs:g} epochs {row['steps']:>5} steps  tau "
          f"{row['expected_tau']:.3f}  top-1 {row['top1_per_depth']}", flush=True)
    return row


def extra_row(config: ScalingConfig, method: str, run_dir: Path,
              kept: dict[tuple[str, str], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Summarise a finished run of another recipe, refusing one held out on a different set (not comparable)."""
    record, settings = final_record(run_dir), load_saved_config(run_dir)
    row = (kept or {}).get(("extra", str(run_dir)))
    if (record is None or settings is None) and row is not None and row["method"] == method:
        print(f"[scaling] --extra_runs {method}: {run_dir} is gone; its row is kept from {config.results_json}",
              flush=True)
        return row
    if record is None or settings is None:
        raise FileNotFoundError(f"--extra_runs: {run_dir} holds no finished train_heads run (metrics.jsonl with "
                                f"final metrics and {CONFIG_FILE}); train it first or leave it out")
    if settings.method != method:
        raise ValueError(f"--extra_runs: {run_dir} trained {settings.method!r}, not {method!r}")
    if Path(settings.eval_dataset or "").resolve() != Path(config.eval_dataset).resolve():
        raise ValueError(f"--extra_runs: {run_dir} was held out on {settings.eval_dataset!r}, not "
                         f"--eval_dataset {config.eval_dataset}; its numbers would not be comparable")
    if record.get("eval/tokens") is None:
        raise ValueError(f"--extra_runs: {run_dir} has no held-out evaluation in its final metrics")
    return summarise(method, int(record["train/assistant_tokens"]), record, config.eval_top_k, settings.dataset,
                     run_dir, "extra")


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    config = parse_flags(ScalingConfig, argv)
    kept = kept_rows(config)
    extra = [extra_row(config, m, d, kept) for m, d in config.extra_run_list()]  # checked before hours of training
    order = config.runs()
    done: dict[tuple[str, int, float], dict[str, Any]] = {}
    with ThreadPoolExecutor(max_workers=config.jobs) as pool:
        futures = {pool.submit(run_one, config, *key, kept): key for key in order}
        for future, key in futures.items():
            done[key] = future.result()
            write_results(config, [done[k] for k in order if k in done] + extra)
    runs = [done[k] for k in order] + extra
    write_results(config, runs)
    if config.plot:
        plot(config, runs)
    print(markdown_table(runs, config.eval_top_k), flush=True)
    return runs


if __name__ == "__main__":
    run_cli(main)
