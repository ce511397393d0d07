"""The on-disk cache under several real processes at once, with entries cut short, and in a directory that cannot
be written: one process builds, the others reuse; an incomplete entry is rebuilt with one line; errors name the
directory and SPECHEADS_CACHE."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from heads import cache
from tests.tiny_models import SMOLLM2

ROOT = Path(__file__).resolve().parents[2]


def _run_together(code: str, count: int, env: dict) -> list[subprocess.CompletedProcess]:
    """Start `count` Python processes running `code` at the same moment; wait for all."""
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(count)]
    done = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


def _env(cache_root: Path) -> dict:
    return {**os.environ, "SPECHEADS_CACHE": str(cache_root), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1"}


def test_several_processes_build_a_directory_entry_once(tmp_path):
    code = """
import time
from pathlib import Path
from heads import cache

def build(tmp):
    with open(Path(cache.cache_dir()) / "builds.log", "a") as log:
        log.write("built\\n")
    time.sleep(0.5)
    (tmp / "weights.bin").write_bytes(b"x" * 1000)

print(cache.build_directory(cache.entry("things", "one"), build, "a test entry"))
"""
    results = _run_together(code, 4, _env(tmp_path))
    assert all(r.returncode == 0 for r in results), [r.stderr for r in results]
    assert len({r.stdout.strip() for r in results}) == 1
    assert (tmp_path / "builds.log").read_text() == "built\n"  # one builder, three waited and reused
    entry = tmp_path / "things" / "one"
    assert cache.is_complete(entry) and sorted(p.name for p in entry.iterdir()) == ["COMPLETE.json", "weights.bin"]
    assert [p.name for p in (tmp_path / "things").iterdir()] == ["one"]  # no temporary directory left


def test_an_incomplete_directory_entry_is_rebuilt_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    builds = []

    def build(tmp):
        builds.append(tmp)
        (tmp / "a.bin").write_bytes(b"abc")
        (tmp / "b.json").write_text("{}")

    entry = cache.entry("things", "one")
    cache.build_directory(entry, build, "a test entry")
    cache.build_directory(entry, build, "a test entry")
    assert len(builds) == 1
    (entry / "a.bin").write_bytes(b"ab")  # cut short
    cache.build_directory(entry, build, "a test entry")
    assert len(builds) == 2 and "a test entry at" in capsys.readouterr().err
    (entry / "b.json").unlink()  # a file gone
    cache.build_directory(entry, build, "a test entry")
    (entry / cache.COMPLETE).unlink()  # an entry of an older version, or a rename that never happened
    cache.build_directory(entry, build, "a test entry")
    assert len(builds) == 4 and cache.is_complete(entry)


def test_an_unreadable_json_entry_is_measured_again(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    path = cache.entry("curves", "x.json")
    calls = []
    compute = lambda: calls.append(1) or {"value": len(calls)}  # noqa: E731
    assert cache.cached_json(path, compute) == {"value": 1}
    assert cache.cached_json(path, compute) == {"value": 1} and len(calls) == 1
    path.write_text('{"value": ')  # cut short
    assert cache.cached_json(path, compute) == {"value": 2}
    assert "not valid JSON" in capsys.readouterr().err
    assert cache.cached_json(path, compute, valid=lambda v: v["value"] > 5) == {"value": 3}  # not valid: again
    assert json.loads(path.read_text()) == {"value": 3}


def test_a_cache_directory_that_cannot_be_written_is_one_error_naming_it(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("SPECHEADS_CACHE", str(blocker / "cache"))
    with pytest.raises(cache.CacheError, match=r"cache directory .*a-file/cache cannot be created.*SPECHEADS_CACHE"):
        cache.cache_dir()
    env = {**_env(blocker / "cache"), "SPECHEADS_DEBUG": ""}
    result = subprocess.run([sys.executable, "-m", "runtime.generate", "--model", str(SMOLLM2), "--prompt", "hi",
                             "--max_new_tokens", "2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    assert "a-file/cache" in lines[0] and "SPECHEADS_CACHE" in lines[0] and "Traceback" not in result.stderr


def test_two_processes_convert_the_gguf_once_and_a_cut_entry_heals(tmp_path):
    """What `accelerate launch --num_processes 2 -m data.distill` does first on an empty cache, then with the
    converted copy's config.json and model.safetensors deleted (the entry an interrupted run leaves)."""
    code = f"from heads.loading import model_path; print(model_path({str(SMOLLM2)!r}))"
    results = _run_together(code, 2, _env(tmp_path))
    assert all(r.returncode == 0 for r in results), [r.stderr[-2000:] for r in results]
    paths = {r.stdout.strip().splitlines()[-1] for r in results}
    assert len(paths) == 1
    entry = Path(paths.pop())
    assert cache.is_complete(entry) and (entry / "config.json").is_file() and (entry / "model.safetensors").is_file()
    assert sum("de-quantizing" in r.stderr for r in results) == 1  # converted by one of them
    (entry / "config.json").unlink()
    (entry / "model.safetensors").unlink()
    results = _run_together(code, 2, _env(tmp_path))
    assert all(r.returncode == 0 for r in results), [r.stderr[-2000:] for r in results]
    assert sum("is incomplete" in r.stderr for r in results) == 1 and cache.is_complete(entry)


def test_gguf_converted_once_by_any_rank_and_loaded_from_the_copy(tmp_path, monkeypatch):
    """transformers' save_pretrained writes nothing on rank != 0 of a process group; our conversion must."""
    import transformers.distributed.mixin as mixin

    import heads.loading as loading

    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    monkeypatch.setattr(mixin, "_is_torch_distributed_initialized", lambda: True)
    monkeypatch.setattr(mixin, "_get_torch_distributed_rank", lambda: 1)
    path = Path(loading.model_path(str(SMOLLM2)))
    assert path.parent == tmp_path / "converted"
    stamp = path.stat().st_mtime_ns
    assert loading.model_path(str(SMOLLM2)) == str(path) and path.stat().st_mtime_ns == stamp  # converted once
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in path.iterdir()}
    model = loading.load_model(str(SMOLLM2), dtype="float32")
    assert model.config.num_hidden_layers == 30
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied again on load


def test_two_processes_compile_the_kernel_once(tmp_path):
    code = "from runtime import kernels; print(kernels.build()); print(kernels.library() is not None)"
    results = _run_together(code, 2, _env(tmp_path))
    if any("no C compiler" in r.stderr for r in results):
        pytest.skip("no C compiler on this machine")
    assert all(r.returncode == 0 for r in results), [r.stderr[-2000:] for r in results]
    assert {r.stdout.split()[0] for r in results} == {str(next((tmp_path / "kernels").glob("*.so")))}
    assert all(r.stdout.split()[1] == "True" for r in results)
    library = next((tmp_path / "kernels").glob("*.so"))
    library.write_bytes(library.read_bytes()[:100])  # cut short
    healed = _run_together(code, 1, _env(tmp_path))[0]
    assert healed.returncode == 0 and healed.stdout.split()[1] == "True", healed.stderr[-2000:]
    assert "does not load" in healed.stderr
