"""Prompt sets of several kinds, for measuring drafters on text unlike MT-Bench chat.

    python -m bench.prompt_kinds --output outputs/prompts/kinds.jsonl [--per_kind 4] [--seed 0] \
        [--kinds summarise,translate,qa,rag,math,code,chat]

Speculative decoders behave very differently per kind: summarising a long document and answering from retrieved
passages copy from the prompt (prompt lookup drafts well), chat and math do not. Every kind is built
deterministically from the files of `--data_dir` (default ../shared/data; licences in ../shared/PROVENANCE.md):

- summarise: a long document (600-2,000 tokens of the model's tokenizer) followed by an instruction to summarise
  it: the TinyStories sample's stories in a row (the first prompt, when they reach 600 tokens), else Tiny
  Shakespeare passages of whole speeches at seeded offsets;
- translate: two to four consecutive TinyStories sentences with "Translate into French:" (German, Spanish);
- qa: a passage (a TinyStories story, or a Tiny Shakespeare passage) and an extractive question, answered by
  quoting the sentence (the line of the same speech) that follows a quoted one;
- rag: three to five numbered "retrieved" passages (ShareGPT answers and TinyStories stories) and the question
  one of the ShareGPT answers answers, with an instruction to cite the passage;
- math: GSM8K train questions, "Solve step by step.";
- code: HumanEval prompts, "Complete the following Python function:";
- chat: MT-Bench first turns.

Each row: {"kind", "prompt" (the user turn), "source" (file name(s)), "index" (row / line / story number(s) in
it), "category" (= kind, read by bench.speed), "prompt_tokens" (the user text's tokens, no chat template),
"reference" (what a correct answer contains, where known)}. `bench.common.read_prompts` reads the `prompt`
column. The combined file goes to --output and one file per kind next to it (outputs/prompts/kinds/<kind>.jsonl
for --output outputs/prompts/kinds.jsonl), each usable as `prompts:` of bench.drafters. Each kind has its
own random stream (seeded by seed and kind name), so a kind's prompts do not depend on which other kinds are
built.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

from bench.report import markdown_table, write_jsonl
from heads.cli import DEBUG_FLAG, raise_flag_error, run_cli
from heads.loading import load_tokenizer

KINDS = ("summarise", "translate", "qa", "rag", "math", "code", "chat")
DEFAULT_DATA_DIR = "../shared/data"
DEFAULT_MODEL = "../shared/models/smollm2-135m-instruct"
SUMMARY_TOKENS = (600, 2000)  # summarise: the whole user text's length range, in tokens
RAG_MAX_TOKENS = 2000

STORIES = "tinystories_sample.jsonl"
SHAKESPEARE = "tinyshakespeare.txt"
SHAREGPT = "sharegpt_sample.jsonl"
GSM8K = "gsm8k_train.jsonl"
HUMANEVAL = "humaneval.jsonl"
MT_BENCH = "mt_bench_question.jsonl"

CountTokens = Callable[[str], int]
Row = dict[str, Any]


# ---------------------------------------------------------------- source files


@lru_cache(maxsize=16)
def _jsonl(path: str) -> tuple[dict[str, Any], ...]:
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"--data_dir: {file}: no such file")
    return tuple(json.loads(line) for line in file.read_text(encoding="utf-8").split("\n") if line.strip())
    # split("\n"), not splitlines(): JSON strings may hold U+2028 and other characters splitlines() breaks at


def stories(data: Path) -> list[str]:
    """The TinyStories sample's stories, in file order."""
    return [row["text"].strip() for row in _jsonl(str(data / STORIES))]


@lru_cache(maxsize=4)
def _speeches(path: str) -> tuple[tuple[int, str], ...]:
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"--data_dir: {file}: no such file")
    out, line = [], 1
    for block in file.read_text(encoding="utf-8").split("\n\n"):
        if block.strip():
            out.append((line, block.strip()))
        line += block.count("\n") + 2
    return tuple(out)


