"""How a distilled dataset is stored: shards written atomically while a job runs (so it resumes from what is on
disk), then merged into one Arrow dataset with manifest.json written last. Shared by both modes of
`python -m data.distill` (data/distill.py, data/teacher_forced.py) and read by data.hidden_states and training.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import datasets
from safetensors.torch import save_file
from transformers import PreTrainedTokenizerBase

from data.runfiles import replace_dir, temporary_dir
from heads.files import atomic_write_json

MANIFEST = "manifest.json"
SHARDS = "shards"
FEATURES_FILE = "features.safetensors"  # a shard's captured hidden states (data.distill --features_dir)


def tokenizer_hash(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 of the vocabulary (a dataset is only valid for models that share it)."""
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()


def features():
    return datasets.Features({
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "loss_mask": datasets.Sequence(datasets.Value("int8")),
        "text": datasets.Value("string"), "conversation": datasets.Value("string"),
        "index": datasets.Value("int64"), "truncated_turns": datasets.Sequence(datasets.Value("int32")),
        "generated_tokens": datasets.Value("int32"),
    })


def shard_path(output_dir: Path, shard: int) -> Path:
    return output_dir / SHARDS / f"shard-{shard:05d}"


def write_shard(path: Path, columns: dict[str, list], meta: dict[str, Any],
                hidden: dict[str, Any] | None = None) -> None:
    """Save one shard (dataset + meta.json, and with `hidden` {tensor name: [tokens, H]} the rows' captured hidden
    states in FEATURES_FILE) to a temporary directory, then rename it into place."""
    tmp = temporary_dir(path)
    try:
        datasets.Dataset.from_dict(columns, features=features()).save_to_disk(str(tmp / "data"))
        if hidden is not None:
            save_file({name: tensor.contiguous() for name, tensor in hidden.items()}, str(tmp / FEATURES_FILE))
        atomic_write_json(tmp / "meta.json", meta)
        replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def merge_shards(output_dir: Path, num_shards: int, manifest: dict[str, Any],
                 left: set[int] = frozenset(), write_features=None) -> dict[str, Any]:
    """Concatenate the shards (all but those `left` by a time budget) into one dataset saved in `output_dir`, write
    manifest.json last, drop shards. `write_features(shard_dirs, merged)`, when given, is called after the dataset is
    in place and before the manifest (it moves the shards' captured hidden states out; data.distill)."""
    parts, skipped, seconds, unanswered = [], [], 0.0, 0
    present = [s for s in range(num_shards) if (shard_path(output_dir, s) / "meta.json").is_file()]
    missing = sorted(set(range(num_shards)) - set(present) - set(left))
    if missing:
        raise ValueError(f"--output_dir {output_dir}: shards {missing} are missing; run again to resume")
    for shard in present:
        path = shard_path(output_dir, shard)
        parts.append(datasets.load_from_disk(str(path / "data")))
        meta = json.loads((path / "meta.json").read_text())
        skipped += meta["skipped_conversations"]
        seconds += meta["seconds"]
        unanswered += meta["unanswered_turns"]
    merged = datasets.concatenate_datasets(parts) if parts else datasets.Dataset.from_dict(
        {name: [] for name in features()}, features=features())
    tmp = temporary_dir(output_dir / "dataset")
    try:
        merged.save_to_disk(str(tmp))
        names = sorted(p.name for p in tmp.iterdir())
        for name in [n for n in names if n != "state.json"] + ["state.json"]:  # state.json makes it loadable
            (tmp / name).replace(output_dir / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if write_features is not None:
        manifest["features"] = write_features([shard_path(output_dir, s) for s in present], merged)
    lengths = [len(ids) for ids in merged["input_ids"]]
    masked = [sum(mask) for mask in merged["loss_mask"]]
    generated = sum(merged["generated_tokens"])
    manifest.update({
        "conversations_written": len(merged),
        "conversations_skipped": len(skipped),
        "skipped_conversations": skipped,
        "assistant_turns": sum(sum(m["role"] == "assistant" for m in json.loads(c)) for c in merged["conversation"]),
        "truncated_answers": sum(len(turns) for turns in merged["truncated_turns"]),
        "unanswered_turns": unanswered,
        "tokens": {"total": sum(lengths), "loss": sum(masked), "generated": generated,
                   "mean_length": sum(lengths) / len(lengths) if lengths else 0.0,
                   "min_length": min(lengths, default=0), "max_length": max(lengths, default=0)},
        "generation_seconds": round(seconds, 3),
        "generated_tokens_per_second": round(generated / seconds, 2) if seconds else None,
    })
    atomic_write_json(output_dir / MANIFEST, manifest)
    shutil.rmtree(output_dir / SHARDS, ignore_errors=True)
    return manifest
