"""Flag parsing for the heads CLIs: a flat dataclass via transformers.HfArgumentParser, `--config file.yaml`
giving defaults (unknown keys are an error naming the key), command-line flags overriding."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TypeVar

import yaml
from transformers import HfArgumentParser

T = TypeVar("T")


def parse_flags(cls: type[T], argv: list[str] | None = None) -> T:
    """Parse `argv` into the dataclass `cls` (see the module docstring)."""
    parser = HfArgumentParser(cls)
    parser.add_argument("--config", default=None, help="YAML file with defaults for these flags")
    known, _ = parser.parse_known_args(argv)
    if known.config:
        path = Path(known.config)
        if not path.is_file():
            raise FileNotFoundError(f"--config {path}: no such file")
        values = yaml.safe_load(path.read_text()) or {}
        if not isinstance(values, dict):
            raise ValueError(f"--config {path}: expected a mapping of flag names to values")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"--config {path}: unknown key(s) {unknown}; expected some of {sorted(names)}")
        parser.set_defaults(**values)
    (flags, _config) = parser.parse_args_into_dataclasses(argv)[:2]
    return flags
