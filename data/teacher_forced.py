"""Teacher-forced data: existing conversations, as they are, in the schema of a distilled dataset.

    python -m data.distill --mode teacher_forced --model ../shared/models/smollm2-135m-instruct \\
        --sources sharegpt=../shared/data/sharegpt_sample.jsonl gsm8k=../shared/data/gsm8k_train.jsonl:2000 \\
        --eval_fraction 0.02 --max_length 2048 --output_dir outputs/data/smollm2-tf

No model is loaded (only its tokenizer, chat template and end-of-turn ids): every assistant turn of every
conversation is a training target, tokenised with loss masks exactly as self-distilled answers are
(`data.chat_format.tokenize_conversation`). What it does, in order:

1. read every source (`--sources NAME=PATH[:CAP] ...`, or `--prompts` with `--max_prompts` as the one
   source): a prompt file or dataset in any format `data.prompts` reads (ShareGPT keeps its gpt answers,
   GSM8K question -> answer, HumanEval prompt -> canonical_solution), or a dataset directory written by
   `python -m data.distill` in either mode, whose conversations (with their cut answers) are taken as they are;
2. check roles: optional system messages first, then user / assistant alternating from a user turn; trailing
   user turns (no answer) are dropped; a conversation with no assistant turn, roles out of order or an empty
   message is skipped and reported with its source and row;
3. deduplicate across all sources by the hash of the normalised conversation (roles + contents, whitespace
   collapsed, lower case); the first occurrence is kept; then take at most CAP conversations of each source;
4. split: a conversation goes to the held-out split when the hash of its normalised FIRST USER MESSAGE falls
   below `--eval_fraction`, so conversations that share a prompt are never on both sides;
5. per shard of `--shard_size` conversations: tokenise; a conversation over `--max_length` tokens is cut after
   the last assistant turn that fits (skipped when none does); write the shard atomically; shards already on
   disk are skipped (resume);
6. merge: held-out rows into OUT/eval (a finished dataset with its own manifest.json), training rows into OUT,
   OUT/manifest.json last. `--dataset OUT` trains on the training rows only.

Columns are those of `data.distill` (`index` = position in the deduplicated, capped order of all sources:
source k holds the `index_range` its manifest entry names; generated_tokens = 0 except for rows taken from a
self-distilled dataset).
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import AutoConfig, GenerationConfig, PreTrainedTokenizerBase

from data.chat_format import ChatFormat, TokenizedConversation, chat_format, highlight, tokenize_conversation
from data.prompts import Conversation, read_numbered_conversations
from data.runfiles import check_run_identity
from data.shards import MANIFEST, merge_shards, shard_path, tokenizer_hash, write_shard
from heads.loading import load_tokenizer, model_path

if TYPE_CHECKING:  # annotations only: data.distill runs this module for --mode teacher_forced
    from data.distill import DistillConfig

FORMAT_VERSION = 1
EVAL_DIR = "eval"
SHOWN_SKIPS = 5  # skipped rows printed per reason (all are in the manifest, up to MAX_DETAILS)
MAX_DETAILS = 1000


@dataclass(frozen=True)
class Source:
    """One `--sources` entry: NAME=PATH[:CAP] (NAME defaults to the file stem, CAP to no limit)."""

    name: str
    path: str
    cap: int | None = None
    from_flag: bool = True  # given as a --sources entry (False: the plain --prompts of a run without --sources)

    @property
    def label(self) -> str:
        """How errors name this source: the flag and value the user wrote."""
        return f"--sources {self.name}={self.path}" if self.from_flag else f"--prompts {self.path}"


@dataclass
class Example:
    """A conversation ready to tokenise, with where it came from."""

    source: str
    row: int  # line (JSONL) or row index (JSON list, datasets), as data.prompts counts them
    messages: Conversation
    truncated_turns: list[int] = field(default_factory=list)  # answers cut by generation (distilled sources)
    generated_tokens: int = 0


class BadConversation(ValueError):
    """A conversation that cannot be a training example; `reason` is the manifest's counter key."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def parse_sources(values: list[str]) -> list[Source]:
    """`["sharegpt=data/s.jsonl:500", "data/gsm8k.jsonl"]` -> Sources; names must be unique."""
    sources = []
    for value in values:
        name, separator, rest = value.partition("=")
        if not separator or not re.fullmatch(r"[\w.-]+", name):
            name, rest = "", value
        match = re.fullmatch(r"(.+):(\d+)", rest)
        path, cap = (match.group(1), int(match.group(2))) if match else (rest, None)
        if not path:
            raise ValueError(f"--sources {value!r}: expected NAME=PATH[:CAP]")
        if cap is not None and cap < 1:
            raise ValueError(f"--sources {value!r}: CAP must be >= 1")
        sources.append(Source(name or Path(path.rstrip("/")).stem, path, cap))
    names = [source.name for source in sources]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"--sources: name(s) {repeated} used twice; write NAME=PATH to tell them apart")
    return sources


