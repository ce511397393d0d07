"""The training rows (distilled dataset) and, offline, their stored target features."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from training.config import TrainConfig


@dataclass
class TrainingData:
    rows: Any  # datasets.Dataset with input_ids / loss_mask
    features: Callable[[int], dict[str, Tensor]] | None  # row -> {feature name: [T, H]} (offline) or None
    pad_token_id: int

    def assistant_tokens(self, indices: list[int]) -> Iterator[list[int]]:
        """Assistant tokens (loss_mask == 1) of the given rows: what EAGLE-3's draft vocabulary is counted on."""
        selected = self.rows.select(indices)
        for ids, mask in zip(selected["input_ids"], selected["loss_mask"], strict=True):
            yield [t for t, m in zip(ids, mask, strict=True) if m]


def pad_token_id(target: nn.Module) -> int:
    """Any id works (padding is masked everywhere); use the target's pad id when it has one."""
    config = target.config.get_text_config()
    value = getattr(config, "pad_token_id", None)
    return int(value) if isinstance(value, int) else 0


def check_manifest(config: TrainConfig) -> dict[str, Any]:
    """The dataset's manifest.json, refused when it was distilled from another model.

    Same model = same name or the same resolved checkpoint (`heads.loading.model_path`). With
    --allow_other_model another model's answers are accepted, but the tokenizer must still be the same
    (token ids must mean the same thing).
    """
    from data.distill import MANIFEST, tokenizer_hash
    from heads.loading import load_tokenizer, model_path

    path = Path(config.dataset) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"--dataset {config.dataset}: no {MANIFEST}; not a finished distilled dataset "
                                "(python -m data.distill writes it last)")
    manifest = json.loads(path.read_text())
    made_by = manifest.get("model")
    same = made_by == config.model or (
        manifest.get("model_path") is not None
        and Path(manifest["model_path"]).resolve() == Path(model_path(config.model)).resolve())
    if not same and not config.allow_other_model:
        raise ValueError(f"--dataset {config.dataset} was distilled from {made_by!r}, not from --model "
                         f"{config.model!r}: heads must learn what their target says. Distill with the target "
                         "(python -m data.distill --model ...), or pass --allow_other_model")
    expected = manifest.get("tokenizer_sha256")
    if expected is not None and expected != tokenizer_hash(load_tokenizer(config.model)):
        raise ValueError(f"--dataset {config.dataset} was tokenised with another vocabulary than --model "
                         f"{config.model!r} (tokenizer_sha256 differs); its token ids mean something else")
    return manifest


def load_training_data(config: TrainConfig, target: nn.Module) -> TrainingData:
    """Load --dataset (checking its manifest against --model) and, with --features, the shard reader."""
    import datasets

    path = Path(config.dataset)
    if not config.dataset or not path.is_dir():
        raise FileNotFoundError(f"--dataset {config.dataset!r}: no such directory (expected a distilled dataset "
                                "written by python -m data.distill)")
    check_manifest(config)
    rows = datasets.load_from_disk(str(path))
    missing = {"input_ids", "loss_mask"} - set(rows.column_names)
    if missing:
        raise ValueError(f"--dataset {path}: missing column(s) {sorted(missing)}; has {rows.column_names}")
    return TrainingData(rows, None, pad_token_id(target))
