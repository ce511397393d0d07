"""Kill after a checkpoint, resume, and end with the weights of an uninterrupted run; refuse foreign resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.tiny_models import REPO

# eagle: noise on features; accumulation 2; 55 training rows / batch 4 = 13 micro-batches per epoch, so the
# 10 steps (20 micro-batches) cross an epoch boundary inside an accumulation group.
RESUME_FLAGS = {"max_steps": 10, "save_steps": 3, "gradient_accumulation_steps": 2, "warmup_steps": 2}


def env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")


def losses(directory: Path) -> dict[int, float]:
    records = map(json.loads, (directory / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_killed_run_resumes_to_the_same_weights(train_args, tmp_path, reset_accelerate):
    from training.train_heads import main

    uninterrupted = tmp_path / "uninterrupted"
    main(train_args("eagle", uninterrupted, **RESUME_FLAGS))

    killed = tmp_path / "killed"
    args = [sys.executable, "training/train_heads.py", *train_args("eagle", killed, **RESUME_FLAGS)]
    process = subprocess.Popen(args, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               text=True, start_new_session=True)
    deadline = time.monotonic() + 240
    for line in process.stdout:
        if "saved checkpoint" in line and "(step 3)" in line:
            os.killpg(process.pid, signal.SIGKILL)
            break
        assert time.monotonic() < deadline, "no checkpoint within 240 s"
    process.wait()
    assert process.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert not (killed / "heads").exists()

    resumed = subprocess.run(args, cwd=REPO, env=env(), capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "at step" in resumed.stdout

    a = load_file(str(uninterrupted / "heads" / "model.safetensors"))
    b = load_file(str(killed / "heads" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-6, msg=name)
    assert losses(killed) == pytest.approx(losses(uninterrupted), rel=1e-6)


def test_resume_with_another_config_is_refused_and_nothing_is_written(train_args, tmp_path, reset_accelerate):
    from training.train_heads import main

    out = tmp_path / "run"
    main(train_args("medusa", out, max_steps=2, save_steps=2))
    before = snapshot(out)
    with pytest.raises(ValueError, match="learning_rate"):
        main(train_args("medusa", out, max_steps=4, save_steps=2, learning_rate=0.1))
    assert snapshot(out) == before
    # An explicit checkpoint from another configuration, into a fresh directory: refused before any write.
    fresh = tmp_path / "fresh"
    with pytest.raises(ValueError, match="num_heads"):
        main(train_args("medusa", fresh, num_heads=2, resume_from=out / "checkpoints" / "step_00000002"))
    assert not fresh.exists()
    # Longer training of the same configuration is allowed and continues from step 2.
    result = main(train_args("medusa", out, max_steps=4, save_steps=2))
    assert result["step"] == 4
