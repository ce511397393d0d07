"""Every command's --help prints its flags and exits 0 (argparse %-formats help texts: a bare '%' in one breaks it)."""

from __future__ import annotations

import importlib

import pytest

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
