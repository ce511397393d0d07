"""Independent checkers of exported directories, written from the engines' loader rules (see
heads/FORMATS.md), NOT from our exporter: they read the files and list every rule a loader would trip on.

Each returns a list of problems (empty = the engine would load it as the head intends).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open


def _read(directory: Path, weights: str) -> tuple[dict, dict[str, torch.Tensor], list[str]]:
    problems: list[str] = []
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    if not config:
        problems.append("config.json missing or empty")
    tensors: dict[str, torch.Tensor] = {}
    path = directory / weights
    if not path.is_file():
        problems.append(f"{weights} missing")
    else:
        with safe_open(str(path), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    return config, tensors, problems


def _expect(tensors, name, shape, problems, dtype=None):
    if name not in tensors:
        problems.append(f"missing tensor {name}")
        return
    if tuple(tensors[name].shape) != tuple(shape):
        problems.append(f"{name}: shape {list(tensors[name].shape)} != {list(shape)}")
    if dtype is not None and tensors[name].dtype != dtype:
        problems.append(f"{name}: dtype {tensors[name].dtype} != {dtype}")


def _one_float_dtype(tensors, problems):
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(dtypes) > 1:
        problems.append(f"mixed float dtypes {sorted(map(str, dtypes))}")


def check_tgi_medusa(directory: Path, hidden: int, vocab: int) -> list[str]:
    """TGI: config.json medusa_num_heads / medusa_num_layers / base_model_name_or_path and no architectures key;
    medusa_lm_head.safetensors with {h}.{l}.linear.weight [H,H] + .bias [H] (ResBlock loads bias=True) and
    {h}.{L}.weight [V,H] (no bias): MedusaHeadV1. SpeculativeHead.load falls back to MedusaHeadV2 when V1 fails (a
    missing projection): V2 asserts medusa_num_layers == 1, reads {h}.0.linear.* and applies the target's lm_head,
    so a directory without any {h}.1.weight is the shared-LM-head Medusa; some but not all projections would be
    silently ignored by V2."""
    config, tensors, problems = _read(directory, "medusa_lm_head.safetensors")
    for key in ("medusa_num_heads", "medusa_num_layers", "base_model_name_or_path"):
        if key not in config:
            problems.append(f"config.json lacks {key}")
    if "architectures" in config:  # SpeculativeHead.load: Medusa only on KeyError for architectures
        problems.append("config.json has architectures: TGI would disable the Medusa speculator")
    if problems:
        return problems
    heads, layers = config["medusa_num_heads"], config["medusa_num_layers"]
    projections = [f"{h}.{layers}.weight" for h in range(heads)]
    present = [name for name in projections if name in tensors]
    v2 = not present  # MedusaHeadV1 fails on the first missing projection
    if v2 and layers != 1:
        problems.append(f"no {{h}}.{layers}.weight projections and medusa_num_layers {layers}: MedusaHeadV2 (the "
                        "target's LM head) asserts medusa_num_layers == 1")
    if present and len(present) < heads:
        problems.append(f"projections {sorted(set(projections) - set(present))[:3]} missing: V1 fails and V2 would "
                        f"ignore the {len(present)} present")
    expected = set()
    for h in range(heads):
        for layer in range(layers):
            _expect(tensors, f"{h}.{layer}.linear.weight", (hidden, hidden), problems)
            _expect(tensors, f"{h}.{layer}.linear.bias", (hidden,), problems)
            expected |= {f"{h}.{layer}.linear.weight", f"{h}.{layer}.linear.bias"}
        if not v2:
            _expect(tensors, f"{h}.{layers}.weight", (vocab, hidden), problems)
            expected.add(f"{h}.{layers}.weight")
    extra = sorted(set(tensors) - expected)
    if extra:
        problems.append(f"unexpected tensors {extra[:5]}")
    _one_float_dtype(tensors, problems)
    return problems


def check_vllm_medusa(directory: Path, hidden: int, vocab: int) -> list[str]:
    """vLLM medusa.py: MedusaConfig (model_type medusa; num_heads / num_hidden_layers, or keys holding "num" and
    "heads"/"layers"; hidden_size; vocab_size; truncated_vocab_size), weights blocks.{h}.layers.{l}.weight [H,H]
    (+ .bias iff medusa_fc_bias) and lm_heads.{h}.weight [V,H] (with original_lm_head: only lm_heads.0.weight, one
    LM head every head reads). Unknown names are dropped silently by vLLM, so a
    tensor it would drop is a problem here."""
    config, tensors, problems = _read(directory, "model.safetensors")
    if config.get("model_type") != "medusa":
        problems.append("config.json model_type must be 'medusa'")
    for key in list(config):
        if "num" in key and "heads" in key:
            config["num_heads"] = config[key]
        elif "num" in key and "layers" in key:
            config["num_hidden_layers"] = config[key]
    if config.get("hidden_size") != hidden or config.get("vocab_size") != vocab:
        problems.append(f"hidden_size/vocab_size {config.get('hidden_size')}/{config.get('vocab_size')} "
                        f"!= target {hidden}/{vocab}")
    if config.get("truncated_vocab_size", vocab) != vocab and "token_map" not in tensors:
        problems.append("truncated_vocab_size < vocab_size without token_map")
    if "num_heads" not in config:
        problems.append("config.json lacks num_heads")
        return problems
    bias = bool(config.get("medusa_fc_bias", False))
    original_lm_head = bool(config.get("original_lm_head", False))
    expected = set()
    for h in range(config["num_heads"]):
        for layer in range(config.get("num_hidden_layers", 1)):
            _expect(tensors, f"blocks.{h}.layers.{layer}.weight", (hidden, hidden), problems)
            expected.add(f"blocks.{h}.layers.{layer}.weight")
            if bias:
                _expect(tensors, f"blocks.{h}.layers.{layer}.bias", (hidden,), problems)
                expected.add(f"blocks.{h}.layers.{layer}.bias")
        if h == 0 or not original_lm_head:  # original_lm_head: every head reads lm_heads.0 (as lm_head)
            _expect(tensors, f"lm_heads.{h}.weight", (vocab, hidden), problems)
            expected.add(f"lm_heads.{h}.weight")
    extra = sorted(set(tensors) - expected)
    if extra:
        problems.append(f"tensors vLLM would drop: {extra[:5]}")
    _one_float_dtype(tensors, problems)
    return problems


def _attention_and_mlp(tensors, prefix, config, in_features, problems):
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    dim = config.get("head_dim") or hidden // heads
    _expect(tensors, f"{prefix}.self_attn.q_proj.weight", (heads * dim, in_features), problems)
    _expect(tensors, f"{prefix}.self_attn.k_proj.weight", (kv * dim, in_features), problems)
    _expect(tensors, f"{prefix}.self_attn.v_proj.weight", (kv * dim, in_features), problems)
    _expect(tensors, f"{prefix}.self_attn.o_proj.weight", (hidden, heads * dim), problems)
    _expect(tensors, f"{prefix}.mlp.gate_proj.weight", (inter, hidden), problems)
    _expect(tensors, f"{prefix}.mlp.up_proj.weight", (inter, hidden), problems)
    _expect(tensors, f"{prefix}.mlp.down_proj.weight", (hidden, inter), problems)
    _expect(tensors, f"{prefix}.post_attention_layernorm.weight", (hidden,), problems)


def check_eagle3(directory: Path, hidden: int, vocab: int, target_layers: int, engine: str) -> list[str]:
    """vLLM llama_eagle3.py / SGLang llama_eagle3.py: architectures LlamaForCausalLMEagle3; one layer named
    midlayer.* whose q/k/v read 2H; fc.weight [H, 3*target_hidden] without bias (vLLM builds it bias=False,
    SGLang with config.bias, default False); norm.weight; lm_head.weight [draft_vocab_size, H]; d2t int64
    [draft_vocab_size] with target = draft + d2t inside the vocab (required when the draft vocab is reduced,
    otherwise vLLM keeps zeros / SGLang has no hot-token map); t2d bool [V] consistent if present; no
    embed_tokens; tie_word_embeddings false (SGLang would use the embedding as lm_head). Aux layer ids: vLLM
    reads top-level eagle_aux_hidden_state_layer_ids (hidden_states indices, must be < L); SGLang reads
    eagle_config.eagle_aux_hidden_state_layer_ids and adds 1."""
    config, tensors, problems = _read(directory, "model.safetensors")
    if "LlamaForCausalLMEagle3" not in config.get("architectures", []):
        problems.append(f"architectures {config.get('architectures')} lacks LlamaForCausalLMEagle3")
    if config.get("hidden_size") != hidden or config.get("vocab_size") != vocab:
        problems.append("hidden_size/vocab_size differ from the target")
    if config.get("num_hidden_layers") != 1:
        problems.append("num_hidden_layers must be 1 (one midlayer)")
    if config.get("tie_word_embeddings", True):
        problems.append("tie_word_embeddings must be false")
    if config.get("bias", False):
        problems.append("config bias=true would give fc a bias")
    draft_vocab = config.get("draft_vocab_size")
    if not isinstance(draft_vocab, int):
        problems.append("draft_vocab_size missing")
        return problems
    target_hidden = config.get("target_hidden_size", hidden)
    _expect(tensors, "fc.weight", (hidden, 3 * target_hidden), problems)
    if "fc.bias" in tensors:
        problems.append("fc.bias present (fc has no bias)")
    _attention_and_mlp(tensors, "midlayer", config, 2 * hidden, problems)
    for name in ("midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "norm.weight"):
        _expect(tensors, name, (hidden,), problems)
    _expect(tensors, "lm_head.weight", (draft_vocab, hidden), problems)
    if any("embed_tokens" in k for k in tensors):
        problems.append("embed_tokens shipped")
    if "d2t" not in tensors:
        if draft_vocab != vocab:
            problems.append("d2t missing with a reduced draft vocabulary")
    else:
        _expect(tensors, "d2t", (draft_vocab,), problems, torch.int64)
        if tensors["d2t"].shape == (draft_vocab,):
            ids = tensors["d2t"].to(torch.int64) + torch.arange(draft_vocab)
            inside = bool(((ids >= 0) & (ids < vocab)).all())
            if not inside:
                problems.append("d2t maps outside the target vocabulary")
            if ids.unique().numel() != draft_vocab:
                problems.append("d2t maps two draft ids to one target id")
            if "t2d" in tensors and inside:
                _expect(tensors, "t2d", (vocab,), problems, torch.bool)
                t2d = tensors["t2d"]
                if t2d.shape == (vocab,) and (int(t2d.sum()) != draft_vocab or not bool(t2d[ids].all())):
                    problems.append("t2d inconsistent with d2t")
    layer_ids = config.get("eagle_aux_hidden_state_layer_ids")
    sglang_ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if engine == "vllm" and layer_ids is not None and not all(1 <= i < target_layers for i in layer_ids):
        problems.append(f"eagle_aux_hidden_state_layer_ids {layer_ids} outside [1, {target_layers})")
    if engine == "sglang" and sglang_ids is not None:
        captured = [i + 1 for i in sglang_ids]
        if not all(1 <= i < target_layers for i in captured):
            problems.append(f"eagle_config ids {sglang_ids} capture layers outside the target")
        if layer_ids is not None and captured != list(layer_ids):
            problems.append("eagle_config ids + 1 != eagle_aux_hidden_state_layer_ids (vLLM and SGLang disagree)")
    expected_names = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
    extra = sorted(k for k in tensors if k not in expected_names and not k.startswith("midlayer."))
    if extra:
        problems.append(f"unexpected tensors {extra[:5]}")
    _one_float_dtype(tensors, problems)
    return problems


def check_eagle(directory: Path, hidden: int, vocab: int, engine: str) -> list[str]:
    """EAGLE-1/2: the EAGLE reference / SGLang llama_eagle.py / vLLM llama_eagle.py. One layer layers.0.* with no
    input_layernorm (all three drop it), fc.weight [H, 2H]; fc.bias [H] required by SGLang (nn.Linear default
    bias) and the reference (bias=True), forbidden by vLLM (fc built bias=False); num_hidden_layers 1; no
    lm_head (the target's is used); SGLang architectures LlamaForCausalLMEagle."""
    config, tensors, problems = _read(directory, "model.safetensors")
    if config.get("hidden_size") != hidden or config.get("vocab_size") != vocab:
        problems.append("hidden_size/vocab_size differ from the target")
    if config.get("num_hidden_layers") != 1:
        problems.append("num_hidden_layers must be 1")
    if engine == "sglang" and "LlamaForCausalLMEagle" not in config.get("architectures", []):
        problems.append("SGLang needs architectures LlamaForCausalLMEagle")
    _expect(tensors, "fc.weight", (hidden, 2 * hidden), problems)
    if engine == "vllm" and "fc.bias" in tensors:
        problems.append("fc.bias present but vLLM's fc has no bias")
    if engine in ("sglang", "eagle"):
        _expect(tensors, "fc.bias", (hidden,), problems)
    if "layers.0.input_layernorm.weight" in tensors:
        problems.append("layers.0.input_layernorm present (EAGLE layer 0 has none)")
    if "midlayer.self_attn.q_proj.weight" in tensors:
        problems.append("EAGLE-3 midlayer names in an EAGLE-1/2 checkpoint")
    else:
        _attention_and_mlp(tensors, "layers.0", config, hidden, problems)
    extra = sorted(k for k in tensors if not k.startswith(("layers.0.", "fc.")))
    if extra:
        problems.append(f"unexpected tensors {extra[:5]}")
    _one_float_dtype(tensors, problems)
    return problems
