"""The one flag parser of every CLI: flat dataclasses via transformers.HfArgumentParser, `--config file.yaml`
giving defaults (unknown keys are an error naming the key and the file), command-line flags overriding.

It lives in `heads/` (a leaf every package may import) so runtime, data and training share it.

`run_cli(main)` runs a CLI's `main(argv)` so that bad input (ValueError / FileNotFoundError, whose messages name
the flag or file) ends as ONE line on stderr and exit code 2; `--debug` or SPECHEADS_DEBUG=1 shows tracebacks.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import yaml
from transformers import HfArgumentParser

T = TypeVar("T")
DEBUG_FLAG = "--debug"
DEBUG_ENV = "SPECHEADS_DEBUG"
INPUT_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError)


def read_recipe(path: str | Path, classes: tuple[type, ...]) -> dict[str, Any]:
    """A flat YAML recipe -> {field: value}; raises naming the file for a missing file or an unknown key."""
    return read_config_mapping(path, {f.name for cls in classes for f in dataclasses.fields(cls)})


def read_config_mapping(path: str | Path, names: set[str]) -> dict[str, Any]:
    """A YAML mapping whose keys must be among `names` -> dict; raises naming --config and the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--config {path}: no such file")
    try:
        values = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"--config {path}: not valid YAML ({' '.join(str(err).split())})") from err
    if not isinstance(values, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values, got {type(values).__name__}")
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"--config {path}: unknown key(s) {unknown}; expected some of {sorted(names)}")
    return values


def parse_flag_groups(classes: tuple[type, ...], argv: list[str] | None = None) -> tuple[Any, ...]:
    """Parse `argv` into one instance of each dataclass in `classes` (see the module docstring)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    pre.add_argument(DEBUG_FLAG, action="store_true")
    known, rest = pre.parse_known_args(argv)
    parser = HfArgumentParser(classes)
    parser.error = raise_flag_error  # argparse's usage + message + exit becomes one ValueError (see run_cli)
    if not any(f.name == "config" for cls in classes for f in dataclasses.fields(cls)):
        parser.add_argument("--config", default=None, help="YAML file giving defaults for the flags below")
    parser.add_argument(DEBUG_FLAG, action="store_true", help=f"show Python tracebacks of errors (or {DEBUG_ENV}=1)")
    if known.config:
        parser.set_defaults(**read_recipe(known.config, classes))
    parsed = parser.parse_args_into_dataclasses(args=rest, look_for_args_file=False)
    return tuple(parsed[: len(classes)])  # an extra namespace (holding --config) may follow


def parse_flags(cls: type[T], argv: list[str] | None = None) -> T:
    """Parse `argv` into the dataclass `cls` (see the module docstring)."""
    return parse_flag_groups((cls,), argv)[0]


def raise_flag_error(message: str) -> NoReturn:
    """An argparse parser's `error` (usage, message, exit 2) replaced by a ValueError that run_cli prints."""
    raise ValueError(message)


def debug_requested(argv: Sequence[str]) -> bool:
    """True when `--debug` is among the flags or SPECHEADS_DEBUG is set to anything but '' / '0'."""
    return DEBUG_FLAG in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def error_line(error: BaseException) -> str:
    """The one stderr line for a bad-input error: 'error: <message>' with its lines joined."""
    message = " ".join(part.strip() for part in str(error).splitlines() if part.strip())
    return f"error: {message or type(error).__name__}"


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"warning: {message}\n"


def run_cli(main: Callable[[list[str]], Any], argv: Sequence[str] | None = None,
            errors: tuple[type[BaseException], ...] = ()) -> Any:
    """Run `main(argv)` (default: sys.argv[1:]) as a command: a ValueError / FileNotFoundError (or one of
    `errors`) becomes one line 'error: ...' on stderr and exit code 2, and warnings print as one line each.
    With `--debug` (removed from argv) or SPECHEADS_DEBUG=1 errors propagate with their traceback.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if debug_requested(argv):
        return main([a for a in argv if a != DEBUG_FLAG])
    warnings.formatwarning = _one_line_warning
    try:
        return main(argv)
    except INPUT_ERRORS + tuple(errors) as error:
        sys.stdout.flush()
        print(error_line(error), file=sys.stderr)
        sys.exit(2)
