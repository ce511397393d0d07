"""The one on-disk cache: converted models, compiled kernels, layout choices, cost curves, verify-check results.

Every entry is built by ONE process at a time and trusted only when complete, so N processes started at once on an
empty cache (`accelerate launch --num_processes N`) build each entry once and the others wait and reuse it, and an
entry cut short (a killed run, a disk that filled, a file someone deleted) is rebuilt with one line saying so:

- `lock(path)`: an exclusive `flock` on a file under `locks/` (released by the kernel when the process dies, so a crashed
  builder never blocks the next run);
- `build_directory(path, build)`: a directory entry (a converted model) is built into a hidden temporary directory,
  gets a `COMPLETE.json` listing every file and its size (written last), and is moved into place with one rename.
  An entry is complete when that list exists and every file in it is there with its size;
- `read_json` / `cached_json`: a JSON entry (layouts, cost curves, verify check) written atomically; an unreadable
  one is measured again.

The cache lives in $SPECHEADS_CACHE or ~/.cache/specheads; a directory that cannot be written is one error naming it
and SPECHEADS_CACHE. This module lives in `heads/` (a leaf every package may import).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from heads.files import atomic_write_json

ENV = "SPECHEADS_CACHE"
COMPLETE = "COMPLETE.json"


class CacheError(ValueError):
    """The cache directory cannot be used (printed as one `error:` line by the CLIs)."""


def _folder(path: Path) -> Path:
    """`path` created if needed; CacheError naming it (and SPECHEADS_CACHE) when it cannot be."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CacheError(f"cache directory {path} cannot be created ({error.strerror or error}); set {ENV} to a "
                         f"writable directory") from None
    return path


def cache_dir() -> Path:
    """$SPECHEADS_CACHE or ~/.cache/specheads, created if needed; CacheError naming it when it is not writable."""
    path = _folder(Path(os.environ.get(ENV) or Path.home() / ".cache" / "specheads"))
    try:  # a real write (root passes os.access on a read-only mount)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise CacheError(f"cache directory {path} is not writable ({error.strerror or error}); set {ENV} to a "
                         f"writable directory") from None
    return path


def entry(kind: str, name: str) -> Path:
    """The path of entry `name` of `kind` (a subdirectory such as 'converted' or 'layouts'), parents created."""
    return _folder(cache_dir() / kind) / name


def say(message: str) -> None:
    print(f"cache: {message}", file=sys.stderr, flush=True)


@contextmanager
def lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on entry `path` inside the block (through a file in the cache's `locks/` folder);
    blocks until it is free."""
    folder = path.parent.parent / "locks"  # beside the entry kinds, so an entry's folder holds entries only
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{path.parent.name}--{path.name}.lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def is_complete(directory: Path) -> bool:
    """True when `directory` holds COMPLETE.json and every file it lists, with the listed size."""
    try:
        listed = json.loads((directory / COMPLETE).read_text())["files"]
        return all((directory / name).stat().st_size == size for name, size in listed.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _listing(directory: Path) -> dict[str, int]:
    return {str(p.relative_to(directory)): p.stat().st_size for p in sorted(directory.rglob("*")) if p.is_file()}


def build_directory(target: Path, build: Callable[[Path], None], what: str) -> Path:
    """Return `target` once complete: built by `build(tmp_dir)` in this process (under the lock, into a temporary
    directory moved into place at the end) unless another process has built it already. An incomplete entry is
    removed and rebuilt, with one line naming it."""
    if is_complete(target):
        return target
    with lock(target):
        if is_complete(target):  # built by another process while this one waited
            return target
        if target.exists():
            say(f"{what} at {target} is incomplete (COMPLETE.json missing or a file in it missing or cut short); "
                f"rebuilding it")
            shutil.rmtree(target, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
        try:
            build(tmp)
            atomic_write_json(tmp / COMPLETE, {"files": _listing(tmp)})
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def read_json(path: Path) -> Any | None:
    """The JSON value at `path`; None when there is no such file, or (with one line) when it does not parse."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as error:
        say(f"{path} is unreadable ({error.strerror or error}); measuring again")
        return None
    try:
        return json.loads(text)
    except ValueError:
        say(f"{path} is not valid JSON (cut short?); measuring again")
        return None


def cached_json(path: Path, compute: Callable[[], Any], valid: Callable[[Any], bool] = lambda value: True,
                use_cache: bool = True) -> Any:
    """The value cached at `path` when it is `valid`, else `compute()` (by one process at a time: the others wait
    and read what it wrote), written atomically."""
    if not use_cache:
        return compute()
    value = read_json(path)
    if value is not None and valid(value):
        return value
    with lock(path):
        value = read_json(path)
        if value is not None and valid(value):
            return value
        value = compute()
        atomic_write_json(path, value, indent=1)
    return value
