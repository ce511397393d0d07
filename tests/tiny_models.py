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
# deepseek_v3_gqa (fewer KV heads than query heads) verifies trees on CPU because the masked sdpa forward keeps the
# grouped heads in torch's kernel (runtime/target.py); transformers' own K/V repeat broke on its multi-token forwards.
ARCHITECTURES = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3", "gpt2", "deepseek_v3",
                 "deepseek_v3_gqa"]
ATTENTION = {"gemma2": "eager", "bloom": "eager", "mpt": "eager", "mamba": "eager"}
# Families the load-time verify check (runtime/verify_check.py) degrades or refuses -> the mode it chooses.
# falcon and bloom (ALiBi) reject 4D masks, mpt (ALiBi) ignores them, mamba keeps a recurrent state.
DEGRADED = {"falcon": "chain", "bloom": "chain", "mpt": "chain", "mamba": "refused"}

_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
               initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)


_OTHER = {  # families whose configs name their sizes differently
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=512),
    "bloom": dict(hidden_size=64, n_layer=2, n_head=4, pad_token_id=0),
    "falcon": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, alibi=True, max_position_embeddings=512),
    "mpt": dict(d_model=64, n_layers=2, n_heads=4, max_seq_len=512),
    "mamba": dict(hidden_size=64, num_hidden_layers=2, state_size=8),
}
# DeepSeek-V3: MLA (low-rank q/kv, split rope/nope head dims) and MoE (4 routed experts, 1 shared) after layer 0
_DEEPSEEK = dict(moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
                 topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                 qk_nope_head_dim=8, v_head_dim=16, num_key_value_heads=4, head_dim=8)  # head_dim = rope dim, as DeepSeek


def tiny_config(arch: str, **overrides):
    """A 2-layer, hidden-64, vocab-256 config of `arch` (a transformers model_type; "deepseek_v3_gqa" is
    DeepSeek-V3 with 2 KV heads for 4 query heads)."""
    if arch in _OTHER:
        kwargs = dict(vocab_size=256, initializer_range=0.1, bos_token_id=1, eos_token_id=2, **_OTHER[arch])
    elif arch.startswith("deepseek_v3"):
        kwargs = {**_COMMON, **_DEEPSEEK}
        if arch == "deepseek_v3_gqa":
            arch, kwargs["num_key_value_heads"] = "deepseek_v3", 2
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
