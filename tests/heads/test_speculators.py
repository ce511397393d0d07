"""The speculators layout (`--to speculators`, vLLM's zero-config draft format) against the rules of vLLM's reader
(vllm/transformers_utils/configs/speculators/{base,algos}.py, model_executor/models/llama_eagle3.py), and import
round trips of the speculators, SpecForge and EAGLE reference layouts (identical heads, identical outputs, identical
decoding by our runtime)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from heads import load_heads
from heads.cli import run_cli
from heads.convert import import_checkpoint
from heads.convert import main as convert_main
from heads.draft_vocab import build_vocab_mapping
from heads.export import export_heads
from heads.export import main as export_main
from runtime.config import DecodeConfig, HeadsOptions, SpeculationConfig
from runtime.loop import GenerationStats, generate
from runtime.proposers.factory import proposer_from_heads
from runtime.target import TargetModel
from tests.heads.helpers import TARGET_NAME, head_outputs, random_heads, save_random_heads

H, V, L = 64, 256, 2


@pytest.fixture(scope="module")
def saved(target, tmp_path_factory):
    return save_random_heads(target, tmp_path_factory, ("eagle3",))["eagle3"]


# ---- what vLLM 0.32's speculators reader does with a directory (written from its source) -----------------

# update_eagle3: keys read with a default when absent. norm_before_residual defaults to TRUE there.
VLLM_EAGLE3_DEFAULTS = {"norm_before_residual": True, "norm_before_fc": False, "fc_norm": False, "norm_output": False}


def vllm_speculative_config(config: dict) -> dict:
    """SpeculatorsConfig.validate_speculators_config + build_vllm_speculative_config + maybe_override_with_speculators."""
    spec = config["speculators_config"]
    first = spec["proposal_methods"][0]
    assert isinstance(config["transformer_layer_config"], dict)
    return {"method": config["speculators_model_type"], "num_speculative_tokens": first["speculative_tokens"],
            "target": spec["verifier"]["name_or_path"]}


def vllm_loaded_params(tensors: dict[str, torch.Tensor]) -> dict[str, list]:
    """Eagle3LlamaForCausalLM.load_weights: t2d skipped, d2t -> draft_id_to_target_id, names other than lm_head get
    `model.`, then q/k/v and gate/up are stacked (AutoWeightsLoader + the packed-modules mapping)."""
    loaded: dict[str, list] = {}
    stacked = {".q_proj": ".qkv_proj", ".k_proj": ".qkv_proj", ".v_proj": ".qkv_proj", ".gate_proj": ".gate_up_proj",
               ".up_proj": ".gate_up_proj"}
    for name, tensor in tensors.items():
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name
        for part, packed in stacked.items():
            if part in name:
                name = name.replace(part, packed)
                break
        loaded.setdefault(name, []).append(tensor)
    return loaded


def vllm_eagle3_params(hidden, heads, kv_heads, head_dim, inter, draft_vocab, target_hidden):
    """Every parameter of vLLM's Eagle3LlamaForCausalLM (one layer, no norm_before_fc) and its shape."""
    p = "model.layers.0."
    return {"model.embed_tokens.weight": None,  # shared with the target when the file has none
            "model.fc.weight": [hidden, 3 * target_hidden],
            p + "self_attn.qkv_proj.weight": [(heads + 2 * kv_heads) * head_dim, 2 * hidden],
            p + "self_attn.o_proj.weight": [hidden, heads * head_dim],
            p + "mlp.gate_up_proj.weight": [2 * inter, hidden], p + "mlp.down_proj.weight": [hidden, inter],
            p + "input_layernorm.weight": [hidden], p + "hidden_norm.weight": [hidden],
            p + "post_attention_layernorm.weight": [hidden], "model.norm.weight": [hidden],
            "lm_head.weight": [draft_vocab, hidden], "draft_id_to_target_id": [draft_vocab]}


