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


@pytest.mark.parametrize("mode", ["llama", "eagle", "eagle3"])
def test_last_rows_only_equal_the_full_forward_and_cache(mode):
    """`last`: the outputs of the last rows only, the cache of all of them (what feeding committed entries needs),
    with and without a past and with an explicit mask."""
    layer = DecoderLayer(HeadsConfig.for_target("mtp", LlamaConfig(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=256), "tiny"), mode=mode).to(torch.float64)
    torch.manual_seed(1)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(1, 9, 64, dtype=torch.float64)
    embeds = torch.randn(1, 9, 64, dtype=torch.float64) if mode == "eagle3" else None
    pos = torch.arange(9)[None]
    full, full_kv = layer(x, pos, inputs_embeds=embeds)
    for last in (1, 3, 9):
        got, kv = layer(x, pos, inputs_embeds=embeds, last=last)
        assert got.shape == (1, last, 64)
        torch.testing.assert_close(got, full[:, 9 - last:], atol=1e-12, rtol=0)
        torch.testing.assert_close(kv.key, full_kv.key, atol=0, rtol=0)
        torch.testing.assert_close(kv.value, full_kv.value, atol=0, rtol=0)
    _, past = layer(x[:, :4], pos[:, :4], inputs_embeds=None if embeds is None else embeds[:, :4])
    rest = None if embeds is None else embeds[:, 4:]
    got, kv = layer(x[:, 4:], pos[:, 4:], past_key_value=past, inputs_embeds=rest, last=2)
    torch.testing.assert_close(got, full[:, 7:], atol=1e-12, rtol=0)
    assert kv.length == 9
    mask = causal_mask(1, 5, 4, torch.float64)
    got, _ = layer(x[:, 4:], pos[:, 4:], attention_mask=mask, past_key_value=past, inputs_embeds=rest, last=1)
    torch.testing.assert_close(got, full[:, 8:], atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="last"):
        layer(x, pos, inputs_embeds=embeds, last=10)


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


def test_eagle3_training_time_test_mask_equals_per_position_drafting():
    """EAGLE-3's unrolled training step (step-2 queries see step-1 keys causally and only their own step-2
    key) equals what the runtime computes: one draft step per prefix with that prefix's step-1 cache."""
    from heads import HeadsConfig, build_heads
    from tests.tiny_models import tiny_model

    target = tiny_model("llama")
    heads = build_heads(HeadsConfig.for_target("eagle3", target.config, "t", draft_vocab_size=256)).double()
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.2)
    embed = target.get_input_embeddings().double()
    S = 6
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(1, S, 3 * 64, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 256, (1, S + 1), generator=g)
    pos = torch.arange(S)[None]
    step1 = heads(heads.project(feats), ids[:, :S], embed_tokens=embed, position_ids=pos)
    # step 2 (batched): hidden = step-1 output, token shifted by one, position + 1
    minimum = torch.finfo(torch.float64).min
    mask = torch.full((S, 2 * S), minimum, dtype=torch.float64)
    mask[:, :S] = causal_mask(1, S, 0, torch.float64)[0, 0]
    mask[:, S:].fill_diagonal_(0.0)
    step2 = heads(step1.hidden_states, ids[:, 1:], embed_tokens=embed, position_ids=pos + 1,
                  attention_mask=mask[None, None], past_key_value=step1.past_key_value)
    for t in range(S):
        one = heads(step1.hidden_states[:, t:t + 1], ids[:, t + 1:t + 2], embed_tokens=embed,
                    position_ids=pos[:, t:t + 1] + 1, past_key_value=step1.past_key_value.crop(t + 1))
        torch.testing.assert_close(one.hidden_states[:, 0], step2.hidden_states[:, t], atol=1e-12, rtol=0)
