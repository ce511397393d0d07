"""Parallel drafter heads (DFlash, P-EAGLE): config keys and their refusals, save / load round trip, the speculators
export vLLM reads (keys, tensor names) and what it refuses."""

from __future__ import annotations

import json

import pytest
import torch

from heads import DFlashDraft, HeadsConfig, PEagleDraft, build_heads, load_heads
from heads.export import export_heads, plan_export
from tests.tiny_models import tiny_model

KINDS = ["dflash", "peagle"]


def heads_for(kind, model, **options):
    torch.manual_seed(0)
    config = HeadsConfig.for_target(kind, model, "tiny-target", block_size=5, num_draft_layers=2, **options)
    heads = build_heads(config).eval()
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    return heads


@pytest.mark.parametrize("kind", KINDS)
def test_save_load_round_trip_drafts_identically(kind, tmp_path):
    model = tiny_model("qwen3")
    heads = heads_for(kind, model, **({"draft_vocab_size": 100} if kind == "peagle" else {}))
    heads.save_pretrained(tmp_path / "h")
    loaded = load_heads(tmp_path / "h", target=model, target_name="tiny-target")
    assert type(loaded) is (DFlashDraft if kind == "dflash" else PEagleDraft)
    assert loaded.config.to_dict() == heads.config.to_dict()
    for name, tensor in heads.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    assert config["block_size"] == 5 and config["mask_token_id"] == model.config.vocab_size - 1
    assert config["aux_hidden_state_layer_ids"] == heads.config.target_layers and config["num_hidden_layers"] == 2
    emb, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    hs = model(torch.arange(3, 12)[None], output_hidden_states=True).hidden_states
    features = [hs[i][:, :8] for i in heads.config.target_layers]
    with torch.no_grad():
        if kind == "dflash":
            outs = [h(h.block_ids(torch.tensor([7])), embed_tokens=emb, position_ids=torch.arange(8, 13)[None],
                      context=h.context_cache(h.project(features), torch.arange(8)[None])) for h in (heads, loaded)]
            assert torch.equal(heads.compute_logits(outs[0], lm_head), loaded.compute_logits(outs[1], lm_head))
        else:
            outs = [h(h.project(features), torch.arange(4, 12)[None], embed_tokens=emb,
                      position_ids=torch.arange(8)[None])[0] for h in (heads, loaded)]
            assert torch.equal(heads.compute_logits(outs[0]), loaded.compute_logits(outs[1]))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("options", "flag"), [({"block_size": 1}, "--block_size"), ({"block_size": 65}, "--block_size"),
                                               ({"mask_token_id": 256}, "--mask_token_id"),
                                               ({"target_layers": [0]}, "target_layers"),
                                               ({"target_layers": [3]}, "target_layers")])
def test_bad_config_is_one_line_naming_the_key(kind, options, flag):
    model = tiny_model("llama")  # 2 layers, vocabulary 256
    with pytest.raises(ValueError, match=flag) as err:
        HeadsConfig.for_target(kind, model, "tiny-target", **options)
    assert "\n" not in str(err.value)


def test_speculators_export_dflash(tmp_path):
    model = tiny_model("llama")
    heads = heads_for("dflash", model, target_layers=[1])
    heads.save_pretrained(tmp_path / "h")
    out = export_heads(tmp_path / "h", "speculators", tmp_path / "out", verifier="base-model", speculative_tokens=2)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["architectures"] == ["DFlashDraftModel"]
    assert config["block_size"] == 5 and config["mask_token_id"] == 255 and config["aux_hidden_state_layer_ids"] == [1]
    assert config["sample_from_anchor"] is False and config["draft_vocab_size"] == 256
    # vLLM's block is 1 + num_speculative_tokens slots: always block_size - 1, whatever was asked
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["num_hidden_layers"] == 2 and layer["vocab_size"] == 256
    from safetensors.torch import load_file

    tensors = load_file(out / "model.safetensors")
    assert set(tensors) == set(heads.state_dict()) and "layers.1.self_attn.k_norm.weight" in tensors
    assert not any(k.startswith(("lm_head", "embed_tokens", "mask_hidden")) for k in tensors)


def test_speculators_export_peagle(tmp_path):
    model = tiny_model("llama")
    heads = heads_for("peagle", model, target_layers=[1], draft_vocab_size=100)
    plan = plan_export(heads, "speculators")
    config = plan.config
    assert config["speculators_model_type"] == "peagle" and config["mask_token_id"] == 255
    assert config["eagle_aux_hidden_state_layer_ids"] == [1] and config["draft_vocab_size"] == 100
    assert config["norm_before_residual"] is False and config["transformer_layer_config"]["num_hidden_layers"] == 2
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert plan.tensors["mask_hidden"].shape == (heads.config.hidden_size,)
    assert torch.equal(plan.tensors["layers.1.hidden_norm.weight"], torch.ones(heads.config.hidden_size))
    assert {"d2t", "t2d", "lm_head.weight", "layers.0.hidden_norm.weight"} <= set(plan.tensors)


@pytest.mark.parametrize("kind", KINDS)
def test_export_refusals(kind):
    model = tiny_model("llama")
    last = heads_for(kind, model, target_layers=[2])  # hs[L]: what offline last-layer shards hold
    with pytest.raises(ValueError, match=r"read hidden_states\[2\].*vLLM captures the inputs of decoder layers 1..1"):
        plan_export(last, "speculators")
    with pytest.raises(ValueError, match="--to vllm: no vllm layout for kind .*use --to speculators"):
        plan_export(heads_for(kind, model), "vllm")
