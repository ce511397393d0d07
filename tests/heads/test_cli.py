"""Every CLI turns bad input into one line on stderr and exit code 2, without a traceback (heads.cli.run_cli).

A few CLIs run for real in a subprocess (bad --dtype, a missing --model, --dtype float16 on CPU, an unknown YAML
key); the rest of the wiring is checked in-process (fast) and by reading each CLI's `__main__` block.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from heads.cli import error_line, parse_flags, run_cli
from tests.tiny_models import STORIES260K

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("heads", "data", "training", "runtime", "bench")
# every file of ours with a __main__ block is a CLI (training/train_heads.py is run as a script), except the vLLM
# worker: a JSON-lines protocol over stdin/stdout run by another venv's python (data/engines.py reads its errors)
NOT_CLIS = {"data/vllm_worker.py"}
CLI_MODULES = sorted(str(p.relative_to(ROOT)) for package in PACKAGES for p in (ROOT / package).rglob("*.py")
                     if 'if __name__ == "__main__":' in p.read_text() and str(p.relative_to(ROOT)) not in NOT_CLIS)


def start_command(args: list[str], **env: str) -> subprocess.Popen:
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **env}
    if "SPECHEADS_DEBUG" not in env:
        environment.pop("SPECHEADS_DEBUG", None)
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=environment, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def assert_one_error_line(result: subprocess.CompletedProcess, *expected: str) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def test_cli_bad_input_is_one_line_exit_2(tmp_path):
    """Real processes, started together (each mostly imports torch/transformers; two cores run them at once)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("method: eagle\nlearning_rat: 0.001\n")
    cases = [
        (["-m", "runtime.generate", "--model", str(STORIES260K), "--dtype", "float8", "--max_new_tokens", "2"],
         ["--dtype", "float8", "auto"]),
        (["-m", "bench.speed", "--model", "/no/such/model", "--max_prompts", "1"], ["--model /no/such/model"]),
        (["-m", "bench.cost_curve", "--model", str(STORIES260K), "--dtype", "float16"], ["--dtype float16 on CPU"]),
        (["training/train_heads.py", "--config", str(recipe)], ["--config", str(recipe), "learning_rat"]),
    ]
    processes = [start_command(args) for args, _ in cases]
    for process, (args, expected) in zip(processes, cases, strict=True):
        stdout, stderr = process.communicate(timeout=300)
        assert_one_error_line(subprocess.CompletedProcess(args, process.returncode, stdout, stderr), *expected)


def test_debug_env_shows_the_traceback():
    process = start_command(["-m", "heads.export", "--heads", "/no/such/heads", "--to", "vllm", "--output_dir", "x"],
                            SPECHEADS_DEBUG="1")
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 1 and "Traceback" in stderr and "/no/such/heads" in stderr


def test_every_cli_main_block_uses_run_cli():
    assert len(CLI_MODULES) >= 15 and "runtime/generate.py" in CLI_MODULES and "bench/speed.py" in CLI_MODULES
    for module in CLI_MODULES:
        source = (ROOT / module).read_text()
        block = source[source.index('if __name__ == "__main__":'):]
        assert re.search(r"run_cli\(main", block), f"{module}: its __main__ block does not call run_cli(main)"


# ------------------------------------------------------------------ in-process (no model loaded)


def _fail(argv: list[str]) -> None:
    raise FileNotFoundError(f"--heads {argv[0]}: no such directory\nsecond line")


def test_run_cli_one_line_exit_2_and_debug(capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli(_fail, ["/x"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "error: --heads /x: no such directory second line\n"
    with pytest.raises(FileNotFoundError):  # --debug: the exception (and its traceback) propagates
        run_cli(_fail, ["/x", "--debug"])


def test_run_cli_other_errors_propagate():
    def broken(argv):
        raise KeyError("a bug, not bad input")

    with pytest.raises(KeyError):
        run_cli(broken, [])


@pytest.mark.parametrize("module, argv, expected", [
    ("runtime.generate", ["--max_new_tokens", "abc"], "--max_new_tokens"),
    ("runtime.generate", ["--no_such_flag", "1"], "--no_such_flag"),
    ("bench.drafters", [], "--config"),
    ("bench.tree_search", ["--num_nodes", "4"], "--output"),
    ("data.hidden_states", ["--model", "m", "--dataset", "d"], "--output_dir"),
    ("data.distill", ["--model", "m", "--prompts", "/no/such/prompts.jsonl", "--output_dir", "o"],
     "/no/such/prompts.jsonl"),
    ("heads.convert", ["--source", "/no/such/dir", "--base_model", str(STORIES260K), "--output_dir", "o"],
     "/no/such/dir"),
])
def test_cli_flag_errors_are_one_line(module, argv, expected, capsys):
    import importlib

    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as exit_info:
        run_cli(main, argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and expected in err, err


def test_debug_flag_is_accepted_and_listed_in_help(capsys):
    from dataclasses import dataclass

    @dataclass
    class Flags:
        size: int = 1

    assert parse_flags(Flags, ["--debug", "--size", "3"]).size == 3
    with pytest.raises(SystemExit):
        parse_flags(Flags, ["--help"])
    assert "--debug" in capsys.readouterr().out


def test_error_line_joins_lines():
    assert error_line(ValueError("a\n  b\n")) == "error: a b"