def test_speculators_export_is_what_vllm_reads(saved, tmp_path, capsys):
    heads = load_heads(saved)
    c = heads.config
    export_main(["--heads", str(saved), "--to", "speculators", "--output_dir", str(tmp_path / "x"),
                 "--verifier", "org/target-model", "--speculative_tokens", "4"])
    printed = capsys.readouterr().out
    config = json.loads((tmp_path / "x" / "config.json").read_text())
    tensors = load_file(str(tmp_path / "x" / "model.safetensors"))
    # the printed summary names the keys written
    assert f"config.json keys: {sorted(config)}" in printed and "model.safetensors: 15 tensors" in printed
    assert set(config) == {"architectures", "speculators_model_type", "speculators_version", "speculators_config",
                           "transformer_layer_config", "draft_vocab_size", "target_hidden_size",
                           "eagle_aux_hidden_state_layer_ids", "norm_before_residual", "norm_before_fc", "fc_norm",
                           "norm_output", "embed_requires_grad", "torch_dtype"}
    assert config["speculators_config"] == {
        "algorithm": "eagle3", "default_proposal_method": "greedy",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 4, "verifier_accept_k": 1,
                              "accept_tolerance": 0.0}],
        "verifier": {"name_or_path": "org/target-model", "architectures": ["LlamaForCausalLM"]}}
    assert vllm_speculative_config(config) == {"method": "eagle3", "num_speculative_tokens": 4,
                                               "target": "org/target-model"}
    # every key vLLM reads with a default is written, with what our head computes (never vLLM's default true)
    for key in VLLM_EAGLE3_DEFAULTS:
        assert config[key] is False
    layer = config["transformer_layer_config"]
    assert layer["vocab_size"] == V and layer["hidden_size"] == H and layer["model_type"] == "llama"
    assert layer["num_hidden_layers"] == 1 and not layer.get("bias") and not layer["attention_bias"]
    assert config["draft_vocab_size"] == c.draft_vocab_size < V and config["target_hidden_size"] == H
    # hidden_states indices (the input of layer k), as our head reads them
    assert config["eagle_aux_hidden_state_layer_ids"] == list(c.target_layers)
    assert all(0 <= i <= L for i in config["eagle_aux_hidden_state_layer_ids"])
    # weights: exactly the parameters vLLM builds, each loaded once with its shape; no embedding (shared)
    expected = vllm_eagle3_params(H, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size,
                                  c.draft_vocab_size, H)
    loaded = vllm_loaded_params(tensors)
    assert set(loaded) == set(expected) - {"model.embed_tokens.weight"}
    for name, parts in loaded.items():
        rows = sum(t.shape[0] for t in parts)
        assert [rows, *parts[0].shape[1:]] == expected[name], name
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool and tensors["t2d"].shape == (V,)
    targets = torch.arange(c.draft_vocab_size) + tensors["d2t"]  # target id = i + d2t[i]
    assert torch.equal(targets, heads.draft_to_target(torch.arange(c.draft_vocab_size)))
    assert int(tensors["t2d"].sum()) == c.draft_vocab_size and bool(tensors["t2d"][targets].all())
    assert not any("embed" in k for k in tensors)
    assert "vllm serve" in (tmp_path / "x" / "README.md").read_text()


def test_speculators_round_trip_identical(saved, target, tmp_path):
    out = export_heads(saved, "speculators", tmp_path / "x")
    with pytest.raises(ValueError, match="heads.convert"):
        load_heads(out)
    imported = import_checkpoint(out, target.config, TARGET_NAME)
    _assert_identical(load_heads(saved), imported, target)


