"""A stand-in for vLLM's offline API (LLM, SamplingParams, outputs) answering with HF greedy generation, one prompt
at a time: lets tests run data/vllm_worker.py's protocol without vLLM installed. Greedy only."""

import os
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM

__version__ = "0.0-stand-in"


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    stop_token_ids: list = field(default_factory=list)
    seed: int | None = None
    detokenize: bool = True


@dataclass
class CompletionOutput:
    token_ids: list
    finish_reason: str
    stop_reason: int | None


@dataclass
class RequestOutput:
    outputs: list


class LLM:
    def __init__(self, model, dtype="float32", **kwargs):
        if os.environ.get("FAKE_VLLM_FAIL"):
            raise RuntimeError(os.environ["FAKE_VLLM_FAIL"])
        torch.set_num_threads(1)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()

    def generate(self, prompts, params, use_tqdm=False):
        results = []
        for prompt in prompts:
            ids = torch.tensor([prompt["prompt_token_ids"]])
            with torch.inference_mode():
                out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                          max_new_tokens=params.max_tokens, eos_token_id=params.stop_token_ids,
                                          pad_token_id=params.stop_token_ids[0])[0, ids.shape[1]:].tolist()
            stop = next((i for i, t in enumerate(out) if t in params.stop_token_ids), None)
            tokens = out if stop is None else out[:stop + 1]
            results.append(RequestOutput([CompletionOutput(tokens, "length" if stop is None else "stop",
                                                           None if stop is None else tokens[-1])]))
        return results
