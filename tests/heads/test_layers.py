"""The draft decoder layer against transformers' LlamaDecoderLayer, and its cache / mask contract."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from heads.config import HeadsConfig
from heads.layers import DecoderLayer, causal_mask

ROPES = [{"rope_type": "default", "rope_theta": 10000.0},
         {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}]


def _pair(rope: dict, dtype=torch.float64):
    hf_config = LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=256, rope_parameters=rope,
                            attn_implementation="sdpa")
    hf_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    reference = LlamaDecoderLayer(hf_config, layer_idx=0).to(dtype).eval()
    for p in reference.parameters():
        torch.nn.init.normal_(p, std=0.2)
    config = HeadsConfig.for_target("mtp", hf_config, "tiny")
    ours = DecoderLayer(config, mode="llama").to(dtype)
    missing, unexpected = ours.load_state_dict(reference.state_dict(), strict=True)
    return reference, ours, LlamaRotaryEmbedding(hf_config)


@pytest.mark.parametrize("rope", ROPES, ids=["default", "llama3"])
def test_layer_equals_transformers_llama_layer(rope):
    reference, ours, rotary = _pair(rope)
    x = torch.randn(2, 7, 64, dtype=torch.float64)
    pos = torch.arange(3, 10)[None].expand(2, -1)
    mask = causal_mask(2, 7, 0, torch.float64)
    expected = reference(x, attention_mask=mask, position_ids=pos, position_embeddings=rotary(x, pos))
    expected = expected[0] if isinstance(expected, tuple) else expected
    got, kv = ours(x, pos)
    assert kv.key.shape == (2, 2, 7, 16)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-10)


def test_cache_and_tree_mask_match_full_causal_forward():
    _, layer, _ = _pair(ROPES[0])
    x = torch.randn(1, 9, 64, dtype=torch.float64)
    pos = torch.arange(9)[None]
    full, _ = layer(x, pos)
    # prefix of 5 then 4 more with the cache
    out1, kv = layer(x[:, :5], pos[:, :5])
    out2, kv2 = layer(x[:, 5:], pos[:, 5:], past_key_value=kv)
    assert kv2.length == 9
    torch.testing.assert_close(torch.cat([out1, out2], 1), full, atol=1e-12, rtol=0)
    # a 2-branch "tree" after the prefix: nodes 5 and 6 are siblings at depth 0 (same position)
    tree_x = torch.stack([x[0, 5], x[0, 5] * 0.5])[None]
    tree_pos = torch.tensor([[5, 5]])
    mask = torch.zeros(1, 1, 2, 7, dtype=torch.float64)
    mask[0, 0, 0, 6] = torch.finfo(torch.float64).min
    mask[0, 0, 1, 5] = torch.finfo(torch.float64).min
    tree_out, tree_kv = layer(tree_x, tree_pos, attention_mask=mask, past_key_value=kv)
    torch.testing.assert_close(tree_out[:, 0], full[:, 5], atol=1e-12, rtol=0)
    # keeping only the accepted slot gives the same cache as the sequential run
    kept = tree_kv.select(torch.tensor([0, 1, 2, 3, 4, 5]))
    torch.testing.assert_close(kept.key, kv2.crop(6).key, atol=1e-12, rtol=0)


def test_bad_mask_shapes_and_bool_masks_are_refused():
    _, layer, _ = _pair(ROPES[0])
    x = torch.randn(1, 3, 64, dtype=torch.float64)
    pos = torch.arange(3)[None]
    with pytest.raises(ValueError, match="attention_mask"):
        layer(x, pos, attention_mask=torch.zeros(1, 1, 3, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="bool"):
        layer(x, pos, attention_mask=torch.ones(1, 1, 3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="position_ids"):
        layer(x, torch.arange(4)[None])
