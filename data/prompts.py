"""Read prompt files and datasets into conversations: lists of {"role", "content"} messages.

Recognised row formats (the first row with a recognised column decides the format of the whole source):

| format    | columns                                   | becomes                                              |
|-----------|-------------------------------------------|------------------------------------------------------|
| ShareGPT  | `conversations`: [{from, value}, ...]     | from human/user -> user, gpt/assistant/... -> assistant, system -> system |
| OpenAI    | `messages`: [{role, content}, ...]        | as is (roles system/user/assistant)                  |
| Alpaca    | `instruction` (+ `input`, + `output`)     | user = instruction + "\\n\\n" + input; assistant = output |
| MT-Bench  | `turns`: [str, ...]                       | one user message per turn, no answers                |
| GSM8K-like| `question` (+ `answer`)                   | user = question; assistant = answer                  |
| prompt    | `prompt` (+ `canonical_solution`, or `completion` / `response`) | user = prompt; assistant = prompt + canonical_solution (HumanEval: the whole function) or the answer column |
| plain     | `text`                                    | one user message                                     |

Sources: a `.jsonl` file, a `.json` file holding a list of rows (or JSONL under a .json name), a `.parquet` /
`.csv` file, or a directory / dataset name that `datasets.load_dataset` understands. Rows that do not parse
(bad JSON, missing or mistyped fields, unknown roles, no user message) are skipped and returned as
`SkippedRow(line, reason)`; a source with no usable format at all is an error naming the file.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Message = dict[str, str]
Conversation = list[Message]

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "model": "assistant",
                  "system": "system"}
OPENAI_ROLES = {"system": "system", "user": "user", "assistant": "assistant", "developer": "system"}
# Checked in this order: the first column present in a row decides the format.
FORMAT_COLUMNS = ("conversations", "messages", "instruction", "turns", "question", "prompt", "text")


@dataclass(frozen=True)
class SkippedRow:
    line: int  # 1-based line (JSONL) or row index (JSON list / HF dataset)
    reason: str


class RowError(ValueError):
    """A row that cannot become a conversation (reported as a SkippedRow, never fatal)."""


def _text(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise RowError(f"`{field}` is {type(value).__name__}, expected a string")
    return value


def _from_role_list(items: Any, column: str, role_key: str, content_key: str,
                    roles: dict[str, str]) -> Conversation:
    if not isinstance(items, list) or not items:
        raise RowError(f"`{column}` must be a non-empty list")
    conversation = []
    for position, item in enumerate(items):
        if not isinstance(item, dict) or role_key not in item or content_key not in item:
            raise RowError(f"`{column}[{position}]` must be an object with `{role_key}` and `{content_key}`")
        role = item[role_key]
        if not isinstance(role, str) or role.lower() not in roles:
            raise RowError(f"`{column}[{position}].{role_key}` = {role!r} is not one of {sorted(roles)}")
        conversation.append({"role": roles[role.lower()],
                             "content": _text(item[content_key], f"{column}[{position}].{content_key}")})
    return conversation


def _alpaca(row: dict) -> Conversation:
    user = _text(row["instruction"], "instruction")
    extra = row.get("input")
    if extra:
        user = user + "\n\n" + _text(extra, "input")
    conversation = [{"role": "user", "content": user}]
    if row.get("output"):
        conversation.append({"role": "assistant", "content": _text(row["output"], "output")})
    return conversation


def _turns(row: dict) -> Conversation:
    turns = row["turns"]
    if not isinstance(turns, list) or not turns:
        raise RowError("`turns` must be a non-empty list of strings")
    return [{"role": "user", "content": _text(turn, f"turns[{i}]")} for i, turn in enumerate(turns)]


def _question(row: dict) -> Conversation:
    conversation = [{"role": "user", "content": _text(row["question"], "question")}]
    if row.get("answer"):
        conversation.append({"role": "assistant", "content": _text(row["answer"], "answer")})
    return conversation


ANSWER_COLUMNS = ("canonical_solution", "completion", "response")  # of `prompt` rows, first present wins


def _prompt(row: dict) -> Conversation:
    prompt = _text(row["prompt"], "prompt")
    conversation = [{"role": "user", "content": prompt}]
    column = next((name for name in ANSWER_COLUMNS if row.get(name)), None)
    if column == "canonical_solution":
        # HumanEval: the solution continues the prompt's code (it starts with the body's indentation); the
        # answer is the whole function, as a chat model writes it (a leading "    " would also merge with the
        # template's "\n" into one token that starts before the answer and is never learned)
        conversation.append({"role": "assistant", "content": prompt + _text(row[column], column)})
    elif column is not None:
        conversation.append({"role": "assistant", "content": _text(row[column], column)})
    return conversation


PARSERS = {
    "conversations": lambda row: _from_role_list(row["conversations"], "conversations", "from", "value",
                                                 SHAREGPT_ROLES),
    "messages": lambda row: _from_role_list(row["messages"], "messages", "role", "content", OPENAI_ROLES),
    "instruction": _alpaca,
    "turns": _turns,
    "question": _question,
    "prompt": _prompt,
    "text": lambda row: [{"role": "user", "content": _text(row["text"], "text")}],
}


def detect_format(columns: Iterable[str]) -> str | None:
    """The format column among `columns` (see FORMAT_COLUMNS), or None if nothing is recognised."""
    present = set(columns)
    return next((column for column in FORMAT_COLUMNS if column in present), None)


def parse_row(row: Any, fmt: str) -> Conversation:
    """One raw row -> a conversation in `fmt`; raises RowError saying what is wrong."""
    if not isinstance(row, dict):
        raise RowError(f"row is {type(row).__name__}, expected an object")
    if fmt not in row:
        raise RowError(f"missing column `{fmt}` (format detected from earlier rows)")
    conversation = PARSERS[fmt](row)
    if not any(message["role"] == "user" for message in conversation):
        raise RowError("conversation has no user message")
    empty = next((i for i, m in enumerate(conversation) if m["role"] == "user" and not m["content"].strip()), None)
    if empty is not None:  # nothing to answer: a self-distilled answer to it would teach the head noise
        raise RowError(f"user message {empty} is empty")
    return conversation


def _json_rows(path: Path, label: str) -> tuple[list[tuple[int, Any]], list[SkippedRow]]:
    """(line or index, parsed row) pairs of a JSON list / JSONL file, and the lines that are not JSON."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = None  # maybe JSONL under a .json name; tried below
        if isinstance(data, list):
            return list(enumerate(data)), []
        if isinstance(data, dict):
            raise ValueError(f"{label}: a .json file must hold a list of rows, got an object "
                             f"with keys {sorted(data)[:10]}")
    rows, bad = [], []
    for number, line in enumerate(text.split("\n"), start=1):  # not splitlines: JSON strings may hold U+2028
        if not line.strip():
            continue
        try:
            rows.append((number, json.loads(line)))
        except json.JSONDecodeError as err:
            bad.append(SkippedRow(number, f"not JSON: {err.msg}"))
    if not rows:
        raise ValueError(f"{label}: not a JSON list or JSON Lines file "
                         f"(no line parses as JSON{'; first error: ' + bad[0].reason if bad else ''})")
    return rows, bad


