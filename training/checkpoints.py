"""Checkpoints: `accelerator.save_state` directories under `<output_dir>/checkpoints/step_NNNNNNNN`.

A checkpoint is written to a temporary directory and renamed into place once complete, with
`trainer_state.json` (step and data position) and the resolved `train_config.yaml` inside, so a resumed run
can refuse a checkpoint made with a different configuration before it touches anything.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from heads.files import atomic_write_json
from training.config import (
    CONFIG_FILE,
    TrainConfig,
    config_differences,
    load_saved_config,
    save_config,
)

STATE_FILE = "trainer_state.json"
PREFIX = "step_"


@dataclass(frozen=True)
class TrainerState:
    """Where training stands after `step` optimizer steps: the next micro-batch is number `batch` of `epoch`."""

    step: int
    epoch: int
    batch: int
    samples: int  # sequences consumed over all processes
    total_steps: int = 0  # the schedule's horizon once --fit_train_minutes has fitted it; 0 = as configured
    warmup_steps: int = 0  # its warmup, a share of the fitted horizon (with total_steps)
    train_seconds: float = 0.0  # wall-clock seconds of the training loop so far, over every resumed run


def checkpoints_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def checkpoint_path(output_dir: str | Path, step: int) -> Path:
    return checkpoints_root(output_dir) / f"{PREFIX}{step:08d}"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints (with trainer_state.json), oldest first."""
    root = checkpoints_root(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def read_state(checkpoint: Path) -> TrainerState:
    path = checkpoint / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"--resume_from {checkpoint}: not a checkpoint ({STATE_FILE} missing)")
    return TrainerState(**json.loads(path.read_text()))


def resolve_resume(config: TrainConfig) -> Path | None:
    """The checkpoint to resume from: --resume_from latest (newest in output_dir or None), none, or a path."""
    if config.resume_from == "none":
        return None
    if config.resume_from == "latest":
        found = list_checkpoints(config.output_dir)
        return found[-1] if found else None
    path = Path(config.resume_from)
    if not path.is_dir():
        raise FileNotFoundError(f"--resume_from {path}: no such checkpoint directory")
    read_state(path)
    return path


def check_compatible(config: TrainConfig, checkpoint: Path | None) -> None:
    """Refuse to resume (or to reuse output_dir) when the saved configuration trains something else.

    Raises ValueError naming each differing field; nothing has been written when it does.
    """
    sources = [checkpoint] if checkpoint is not None else []
    sources.append(Path(config.output_dir))
    for directory in sources:
        saved = load_saved_config(directory)
        if saved is None:
            continue
        differences = config_differences(saved, config)
        if differences:
            listed = "; ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in differences.items())
            where = (f"--resume_from {checkpoint}" if directory == checkpoint
                     else f"--output_dir {config.output_dir}")
            raise ValueError(f"{where} was made with a different configuration ({listed}). Use another "
                             "--output_dir, or --resume_from none with a fresh --output_dir.")


def finalize_checkpoint(tmp: Path, config: TrainConfig, state: TrainerState, keep: int) -> Path:
    """Main process, after every process wrote `accelerator.save_state(tmp)`: add state and config, rename
    into place, and delete the oldest checkpoints beyond `keep` (0 = keep all). Returns the final path."""
    save_config(config, tmp)
    atomic_write_json(tmp / STATE_FILE, asdict(state))
    final = checkpoint_path(config.output_dir, state.step)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    if keep:
        for old in list_checkpoints(config.output_dir)[:-keep]:
            shutil.rmtree(old)
    return final


def temporary_checkpoint_path(output_dir: str | Path, step: int) -> Path:
    return checkpoints_root(output_dir) / f".tmp-{PREFIX}{step:08d}"


__all__ = ["CONFIG_FILE", "TrainerState", "check_compatible", "checkpoint_path", "finalize_checkpoint",
           "list_checkpoints", "read_state", "resolve_resume", "temporary_checkpoint_path"]