def test_speculators_datagen_ids_with_the_final_layer(saved, target, tmp_path):
    """speculators' offline datagen ids carry the verifier's final layer; its resolve_target_layer_ids drops it."""
    out = export_heads(saved, "speculators", tmp_path / "x")
    config = json.loads((out / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [*config["eagle_aux_hidden_state_layer_ids"], L]
    (out / "config.json").write_text(json.dumps(config))
    _assert_identical(load_heads(saved), import_checkpoint(out, target.config, TARGET_NAME), target)


def test_speculators_full_vocabulary_ships_no_mapping(target, tmp_path):
    """Vd = V: vLLM builds no draft_id_to_target_id, so a d2t would be an unexpected weight: none is written."""
    heads = random_heads("eagle3", target)
    heads.config.draft_vocab_size = V
    full = type(heads)(heads.config)
    state = {k: v for k, v in heads.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    full.load_state_dict(state, strict=False)
    full.save_pretrained(tmp_path / "h")
    out = export_heads(tmp_path / "h", "speculators", tmp_path / "x")
    assert not {"d2t", "t2d"} & set(load_file(str(out / "model.safetensors")))
    _assert_identical(load_heads(tmp_path / "h"), import_checkpoint(out, target.config, TARGET_NAME), target)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(speculators_model_type="dflash"),
     r"speculators_model_type 'dflash' is not supported; supported: \['eagle3'\]"),
    (lambda c: c.pop("norm_before_residual"), "no norm_before_residual; vLLM reads that as true"),
    (lambda c: c.update(norm_before_fc=True), "norm_before_fc is True"),
    (lambda c: c.update(embed_requires_grad=True), "embed_requires_grad is true: the checkpoint trained its own"),
])
def test_speculators_import_refusals(saved, target, tmp_path, capsys, edit, message):
    out = export_heads(saved, "speculators", tmp_path / "x")
    config = json.loads((out / "config.json").read_text())
    edit(config)
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        import_checkpoint(out, target.config, TARGET_NAME)
    target.save_pretrained(tmp_path / "target")
    capsys.readouterr()
    with pytest.raises(SystemExit):
        run_cli(convert_main, ["--source", str(out), "--base_model", str(tmp_path / "target"), "--output_dir",
                               str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(out) in err, err


def test_norm_before_residual_checkpoints_import_and_compute_it(saved, target, tmp_path):
    """A speculators checkpoint trained with norm_before_residual (many published ones): imported as such, the
    midlayer's residual is hidden_norm(hidden) (speculators' and vLLM's definition); the speculators and vLLM exports
    write the key true, the SGLang / reference layouts (no such key) refuse the heads."""
    out = export_heads(saved, "speculators", tmp_path / "x")
    config = json.loads((out / "config.json").read_text())
    config["norm_before_residual"] = True
    (out / "config.json").write_text(json.dumps(config))
    heads = import_checkpoint(out, target.config, TARGET_NAME)
    assert heads.config.norm_before_residual is True
    layer = heads.midlayer
    gen = torch.Generator().manual_seed(0)
    hidden, embeds = torch.randn(1, 5, H, generator=gen), torch.randn(1, 5, H, generator=gen)
    positions = torch.arange(5)[None]
    with torch.no_grad():
        got, _ = layer(hidden, positions, inputs_embeds=embeds)
        normed = layer.hidden_norm(hidden)
        cos, sin = layer.rotary(positions, hidden.dtype)
        attn, _ = layer.self_attn(torch.cat([layer.input_layernorm(embeds), normed], -1), cos, sin, None, None)
        want = normed + attn  # the residual is the normalised hidden state
        want = want + layer.mlp(layer.post_attention_layernorm(want))
    assert torch.equal(got, want)
    assert not torch.equal(got, load_heads(saved).midlayer(hidden, positions, inputs_embeds=embeds)[0])
    heads.save_pretrained(tmp_path / "nbr")
    assert json.loads((export_heads(tmp_path / "nbr", "speculators", tmp_path / "s") / "config.json").read_text())[
        "norm_before_residual"] is True
    assert json.loads((export_heads(tmp_path / "nbr", "vllm", tmp_path / "v") / "config.json").read_text())[
        "norm_before_residual"] is True
    _assert_identical(heads, import_checkpoint(tmp_path / "s", target.config, TARGET_NAME), target)
    for to in ("sglang", "eagle"):
        with pytest.raises(ValueError, match=f"--to {to}: these EAGLE-3 heads compute norm_before_residual"):
            export_heads(tmp_path / "nbr", to, tmp_path / to)


def test_speculators_refuses_other_kinds(tmp_path, target):
    random_heads("eagle", target).save_pretrained(tmp_path / "h")
    with pytest.raises(ValueError, match=r"--to speculators: no speculators layout for kind 'eagle'"):
        export_heads(tmp_path / "h", "speculators", tmp_path / "x")


# ---- SpecForge output and the EAGLE reference ----------------------------------------------------------------

SPECFORGE_REQUIRED = ("fc.weight", "norm.weight", "lm_head.weight", "t2d", "d2t")  # specforge/export/to_sglang.py


def _public(out, drop=("specheads",)):
    config = json.loads((out / "config.json").read_text())
    for key in drop:
        config.pop(key, None)
    (out / "config.json").write_text(json.dumps(config))
    return config


def test_specforge_output_round_trip(saved, target, tmp_path):
    """SpecForge's to_sglang export: LlamaForCausalLMEagle3, midlayer.*, the required serving keys, no embedding;
    its draft configs carry SGLang's eagle_config ids, not vLLM's. Also its sharded save_pretrained form with an
    embedding copy (older SpecForge checkpoints)."""
    out = export_heads(saved, "sglang", tmp_path / "sf")
    config = _public(out, ("specheads", "eagle_aux_hidden_state_layer_ids"))
    tensors = load_file(str(out / "model.safetensors"))
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert all(k in tensors for k in SPECFORGE_REQUIRED) and not any("embed" in k.lower() for k in tensors)
    assert all(k in SPECFORGE_REQUIRED or k.startswith("midlayer.") for k in tensors)
    original = load_heads(saved)
    _assert_identical(original, import_checkpoint(out, target.config, TARGET_NAME), target)

    names = sorted(tensors)
    tensors["embed_tokens.weight"] = torch.randn(V, H)
    (out / "model.safetensors").unlink()
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:] + ["embed_tokens.weight"]}
    for file, keys in shards.items():
        save_file({k: tensors[k].contiguous() for k in keys}, str(out / file))
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: file for file, keys in shards.items() for k in keys}}))
    _assert_identical(original, import_checkpoint(out, target.config, TARGET_NAME), target)


