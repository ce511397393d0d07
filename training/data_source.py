"""The training rows (distilled dataset) and, offline, their stored target features."""

from __future__ import annotations

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

    def assistant_tokens(self) -> Iterator[list[int]]:
        """Assistant tokens (loss_mask == 1) of every row: what EAGLE-3's draft vocabulary is counted on."""
        for ids, mask in zip(self.rows["input_ids"], self.rows["loss_mask"], strict=True):
            yield [t for t, m in zip(ids, mask, strict=True) if m]


def pad_token_id(target: nn.Module) -> int:
    """Any id works (padding is masked everywhere); use the target's pad id when it has one."""
    config = target.config.get_text_config()
    value = getattr(config, "pad_token_id", None)
    return int(value) if isinstance(value, int) else 0


def load_training_data(config: TrainConfig, target: nn.Module) -> TrainingData:
    """Load --dataset (checking its manifest against --model) and, with --features, the shard reader."""
    import datasets

    path = Path(config.dataset)
    if not config.dataset or not path.is_dir():
        raise FileNotFoundError(f"--dataset {config.dataset!r}: no such directory (expected a distilled dataset "
                                "written by python -m data.distill)")
    rows = datasets.load_from_disk(str(path))
    missing = {"input_ids", "loss_mask"} - set(rows.column_names)
    if missing:
        raise ValueError(f"--dataset {path}: missing column(s) {sorted(missing)}; has {rows.column_names}")
    return TrainingData(rows, None, pad_token_id(target))