def _dataset_rows(source: str, split: str, label: str) -> Iterator[tuple[int, Any]]:
    import datasets  # imported lazily: reading a JSONL file should not pay for it

    path = Path(source)
    try:
        if path.is_file():
            builder = {".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}.get(path.suffix)
            if builder is None:
                raise ValueError(f"{label}: unsupported file type {path.suffix!r}; expected "
                                 ".json, .jsonl, .parquet, .csv or a dataset directory")
            dataset = datasets.load_dataset(builder, data_files=str(path), split=split)
        elif path.is_dir() and (path / "state.json").is_file():
            dataset = datasets.load_from_disk(str(path))  # a save_to_disk directory
        else:
            dataset = datasets.load_dataset(source, split=split)
    except (FileNotFoundError, ConnectionError, datasets.exceptions.DatasetNotFoundError) as err:
        raise FileNotFoundError(f"{label}: not a file, directory or loadable dataset ({err})") from err
    if isinstance(dataset, datasets.DatasetDict):
        if split not in dataset:
            raise ValueError(f"{label}: no split {split!r}; has {sorted(dataset)}")
        dataset = dataset[split]
    if detect_format(dataset.column_names) is None:
        raise ValueError(f"{label}: no recognised column in {dataset.column_names}; "
                         f"expected one of {list(FORMAT_COLUMNS)}")
    yield from enumerate(dataset)


def read_conversations(source: str, max_rows: int | None = None, split: str = "train", label: str | None = None
                       ) -> tuple[list[Conversation], list[SkippedRow]]:
    """Read up to `max_rows` conversations from a prompt file or dataset.

    Returns (conversations, skipped): each conversation is [{"role": "system"|"user"|"assistant",
    "content": str}, ...] with at least one user message; skipped rows carry their 1-based line (JSONL)
    or 0-based row index (JSON list, datasets) and the reason. Raises FileNotFoundError / ValueError
    naming `source` when it cannot be read at all or has no recognised column.
    """
    numbered, skipped = read_numbered_conversations(source, max_rows, split, label)
    return [conversation for _, conversation in numbered], skipped


def read_numbered_conversations(source: str, max_rows: int | None = None, split: str = "train",
                                label: str | None = None) -> tuple[list[tuple[int, Conversation]], list[SkippedRow]]:
    """`read_conversations`, each conversation with its line / row number (as SkippedRow.line counts). Errors name
    the source as `label` (default "--prompts SOURCE"; a --sources entry passes its own)."""
    label = label or f"--prompts {source}"
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"--max_prompts must be >= 1, got {max_rows}")
    path = Path(source)
    if path.is_file() and path.suffix in (".json", ".jsonl"):
        rows, skipped = _json_rows(path, label)
    elif path.is_file() or path.is_dir() or not source.startswith((".", "/", "~")):
        rows, skipped = _dataset_rows(source, split, label), []
    else:
        raise FileNotFoundError(f"{label}: no such file or directory")

    conversations: list[tuple[int, Conversation]] = []
    fmt = None
    for number, row in rows:
        if fmt is None and isinstance(row, dict):
            fmt = detect_format(row)
        if fmt is None:
            skipped.append(SkippedRow(number, f"no recognised column (expected one of {list(FORMAT_COLUMNS)})"))
            continue
        try:
            conversations.append((number, parse_row(row, fmt)))
        except RowError as err:
            skipped.append(SkippedRow(number, str(err)))
        if max_rows is not None and len(conversations) >= max_rows:
            skipped = [row for row in skipped if row.line <= number]  # lines past the cut were not read
            break
    if not conversations and fmt is None:
        raise ValueError(f"{label}: no row has a recognised column; expected one of "
                         f"{list(FORMAT_COLUMNS)}")
    skipped.sort(key=lambda row: row.line)
    return conversations, skipped