def speeches(data: Path) -> list[tuple[int, str]]:
    """Tiny Shakespeare's speeches ("Speaker:\\nlines", separated by blank lines) with their 1-based first line."""
    return list(_speeches(str(data / SHAKESPEARE)))


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|(?<=[.!?][\"”’])\s+")


def sentences(text: str) -> list[str]:
    """A story's sentences: lines split after . ! ? (a closing quote stays with its sentence)."""
    return [s.strip() for line in text.splitlines() for s in _SENTENCE_END.split(line.strip()) if s.strip()]


def _mostly_ascii(text: str) -> bool:
    return sum(ch.isascii() for ch in text) >= 0.99 * len(text)


def sharegpt_pairs(data: Path) -> list[tuple[int, str, str]]:
    """(row, question, answer) of ShareGPT first exchanges fit to be a retrieved passage and its question: a
    question of 20-300 characters, an answer of 400-1,600, mostly ASCII, not a refusal."""
    pairs = []
    for i, row in enumerate(_jsonl(str(data / SHAREGPT))):
        turns = row.get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
            continue
        question, answer = turns[0]["value"].strip(), turns[1]["value"].strip()
        if (20 <= len(question) <= 300 and 400 <= len(answer) <= 1600 and _mostly_ascii(question + answer)
                and not answer.lower().startswith(("i'm sorry", "i am sorry", "as an ai"))):
            pairs.append((i, question, answer))
    return pairs


# ---------------------------------------------------------------- kinds


SUMMARY_INSTRUCTIONS = (
    "Summarise the text above in five sentences.",
    "Write a short summary of the text above.",
    "Summarise the text above: who appears in it and what happens.",
)


def _shakespeare_passage(rng: random.Random, data: Path, count: CountTokens, low: int, high: int
                         ) -> tuple[int, str]:
    """Whole consecutive speeches from a seeded speech onwards, `low`..`high` tokens: (first line, text)."""
    blocks = speeches(data)
    target = rng.randint(low + (high - low) // 10, high - (high - low) // 4)
    while True:
        start = rng.randrange(len(blocks) - 200)
        taken, tokens = [], 0
        for _, block in blocks[start:]:
            n = count(block) + 1
            if tokens + n > high:
                break
            taken.append(block)
            tokens += n
            if tokens >= target:
                break
        if tokens >= low:
            return blocks[start][0], "\n\n".join(taken)


def build_summarise(n: int, rng: random.Random, data: Path, count: CountTokens) -> list[Row]:
    """A long document, then an instruction to summarise it; 600-2,000 tokens in all."""
    low, high = SUMMARY_TOKENS
    rows: list[Row] = []
    story_text = "\n\n".join(stories(data))
    for i in range(n):
        instruction = SUMMARY_INSTRUCTIONS[rng.randrange(len(SUMMARY_INSTRUCTIONS))]
        if i == 0 and low <= count(story_text + "\n\n" + instruction) <= high:
            rows.append({"prompt": f"{story_text}\n\n{instruction}", "source": STORIES,
                         "index": list(range(len(stories(data))))})
            continue
        budget = high - count(instruction) - 8
        line, passage = _shakespeare_passage(rng, data, count, low, budget)
        rows.append({"prompt": f"{passage}\n\n{instruction}", "source": SHAKESPEARE, "index": line})
    for row in rows:
        if not low <= count(row["prompt"]) <= high:  # the passages are measured block by block; check the whole
            raise AssertionError(f"summarise prompt of {count(row['prompt'])} tokens, outside {SUMMARY_TOKENS}")
    return rows


LANGUAGES = ("French", "German", "Spanish")


def build_translate(n: int, rng: random.Random, data: Path, count: CountTokens) -> list[Row]:
    """Two to four consecutive TinyStories sentences, to translate into French, German or Spanish."""
    texts = stories(data)
    first_language = rng.randrange(len(LANGUAGES))
    rows = []
    for i in range(n):
        story = rng.randrange(len(texts))
        parts = sentences(texts[story])
        size = min(rng.randint(2, 4), len(parts))
        start = rng.randrange(len(parts) - size + 1)
        language = LANGUAGES[(first_language + i) % len(LANGUAGES)]
        rows.append({"prompt": f"Translate into {language}:\n\n{' '.join(parts[start:start + size])}",
                     "source": STORIES, "index": story, "reference": language})
    return rows


def _anchor(units: list[str], groups: list[int], rng: random.Random) -> int | None:
    """A unit (sentence / line) followed by another of the same group (speech), both occurring once in the passage
    and of 4+ words; None if there is none."""
    options = [k for k in range(len(units) - 1)
               if groups[k] == groups[k + 1] and units.count(units[k]) == 1 and units.count(units[k + 1]) == 1
               and len(units[k].split()) >= 4 and len(units[k + 1].split()) >= 4]
    return rng.choice(options) if options else None


def build_qa(n: int, rng: random.Random, data: Path, count: CountTokens) -> list[Row]:
    """A passage and an extractive question: quote the sentence (line) that follows a quoted one. Even rows: a
    TinyStories story; odd rows: 250-600 tokens of Tiny Shakespeare."""
    texts = stories(data)
    rows = []
    for i in range(n):
        while True:
            if i % 2 == 0:
                index = rng.randrange(len(texts))
                passage, unit, document, source = texts[index], "sentence", "story", STORIES
                units = sentences(passage)
                groups = [0] * len(units)
            else:  # lines of one speech (its first line is the speaker's name)
                index, passage = _shakespeare_passage(rng, data, count, 250, 600)
                speech_lines = [block.splitlines()[1:] for block in passage.split("\n\n")]
                units = [line.strip() for lines in speech_lines for line in lines]
                groups = [g for g, lines in enumerate(speech_lines) for _ in lines]
                unit, document, source = "line", "scene", SHAKESPEARE
            k = _anchor(units, groups, rng)
            if k is not None:
                break
        question = (f'Quote the {unit} of the {document} that comes right after "{units[k]}". '
                    f"Answer with that {unit} only.")
        rows.append({"prompt": f"{passage}\n\n{question}", "source": source, "index": index,
                     "reference": units[k + 1]})
    return rows


def build_rag(n: int, rng: random.Random, data: Path, count: CountTokens) -> list[Row]:
    """Three to five numbered passages (ShareGPT answers, TinyStories stories) and the question one of the ShareGPT
    answers answers; at most 2,000 tokens."""
    pairs = sharegpt_pairs(data)
    texts = stories(data)
    targets = rng.sample(range(len(pairs)), n)
    rows = []
    for target in targets:
        while True:
            size = rng.randint(3, 5)
            passages = [(SHAREGPT, pairs[target][0], pairs[target][2])]
            while len(passages) < size:
                if rng.random() < 0.5:
                    story = rng.randrange(len(texts))
                    candidate = (STORIES, story, texts[story])
                else:
                    other = pairs[rng.randrange(len(pairs))]
                    candidate = (SHAREGPT, other[0], other[2])
                if all(candidate[:2] != p[:2] for p in passages):
                    passages.append(candidate)
            rng.shuffle(passages)
            cited = 1 + next(k for k, p in enumerate(passages) if p[:2] == (SHAREGPT, pairs[target][0]))
            body = "\n\n".join(f"[{k + 1}] {text}" for k, (_, _, text) in enumerate(passages))
            prompt = (f"Passages:\n\n{body}\n\nUsing the passages, answer: {pairs[target][1]}\n"
                      f"Cite the passage you used, e.g. [{cited}].")
            if count(prompt) <= RAG_MAX_TOKENS:
                break
        rows.append({"prompt": prompt, "source": ",".join(sorted({p[0] for p in passages})),
                     "index": [f"{p[0]}:{p[1]}" for p in passages], "reference": f"[{cited}]"})
    return rows


def build_math(n: int, rng: random.Random, data: Path, count: CountTokens) -> list[Row]:
    """GSM8K train questions, to solve step by step."""
    table = _jsonl(str(data / GSM8K))
    return [{"prompt": f"Solve step by step.\n\n{table[i]['question']}", "source": GSM8K, "index": i,
             "reference": table[i]["answer"].rsplit("####", 1)[-1].strip()}
            for i in _sample(rng, len(table), n, "math", GSM8K)]


def build_code(n: int, rng: random.Random, data: Path, count: CountTokens) -> list[Row]:
    """HumanEval prompts, to complete."""
    table = _jsonl(str(data / HUMANEVAL))
    return [{"prompt": f"Complete the following Python function:\n\n```python\n{table[i]['prompt']}```",
             "source": HUMANEVAL, "index": i, "reference": table[i]["entry_point"]}
            for i in _sample(rng, len(table), n, "code", HUMANEVAL)]


def build_chat(n: int, rng: random.Random, data: Path, count: CountTokens) -> list[Row]:
    """MT-Bench first turns."""
    table = _jsonl(str(data / MT_BENCH))
    return [{"prompt": table[i]["turns"][0], "source": MT_BENCH, "index": i}
            for i in _sample(rng, len(table), n, "chat", MT_BENCH)]


def _sample(rng: random.Random, size: int, n: int, kind: str, source: str) -> list[int]:
    if n > size:
        raise ValueError(f"--per_kind {n}: {kind} has only {size} prompts ({source})")
    return rng.sample(range(size), n)


BUILDERS: dict[str, Callable[[int, random.Random, Path, CountTokens], list[Row]]] = {
    "summarise": build_summarise, "translate": build_translate, "qa": build_qa, "rag": build_rag,
    "math": build_math, "code": build_code, "chat": build_chat}


# ---------------------------------------------------------------- the whole set


def parse_kinds(value: str | list[str] | None, flag: str = "--kinds") -> list[str]:
    """'summarise,qa' (or a list) -> ['summarise', 'qa'], checked; None/empty -> every kind."""
    if value is None or value == "" or value == []:
        return list(KINDS)
    names = [v.strip() for v in (value.split(",") if isinstance(value, str) else value) if str(v).strip()]
    unknown = [v for v in names if v not in KINDS]
    if unknown:
        raise ValueError(f"{flag}: unknown kind(s) {unknown}; expected some of {list(KINDS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"{flag}: kinds repeated in {names}")
    return names


def build_prompts(kinds: list[str], per_kind: int, seed: int, data_dir: str | Path, count: CountTokens
                  ) -> list[Row]:
    """Rows of every kind in `kinds`, `per_kind` each, in kind order; `count` measures a text's tokens."""
    if per_kind < 1:
        raise ValueError(f"--per_kind must be >= 1, got {per_kind}")
    data = Path(data_dir)
    rows = []
    for kind in parse_kinds(kinds):
        rng = random.Random(f"{seed}:{kind}")  # str seeds hash with SHA-512: the same on every run and machine
        for row in BUILDERS[kind](per_kind, rng, data, count):
            rows.append({"kind": kind, "prompt": row["prompt"], "source": row["source"], "index": row["index"],
                         "category": kind, "prompt_tokens": count(row["prompt"]),
                         **({"reference": row["reference"]} if "reference" in row else {})})
    return rows


def token_counter(model: str) -> CountTokens:
    """A text's token count in `model`'s tokenizer (no special tokens, no chat template)."""
    tokenizer = load_tokenizer(model)
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])


def kind_files_dir(output: str | Path) -> Path:
    """outputs/prompts/kinds.jsonl -> outputs/prompts/kinds (the folder of the per-kind files)."""
    output = Path(output)
    return output.with_suffix("") if output.suffix else output.with_name(output.name + "_kinds")


def write_prompts(rows: list[Row], output: str | Path) -> dict[str, Path]:
    """The combined JSONL at `output` and one JSONL per kind in kind_files_dir(output): {kind: path}."""
    write_jsonl(output, rows)
    paths = {}
    for kind in dict.fromkeys(row["kind"] for row in rows):
        paths[kind] = write_jsonl(kind_files_dir(output) / f"{kind}.jsonl",
                                         [row for row in rows if row["kind"] == kind])
    return paths


def length_table(rows: list[Row]) -> str:
    """Per kind: count and prompt tokens min / median / max (markdown)."""
    lines = []
    for kind in dict.fromkeys(row["kind"] for row in rows):
        lengths = [row["prompt_tokens"] for row in rows if row["kind"] == kind]
        sources = sorted({s for row in rows if row["kind"] == kind for s in row["source"].split(",")})
        lines.append([kind, len(lengths), min(lengths), f"{statistics.median(lengths):g}", max(lengths),
                      ", ".join(sources)])
    return markdown_table(["kind", "count", "tokens min", "median", "max", "sources"], lines,
                          right=[False, True, True, True, True, False])


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.error = raise_flag_error
    parser.add_argument("--output", default="outputs/prompts/kinds.jsonl", help="combined JSONL (per-kind files "
                        "go to the folder of the same name without the suffix)")
    parser.add_argument("--per_kind", type=int, default=4, help="prompts per kind")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {','.join(KINDS)}")
    parser.add_argument("--data_dir", default=DEFAULT_DATA_DIR)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="whose tokenizer measures the lengths")
    parser.add_argument(DEBUG_FLAG, action="store_true", help="show Python tracebacks of errors")
    args = parser.parse_args(argv)
    kinds = parse_kinds(args.kinds)
    rows = build_prompts(kinds, args.per_kind, args.seed, args.data_dir, token_counter(args.model))
    paths = write_prompts(rows, args.output)
    print(f"{len(rows)} prompts -> {args.output}; per kind: {kind_files_dir(args.output)}/<kind>.jsonl "
          f"({len(paths)} files); tokens of the user text in {args.model}'s tokenizer, no chat template",
          file=sys.stderr)
    print(length_table(rows))
    return rows


if __name__ == "__main__":
    run_cli(main)
