"""Fixtures for training tests: a small dataset distilled from stories260K by the real data pipeline, and
the flags every short training run shares."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_models import DATA, STORIES260K

STORIES = str(STORIES260K)


@pytest.fixture(scope="session")
def stories_dataset(tmp_path_factory) -> Path:
    """~60 conversations answered greedily by stories260K (plain format), via `python -m data.distill`."""
    from data.distill import main as distill

    out = tmp_path_factory.mktemp("distill") / "stories"
    distill(["--model", STORIES, "--prompts", str(DATA / "sharegpt_prompts.jsonl"), "--plain_format",
             "--max_prompts", "96", "--max_new_tokens", "40", "--max_length", "160", "--batch_size", "32",
             "--output_dir", str(out)])
    return out


@pytest.fixture(scope="session")
def train_args(stories_dataset):
    """Flags for a short run of `--method` on stories260K; keyword overrides become --key value."""

    def make(method: str, output_dir: Path, **overrides) -> list[str]:
        values = {"method": method, "model": STORIES, "dataset": str(stories_dataset), "output_dir": str(output_dir),
                  "max_steps": 8, "per_device_batch_size": 4, "learning_rate": 3e-3, "eval_samples": 8,
                  "eval_steps": 0, "save_steps": 0, "logging_steps": 1, "progress_bar": "false", "num_heads": 3,
                  "ttt_steps": 3, "eval_depth": 3, "draft_vocab_size": 256, "warmup_steps": 0}
        values.update(overrides)
        return [f"--{key}={value}" for key, value in values.items()]

    return make


@pytest.fixture
def reset_accelerate():
    """Let several in-process runs create their own Accelerator."""
    from accelerate.state import AcceleratorState, GradientState

    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()

