"""What a finished run leaves behind: pushed heads, Medusa-2 adapter and merged target, mixed precision."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def main(reset_accelerate):
    from training.train_heads import main as train_main

    return train_main


def test_push_to_hub_uploads_the_heads_directory(main, train_args, tmp_path, monkeypatch):
    import training.train_heads as entry

    pushed = []
    monkeypatch.setattr(entry, "push_directory", lambda directory, repo_id, private: pushed.append(
        (directory, repo_id, private, sorted(p.name for p in directory.iterdir()))) or "https://hub/commit")
    final = main(train_args("mtp", tmp_path / "run", max_steps=2, push_to_hub="me/mtp-heads", hub_private="true"))
    assert pushed == [(tmp_path / "run" / "heads", "me/mtp-heads", True, ["README.md", "config.json", "draft_vocab.safetensors", "model.safetensors"])]
    assert final["peak_rss_mb"] > 0 and final["train/samples_per_second"] > 0


def test_medusa2_saves_adapter_and_merged_target_beside_the_heads(main, train_args, tmp_path):
    from peft import PeftModel

    from heads.loading import load_model
    from tests.tiny_models import STORIES260K

    out = tmp_path / "run"
    main(train_args("medusa2", out, max_steps=2, save_merged="true", lora_r=2))
    adapted = PeftModel.from_pretrained(load_model(str(STORIES260K), dtype="float32"), str(out / "heads" / "adapter"))
    merged = load_model(str(out / "merged"), dtype="float32")
    ids = torch.tensor([[1, 20, 30, 40, 50]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted(ids).logits, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(merged(ids).logits, load_model(str(STORIES260K), dtype="float32")(ids).logits,
                                  atol=1e-6)


@pytest.mark.parametrize("method", ["eagle3", "medusa2"])
def test_bf16_target_with_autocast_trains(main, train_args, tmp_path, method):
    merge = {"save_merged": "true", "lora_r": 2} if method == "medusa2" else {}
    final = main(train_args(method, tmp_path / "run", max_steps=2, mixed_precision="bf16", target_dtype="bfloat16",
                            **merge))
    assert final["eval/acceptance_length"] >= 1.0
    if merge:  # the float32 LoRA merged into the bf16 target, saved in bf16
        from heads.loading import load_model

        merged = load_model(str(tmp_path / "run" / "merged"), dtype="bfloat16")
        assert next(merged.parameters()).dtype == torch.bfloat16
        assert merged.config.dtype in (torch.bfloat16, "bfloat16")


def test_bf16_target_without_autocast_is_refused(main, train_args, tmp_path):
    with pytest.raises(ValueError, match="--target_dtype bfloat16"):
        main(train_args("eagle", tmp_path / "run", target_dtype="bfloat16", mixed_precision="no"))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("cpu_kind, expected", [("native", "bf16"), ("emulated", "no")])
def test_mixed_precision_auto_follows_the_cpu_kind(main, train_args, tmp_path, monkeypatch, capsys, cpu_kind,
                                                   expected):
    """auto = bf16 autocast where the CPU runs bf16 natively, float32 where torch would emulate it; the run says
    which, and a bf16 target (target_dtype auto) comes with the autocast."""
    from training.train_heads import resolve_mixed_precision

    monkeypatch.setenv("SPECHEADS_CPU_BF16", cpu_kind)
    assert resolve_mixed_precision("auto") == expected
    assert resolve_mixed_precision("no") == "no" and resolve_mixed_precision(None) is None
    final = main(train_args("eagle3", tmp_path / "run", max_steps=2, mixed_precision="auto"))
    assert final["eval/acceptance_length"] >= 1.0
    err = capsys.readouterr().err
    assert f"--mixed_precision auto: {expected}" in err
    assert ("bfloat16" if expected == "bf16" else "float32") in err.split("target_")[1].splitlines()[0]
