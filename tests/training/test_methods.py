"""Training modules: Medusa with the shared target LM head trains only its residual blocks (Medusa-1 and -2)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from heads import load_heads
from heads.loading import load_model
from tests.tiny_models import STORIES260K
from training.config import parse_config
from training.methods import build_training_module

HIDDEN = 64  # stories260K


@pytest.fixture
def main(reset_accelerate):
    from training.train_heads import main as train_main

    return train_main


def trainable_names(module) -> list[str]:
    return [name for name, p in module.named_parameters() if p.requires_grad]


def test_shared_medusa_optimizes_only_residual_blocks(train_args, tmp_path):
    config = parse_config(train_args("medusa", tmp_path, medusa_shared_lm_head="true"))
    target = load_model(str(STORIES260K))
    module = build_training_module(config, target, lambda: [])
    names = trainable_names(module)
    assert names and all(n.startswith("heads.heads.") and ".linear." in n for n in names), names
    assert sum(p.numel() for p in module.parameters() if p.requires_grad) == 3 * (HIDDEN * HIDDEN + HIDDEN)
    batch = {"input_ids": torch.randint(3, 512, (2, 12), generator=torch.Generator().manual_seed(0))}
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    batch["loss_mask"] = torch.ones_like(batch["input_ids"])
    module(batch).loss.backward()
    assert target.lm_head.weight.grad is None  # the frozen LM head passes gradients, it does not collect them
    assert all(p.grad is not None for p in module.parameters() if p.requires_grad)


@pytest.mark.parametrize("method", ["medusa", "medusa2"])
def test_shared_medusa_trains_and_saves_blocks_only(main, train_args, tmp_path, method):
    out = tmp_path / "run"
    extra = {"lora_r": 2} if method == "medusa2" else {}
    final = main(train_args(method, out, medusa_shared_lm_head="true", max_steps=4, **extra))
    assert final["eval/acceptance_length"] >= 1.0
    heads = load_heads(out / "heads")
    assert heads.config.medusa_shared_lm_head
    saved = load_file(str(out / "heads" / "medusa_lm_head.safetensors"))
    assert sorted(saved) == sorted(f"{h}.0.linear.{p}" for h in range(3) for p in ("weight", "bias"))
    assert any(bool(t.ne(0).any()) for t in saved.values())  # trained away from the zero (identity) start
    with pytest.raises(ValueError, match="medusa_shared_lm_head is True there"):
        main(train_args(method, tmp_path / "again", init_heads=out / "heads", **extra))
