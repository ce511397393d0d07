"""The measurement configs in configs/ (and the tree files, whose first line is the command that wrote them): each
first line names its bench command and the file parses with that command's flags (unknown keys are errors there), so
a config cannot silently drift from its CLI, nor keep naming a command that moved."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from bench import drafters, kinds
from bench.scaling import ScalingConfig
from bench.speed import BenchArguments
from bench.tree_search import TreeSearchArgs
from heads.cli import parse_flag_groups, parse_flags
from runtime.config import GenerateArguments
from tests.tiny_models import REPO

MOVED = ("runtime.bench", "runtime.bench_heads", "runtime.bench_batch", "runtime.exactness", "runtime.calibration",
         "runtime.lookup_replay", "runtime.cost_model", "runtime.tree_search", "runtime.proposers.draft_cost",
         "data.bench_distill", "training.scaling")
CONFIGS = sorted((REPO / "configs").glob("*.yaml")) + sorted((REPO / "configs" / "trees").glob("*.yaml"))


def first_line(path: Path) -> str:
    return path.read_text().splitlines()[0]


def bench_command(path: Path) -> str | None:
    """'bench.speed' for a first line '# python -m bench.speed ...', else None."""
    words = shlex.split(first_line(path)[1:])
    return words[words.index("-m") + 1] if "-m" in words and words[words.index("-m") + 1].startswith("bench.") else None


BENCH_CONFIGS = [p for p in CONFIGS if bench_command(p)]


def test_no_config_names_a_moved_command():
    for path in CONFIGS:
        words = shlex.split(first_line(path)[1:])
        assert not set(words) & set(MOVED), f"{path.name}: {first_line(path)[:80]}"


def test_every_kind_of_bench_config_is_checked():
    assert {bench_command(p) for p in BENCH_CONFIGS} == {"bench.speed", "bench.drafters", "bench.kinds",
                                                         "bench.scaling", "bench.tree_search"}


@pytest.mark.parametrize("path", BENCH_CONFIGS, ids=lambda p: p.relative_to(REPO / "configs").as_posix())
def test_bench_config_parses_with_its_command(path: Path, monkeypatch):
    monkeypatch.chdir(REPO)  # recipes and tree files are named relative to the repository
    command = bench_command(path)
    first = first_line(path)
    assert first.startswith("# ") and f"configs/{path.relative_to(REPO / 'configs').as_posix()}" in first
    if command == "bench.speed":
        gen_args, bench_args = parse_flag_groups((GenerateArguments, BenchArguments), ["--config", str(path)])
        assert gen_args.model and bench_args.output_json
    elif command == "bench.drafters":
        config, specs = drafters.read_config(path)
        assert config["methods"] and specs
    elif command == "bench.kinds":
        assert kinds.read_config(path)["methods"]
    elif command == "bench.scaling":
        assert parse_flags(ScalingConfig, ["--config", str(path)]).runs()
    else:  # a tree file: its first line is the full command that wrote it
        words = shlex.split(first[1:])
        args = parse_flags(TreeSearchArgs, words[words.index("-m") + 2:])
        assert args.output == path.relative_to(REPO).as_posix()