def check_roles(messages: Conversation) -> Conversation:
    """The conversation without trailing unanswered user turns; BadConversation when it cannot be trained on.

    Valid: system messages only at the start, then user and assistant alternating, starting with user.
    """
    roles = [message["role"] for message in messages]
    first = next((i for i, role in enumerate(roles) if role != "system"), len(roles))
    for position, role in enumerate(roles[first:], start=first):
        expected = "user" if (position - first) % 2 == 0 else "assistant"
        if role != expected:
            raise BadConversation("roles_out_of_order", f"message {position} is {role!r}, expected {expected!r} "
                                                        f"(roles {roles})")
    empty = [i for i, message in enumerate(messages) if not message["content"].strip()]
    if empty:
        raise BadConversation("empty_message", f"message {empty[0]} ({roles[empty[0]]}) is empty")
    last = max((i for i, role in enumerate(roles) if role == "assistant"), default=None)
    if last is None:
        raise BadConversation("no_assistant_turn", f"no assistant turn (roles {roles})")
    return messages[:last + 1]


def normalised(text: str) -> str:
    return " ".join(text.split()).lower()


def conversation_hash(messages: Conversation) -> str:
    """sha256 of the normalised conversation: the deduplication key."""
    key = json.dumps([[m["role"], normalised(m["content"])] for m in messages], ensure_ascii=False)
    return hashlib.sha256(key.encode()).hexdigest()


