"""Families outside tests/tiny_models.ARCHITECTURES, each with something the Llama layout lacks, through the whole
runtime: the load-time verify check, prompt lookup, a draft model, EAGLE heads and the hybrid reproduce HF's greedy
output in float32, and plain bfloat16 decoding token for token in bfloat16.

    gpt_neox     fused QKV, partial rotary, parallel attention + MLP
    opt          learned absolute positions, no rotary
    phi          partial rotary, parallel block, dense final projection names
    cohere       parallel block, LayerNorm with no bias, logit scale
    olmo2        norms after attention and MLP (post-norm), q/k norms
    gpt_bigcode  multi-query attention (one KV head), learned positions
    mixtral      a routed mixture of experts
    granite      embedding / residual / attention / logit multipliers

A sweep of 24 such families (these and gptj, codegen, stablelm, starcoder2, olmo, gemma, qwen2_moe, qwen3_moe,
smollm3, persimmon, helium, glm, olmoe, exaone4, ministral, seed_oss) passed the same checks; these eight keep the
suite short.
"""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from runtime.layout import set_layout
from runtime.proposers import Autoregressive, DraftModelProposer, PromptLookupProposer
from runtime.proposers.factory import HeadsOptions, hybrid_from_heads, proposer_from_heads
from runtime.verify_check import prepare_target
from tests.runtime.test_generate import perturbed_copy, reference
from tests.runtime.test_head_proposers import make_heads
from tests.runtime.test_verify_check import _prompt, _run
from tests.tiny_models import _COMMON

_SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=512)
FAMILIES = {
    "gpt_neox": _SIZES,
    "opt": dict(vocab_size=256, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=512, word_embed_proj_dim=64),
    "phi": _SIZES,
    "cohere": _COMMON,
    "olmo2": _COMMON,
    "gpt_bigcode": dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=512),
    "mixtral": dict(_COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    "granite": dict(_COMMON, embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2,
                    logits_scaling=2.0),
}


def _family(arch: str, dtype: torch.dtype):
    torch.manual_seed(0)
    config = AutoConfig.for_model(arch, **{"initializer_range": 0.1, "bos_token_id": 1, "eos_token_id": 2,
                                           **FAMILIES[arch]})
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # random models emit EOS anywhere
    return model


def _drafters(model, target):
    yield "prompt lookup", PromptLookupProposer()
    yield "draft model", DraftModelProposer(perturbed_copy(model), model.config.vocab_size, mode=target.mode)
    yield "eagle chain", proposer_from_heads(make_heads("eagle", model), target, HeadsOptions(tree_size="3"),
                                             target_name="tiny-target").proposer
    yield "eagle-2 tree", proposer_from_heads(make_heads("eagle", model), target,
                                              HeadsOptions(tree_size="6", tree_depth="3", tree_top_k="2"),
                                              target_name="tiny-target").proposer
    yield "hybrid", hybrid_from_heads(make_heads("eagle", model), target, HeadsOptions(tree_size="3"),
                                      target_name="tiny-target").proposer


@pytest.mark.parametrize("arch", FAMILIES)
def test_float32_every_drafter_reproduces_hf_greedy(arch):
    model = _family(arch, torch.float32)
    target = prepare_target(model)
    assert target.mode == "tree"
    prompt = _prompt()
    expected = reference(model, prompt, 40)
    for name, proposer in _drafters(model, target):
        out, stats = _run(target, proposer, prompt)
        assert torch.equal(out, expected), f"{arch}: {name}"
        if name == "draft model":  # drafts are accepted, so multi-token verifies were compared
            assert stats.tau > 1.3, f"{arch}: the draft model's tau {stats.tau:.2f}"


@pytest.mark.parametrize("arch", FAMILIES)
def test_bfloat16_every_drafter_reproduces_plain_bfloat16(arch, capsys):
    model = _family(arch, torch.bfloat16)
    set_layout(model, "rows+panels")  # auto's bf16 layout on a CPU
    target = prepare_target(model)
    assert "bit for bit" in capsys.readouterr().err, f"{arch}: the verify check did not compare verify with steps"
    prompt = _prompt()
    expected, _ = _run(target, Autoregressive(), prompt)
    for name, proposer in _drafters(model, target):
        out, stats = _run(target, proposer, prompt)
        assert torch.equal(out, expected), f"{arch}: {name}"
        if name == "draft model":
            assert stats.tau > 1.3, f"{arch}: the draft model's tau {stats.tau:.2f}"
