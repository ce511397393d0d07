"""Tiny deterministic models for tests: random-weight configs of real architectures, plus ../shared paths."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
STORIES260K = SHARED / "models" / "stories260K"
SMOLLM2 = SHARED / "models" / "smollm2-135m-instruct"
DATA = SHARED / "data"

# Architectures the runtime supports; attention backend each runs on (gemma2 refuses sdpa: softcapping).
ARCHITECTURES = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3", "gpt2"]
ATTENTION = {"gemma2": "eager"}

_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
               initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def tiny_config(arch: str, **overrides):
    """A 2-layer, hidden-64, vocab-256 config of `arch` (a transformers model_type)."""
    if arch == "gpt2":
        kwargs = dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=512,
                      initializer_range=0.1, bos_token_id=1, eos_token_id=2)
    else:
        kwargs = dict(_COMMON)
        if arch in ("mistral", "qwen2", "gemma2", "gemma3_text"):
            kwargs["sliding_window"] = None if arch in ("mistral", "qwen2") else 4096
    kwargs.update(overrides)
    return AutoConfig.for_model(arch, **kwargs)


def tiny_model(arch: str, dtype: torch.dtype = torch.float32, seed: int = 0, attn: str | None = None,
               **overrides):
    """A random-weight model of `arch` in eval mode; deterministic for a given seed."""
    torch.manual_seed(seed)
    config = tiny_config(arch, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                             attn_implementation=attn or ATTENTION.get(arch, "sdpa"))
    return model.eval()


def stories260k(dtype: torch.dtype = torch.float32, attn: str = "sdpa"):
    """The real 260K-parameter TinyStories Llama from ../shared."""
    return AutoModelForCausalLM.from_pretrained(STORIES260K, dtype=dtype, attn_implementation=attn).eval()
