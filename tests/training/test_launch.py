"""The real `accelerate launch` of training/train_heads.py with 2 CPU processes, for every method."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from heads.checkpoint import load_heads
from tests.tiny_models import REPO, stories260k

METHODS = ["medusa", "medusa2", "eagle", "eagle3", "mtp"]
KIND = {"medusa": "medusa", "medusa2": "medusa", "eagle": "eagle", "eagle3": "eagle3", "mtp": "mtp"}
# Extra flags per method, so the launches together also cover trackers, checkpoints and accumulation.
EXTRA = {
    "medusa": {},
    "medusa2": {"distill_weight": 0.5, "lora_r": 4},
    "eagle": {"report_to": "tensorboard", "gradient_accumulation_steps": 2},
    "eagle3": {"save_steps": 5},
    "mtp": {"report_to": "wandb"},
}


def run_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", WANDB_SILENT="true")
    env["PYTHONPATH"] = str(REPO)
    return env


def accelerate_launch(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file configs/accelerate/cpu_2proc.yaml training/train_heads.py ARGS`."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           "configs/accelerate/cpu_2proc.yaml", "training/train_heads.py", *args]
    result = subprocess.run(cmd, cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def launched(tmp_path_factory, train_args):
    """method -> output_dir of its 2-process run (each method launched once per module)."""
    done: dict[str, Path] = {}

    def get(method: str) -> Path:
        if method not in done:
            out = tmp_path_factory.mktemp(f"launch-{method}")
            accelerate_launch(train_args(method, out, max_steps=10, **EXTRA[method]))
            done[method] = out
        return done[method]

    return get


@pytest.mark.parametrize("method", METHODS)
def test_two_process_launch_trains_and_saves_loadable_heads(method, launched):
    out = launched(method)
    records = read_metrics(out)
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 10
    assert sum(losses[-3:]) / 3 < losses[0], losses
    heads = load_heads(out / "heads", target=stories260k(), target_name=str(REPO / "../shared/models/stories260K"),
                       allow_base_model_mismatch=True)
    assert heads.config.kind == KIND[method]
    metrics = heads.config.metrics
    assert len(metrics["top1_accuracy_per_depth"]) == 3
    assert 1.0 <= metrics["expected_acceptance_length"] <= 4.0
    assert "expected_acceptance_length" in (out / "heads" / "README.md").read_text()
    final = records[-1]
    assert final["eval/acceptance_length"] == pytest.approx(metrics["expected_acceptance_length"], abs=1e-4)
    if method == "medusa2":
        assert (out / "heads" / "adapter" / "adapter_config.json").is_file()
        assert all("train/distill_loss" in r for r in records if "loss" in r)
    if method == "eagle":
        assert list(out.rglob("events.out.tfevents.*")), "tensorboard event file missing"
    if method == "mtp":
        assert list(out.rglob("offline-run-*")), "wandb offline run directory missing"
    if method == "eagle3":
        assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000005", "step_00000010"]
        assert (out / "checkpoints" / "step_00000010" / "random_states_1.pkl").is_file()
        assert int(heads.t2d.sum()) == 256


def test_two_processes_equal_one_process_with_the_same_global_batch(launched, train_args, tmp_path,
                                                                    reset_accelerate):
    """2 processes x batch 4 and 1 process x batch 8 see the same samples per step: same losses."""
    from training.train_heads import main

    two = [r["loss"] for r in read_metrics(launched("medusa")) if "loss" in r]
    torch.set_num_threads(1)
    main(train_args("medusa", tmp_path, max_steps=10, per_device_batch_size=8))
    one = [r["loss"] for r in read_metrics(tmp_path) if "loss" in r]
    assert one == pytest.approx(two, rel=1e-5)