def is_held_out(messages: Conversation, eval_fraction: float) -> bool:
    """Whether the conversation belongs to the held-out split: by the hash of its normalised first user message."""
    prompt = next(m["content"] for m in messages if m["role"] == "user")
    digest = hashlib.sha256(normalised(prompt).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2 ** 64 < eval_fraction


def is_distilled_dataset(path: str) -> bool:
    directory = Path(path)
    return directory.is_dir() and (directory / MANIFEST).is_file() and (directory / "state.json").is_file()


def read_source(source: Source, split: str) -> tuple[list[Example], list[dict[str, Any]]]:
    """All conversations of a source (no cap yet) and its unreadable rows as {source, row, reason, detail}."""
    if is_distilled_dataset(source.path):
        import datasets

        rows = datasets.load_from_disk(source.path)
        examples = [Example(source.name, row, json.loads(conversation), list(truncated), int(generated))
                    for row, (conversation, truncated, generated) in enumerate(zip(
                        rows["conversation"], rows["truncated_turns"], rows["generated_tokens"], strict=True))]
        return examples, []
    numbered, skipped = read_numbered_conversations(source.path, None, split, label=source.label)
    examples = [Example(source.name, row, messages) for row, messages in numbered]
    return examples, [{"source": source.name, "row": row.line, "reason": "unreadable", "detail": row.reason}
                      for row in skipped]


def turn_ends(loss_mask: list[int]) -> list[int]:
    """Token positions just after each run of 1s in the loss mask (the end of each assistant turn)."""
    return [i + 1 for i, value in enumerate(loss_mask) if value and (i + 1 == len(loss_mask) or not loss_mask[i + 1])]


def fit_length(tokenizer: PreTrainedTokenizerBase, fmt: ChatFormat, example: Example, max_length: int
               ) -> tuple[TokenizedConversation, Conversation, list[int]]:
    """Tokenise; over `max_length` tokens, cut after the last assistant turn that fits (BadConversation if none).

    Returns (tokenized, messages kept, truncated_turns kept).
    """
    messages, truncated = example.messages, example.truncated_turns
    tokenized = tokenize_conversation(tokenizer, fmt, messages, truncated)
    answers = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    keep = len(answers)
    while len(tokenized.input_ids) > max_length:
        keep = min(keep - 1, sum(end <= max_length for end in turn_ends(tokenized.loss_mask)))
        if keep < 1:
            raise BadConversation("over_max_length", f"{len(tokenized.input_ids)} tokens with its first answer "
                                                     f"> --max_length {max_length}")
        messages = messages[:answers[keep - 1] + 1]
        truncated = [turn for turn in truncated if turn < keep]
        tokenized = tokenize_conversation(tokenizer, fmt, messages, truncated)
    return tokenized, messages, truncated


def shard_rows(tokenizer: PreTrainedTokenizerBase, fmt: ChatFormat, examples: list[tuple[int, Example]],
               max_length: int) -> tuple[dict[str, list], dict[str, Any]]:
    """Columns of one shard ((index, example) pairs) and its meta: skipped rows and per-source counts."""
    columns: dict[str, list] = {name: [] for name in ("input_ids", "loss_mask", "text", "conversation", "index",
                                                      "truncated_turns", "generated_tokens")}
    skipped, per_source = [], {}
    for index, example in examples:
        counts = per_source.setdefault(example.source, Counter())
        try:
            tokenized, messages, truncated = fit_length(tokenizer, fmt, example, max_length)
        except BadConversation as err:
            skipped.append({"index": index, "source": example.source, "row": example.row, "reason": err.reason,
                            "detail": str(err)})
            continue
        dropped = sum(m["role"] == "assistant" for m in example.messages) - sum(m["role"] == "assistant"
                                                                                for m in messages)
        counts.update(conversations=1, tokens=len(tokenized.input_ids), assistant_tokens=sum(tokenized.loss_mask),
                      cut_conversations=int(dropped > 0), dropped_turns=dropped)
        columns["input_ids"].append(tokenized.input_ids)
        columns["loss_mask"].append(tokenized.loss_mask)
        columns["text"].append(tokenized.text)
        columns["conversation"].append(json.dumps(messages, ensure_ascii=False))
        columns["index"].append(index)
        columns["truncated_turns"].append(truncated)
        columns["generated_tokens"].append(example.generated_tokens)
    meta = {"skipped_conversations": skipped, "unanswered_turns": 0,
            "per_source": {name: dict(counts) for name, counts in per_source.items()}}
    return columns, meta


@dataclass
class Selection:
    """The conversations to tokenise, in order, after checks, deduplication and caps."""

    examples: list[Example]
    held_out: list[bool]
    skipped: list[dict[str, Any]]  # bad rows {source, row, reason, detail}
    duplicates: Counter
    read: Counter  # rows read per source (incl. bad ones)
    index_ranges: dict[str, tuple[int, int]]


def select(sources: list[Source], split: str, eval_fraction: float) -> Selection:
    """Read, check, deduplicate and cap every source (steps 1-4 of the module docstring)."""
    examples, held_out, skipped, seen = [], [], [], set()
    duplicates, read, ranges = Counter(), Counter(), {}
    for source in sources:
        rows, bad = read_source(source, split)
        skipped += bad
        read[source.name] = len(rows) + len(bad)
        start, valid = len(examples), 0
        for example in rows:
            try:
                example.messages = check_roles(example.messages)
            except BadConversation as err:
                skipped.append({"source": source.name, "row": example.row, "reason": err.reason, "detail": str(err)})
                continue
            valid += 1
            key = conversation_hash(example.messages)
            if key in seen:
                duplicates[source.name] += 1
                continue
            seen.add(key)
            if source.cap is not None and len(examples) - start >= source.cap:
                break
            examples.append(example)
            held_out.append(is_held_out(example.messages, eval_fraction))
        if valid == 0:
            reasons = Counter(row["reason"] for row in skipped if row["source"] == source.name)
            raise ValueError(f"{source.label}: no usable conversation ({read[source.name]} "
                             f"rows read; skipped: {dict(reasons) or 'none'}); teacher forcing needs assistant turns")
        ranges[source.name] = (start, len(examples))
    return Selection(examples, held_out, skipped, duplicates, read, ranges)


def report_skipped(skipped: list[dict[str, Any]]) -> None:
    """Print the first SHOWN_SKIPS skipped rows of each reason with their source and row."""
    shown = Counter()
    for row in skipped:
        shown[row["reason"]] += 1
        if shown[row["reason"]] <= SHOWN_SKIPS:
            print(f"skipped {row['source']} row {row['row']}: {row['reason']}: {row['detail']}", file=sys.stderr)
    for reason, count in shown.items():
        if count > SHOWN_SKIPS:
            print(f"skipped {count - SHOWN_SKIPS} more rows for {reason} (all in {MANIFEST})", file=sys.stderr)


def target_format(config: DistillConfig, tokenizer: PreTrainedTokenizerBase) -> ChatFormat:
    """The chat format with the end-of-turn ids generation would stop on (tokenizer EOS + generation config)."""
    path = model_path(config.model)
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:  # no generation_config.json: the tokenizer's EOS is the only stop token
        eos = None
    stop = eos if isinstance(eos, list) else [eos] if eos is not None else []
    return chat_format(tokenizer, config.plain_format, stop_token_ids=stop, model_name=config.model)


def run_identity(config: DistillConfig, sources: list[Source], tokenizer, fmt: ChatFormat, max_length: int
                 ) -> dict[str, Any]:
    """What makes two teacher-forced runs' data the same (checked on resume)."""
    return {
        "format_version": FORMAT_VERSION, "mode": "teacher_forced", "model": config.model,
        "chat_template_sha256": fmt.template_hash, "plain_format": fmt.plain,
        "tokenizer_sha256": tokenizer_hash(tokenizer), "stop_token_ids": list(fmt.stop_token_ids),
        "sources": [{"name": s.name, "path": s.path, "cap": s.cap} for s in sources], "split": config.split,
        "max_length": max_length, "eval_fraction": config.eval_fraction, "shard_size": config.shard_size,
    }


def write_split(output_dir: Path, examples: list[tuple[int, Example]], tokenizer, fmt: ChatFormat,
                config: DistillConfig, max_length: int, progress) -> int:
    """Tokenise and write the missing shards of one split under output_dir/shards; returns the shard count."""
    size = config.shard_size
    num_shards = -(-len(examples) // size)
    for shard in range(num_shards):
        chunk = examples[shard * size:(shard + 1) * size]
        if not (shard_path(output_dir, shard) / "meta.json").is_file():
            started = time.perf_counter()
            columns, meta = shard_rows(tokenizer, fmt, chunk, max_length)
            meta.update(shard=shard, seconds=time.perf_counter() - started)
            write_shard(shard_path(output_dir, shard), columns, meta)
        progress.update(len(chunk))
    return num_shards


def shard_metas(output_dir: Path, num_shards: int) -> list[dict[str, Any]]:
    return [json.loads((shard_path(output_dir, s) / "meta.json").read_text()) for s in range(num_shards)]


def source_summary(sources: list[Source], selection: Selection, metas: list[dict[str, Any]],
                   eval_metas: list[dict[str, Any]]) -> list[dict]:
    """Per source: rows read, bad rows by reason, duplicates, conversations / tokens / assistant tokens written
    (both splits; `held_out_conversations` of them in OUT/eval)."""
    summary = []
    metas = metas + eval_metas
    for source in sources:
        written = Counter()
        for meta in metas:
            written.update(meta["per_source"].get(source.name, {}))
        held_out = sum(meta["per_source"].get(source.name, {}).get("conversations", 0) for meta in eval_metas)
        reasons = Counter(row["reason"] for row in selection.skipped if row["source"] == source.name)
        reasons.update(row["reason"] for meta in metas for row in meta["skipped_conversations"]
                       if row["source"] == source.name)
        summary.append({"name": source.name, "path": source.path, "cap": source.cap,
                        "rows_read": selection.read[source.name], "duplicates_removed": selection.duplicates[source.name],
                        "skipped_by_reason": dict(reasons), "index_range": list(selection.index_ranges[source.name]),
                        "conversations": written["conversations"], "held_out_conversations": held_out,
                        "tokens": written["tokens"],
                        "assistant_tokens": written["assistant_tokens"],
                        "cut_conversations": written["cut_conversations"], "dropped_turns": written["dropped_turns"]})
    return summary


def run(config: DistillConfig) -> dict[str, Any]:
    """Build (or resume building) the teacher-forced dataset in config.output_dir; returns the manifest."""
    from tqdm.auto import tqdm

    started = time.perf_counter()
    sources = parse_sources(config.sources) if config.sources else [Source(Path(config.prompts).stem, config.prompts,
                                                                           config.max_prompts, from_flag=False)]
    tokenizer = load_tokenizer(config.model)
    fmt = target_format(config, tokenizer)
    max_length = config.max_length or AutoConfig.from_pretrained(
        model_path(config.model)).get_text_config().max_position_embeddings
    if config.dry_run:
        return dry_run(tokenizer, fmt, sources, config, max_length)
    output_dir = Path(config.output_dir)
    identity = run_identity(config, sources, tokenizer, fmt, max_length)
    check_run_identity(output_dir, identity)
    if (output_dir / MANIFEST).is_file():
        print(f"{output_dir}: already complete ({MANIFEST} present); nothing to do")
        return json.loads((output_dir / MANIFEST).read_text())

    selection = select(sources, config.split, config.eval_fraction)
    indexed = list(enumerate(selection.examples))
    train = [item for item, held in zip(indexed, selection.held_out, strict=True) if not held]
    held_out = [item for item, held in zip(indexed, selection.held_out, strict=True) if held]
    eval_dir = output_dir / EVAL_DIR
    held = json.loads((eval_dir / MANIFEST).read_text()) if (eval_dir / MANIFEST).is_file() else None
    progress = tqdm(total=len(indexed), unit="conv", desc="teacher_forced", file=sys.stderr)
    train_shards = write_split(output_dir, train, tokenizer, fmt, config, max_length, progress)
    eval_shards = write_split(eval_dir, held_out, tokenizer, fmt, config, max_length, progress) if held is None else 0
    progress.close()
    train_metas = shard_metas(output_dir, train_shards)
    eval_metas = held["shard_metas"] if held else shard_metas(eval_dir, eval_shards)  # merged shards are gone
    summary = source_summary(sources, selection, train_metas, eval_metas)
    empty = {s["name"]: s["skipped_by_reason"] for s in summary if s["conversations"] == 0}
    if empty:
        raise ValueError(f"--sources {sorted(empty)}: every conversation was skipped ({empty}); raise --max_length "
                         f"({max_length}) or drop the source")
    late_skips = [row for meta in train_metas + eval_metas for row in meta["skipped_conversations"]]
    report_skipped(selection.skipped + late_skips)

    base = {**identity, "model_path": model_path(config.model), "config": asdict(config)}
    if held_out and held is None:
        held = merge_shards(eval_dir, eval_shards, {**base, "split_role": "eval", "shard_metas": eval_metas})
    skipped = selection.skipped + late_skips
    manifest = merge_shards(output_dir, train_shards, {  # writes OUT/manifest.json last
        **base, "split_role": "train",
        "rows_read": sum(selection.read.values()),
        "conversations_selected": len(selection.examples),  # after bad rows, duplicates and caps
        "skipped_rows": len(skipped),
        "skipped_by_reason": dict(Counter(row["reason"] for row in skipped)),
        "skipped_row_details": skipped[:MAX_DETAILS],
        "duplicates_removed": sum(selection.duplicates.values()),
        "sources": summary,
        "eval": {"path": str(eval_dir) if held else None, "conversations": held["conversations_written"] if held else 0,
                 "tokens": held["tokens"] if held else None},
        "wall_seconds": round(time.perf_counter() - started, 2),  # up to the final merge
    })
    print_summary(output_dir, manifest)
    return manifest


def dry_run(tokenizer: PreTrainedTokenizerBase, fmt: ChatFormat, sources: list[Source], config: DistillConfig,
            max_length: int) -> dict[str, Any]:
    """Print the first usable conversation of each source tokenised, the learned tokens between ⟦ ⟧; write nothing."""
    for source in sources:
        selection = select([source], config.split, config.eval_fraction)
        for example in selection.examples:
            try:
                tokenized, _, _ = fit_length(tokenizer, fmt, example, max_length)
            except BadConversation as err:
                print(f"{source.name} row {example.row} skipped: {err.reason}: {err}")
                continue
            print(f"--- {source.name} row {example.row}: {len(tokenized.input_ids)} tokens, "
                  f"{sum(tokenized.loss_mask)} learned (between \u27e6 \u27e7) ---")
            print(highlight(tokenizer, tokenized.input_ids, tokenized.loss_mask))
            break
    return {"dry_run": True}


def print_summary(output_dir: Path, manifest: dict[str, Any]) -> None:
    """One line per source and the totals."""
    for source in manifest["sources"]:
        print(f"{source['name']:>12}: {source['conversations']} conversations ({source['held_out_conversations']} "
              f"held out), {source['tokens']} tokens, "
              f"{source['assistant_tokens']} assistant tokens; {source['duplicates_removed']} duplicates, "
              f"skipped {source['skipped_by_reason'] or 0}, {source['cut_conversations']} cut at --max_length")
    tokens = manifest["tokens"]
    held = manifest["eval"]
    print(f"{output_dir}: train {manifest['conversations_written']} conversations, {tokens['total']} tokens "
          f"({tokens['loss']} assistant); held-out {held['conversations']} conversations in {held['path']}; "
          f"{manifest['duplicates_removed']} duplicates removed; skipped {manifest['skipped_by_reason'] or 0}; "
          f"{manifest['wall_seconds']} s")
