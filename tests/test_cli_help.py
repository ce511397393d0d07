"""Every command's --help prints its flags and exits 0 (argparse %-formats help texts: a bare '%' in one breaks it)."""

from __future__ import annotations

import importlib
import re

import pytest

from tests.tiny_models import REPO

COMMANDS = ["bench.calibration", "bench.cost_curve", "bench.distill", "bench.draft_cost", "bench.drafters",
            "bench.exactness", "bench.guard_sim", "bench.kinds", "bench.lookup_replay", "bench.plain_dtypes",
            "bench.prompt_kinds", "bench.scaling", "bench.speed", "bench.tree_search", "data.distill",
            "data.hidden_states", "data.task_prompts", "heads.convert", "heads.export", "heads.vocab", "runtime.cli",
            "training.train_heads"]


@pytest.mark.parametrize("module", COMMANDS)
def test_help_prints_the_flags_and_exits_0(module, capsys):
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code in (0, None)
    out = capsys.readouterr().out
    assert "usage:" in out and "--" in out, out[:200]


def test_the_list_is_every_command():
    """Every module of the packages with a top-level `def main(` is in COMMANDS, so a new command's --help is run."""
    found = sorted(f"{path.parent.name}.{path.stem}" for package in ("bench", "data", "heads", "runtime", "training")
                   for path in (REPO / package).glob("*.py") if re.search(r"^def main\(", path.read_text(), re.M))
    assert found == sorted(COMMANDS)
