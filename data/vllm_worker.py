"""vLLM as a `data.distill` engine: prompt token ids in, answer token ids out. Imports nothing of ours.

Used two ways by `data.engines`:
- in-process (`import vllm` works in the project's venv): `VllmGenerator(...).generate(prompts, ...)`;
- as a worker in another interpreter (`--engine vllm --vllm_python PY`, e.g. the venv tests/engines/check_vllm.sh
  builds): `PY data/vllm_worker.py` reads one JSON line of engine arguments, answers {"ready": ..., "version": ...},
  then one JSON line per request {"prompts": [[ids]], "max_tokens", "stop_token_ids", "temperature", "top_p",
  "seed"} -> {"answers": [{"tokens": [...], "finished": bool}]}. vLLM's own logging goes to stderr (the protocol
  keeps the original stdout).

vLLM on CPU runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), with its OpenMP threads bound to `threads`
cores from `first_core` (process r of an `accelerate launch` takes its own) and a 2 GiB KV cache, unless the
environment says otherwise.
"""

from __future__ import annotations

import json
import os
import sys


def configure_environment(threads: int, first_core: int = 0) -> None:
    """vLLM CPU settings, only where the caller's environment sets none (read when vLLM is imported)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    mine = [cores[(first_core + i) % len(cores)] for i in range(max(threads, 1))]
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, mine)))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


class VllmGenerator:
    """One `vllm.LLM` on a HF-format model directory; greedy (or sampled) answers to token-id prompts."""

    def __init__(self, model: str, dtype: str, max_model_len: int, seed: int = 0, threads: int = 1,
                 first_core: int = 0):
        configure_environment(threads, first_core)
        import vllm
        from vllm import LLM

        self.version = vllm.__version__
        self.llm = LLM(model=model, dtype=dtype, max_model_len=max_model_len, seed=seed, enforce_eager=True,
                       distributed_executor_backend="uni", disable_log_stats=True)

    def generate(self, prompts: list[list[int]], max_tokens: int, stop_token_ids: list[int],
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None) -> list[dict]:
        """Per prompt {"tokens": answer ids (incl. the stop id when finished), "finished": stopped, not cut}."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=temperature, top_p=top_p if temperature > 0 else 1.0,
                                max_tokens=max_tokens, stop_token_ids=list(stop_token_ids), seed=seed,
                                detokenize=False)
        results = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                    use_tqdm=False)
        answers = []
        for result in results:
            output = result.outputs[0]
            tokens = list(output.token_ids)
            finished = output.finish_reason == "stop"
            if finished and (not tokens or tokens[-1] not in stop_token_ids):
                stop = output.stop_reason if isinstance(output.stop_reason, int) else stop_token_ids[0]
                tokens.append(stop)  # the stop id vLLM did not return
            answers.append({"tokens": tokens, "finished": finished})
        return answers


def serve(requests, replies) -> None:
    """The worker loop: engine arguments, then one request per line until end of input."""
    generator = VllmGenerator(**json.loads(requests.readline()))
    replies.write(json.dumps({"ready": True, "version": generator.version}) + "\n")
    replies.flush()
    for line in requests:
        if line.strip():
            replies.write(json.dumps({"answers": generator.generate(**json.loads(line))}) + "\n")
            replies.flush()


if __name__ == "__main__":
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # anything vLLM prints goes to stderr
    serve(sys.stdin, protocol)
