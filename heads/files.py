"""Atomic file writes: the one way every package writes an output file.

The text goes to a hidden temporary file in the target's own directory (same filesystem) and is moved over the
target with one `os.replace`, so a reader sees the old file or the new one, never half of one. The temporary
file is removed when anything fails (including KeyboardInterrupt). It lives in `heads/` (a leaf every package
may import).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write `text` to `path` (parents created) through a temporary file and os.replace; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; outputs are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_json(path: str | Path, value: Any, indent: int | None = 2) -> Path:
    """`value` as JSON with a trailing newline, written atomically."""
    return atomic_write_text(path, json.dumps(value, indent=indent) + "\n")


def atomic_write_jsonl(path: str | Path, rows: Iterable[Any]) -> Path:
    """One JSON object per line, written atomically."""
    return atomic_write_text(path, "".join(json.dumps(row) + "\n" for row in rows))
