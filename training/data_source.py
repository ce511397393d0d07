"""The training rows (distilled dataset) and, offline, their stored target features."""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from data.hidden_states import HiddenStateShards, dataset_fingerprint, feature_name
from data.shards import MANIFEST, tokenizer_hash
from heads.loading import load_tokenizer, model_path
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


def same_model(recorded: str | None, recorded_path: str | None, model: str) -> bool:
    """Whether data recorded as made by `recorded` (resolved checkpoint `recorded_path`) comes from `model`."""
    if recorded is None:
        return False
    if recorded == model:
        return True
    candidates = [recorded_path] if recorded_path else []
    candidates.append(recorded)
    mine = Path(model_path(model)).resolve()
    return any(Path(c).exists() and Path(c).resolve() == mine for c in candidates)


def check_manifest(config: TrainConfig) -> dict[str, Any]:
    """The dataset's manifest.json, refused when it was distilled from another model.

    Same model = same name or the same resolved checkpoint (`heads.loading.model_path`). With
    --allow_other_model another model's answers are accepted, but the tokenizer must still be the same
    (token ids must mean the same thing).
    """
    path = Path(config.dataset) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"--dataset {config.dataset}: no {MANIFEST}; not a finished distilled dataset "
                                "(python -m data.distill writes it last)")
    manifest = json.loads(path.read_text())
    made_by = manifest.get("model")
    if not same_model(made_by, manifest.get("model_path"), config.model) and not config.allow_other_model:
        raise ValueError(f"--dataset {config.dataset} was distilled from {made_by!r}, not from --model "
                         f"{config.model!r}: heads must learn what their target says. Distill with the target "
                         "(python -m data.distill --model ...), or pass --allow_other_model")
    expected = manifest.get("tokenizer_sha256")
    if expected is not None and expected != tokenizer_hash(load_tokenizer(config.model)):
        raise ValueError(f"--dataset {config.dataset} was tokenised with another vocabulary than --model "
                         f"{config.model!r} (tokenizer_sha256 differs); its token ids mean something else")
    return manifest


def assistant_token_counts(rows: Any) -> list[int]:
    """Loss-mask tokens per row (what --max_train_tokens counts)."""
    return [sum(mask) for mask in rows["loss_mask"]]


def paths_of(value: str | None) -> list[str]:
    """The directories a --dataset / --features value names: one, or several separated by commas."""
    return [part.strip() for part in (value or "").split(",") if part.strip()]


def load_parts(config: TrainConfig, held_out: bool = False) -> list[Any]:
    """Each directory of --dataset (--eval_dataset when held_out) loaded, its manifest checked against --model."""
    import dataclasses

    import datasets

    flag, value = ("--eval_dataset", config.eval_dataset) if held_out else ("--dataset", config.dataset)
    paths = paths_of(value)
    parts = []
    for dataset in paths or [value]:
        path = Path(dataset)
        if not dataset or not path.is_dir():
            raise FileNotFoundError(f"{flag} {dataset!r}: no such directory (expected a distilled dataset written by "
                                    "python -m data.distill)")
        check_manifest(dataclasses.replace(config, dataset=dataset))
        rows = datasets.load_from_disk(str(path))
        missing = {"input_ids", "loss_mask"} - set(rows.column_names)
        if missing:
            raise ValueError(f"{flag} {path}: missing column(s) {sorted(missing)}; has {rows.column_names}")
        parts.append(rows)
    return parts


def concatenate(parts: list[Any]) -> Any:
    """The parts' rows one after the other (the columns they all have), or the one part as it is."""
    if len(parts) == 1:
        return parts[0]
    import datasets

    shared = [name for name in parts[0].column_names if all(name in part.column_names for part in parts)]
    return datasets.concatenate_datasets([part.select_columns(shared) for part in parts])


def load_training_data(config: TrainConfig, target: nn.Module) -> TrainingData:
    """Load --dataset (checking its manifest against --model) and, with --features, the shard reader."""
    parts = load_parts(config)
    features = offline_features(config, parts) if config.features else None
    return TrainingData(concatenate(parts), features, pad_token_id(target))


class OfflineFeatures:
    """row -> {"hidden_states.{layer}": [T, H]} from `data.hidden_states` shards, one shard set per dataset part in
    the order the rows were concatenated (picklable for workers)."""

    def __init__(self, shards: list[Any]) -> None:
        self.shards = shards
        self.starts = [0]
        for part in shards:
            self.starts.append(self.starts[-1] + len(part))
        self.layers: list[int] = sorted(set.intersection(*(set(part.layers) for part in shards)))

    def __call__(self, row: int) -> dict[str, Tensor]:
        part = bisect.bisect_right(self.starts, row) - 1
        local = row - self.starts[part]
        return {feature_name(layer): tensor for layer, tensor in self.shards[part][local].items()
                if layer in self.layers}


def offline_features(config: TrainConfig, parts: list[Any], held_out: bool = False) -> OfflineFeatures:
    """Open --features (--eval_features when held_out; comma-separated, one per --dataset directory) and check each
    was computed by --model on its dataset (`parts`, the loaded Datasets), all rows. A dataset is recognised by the
    path the features recorded or by its content fingerprint (recorded too), so a dataset and its features moved or
    copied together still match."""
    flag, dataset_flag = ("--eval_features", "--eval_dataset") if held_out else ("--features", "--dataset")
    value, datasets_value = (config.eval_features, config.eval_dataset) if held_out else (config.features,
                                                                                           config.dataset)
    directories, dataset_paths = paths_of(value), paths_of(datasets_value)
    if len(directories) != len(parts):
        raise ValueError(f"{flag} {value!r} names {len(directories)} feature director"
                         f"{'y' if len(directories) == 1 else 'ies'} for the {len(parts)} of {dataset_flag} "
                         f"{datasets_value!r}: give one per dataset, in the same order")
    shards = []
    for directory, dataset, rows in zip(directories, dataset_paths, parts, strict=True):
        part = HiddenStateShards(directory)
        index = part.index
        fingerprint = dataset_fingerprint(rows)
        same_dataset = Path(index["dataset"]).resolve() == Path(dataset).resolve() or (
            fingerprint is not None and index.get("dataset_fingerprint") == fingerprint)
        if not same_dataset or len(part) != len(rows):
            raise ValueError(f"{flag} {directory} holds {len(part)} samples of {index['dataset']!r}, "
                             f"not the {len(rows)} rows of {dataset_flag} {dataset}")
        if not same_model(index["model"], None, config.model):
            raise ValueError(f"{flag} {directory} were computed by {index['model']!r}, not by --model "
                             f"{config.model!r}")
        shards.append(part)
    return OfflineFeatures(shards)


def check_feature_layers(features: OfflineFeatures | None, needed: list[int], method: str, flag: str,
                         directory: str | None) -> None:
    """The shards `flag` `directory` must hold every hidden_states index `method` reads."""
    if features is None:
        return
    missing = sorted(set(needed) - set(features.layers))
    if missing:
        raise ValueError(f"{flag} {directory} holds layers {features.layers}; --method {method} "
                         f"needs {sorted(set(needed))}: rerun python -m data.hidden_states with --layers "
                         f"{','.join(str(i) for i in sorted(set(needed)))}")
