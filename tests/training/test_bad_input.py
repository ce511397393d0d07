"""Bad input gives a clear error and overwrites nothing: foreign dataset, heads that do not fit, NaN loss."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

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


def test_push_to_hub_uploads_the_heads_directory(main, train_args, tmp_path, monkeypatch):
    import training.train_heads as entry

    pushed = []
    monkeypatch.setattr(entry, "push_directory", lambda directory, repo_id, private: pushed.append(
        (directory, repo_id, private, sorted(p.name for p in directory.iterdir()))) or "https://hub/commit")
    final = main(train_args("mtp", tmp_path / "run", max_steps=2, push_to_hub="me/mtp-heads", hub_private="true"))
    assert pushed == [(tmp_path / "run" / "heads", "me/mtp-heads", True, ["README.md", "config.json", "model.safetensors"])]
    assert final["peak_rss_mb"] > 0 and final["train/samples_per_second"] > 0


def test_medusa2_saves_adapter_and_merged_target_beside_the_heads(main, train_args, tmp_path):
    from peft import PeftModel

    from heads.loading import load_model
    from tests.tiny_models import STORIES260K

    out = tmp_path / "run"
    main(train_args("medusa2", out, max_steps=2, save_merged="true", lora_r=2))
    adapted = PeftModel.from_pretrained(load_model(str(STORIES260K)), str(out / "heads" / "adapter"))
    merged = load_model(str(out / "merged"))
    ids = torch.tensor([[1, 20, 30, 40, 50]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted(ids).logits, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(merged(ids).logits, load_model(str(STORIES260K))(ids).logits, atol=1e-6)
