"""Small shared pieces of the data CLIs: flag parsing with a YAML recipe, atomic directories, run identity.

(`data/` is a leaf package; from `heads` it uses only the model loader, the shared flag parser and
`heads.files` for atomic file writes.)
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import field
from pathlib import Path
from typing import Any, TypeVar

import torch

from heads.cli import parse_flags
from heads.files import atomic_write_json

T = TypeVar("T")
RUN_FILE = "run.json"


def help_field(text: str, default: Any = None) -> Any:
    """A dataclass field with its --help text (the flag classes of the data CLIs)."""
    return field(default=default, metadata={"help": text})


def parse_config(cls: type[T], argv: list[str] | None = None) -> T:
    """`--config file.yaml` (defaults) + flags (overrides) -> a validated `cls` instance."""
    return parse_flags(cls, argv)


def temporary_dir(beside: Path) -> Path:
    """A fresh hidden directory next to `beside` (same filesystem, so os.replace of it is atomic)."""
    beside.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="." + beside.name + ".", suffix=".tmp", dir=beside.parent))


def replace_dir(tmp: Path, target: Path) -> None:
    """Move a finished temporary directory to `target` in one rename (a stale target is removed first)."""
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)


def check_run_identity(output_dir: Path, identity: dict[str, Any], flag: str = "--output_dir",
                       write: bool = True) -> None:
    """Start or resume a run in `output_dir`: record `identity` there, or check it equals the recorded one.

    Raises ValueError naming `flag` when the directory holds another run (another model, other settings) or
    unrelated files, so runs are never mixed. Every process checks (so all of them fail alike); only the
    one with `write` records a new run.
    """
    run_file = output_dir / RUN_FILE
    if run_file.is_file():
        saved = json.loads(run_file.read_text())
        if saved.get("model") != identity.get("model"):
            raise ValueError(f"{flag} {output_dir}: holds data of model {saved.get('model')!r}, not "
                             f"{identity.get('model')!r}; use another {flag}")
        differences = {key: (saved.get(key), identity.get(key)) for key in sorted(set(saved) | set(identity))
                       if saved.get(key) != identity.get(key)}
        if differences:
            raise ValueError(f"{flag} {output_dir}: holds a run with other settings {differences} "
                             f"(saved, now); use another {flag} or the same settings to resume")
        return
    if output_dir.exists() and any(not entry.name.startswith(".") for entry in output_dir.iterdir()):
        raise ValueError(f"{flag} {output_dir}: not empty and holds no {RUN_FILE}; use an empty or new directory")
    if write:
        atomic_write_json(run_file, identity)


def process_state():
    """This process's rank, world size and device under `accelerate launch` (or a single process).

    On machines without CUDA (or with ACCELERATE_USE_CPU=1) processes meet on CPU with gloo: run
    `accelerate launch --multi_gpu --num_processes 2 -m data.distill ...` (with `--cpu` accelerate starts
    one process only).
    """
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    return PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available())