@pytest.mark.parametrize("variant", ["eagle3", "eagle"])
def test_eagle_reference_round_trip(variant, target, tmp_path):
    """SafeAILab/EAGLE checkpoints: pytorch_model.bin with an embed_tokens copy, no specheads section."""
    random_heads(variant, target).save_pretrained(tmp_path / "h")
    out = export_heads(tmp_path / "h", "eagle", tmp_path / "ref")
    _public(out)
    tensors = load_file(str(out / "model.safetensors"))
    tensors["embed_tokens.weight"] = torch.randn(V, H)
    (out / "model.safetensors").unlink()
    torch.save(tensors, out / "pytorch_model.bin")
    _assert_identical(load_heads(tmp_path / "h"), import_checkpoint(out, target.config, TARGET_NAME), target)


def _assert_identical(original, imported, target):
    assert imported.config.kind == original.config.kind
    assert imported.config.target_layers == original.config.target_layers
    assert imported.config.draft_vocab_size == original.config.draft_vocab_size
    a, b = original.state_dict(), imported.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    for x, y in zip(head_outputs(original, target), head_outputs(imported, target), strict=True):
        assert torch.equal(x, y)
    assert _decode(original, target) == _decode(imported, target)  # the runtime's output and acceptance


def _decode(heads, target) -> tuple[list[int], list[int]]:
    """Greedy tokens and accepted lengths of our decode loop drafting with `heads` (a fixed 4-node tree)."""
    model = TargetModel(target)
    built = proposer_from_heads(heads, model, HeadsOptions(tree_size="4", allow_off=False), target_name=TARGET_NAME)
    stats = GenerationStats()
    prompt = torch.randint(3, V, (12,), generator=torch.Generator().manual_seed(5))
    config = DecodeConfig(max_new_tokens=24, eos_token_ids=(), speculation=SpeculationConfig(num_speculative_tokens=4))
    tokens = torch.cat(list(generate(model, built.proposer, prompt, config, stats))).tolist()
    return tokens, [s.accepted_length for s in stats.steps]


def test_reduced_vocabulary_note_printed_for_engines_drafting_all_tokens(target, tmp_path, capsys):
    heads = random_heads("eagle", target)
    heads.set_vocab_mapping(*build_vocab_mapping(torch.arange(V), 64))
    heads.save_pretrained(tmp_path / "h")
    export_main(["--heads", str(tmp_path / "h"), "--to", "sglang", "--output_dir", str(tmp_path / "x")])
    printed = capsys.readouterr().out
    assert "note: these heads draft over a reduced vocabulary in specheads (64 of 256 tokens)" in printed
    assert "sglang drafts over all 256 tokens" in printed


def test_speculators_library_reads_export(saved, tmp_path):
    """Where the speculators package is installed: its own config class and EAGLE-3 model take our export (only the
    embedding and the verifier copies, which it ignores on load, are absent)."""
    library = pytest.importorskip("speculators")
    from speculators.models.eagle3.core import Eagle3DraftModel

    out = export_heads(saved, "speculators", tmp_path / "x")
    config = library.SpeculatorModelConfig.from_pretrained(str(out))
    assert config.speculators_model_type == "eagle3" and config.norm_before_residual is False
    expected = Eagle3DraftModel(config).state_dict()
    tensors = load_file(str(out / "model.safetensors"))
    assert set(expected) - set(tensors) == {"embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
    assert set(tensors) <= set(expected)
    assert all(tuple(expected[k].shape) == tuple(t.shape) for k, t in tensors.items())
