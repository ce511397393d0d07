"""Bad input gives a clear error and overwrites nothing: foreign dataset, heads that do not fit, NaN loss."""

from __future__ import annotations

import json
import shutil

import pytest

from heads.checkpoint import build_heads, save_heads
from heads.config import HeadsConfig
from tests.tiny_models import tiny_config
from training.loop import NonFiniteLossError


@pytest.fixture
def main(reset_accelerate):
    from training.train_heads import main as train_main

    return train_main


def copy_with_manifest(stories_dataset, tmp_path, **changes):
    copy = tmp_path / "dataset"
    shutil.copytree(stories_dataset, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest.update(changes)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def test_dataset_distilled_by_another_model_is_refused(main, stories_dataset, train_args, tmp_path):
    other = copy_with_manifest(stories_dataset, tmp_path, model="HuggingFaceTB/SmolLM2-135M-Instruct",
                               model_path="HuggingFaceTB/SmolLM2-135M-Instruct")
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="distilled from 'HuggingFaceTB/SmolLM2-135M-Instruct'"):
        main(train_args("medusa", out, dataset=other))
    assert not out.exists()
    # Accepted on request, but never with another vocabulary.
    retokenized = copy_with_manifest(stories_dataset, tmp_path / "b", model="other", tokenizer_sha256="0" * 64)
    with pytest.raises(ValueError, match="another vocabulary"):
        main(train_args("medusa", out, dataset=retokenized, allow_other_model="true"))
    assert not out.exists()
    (other / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        main(train_args("medusa", out, dataset=other))


def test_heads_that_do_not_fit_the_target_are_refused(main, train_args, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="target_layers"):
        main(train_args("eagle3", out, eagle3_layers="1,2,9"))
    with pytest.raises(ValueError, match="draft_vocab_size"):
        main(train_args("eagle3", out, draft_vocab_size=4096))
    foreign = save_heads(build_heads(HeadsConfig.for_target("eagle", tiny_config("llama"),
                                                            base_model_name_or_path="tiny-llama")),
                         tmp_path / "foreign")
    with pytest.raises(ValueError, match="cannot run on target"):
        main(train_args("eagle", out, init_heads=foreign))
    assert not (out / "heads").exists() and not (out / "checkpoints").exists()


def test_nan_loss_stops_naming_step_and_rows_and_keeps_the_last_good_checkpoint(main, train_args, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(NonFiniteLossError, match=r"optimizer step \d+, micro-batch 0 \(dataset rows \[") as error:
        main(train_args("medusa", out, learning_rate=1e30, max_grad_norm=0, save_steps=1, max_steps=6))
    step = int(str(error.value).split("optimizer step ")[1].split(",")[0])
    assert step >= 2  # step 1 is finite, its huge update breaks the next forward
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert kept[-1] == f"step_{step - 1:08d}"  # the last good step's checkpoint; nothing after it
    assert not (out / "heads").exists()
