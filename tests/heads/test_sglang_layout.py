"""The SGLang EAGLE-3 layout (`--to sglang`) loaded the way SGLang loads it, without SGLang (no CPU build).

Written from SGLang `python/sglang/srt/models/llama_eagle3.py` (LlamaForCausalLMEagle3.__init__ / load_weights) and
SpecForge `specforge/export/to_sglang.py` (the export rules: architecture LlamaForCausalLMEagle3, identity weight
map, required serving keys fc.weight / norm.weight / lm_head.weight / t2d / d2t, no embedding):

- the model: `model.embed_tokens` [V, H], `model.fc` (3 * target_hidden_size -> H, bias from config "bias"),
  `model.midlayer` (qkv_proj over 2H, o_proj, gate_up_proj, down_proj, input_layernorm, hidden_norm,
  post_attention_layernorm), `model.norm`; `lm_head` = `model.embed_tokens` when tie_word_embeddings, else its own
  [draft_vocab_size, H] (draft_vocab_size None -> the target's LM head is loaded instead).
- load_weights: `d2t` -> hot_token_id = d2t + arange(Vd); `t2d` skipped; q/k/v -> qkv_proj, gate/up ->
  gate_up_proj; a name is used as is when it is a parameter, else with `model.`; names matching nothing are
  dropped silently (so a planted mistake is a missing parameter, not an error, in SGLang).
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from heads import load_heads
from heads.export import export_heads
from tests.heads.helpers import random_heads, tiny_target

H, V = 64, 256
SPECFORGE_REQUIRED = ("fc.weight", "norm.weight", "lm_head.weight", "t2d", "d2t")
STACKED = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
           (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]


def sglang_params(config: dict) -> dict[str, list[int] | None]:
    """LlamaForCausalLMEagle3's parameters (one midlayer) and shapes, from the draft's config.json."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    fc_in = 3 * config.get("target_hidden_size", hidden)
    p = "model.midlayer."
    params = {"model.embed_tokens.weight": [config["vocab_size"], hidden], "model.fc.weight": [hidden, fc_in],
              p + "self_attn.qkv_proj.weight": [(heads + 2 * kv) * d, 2 * hidden],
              p + "self_attn.o_proj.weight": [hidden, heads * d],
              p + "mlp.gate_up_proj.weight": [2 * inter, hidden], p + "mlp.down_proj.weight": [hidden, inter],
              p + "input_layernorm.weight": [hidden], p + "hidden_norm.weight": [hidden],
              p + "post_attention_layernorm.weight": [hidden], "model.norm.weight": [hidden]}
    if config.get("bias", False):
        params["model.fc.bias"] = [hidden]
    if not config.get("tie_word_embeddings", True):  # tied: lm_head IS model.embed_tokens
        params["lm_head.weight"] = [config.get("draft_vocab_size") or config["vocab_size"], hidden]
    return params


def sglang_load(config: dict, tensors: dict[str, torch.Tensor]) -> tuple[dict, torch.Tensor | None, list[str]]:
    """Which parameter each file tensor lands in (rows summed over shards), the hot-token map, dropped names."""
    params = sglang_params(config)
    loaded: dict[str, list[int]] = {}
    hot, dropped = None, []
    for name, tensor in tensors.items():
        if "d2t" in name:
            hot = tensor + torch.arange(tensor.shape[0])
            continue
        if "t2d" in name:
            continue
        for param_name, weight_name, _ in STACKED:
            if weight_name in name:
                name = name.replace(weight_name, param_name)
                break
        target = name if name in params else f"model.{name}"
        if target not in params:
            dropped.append(name)
            continue
        shape = loaded.setdefault(target, [0, *tensor.shape[1:]])
        shape[0] += tensor.shape[0]
    return loaded, hot, dropped


def layout_problems(directory) -> list[str]:
    """Everything SGLang (or SpecForge's export rules) would get wrong or drop in this directory."""
    config = json.loads((directory / "config.json").read_text())
    tensors = load_file(str(directory / "model.safetensors"))
    problems = []
    if config.get("architectures") != ["LlamaForCausalLMEagle3"]:
        problems.append(f"architectures {config.get('architectures')}")
    if config.get("tie_word_embeddings", True):
        problems.append("tie_word_embeddings: SGLang uses the embedding as lm_head")
    if not config.get("draft_vocab_size"):
        problems.append("no draft_vocab_size: SGLang loads the target's LM head instead of ours")
    problems += [f"missing SpecForge serving key {k}" for k in SPECFORGE_REQUIRED if k not in tensors]
    problems += [f"embedding shipped: {k}" for k in tensors if "embed" in k.lower()]
    loaded, hot, dropped = sglang_load(config, tensors)
    problems += [f"dropped silently: {n}" for n in dropped]
    params = sglang_params(config)
    for name, shape in params.items():
        if name == "model.embed_tokens.weight":
            continue  # shared from the target by SGLang's EAGLE worker
        if name not in loaded:
            problems.append(f"not loaded: {name}")
        elif loaded[name] != shape:
            problems.append(f"{name}: {loaded[name]} vs {shape}")
    if hot is None:
        problems.append("no d2t: no hot-token map")
    return problems


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    target = tiny_target()
    path = tmp_path_factory.mktemp("eagle3")
    random_heads("eagle3", target).save_pretrained(path / "h")
    return export_heads(path / "h", "sglang", path / "sglang"), load_heads(path / "h")


def test_sglang_loads_every_parameter_of_our_export(exported):
    out, heads = exported
    assert layout_problems(out) == []
    config = json.loads((out / "config.json").read_text())
    _, hot, _ = sglang_load(config, load_file(str(out / "model.safetensors")))
    vd = heads.config.draft_vocab_size
    assert torch.equal(hot, heads.draft_to_target(torch.arange(vd)))  # SGLang's hot tokens = our draft vocabulary
    # SGLang's eagle_config ids are "output of layer id": ours (hidden_states indices) minus one
    assert [i + 1 for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]] == list(heads.config.target_layers)


@pytest.mark.parametrize("plant, found", [
    (lambda c, t: t.__setitem__("embed_tokens.weight", torch.zeros(V, H)), "embedding shipped"),
    (lambda c, t: t.pop("d2t"), "missing SpecForge serving key d2t"),
    (lambda c, t: c.__setitem__("tie_word_embeddings", True), "tie_word_embeddings"),
    (lambda c, t: t.__setitem__("layers.0.mlp.up_proj.weight", t.pop("midlayer.mlp.up_proj.weight")),
     "dropped silently: layers.0.mlp.gate_up_proj.weight"),
    (lambda c, t: c.pop("draft_vocab_size"), "no draft_vocab_size"),
])
def test_sglang_layout_check_finds_planted_mistakes(exported, tmp_path, plant, found):
    out, _ = exported
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    plant(config, tensors)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert any(found in p for p in layout_problems(tmp_path)), layout_problems(tmp_path)
