"""`python -m data.task_prompts`: prompts of a task other than chat, built from the user text of any prompt file, for
self-distillation (`data.distill --sources`).

    python -m data.task_prompts --task translate --text ../shared/data/gsm8k_train.jsonl --count 480 \\
        --start -2000 --seed 7 --output outputs/prompts/translate.jsonl

Why: a head learns the text it is trained on. The main job's head, trained on the target's answers to ShareGPT chat
only, never accepted a token of the target's French, German or Spanish (tau 1.00-1.06 on translations), so there the
hybrid could only lose its trial drafts (0.97 of prompt lookup alone, docs/results/prompt_kinds.md). The same
recipe with 480 translation requests added to its data drafts the target's translations too.

Tasks (TASKS):
- translate: "Translate into LANGUAGE:" and three other phrasings, cycled, with --languages cycled every four
  prompts, around one text each.

The texts: the first user message of each conversation `data.prompts` reads from --text (any format it reads:
GSM8K's questions, ShareGPT, prompt/text JSONL, ...), rows from --start on (Python slicing: -2000 = the last
2,000), shuffled with --seed, the first --count taken. Output: one {"prompt": ...} JSON line per prompt (the
prompt/text format data.prompts reads), written atomically. The same flags give the same file on any machine.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field

from data.prompts import read_conversations
from data.runfiles import help_field as _help
from data.runfiles import parse_config
from heads.cli import run_cli
from heads.files import atomic_write_jsonl

TRANSLATE_FORMS = ("Translate into {language}:\n\n{text}", "Translate this text into {language}:\n\n{text}",
                   "Please translate the following into {language}.\n\n{text}",
                   "{text}\n\nTranslate the text above into {language}.")


def translate_prompts(texts: list[str], languages: list[str]) -> list[str]:
    """Each text as a translation request: the phrasings cycle per prompt, the languages every len(forms) prompts."""
    return [TRANSLATE_FORMS[i % len(TRANSLATE_FORMS)].format(
        language=languages[(i // len(TRANSLATE_FORMS)) % len(languages)], text=text) for i, text in enumerate(texts)]


TASKS = {"translate": translate_prompts}


@dataclass
class TaskPromptsConfig:
    """Flags of `python -m data.task_prompts` (also the keys of its --config YAML)."""

    task: str = _help(f"What the prompts ask: one of {list(TASKS)}.", "translate")
    text: str | None = _help("Where the texts come from: a prompt file or dataset data.prompts reads (the first "
                             "user message of each conversation is one text).")
    output: str | None = _help("JSONL file to write ({\"prompt\": ...} per line).")
    count: int = _help("Prompts to write.", 480)
    start: int = _help("First row of --text to draw from (negative: from the end, as Python slices).", 0)
    seed: int = _help("Shuffles the rows before the first --count are taken.", 0)
    languages: list[str] = field(default_factory=lambda: ["French", "German", "Spanish"],
                                 metadata={"help": "translate: target languages, cycled."})

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"--task must be one of {list(TASKS)}, got {self.task!r}")
        for name in ("text", "output"):
            if not getattr(self, name):
                raise ValueError(f"--{name} is required")
        if self.count < 1:
            raise ValueError(f"--count must be >= 1, got {self.count}")
        if isinstance(self.languages, str):
            self.languages = [part.strip() for part in self.languages.split(",")]
        if not self.languages or not all(isinstance(lang, str) and lang.strip() for lang in self.languages):
            raise ValueError(f"--languages: expected one or more names, got {self.languages!r}")


def pick_texts(texts: list[str], count: int, start: int, seed: int, flag: str = "--text") -> list[str]:
    """`count` of texts[start:], shuffled with `seed` (random.Random: the same on every machine)."""
    pool = list(texts[start:])
    if len(pool) < count:
        raise ValueError(f"{flag}: {len(pool)} usable texts from row {start} on, fewer than --count {count}")
    random.Random(seed).shuffle(pool)
    return pool[:count]


def first_user_texts(source: str) -> list[str]:
    """The first user message of every conversation of `source` that has a non-blank one."""
    conversations, _ = read_conversations(source)
    texts = [next((m["content"] for m in c if m["role"] == "user"), "").strip() for c in conversations]
    return [text for text in texts if text]


def run(config: TaskPromptsConfig) -> list[str]:
    texts = pick_texts(first_user_texts(config.text), config.count, config.start, config.seed)
    prompts = TASKS[config.task](texts, config.languages)
    atomic_write_jsonl(config.output, ({"prompt": prompt} for prompt in prompts))
    print(f"{config.output}: {len(prompts)} {config.task} prompts from {config.text} (rows {config.start}: on, "
          f"seed {config.seed})", file=sys.stderr)
    return prompts


def main(argv: list[str] | None = None) -> list[str]:
    return run(parse_config(TaskPromptsConfig, argv))


if __name__ == "__main__":
    run_cli(main)
