"""Training configuration: one flat dataclass, parsed with `transformers.HfArgumentParser`.

`--config recipe.yaml` gives defaults (flat keys equal to the field names; an unknown key is an error that
names it), command-line flags override them, and the resolved configuration is written next to the outputs
(`<output_dir>/train_config.yaml`). A resumed run must have the same *fingerprint*: every field except the
ones in `RESUMABLE_FIELDS` (how long to train, how often to log/save, where to report).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from heads.cli import parse_flags, read_recipe
from heads.config import MAX_BLOCK_SIZE
from heads.files import atomic_write_text

METHODS = ("medusa", "medusa2", "eagle", "eagle3", "mtp", "dflash", "peagle")
PARALLEL_METHODS = ("dflash", "peagle")
REPORT_TO = ("none", "wandb", "tensorboard")
TARGET_DTYPES = ("float32", "bfloat16", "float16", "fp32", "bf16", "fp16")
CONFIG_FILE = "train_config.yaml"

# Fields that may change between a checkpoint and its resumption without changing what is trained.
RESUMABLE_FIELDS = frozenset({
    "max_steps", "num_epochs", "save_steps", "save_total_limit", "eval_steps", "logging_steps", "report_to",
    "project_name", "run_name", "resume_from", "push_to_hub", "hub_private", "num_threads", "progress_bar",
    "save_merged", "dataloader_num_workers", "heads_dir", "max_train_minutes", "fit_train_minutes",
    "eval_only",
})


def _help(text: str, **kwargs) -> Any:
    return field(metadata={"help": text}, **kwargs)


@dataclass
class TrainConfig:
    """Everything `training/train_heads.py` reads. Flat on purpose: YAML keys and CLI flags are these names."""

    # --- what to train
    method: str = _help(f"One of {METHODS}.", default="medusa")
    model: str = _help("Target model: Hub id, local directory or GGUF file.",
                       default="../shared/models/smollm2-135m-instruct")
    model_revision: str | None = _help("Hub revision of --model.", default=None)
    target_dtype: str = _help("dtype the frozen target runs in: auto (bfloat16 on CUDA and on CPUs with "
                              "AVX512-BF16 or AMX when --mixed_precision is bf16/fp16, else float32), float32, "
                              "bfloat16 or float16.", default="auto")
    attn_implementation: str = _help("Attention backend of the target (sdpa, eager).", default="sdpa")
    dataset: str = _help("Distilled dataset directory (datasets.save_to_disk + manifest.json); several, separated by "
                         "commas, train together (their rows concatenated in the order given).", default="")
    features: str | None = _help("Hidden-state shards directory (data.hidden_states) for offline training, one per "
                                 "--dataset directory (comma-separated, same order); unset = online (target "
                                 "forward inside the step).", default=None)
    allow_other_model: bool = _help("Accept a dataset whose manifest names another model.", default=False)
    max_length: int = _help("Truncate sequences to this many tokens.", default=2048)

    # --- heads (passed to heads.HeadsConfig)
    num_heads: int = _help("Medusa heads / MTP depths.", default=4)
    num_layers: int = _help("Medusa: ResBlocks per head. EAGLE/EAGLE-3/MTP: decoder layers per module.",
                            default=1)
    medusa_shared_lm_head: bool = _help("Medusa-1/2: every head projects through the target's frozen LM head, so "
                                        "only the ResBlocks train (H^2+H parameters per block; 0.33M per head on "
                                        "SmolLM2 instead of 28.6M); false = each head owns a Linear(H, V) "
                                        "initialised from the LM head.", default=False)
    eagle3_layers: str = _help("EAGLE-3 target layers as HF hidden_states indices 'low,mid,high'; "
                               "empty = (2, L//2, L-3).", default="")
    draft_vocab_size: int = _help("Draft vocabulary size, the most frequent assistant tokens of the training data: "
                                  "EAGLE-3's lm_head rows; Medusa/EAGLE-1/2/MTP draft over these rows of their "
                                  "projections (>= the vocabulary: all rows). See README 'Draft cost'.",
                                  default=32000)
    eagle_fc_bias: bool = _help("EAGLE-1/2: give fc a bias. Off by default so the head exports to vLLM (fc without "
                                "a bias) and SGLang (an explicit zero bias is written) alike.", default=False)

    block_size: int = _help("DFlash: slots per block, [last token, mask x (B-1)], drafting B-1 tokens (default 8). "
                            f"P-EAGLE: depths drafted in one forward (default 4). 0 = default; 2..{MAX_BLOCK_SIZE}.",
                            default=0)
    mask_token_id: int = _help("DFlash / P-EAGLE: the token id filling masked slots (its target embedding is the "
                               "input); -1 = the last vocabulary id.", default=-1)
    target_layer_ids: str = _help("DFlash / P-EAGLE: target layers as HF hidden_states indices 'a,b,c,...' in "
                                  "[1, L-1]; empty = (2, L//2, L-3) as EAGLE-3.", default="")
    num_anchors: int = _help("DFlash: blocks (random anchors) per training sequence, all in one forward under one "
                             "mask.", default=16)
    position_gamma: float = _help("DFlash: weight of block slot k (1-based) is exp(-(k-1)/gamma).", default=7.0)
    peagle_keep_ratio: float = _help("P-EAGLE: depth d trains on n * max(r^d, r_min) of the n positions; this is r.",
                                     default=0.75)
    peagle_min_keep: float = _help("P-EAGLE: r_min of --peagle_keep_ratio.", default=0.2)

    label_source: str = _help("Labels of Medusa-1, EAGLE and EAGLE-3 (training and held-out accuracy): 'target' = the "
                              "target's own greedy next token after the dataset prefix (what greedy verification "
                              "accepts; equal to the dataset token on greedy self-distilled answers, and what makes "
                              "teacher-forced text teach the target's behaviour), 'data' = the dataset tokens. "
                              "Medusa-2 and MTP always use the dataset tokens.", default="target")
    loss_tokens: str = _help("Which training tokens are labels: 'assistant' = the rows' loss mask (the answers), "
                             "'all' = every token, the prompts' too (the heads learn the target's hidden states and "
                             "distribution on the user's text as well: with offline features they are already "
                             "stored, so the data gives ~1.6x the positions; EAGLE's soft targets are the target's "
                             "own distribution there). Held-out accuracy always reads the loss mask.",
                             default="assistant")
    init_heads: str | None = _help("Start from this saved heads directory (checked against the target) "
                                   "instead of fresh heads.", default=None)
    eval_only: bool = _help("Evaluate the --init_heads heads on the held-out split (--eval_dataset / --eval_features, "
                            "else --eval_samples rows of --dataset) and stop: per-depth top-1 / top-k and expected "
                            "tau printed and written to <output_dir>/eval_metrics.json; nothing is trained or "
                            "saved.", default=False)

    # --- losses
    head_decay: float = _help("Weight of depth k (0-based) is head_decay**k (Medusa, EAGLE-3, MTP).",
                              default=0.8)
    ttt_steps: int = _help("EAGLE-3 training-time test: steps the draft is unrolled on its own outputs.",
                           default=7)
    feature_loss_weight: float = _help("EAGLE: weight of the smooth-L1 feature regression.", default=1.0)
    token_loss_weight: float = _help("EAGLE: weight of the CE through the frozen LM head.", default=0.1)
    feature_noise: float = _help("EAGLE: width of the uniform noise added to input features "
                                 "(U(-w/2, w/2)); 0 = off.", default=0.2)
    lm_loss_weight: float = _help("Medusa-2: weight of the target's own LM loss.", default=1.0)
    heads_loss_weight: float = _help("Medusa-2: weight of the (decayed) head losses.", default=0.2)
    distill_weight: float = _help("Medusa-2: weight of KL(frozen target || LoRA target); 0 = off.",
                                  default=0.0)
    lora_r: int = _help("Medusa-2: LoRA rank.", default=8)
    lora_alpha: int = _help("Medusa-2: LoRA alpha.", default=16)
    lora_dropout: float = _help("Medusa-2: LoRA dropout.", default=0.0)
    lora_target_modules: str = _help("Medusa-2: comma-separated module names, or 'all-linear'.",
                                     default="q_proj,k_proj,v_proj,o_proj")
    save_merged: bool = _help("Medusa-2: also save the target with the LoRA merged in.", default=False)

    # --- optimisation
    per_device_batch_size: int = _help("Sequences per process per micro-batch.", default=4)
    gradient_accumulation_steps: int = _help("Micro-batches per optimizer step.", default=1)
    learning_rate: float = _help("Peak AdamW learning rate.", default=1e-3)
    weight_decay: float = _help("AdamW weight decay.", default=0.0)
    adam_beta1: float = _help("AdamW beta1.", default=0.9)
    adam_beta2: float = _help("AdamW beta2.", default=0.95)
    max_grad_norm: float = _help("Clip the global gradient norm to this; 0 = off.", default=0.5)
    warmup_steps: int = _help("Linear warmup steps before the cosine decay.", default=0)
    min_lr_ratio: float = _help("Cosine decays to learning_rate * min_lr_ratio.", default=0.0)
    max_steps: int = _help("Optimizer steps; -1 = num_epochs over the training split.", default=-1)
    num_epochs: float = _help("Epochs when max_steps is -1.", default=1.0)
    max_train_minutes: float = _help("Stop training after this many wall-clock minutes of the loop, summed over resumed "
                                     "runs (the learning-rate "
                                     "schedule still spans max_steps / num_epochs); 0 = no limit. For comparisons "
                                     "at equal training time.", default=0.0)
    fit_train_minutes: float = _help("Fit training into this many wall-clock minutes of the loop: after 10 steps, "
                                     "and again every eighth of the horizon until three quarters of it, the measured "
                                     "seconds per step set the steps to what fits, at most the planned ones, so the "
                                     "learning-rate schedule (its warmup a share of the fitted horizon) decays to its "
                                     "end within 95%% of the budget, and the loop stops at the budget; the fitted "
                                     "schedule and the loop's minutes are kept in checkpoints, so a resumed run goes "
                                     "on with both. 0 = off. Keeps a recipe's time on a slower CPU.",
                                     default=0.0)
    mixed_precision: str | None = _help("no, fp16, bf16 or auto (bf16 autocast where bf16 is fast: CUDA with bf16, a "
                                        "CPU with AVX512-BF16 or AMX; no elsewhere, where torch emulates bf16); unset "
                                        "= whatever `accelerate launch` says.", default=None)
    seed: int = _help("Seed for head initialisation, data order and noise.", default=0)

    # --- evaluation, checkpoints, logging
    eval_samples: int = _help("Held-out sequences (taken from the dataset, never trained on; with --eval_dataset "
                              "the first N rows of that dataset).", default=32)
    eval_dataset: str = _help("A separate held-out dataset (e.g. the target's own answers to MT-Bench first turns, "
                              "python -m data.distill); then every --dataset row trains and evaluation runs the "
                              "target online on this one. Empty = hold out --eval_samples rows of --dataset.",
                              default="")
    eval_features: str | None = _help("Hidden-state shards of --eval_dataset (python -m data.hidden_states) so "
                                      "evaluation reads features instead of running the target; unset = online.",
                                      default=None)
    max_train_tokens: int = _help("Train on a seeded random subset of the training rows holding at least this many "
                                  "assistant (loss-mask) tokens; 0 = all rows. For data-scaling runs.", default=0)
    warmup_ratio: float = _help("Warmup steps as a share of all optimizer steps (the larger of this and "
                                "--warmup_steps is used).", default=0.0)
    eval_steps: int = _help("Evaluate every N optimizer steps (and at the end); 0 = only at the end.",
                            default=200)
    eval_depth: int = _help("Depths measured for EAGLE/EAGLE-3 (drafts unrolled on their own outputs).",
                            default=5)
    eval_top_k: int = _help("k of the top-k accuracy.", default=5)
    output_dir: str = _help("Run directory: checkpoints/, heads/, train_config.yaml, metrics.jsonl.",
                            default="outputs/runs/heads")
    heads_dir: str = _help("Where the final heads directory goes; empty = <output_dir>/heads.", default="")
    save_steps: int = _help("Checkpoint (accelerator.save_state) every N optimizer steps; 0 = never.",
                            default=500)
    save_total_limit: int = _help("Keep this many newest checkpoints; 0 = all.", default=2)
    resume_from: str = _help("'latest' (newest checkpoint in output_dir, if any), 'none', or a checkpoint "
                             "directory.", default="latest")
    logging_steps: int = _help("Log to trackers every N optimizer steps.", default=10)
    report_to: str = _help(f"Tracker: one of {REPORT_TO} (wandb honours WANDB_MODE=offline).",
                           default="none")
    project_name: str = _help("Tracker project name.", default="specheads")
    run_name: str | None = _help("Tracker run name (default: output_dir's name).", default=None)
    push_to_hub: str | None = _help("Push the final heads to this Hub repo id.", default=None)
    hub_private: bool = _help("Create the Hub repo private.", default=False)
    progress_bar: bool = _help("Show a tqdm progress bar on the main process.", default=True)
    num_threads: int | None = _help("torch threads per process; unset = 1 on CPU.", default=None)
    dataloader_num_workers: int = _help("DataLoader worker processes.", default=0)

    def __post_init__(self) -> None:
        _check(self.method in METHODS, "--method", f"one of {METHODS}", self.method)
        _check(self.report_to in REPORT_TO, "--report_to", f"one of {REPORT_TO}", self.report_to)
        _check(self.mixed_precision in (None, "no", "fp16", "bf16", "auto"), "--mixed_precision", "no, fp16, bf16 or auto",
               self.mixed_precision)
        _check(self.target_dtype == "auto" or self.target_dtype in TARGET_DTYPES, "--target_dtype",
               f"auto or one of {TARGET_DTYPES}", self.target_dtype)
        for name in ("per_device_batch_size", "gradient_accumulation_steps", "num_heads", "num_layers",
                     "ttt_steps", "eval_depth", "eval_top_k", "max_length", "draft_vocab_size", "lora_r",
                     "eval_samples"):
            _check(getattr(self, name) >= 1, f"--{name}", "an integer >= 1", getattr(self, name))
        for name in ("eval_steps", "save_steps", "save_total_limit", "warmup_steps",
                     "logging_steps"):
            _check(getattr(self, name) >= 0, f"--{name}", "an integer >= 0", getattr(self, name))
        _check(self.max_steps == -1 or self.max_steps >= 1, "--max_steps", "-1 or an integer >= 1", self.max_steps)
        _check(self.max_steps >= 1 or self.num_epochs > 0, "--num_epochs", "> 0 when --max_steps is -1",
               self.num_epochs)
        _check(0 < self.head_decay <= 1, "--head_decay", "a value in (0, 1]", self.head_decay)
        _check(self.learning_rate > 0, "--learning_rate", "> 0", self.learning_rate)
        _check(self.feature_noise >= 0, "--feature_noise", ">= 0", self.feature_noise)
        _check(self.label_source in ("target", "data"), "--label_source", "target or data", self.label_source)
        _check(self.loss_tokens in ("assistant", "all"), "--loss_tokens", "assistant or all", self.loss_tokens)
        _check(self.max_train_tokens >= 0, "--max_train_tokens", "an integer >= 0", self.max_train_tokens)
        _check(0 <= self.warmup_ratio < 1, "--warmup_ratio", "a value in [0, 1)", self.warmup_ratio)
        _check(0 <= self.min_lr_ratio <= 1, "--min_lr_ratio", "a value in [0, 1]", self.min_lr_ratio)
        _check(self.max_train_minutes >= 0, "--max_train_minutes", ">= 0", self.max_train_minutes)
        _check(self.fit_train_minutes >= 0, "--fit_train_minutes", ">= 0", self.fit_train_minutes)
        _check(not self.eval_only or bool(self.init_heads), "--eval_only", "--init_heads DIR (the heads to "
               "evaluate)", self.init_heads)
        if self.method == "medusa2" and self.features:
            raise ValueError("--features: medusa2 trains LoRA on the target, so it needs the online target "
                             "forward; drop --features")
        if self.eval_features and not self.eval_dataset:
            raise ValueError("--eval_features: shards of --eval_dataset; set --eval_dataset too")
        if self.eagle3_layers:
            eagle3_layers(self)  # validates the format
        _check(self.block_size == 0 or 2 <= self.block_size <= MAX_BLOCK_SIZE, "--block_size",
               f"0 (default) or 2..{MAX_BLOCK_SIZE} (a block drafts at most the verify budget of {MAX_BLOCK_SIZE} "
               "tokens)", self.block_size)
        _check(self.mask_token_id >= -1, "--mask_token_id", "-1 (the last vocabulary id) or a token id",
               self.mask_token_id)
        _check(self.num_anchors >= 1, "--num_anchors", "an integer >= 1", self.num_anchors)
        _check(self.position_gamma > 0, "--position_gamma", "> 0", self.position_gamma)
        _check(0 < self.peagle_keep_ratio <= 1, "--peagle_keep_ratio", "a value in (0, 1]", self.peagle_keep_ratio)
        _check(0 < self.peagle_min_keep <= 1, "--peagle_min_keep", "a value in (0, 1]", self.peagle_min_keep)
        if self.target_layer_ids:
            target_layer_ids(self)  # validates the format

    def fingerprint(self) -> dict[str, Any]:
        """The fields a resumed run must share with the checkpoint it resumes."""
        return {k: v for k, v in dataclasses.asdict(self).items()
                if k not in RESUMABLE_FIELDS and k != "output_dir"}


def _check(ok: bool, flag: str, expected: str, got: Any) -> None:
    if not ok:
        raise ValueError(f"{flag}: expected {expected}, got {got!r}")


def eagle3_layers(config: TrainConfig) -> tuple[int, int, int] | None:
    """`--eagle3_layers '2,15,29'` -> (2, 15, 29); empty -> None (the heads' default)."""
    if not config.eagle3_layers:
        return None
    try:
        layers = tuple(int(x) for x in config.eagle3_layers.split(","))
    except ValueError as err:
        raise ValueError(f"--eagle3_layers: expected three comma-separated integers, got "
                         f"{config.eagle3_layers!r}") from err
    if len(layers) != 3:
        raise ValueError(f"--eagle3_layers: expected three comma-separated integers, got {config.eagle3_layers!r}")
    return layers  # type: ignore[return-value]


def target_layer_ids(config: TrainConfig) -> list[int] | None:
    """`--target_layer_ids '2,8,15,22'` -> [2, 8, 15, 22]; empty -> None (the heads' default)."""
    if not config.target_layer_ids:
        return None
    try:
        layers = [int(x) for x in config.target_layer_ids.split(",")]
    except ValueError as err:
        raise ValueError(f"--target_layer_ids: expected comma-separated integers, got "
                         f"{config.target_layer_ids!r}") from err
    if len(set(layers)) != len(layers):
        raise ValueError(f"--target_layer_ids: expected distinct layers, got {config.target_layer_ids!r}")
    return layers


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Flat YAML recipe -> dict; unknown keys raise ValueError naming the key and the file."""
    return read_recipe(path, (TrainConfig,))


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """`--config file.yaml` (defaults) + flags (overrides) -> validated TrainConfig."""
    return parse_flags(TrainConfig, argv)


def to_yaml(config: TrainConfig) -> str:
    return yaml.safe_dump(dataclasses.asdict(config), sort_keys=False)


def save_config(config: TrainConfig, directory: str | Path) -> Path:
    """Write the resolved config to `<directory>/train_config.yaml` atomically."""
    return atomic_write_text(Path(directory) / CONFIG_FILE, to_yaml(config))


def load_saved_config(directory: str | Path) -> TrainConfig | None:
    """The config a previous run saved in `directory`, or None when there is none."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        return None
    values = yaml.safe_load(path.read_text()) or {}
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in values.items() if k in known})


def config_differences(saved: TrainConfig, current: TrainConfig) -> dict[str, tuple[Any, Any]]:
    """Fingerprint fields that differ: {field: (saved, current)}."""
    a, b = saved.fingerprint(), current.fingerprint()
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
