"""The one flag parser of every CLI: flat dataclasses via transformers.HfArgumentParser, `--config file.yaml`
giving defaults (unknown keys are an error naming the key and the file), command-line flags overriding.

It lives in `heads/` (a leaf every package may import) so runtime, data and training share it.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any, TypeVar

import yaml
from transformers import HfArgumentParser

T = TypeVar("T")


def read_recipe(path: str | Path, classes: tuple[type, ...]) -> dict[str, Any]:
    """A flat YAML recipe -> {field: value}; raises naming the file for a missing file or an unknown key."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--config {path}: no such file")
    values = yaml.safe_load(path.read_text()) or {}
    if not isinstance(values, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values, got {type(values).__name__}")
    names = {f.name for cls in classes for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"--config {path}: unknown key(s) {unknown}; expected some of {sorted(names)}")
    return values


def parse_flag_groups(classes: tuple[type, ...], argv: list[str] | None = None) -> tuple[Any, ...]:
    """Parse `argv` into one instance of each dataclass in `classes` (see the module docstring)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, rest = pre.parse_known_args(argv)
    parser = HfArgumentParser(classes)
    if not any(f.name == "config" for cls in classes for f in dataclasses.fields(cls)):
        parser.add_argument("--config", default=None, help="YAML file giving defaults for the flags below")
    if known.config:
        parser.set_defaults(**read_recipe(known.config, classes))
    parsed = parser.parse_args_into_dataclasses(args=rest, look_for_args_file=False)
    return tuple(parsed[: len(classes)])  # an extra namespace (holding --config) may follow


def parse_flags(cls: type[T], argv: list[str] | None = None) -> T:
    """Parse `argv` into the dataclass `cls` (see the module docstring)."""
    return parse_flag_groups((cls,), argv)[0]
