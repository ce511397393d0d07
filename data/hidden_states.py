"""Offline features: the target's hidden states on a distilled dataset, as safetensors shards + index.json.

    python -m data.hidden_states --model ../shared/models/smollm2-135m-instruct \\
        --dataset outputs/distill/smollm2-sharegpt --layers eagle3 --output_dir outputs/features/smollm2 \\
        --dtype bf16

Layers are Hugging Face `hidden_states` indices (L+1 of them: 0 = embeddings, i = output of layer i-1,
L = -1 = after the final norm, what the LM head reads): `-1` for Medusa / EAGLE-1/2 / MTP, `eagle3` for
(2, L//2, L-3) as vLLM/SGLang, or any comma list such as `3,15,27`. Negative indices are stored as L+1+i.

On disk (FEAT):
- `shard-00000.safetensors`: one tensor per layer, `hidden_states.{layer}` [tokens of the shard's samples
  concatenated, H] in `--dtype`; shard k holds dataset rows [k * shard_size, (k+1) * shard_size);
- `index.json` (written last; its presence means complete): layers, dtype, hidden_size, shards, and per
  sample [shard, token offset, length];
- `run.json`: model / dataset / layers / dtype of the run (another run in the same directory is refused).

Read them with `HiddenStateShards(FEAT)[i] -> {layer: Tensor[T_i, H]}` (row i of the dataset). The disk
estimate is printed before anything runs and the run refuses to start when the free space is short.
Killing and rerunning resumes: finished shards (atomically renamed into place) are kept.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from data.runfiles import check_run_identity, parse_config, process_state, replace_dir, temporary_dir
from data.shards import tokenizer_hash
from heads.cli import run_cli
from heads.files import atomic_write_json
from heads.loading import describe_dtype, load_model, load_tokenizer, parse_dtype

INDEX = "index.json"
FORMAT_VERSION = 1
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
               torch.float64: "float64"}


def dataset_fingerprint(dataset: Any) -> str | None:
    """The content fingerprint `datasets` keeps for a loaded Dataset (recorded with the features, so that a dataset
    and its features moved together still match), or None for anything else."""
    return getattr(dataset, "_fingerprint", None)


def feature_name(layer: int) -> str:
    """Tensor name of hidden_states[layer] in a shard (the training batches use the same name)."""
    return f"hidden_states.{layer}"


@dataclass
class HiddenStatesConfig:
    """Flags of `python -m data.hidden_states`."""

    model: str | None = field(default=None, metadata={"help": "Target model (Hub id, directory or GGUF)."})
    dataset: str | None = field(default=None, metadata={"help": "A data.distill output directory."})
    output_dir: str | None = field(default=None, metadata={"help": "Where shards and index.json go."})
    layers: str = field(default="-1", metadata={"help": "HF hidden_states indices, comma separated, or 'eagle3'."})
    dtype: str = field(default="bfloat16", metadata={"help": "Storage dtype of the features (bfloat16 halves the "
                                                     "disk; independent of --model_dtype)."})
    model_dtype: str = field(default="auto", metadata={"help": "Dtype the target runs in: auto (bfloat16 on CUDA "
                                                       "and on CPUs with AVX512-BF16 or AMX, float32 elsewhere), "
                                                       "float32 or bfloat16."})
    batch_size: int = field(default=8, metadata={"help": "Samples per forward."})
    shard_size: int = field(default=256, metadata={"help": "Samples per shard file."})
    max_samples: int | None = field(default=None, metadata={"help": "Only the first N dataset rows."})
    revision: str | None = field(default=None, metadata={"help": "Model revision (Hub models)."})
    num_threads: int = field(default=1, metadata={"help": "torch CPU threads."})

    def __post_init__(self) -> None:
        for name in ("model", "dataset", "output_dir"):
            if not getattr(self, name):
                raise ValueError(f"--{name} is required")
        for name in ("batch_size", "shard_size", "num_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        parse_dtype(self.dtype)


def parse_layers(spec: str, num_layers: int) -> list[int]:
    """'eagle3' -> [2, L//2, L-3]; '-1' -> [L]; '3,-2' -> [3, L-1]. Indices into hidden_states (0..L), unique."""
    if spec.strip() == "eagle3":
        values = [2, num_layers // 2, num_layers - 3]
    else:
        try:
            values = [int(part) for part in spec.split(",") if part.strip()]
        except ValueError as err:
            raise ValueError(f"--layers {spec!r}: expected comma-separated integers or 'eagle3'") from err
    layers = []
    for value in values:
        layer = value + num_layers + 1 if value < 0 else value
        if not 0 <= layer <= num_layers:
            raise ValueError(f"--layers {spec!r}: index {value} is outside hidden_states[-{num_layers + 1}..{num_layers}]"
                             f" of a {num_layers}-layer model")
        if layer not in layers:
            layers.append(layer)
    if not layers:
        raise ValueError(f"--layers {spec!r}: no layer given")
    return layers


def shard_file(output_dir: Path, shard: int) -> Path:
    return output_dir / f"shard-{shard:05d}.safetensors"


def disk_estimate(lengths: list[int], hidden_size: int, num_layers: int, dtype: torch.dtype) -> int:
    """Bytes of the features of samples with these lengths (index and headers not counted)."""
    return sum(lengths) * hidden_size * num_layers * torch.empty((), dtype=dtype).element_size()


def human_bytes(size: float) -> str:
    return f"{size / 1e9:.2f} GB" if size >= 1e9 else f"{size / 1e6:.2f} MB"


def check_free_disk(output_dir: Path, needed: int) -> None:
    """Raise ValueError naming --output_dir when the filesystem holding it has less than `needed` * 1.05 free."""
    probe = output_dir
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed * 1.05 > free:
        raise ValueError(f"--output_dir {output_dir}: the features need about {human_bytes(needed)} but only "
                         f"{human_bytes(free)} are free; free space, use fewer --layers, --dtype bf16 or --max_samples")


@torch.inference_mode()
def forward_features(model, samples: list[list[int]], layers: list[int], dtype: torch.dtype,
                     batch_size: int) -> dict[int, torch.Tensor]:
    """hidden_states[layer] of each sample, concatenated over samples: {layer: [sum T_i, H]} in `dtype`."""
    device = next(model.parameters()).device
    pieces: dict[int, list] = {layer: [None] * len(samples) for layer in layers}
    order = sorted(range(len(samples)), key=lambda i: len(samples[i]))  # similar lengths, less padding
    for start in range(0, len(order), batch_size):
        batch = order[start:start + batch_size]
        width = max(len(samples[i]) for i in batch)
        input_ids = torch.zeros((len(batch), width), dtype=torch.long)  # [B, S], right padded
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)  # [B, S]
        for row, i in enumerate(batch):
            input_ids[row, :len(samples[i])] = torch.tensor(samples[i])
            attention_mask[row, :len(samples[i])] = 1
        # logits_to_keep=1: the LM head over every position (49k-150k rows) would cost a fifth of the forward and
        # a [B, S, V] float tensor, and no feature needs it
        out = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                    output_hidden_states=True, use_cache=False, logits_to_keep=1)
        for layer in layers:
            hidden = out.hidden_states[layer]  # [B, S, H]
            for row, i in enumerate(batch):
                pieces[layer][i] = hidden[row, :len(samples[i])].to(dtype).cpu()
    return {layer: torch.cat(parts) if parts else torch.empty(0) for layer, parts in pieces.items()}


def write_feature_shard(path: Path, tensors: dict[int, torch.Tensor], metadata: dict[str, str]) -> None:
    """Save one shard to a temporary file and rename it into place."""
    tmp = path.with_name("." + path.name + f".{os.getpid()}.tmp")
    try:
        save_file({feature_name(layer): tensor.contiguous() for layer, tensor in tensors.items()}, str(tmp),
                  metadata=metadata)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def run(config: HiddenStatesConfig) -> dict[str, Any]:
    """Write (or resume writing) the features of config.dataset into config.output_dir; returns the index."""
    import datasets
    from tqdm.auto import tqdm

    state = process_state()
    dataset_dir = Path(config.dataset)
    if not (dataset_dir / "state.json").is_file():
        raise FileNotFoundError(f"--dataset {dataset_dir}: not a finished data.distill output (no state.json)")
    dataset = datasets.load_from_disk(str(dataset_dir))
    if "input_ids" not in dataset.column_names:
        raise ValueError(f"--dataset {dataset_dir}: no input_ids column (has {dataset.column_names})")
    if config.max_samples is not None:
        dataset = dataset.select(range(min(config.max_samples, len(dataset))))
    manifest_path = dataset_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    tokenizer = load_tokenizer(config.model)
    if manifest.get("tokenizer_sha256") not in (None, tokenizer_hash(tokenizer)):
        raise ValueError(f"--dataset {dataset_dir} was tokenised for {manifest.get('model')!r}, whose vocabulary "
                         f"differs from --model {config.model}")

    model = load_model(config.model, dtype=config.model_dtype, device=state.device, revision=config.revision,
                       dtype_flag="--model_dtype")
    if state.is_main_process:
        print("model_" + describe_dtype(model.dtype, config.model_dtype, state.device), file=sys.stderr)
    text_config = model.config.get_text_config()
    layers = parse_layers(config.layers, text_config.num_hidden_layers)
    dtype = parse_dtype(config.dtype)
    all_ids: list[list[int]] = dataset["input_ids"]
    lengths = [len(ids) for ids in all_ids]
    num_shards = math.ceil(len(all_ids) / config.shard_size)
    output_dir = Path(config.output_dir)
    identity = {"format_version": FORMAT_VERSION, "model": config.model, "dataset": str(dataset_dir.resolve()),
                "dataset_fingerprint": dataset_fingerprint(dataset), "num_samples": len(all_ids), "layers": layers,
                "dtype": DTYPE_NAMES[dtype], "model_dtype": DTYPE_NAMES[model.dtype], "shard_size": config.shard_size}
    todo = [s for s in range(num_shards) if not shard_file(output_dir, s).is_file()]
    remaining = disk_estimate([n for s in todo for n in lengths[s * config.shard_size:(s + 1) * config.shard_size]],
                              text_config.hidden_size, len(layers), dtype)
    if state.is_main_process:
        total = disk_estimate(lengths, text_config.hidden_size, len(layers), dtype)
        print(f"hidden states: {len(all_ids)} samples, {sum(lengths)} tokens x {len(layers)} layers {layers} x "
              f"{text_config.hidden_size} x {DTYPE_NAMES[dtype]} = {total} bytes ({human_bytes(total)}; "
              f"{human_bytes(remaining)} still to write)")
    check_free_disk(output_dir, remaining)
    check_run_identity(output_dir, identity, write=state.is_main_process)
    state.wait_for_everyone()
    index_path = output_dir / INDEX
    if index_path.is_file():
        print(f"{output_dir}: already complete ({INDEX} present); nothing to do")
        return json.loads(index_path.read_text())

    mine = todo[state.process_index::state.num_processes]  # the shards still to do, dealt out evenly
    progress = tqdm(total=sum(min(config.shard_size, len(all_ids) - s * config.shard_size) for s in mine),
                    unit="sample", desc=f"hidden_states[{state.process_index}]",
                    disable=not state.is_local_main_process, file=sys.stderr)
    for shard in mine:
        samples = all_ids[shard * config.shard_size:(shard + 1) * config.shard_size]
        tensors = forward_features(model, samples, layers, dtype, config.batch_size)
        write_feature_shard(shard_file(output_dir, shard), tensors, {"first_sample": str(shard * config.shard_size)})
        progress.update(len(samples))
    progress.close()
    state.wait_for_everyone()
    if not state.is_main_process:
        return {}
    missing = [s for s in range(num_shards) if not shard_file(output_dir, s).is_file()]
    if missing:
        raise ValueError(f"--output_dir {output_dir}: shards {missing} are missing; run again to resume")
    samples_index = sample_index([lengths[s * config.shard_size:(s + 1) * config.shard_size]
                                  for s in range(num_shards)])
    index = {**identity, "hidden_size": text_config.hidden_size, "num_tokens": sum(lengths),
             "shards": [shard_file(output_dir, s).name for s in range(num_shards)], "samples": samples_index,
             "config": asdict(config)}
    atomic_write_json(index_path, index)
    print(f"{output_dir}: {len(all_ids)} samples, {num_shards} shards, layers {layers}")
    return index


def sample_index(shard_lengths: list[list[int]]) -> list[list[int]]:
    """index.json's `samples`: [shard, token offset, length] of every sample, shard by shard, from the feature
    positions of each shard's samples in order."""
    samples = []
    for shard, lengths in enumerate(shard_lengths):
        offset = 0
        for length in lengths:
            samples.append([shard, offset, length])
            offset += length
    return samples


def check_captured_dir(features_dir: Path, dataset_dir: Path) -> None:
    """data.distill --features_dir must be new, empty, or the features of the same --output_dir (a rerun replaces
    them): never another directory's files."""
    if not features_dir.exists() or not any(features_dir.iterdir()):
        return
    index_path = features_dir / INDEX
    recorded = json.loads(index_path.read_text()).get("dataset") if index_path.is_file() else None
    if recorded is None or Path(recorded).resolve() != dataset_dir.resolve():
        raise ValueError(f"--features_dir {features_dir}: holds other files (not the features of --output_dir "
                         f"{dataset_dir}); give a new or empty directory")


def write_captured(features_dir: Path, shard_files: list[Path], shard_lengths: list[list[int]], dataset: Any,
                   identity: dict[str, Any], hidden_size: int) -> dict[str, Any]:
    """Put the hidden states data.distill captured per shard (`shard_files`, the merged dataset's shards in order,
    `shard_lengths` their samples' feature positions) into `features_dir` as data.hidden_states writes them:
    shard-NNNNN.safetensors + index.json, in a temporary directory renamed into place. The shard files are linked
    (copied across filesystems), not moved, so a merge that dies here leaves every shard whole for the rerun.
    Returns the index."""
    tmp = temporary_dir(features_dir)
    try:
        for shard, path in enumerate(shard_files):
            try:
                os.link(path, shard_file(tmp, shard))
            except OSError:
                shutil.copyfile(path, shard_file(tmp, shard))
        lengths = [n for shard in shard_lengths for n in shard]
        index = {"format_version": FORMAT_VERSION, **identity, "dataset_fingerprint": dataset_fingerprint(dataset),
                 "num_samples": len(lengths), "hidden_size": hidden_size, "num_tokens": sum(lengths),
                 "shards": [shard_file(tmp, s).name for s in range(len(shard_files))],
                 "samples": sample_index(shard_lengths)}
        atomic_write_json(tmp / INDEX, index)
        replace_dir(tmp, features_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return index


class HiddenStateShards:
    """Random access to `data.hidden_states` output, for offline training.

        features = HiddenStateShards("outputs/features/smollm2")
        features.layers          # [2, 15, 27] (HF hidden_states indices, non-negative)
        features[i]              # {2: Tensor[T_i, H], 15: ..., 27: ...} for row i of the distilled dataset
        len(features)            # number of samples

    Tensors come back in the stored dtype (`features.dtype`); only the rows of sample i are read (memory-
    mapped safetensors slices). Picklable (file handles are reopened in each DataLoader worker).
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        index_path = self.directory / INDEX
        if not index_path.is_file():
            raise FileNotFoundError(f"{self.directory}: no {INDEX}; not a finished data.hidden_states output")
        self.index = json.loads(index_path.read_text())
        self.layers: list[int] = self.index["layers"]
        self.dtype: torch.dtype = parse_dtype(self.index["dtype"])
        self.hidden_size: int = self.index["hidden_size"]
        self._handles: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self.index["samples"])

    def length(self, i: int) -> int:
        """Number of tokens of sample i."""
        return self.index["samples"][i][2]

    def _handle(self, shard: int):
        if shard not in self._handles:
            self._handles[shard] = safe_open(str(self.directory / self.index["shards"][shard]), framework="pt")
        return self._handles[shard]

    def __getitem__(self, i: int) -> dict[int, torch.Tensor]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples in {self.directory}")
        shard, offset, length = self.index["samples"][i]
        handle = self._handle(shard)
        return {layer: handle.get_slice(feature_name(layer))[offset:offset + length] for layer in self.layers}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_handles": {}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    config = parse_config(HiddenStatesConfig, argv)
    torch.set_num_threads(config.num_threads)
    return run(config)


if __name__ == "__main__":
    run_cli(main)
