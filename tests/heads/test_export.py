"""Exports pass independent engine checkers, and the checkers catch planted mistakes; imports round-trip."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from heads import HeadsConfig, build_heads, load_heads
from heads.convert import import_checkpoint
from heads.convert import main as convert_main
from heads.export import export_heads, plan_export
from heads.export import main as export_main
from tests.heads.engine_checkers import check_eagle, check_eagle3, check_tgi_medusa, check_vllm_medusa
from tests.heads.helpers import TARGET_NAME, head_outputs, save_random_heads
from tests.tiny_models import STORIES260K

H, V, L = 64, 256, 2


@pytest.fixture(scope="module")
def saved(target, tmp_path_factory):
    return save_random_heads(target, tmp_path_factory, ("medusa", "medusa_shared", "eagle", "eagle3", "mtp"))


def _check(engine, kind, path):
    if kind.startswith("medusa"):
        return check_tgi_medusa(path, H, V) if engine == "tgi" else check_vllm_medusa(path, H, V)
    if kind == "eagle3":
        return check_eagle3(path, H, V, L, engine)
    return check_eagle(path, H, V, engine)


CASES = [("medusa", "tgi"), ("medusa", "vllm"), ("medusa_shared", "tgi"), ("eagle", "eagle"), ("eagle", "sglang"),
         ("eagle3", "vllm"), ("eagle3", "sglang"), ("eagle3", "eagle")]


@pytest.mark.parametrize("kind, engine", CASES)
def test_export_passes_engine_checker(saved, tmp_path, kind, engine):
    out = export_heads(saved[kind], engine, tmp_path / "out")
    assert _check(engine, kind, out) == []
    assert (out / "README.md").is_file()


def _plant(path, edit_tensors=None, edit_config=None, weights="model.safetensors"):
    if edit_tensors:
        tensors = load_file(str(path / weights))
        edit_tensors(tensors)
        save_file(tensors, str(path / weights))
    if edit_config:
        config = json.loads((path / "config.json").read_text())
        edit_config(config)
        (path / "config.json").write_text(json.dumps(config))


PLANTED = {
    "eagle3 missing d2t": ("eagle3", "vllm", lambda t: t.pop("d2t"), None, "d2t missing"),
    "eagle3 bias on fc": ("eagle3", "sglang", lambda t: t.update({"fc.bias": torch.zeros(H)}), None, "fc.bias"),
    "eagle3 wrong fc width": ("eagle3", "vllm", lambda t: t.update({"fc.weight": torch.zeros(H, 2 * H)}), None,
                              r"fc.weight: shape \[64, 128\] != \[64, 192\]"),
    "eagle3 d2t outside vocab": ("eagle3", "vllm", lambda t: t["d2t"].__setitem__(-1, 500), None, "outside"),
    "eagle3 t2d inconsistent": ("eagle3", "sglang", lambda t: t["t2d"].__setitem__(slice(None), False), None,
                                "t2d inconsistent"),
    "eagle3 embedding shipped": ("eagle3", "vllm", lambda t: t.update({"embed_tokens.weight": torch.zeros(V, H)}),
                                 None, "embed_tokens"),
    "eagle3 tied embeddings": ("eagle3", "sglang", None, lambda c: c.update(tie_word_embeddings=True),
                               "tie_word_embeddings"),
    "eagle3 wrong architecture": ("eagle3", "vllm", None, lambda c: c.update(architectures=["LlamaForCausalLM"]),
                                  "LlamaForCausalLMEagle3"),
    "eagle3 sglang ids disagree": ("eagle3", "sglang", None,
                                   lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 1, 1]),
                                   "disagree"),
    "medusa vllm bias present without medusa_fc_bias": ("medusa", "vllm", None,
                                                        lambda c: c.update(medusa_fc_bias=False), "would drop"),
    "medusa vllm missing lm_heads": ("medusa", "vllm", lambda t: t.pop("lm_heads.1.weight"), None,
                                     "missing tensor lm_heads.1.weight"),
    "medusa tgi missing bias": ("medusa", "tgi", lambda t: t.pop("0.1.linear.bias"), None, "0.1.linear.bias"),
    "medusa tgi wrong vocab": ("medusa", "tgi", lambda t: t.update({"2.2.weight": torch.zeros(100, H)}), None,
                               r"2.2.weight: shape"),
    "medusa tgi missing config key": ("medusa", "tgi", None, lambda c: c.pop("medusa_num_layers"),
                                      "medusa_num_layers"),
    "medusa tgi architectures key": ("medusa", "tgi", None, lambda c: c.update(architectures=["MedusaModel"]),
                                     "architectures"),
    "medusa tgi shared with 2 blocks": ("medusa_shared", "tgi", None, lambda c: c.update(medusa_num_layers=2),
                                        "asserts medusa_num_layers == 1"),
    "medusa tgi some projections": ("medusa_shared", "tgi", lambda t: t.update({"0.1.weight": torch.zeros(V, H)}),
                                    None, "V2 would ignore"),
    "eagle vllm bias present": ("eagle", "vllm", lambda t: t.update({"fc.bias": torch.zeros(H)}), None, "fc.bias"),
    "eagle sglang bias missing": ("eagle", "sglang", lambda t: t.pop("fc.bias"), None, "missing tensor fc.bias"),
    "eagle input norm present": ("eagle", "eagle",
                                 lambda t: t.update({"layers.0.input_layernorm.weight": torch.ones(H)}), None,
                                 "input_layernorm"),
    "eagle wrong fc width": ("eagle", "sglang", lambda t: t.update({"fc.weight": torch.zeros(H, 3 * H)}), None,
                             r"fc.weight: shape"),
}


@pytest.mark.parametrize("name", list(PLANTED))
def test_checkers_fail_on_planted_mistakes(saved, tmp_path, name):
    kind, engine, edit_tensors, edit_config, expected = PLANTED[name]
    if engine == "vllm" and kind == "eagle":
        src = tmp_path / "nobias"
        heads = load_heads(saved["eagle"])
        heads.config.eagle_fc_bias = False
        clean = build_heads(heads.config)
        clean.load_state_dict({k: v for k, v in heads.state_dict().items() if k != "fc.bias"})
        clean.save_pretrained(src)
    else:
        src = saved[kind]
    out = export_heads(src, engine, tmp_path / "out")
    assert _check(engine, kind, out) == []
    weights = "medusa_lm_head.safetensors" if kind.startswith("medusa") and engine == "tgi" else "model.safetensors"
    _plant(out, edit_tensors, edit_config, weights)
    problems = _check(engine, kind, out)
    assert problems, f"checker accepted planted mistake {name!r}"
    import re
    assert any(re.search(expected, p) for p in problems), problems


def test_unsupported_exports_are_refused(saved, tmp_path):
    with pytest.raises(ValueError, match="no vllm layout for kind 'mtp': no engine loads user-trained MTP.*"
                                         "runtime.generate"):
        export_heads(saved["mtp"], "vllm", tmp_path / "a")
    with pytest.raises(ValueError, match="no sglang layout for kind 'medusa': .*--to tgi"):
        export_heads(saved["medusa"], "sglang", tmp_path / "b")
    with pytest.raises(ValueError, match="no tgi layout for kind 'eagle3': TGI .*--to vllm"):
        export_heads(saved["eagle3"], "tgi", tmp_path / "e")
    with pytest.raises(ValueError, match="--to: expected one of"):
        export_heads(saved["eagle3"], "trt", tmp_path / "c")
    with pytest.raises(ValueError, match="--target: .*vLLM's Medusa loader does not read the target's LM head"):
        export_heads(saved["medusa_shared"], "vllm", tmp_path / "d")
    heads = load_heads(saved["eagle"])  # fc.bias non-zero
    with pytest.raises(ValueError, match="--to vllm: vLLM builds the EAGLE-1/2 fc without a bias.*"
                                         "--eagle_fc_bias false"):
        plan_export(heads, "vllm")


def test_vllm_misreading_bias_true_is_refused(saved, monkeypatch):
    """The silent misload: an EAGLE-1 config.json with `"bias": true` (as --to eagle/sglang once wrote), loaded by
    vLLM, gives q/k/v/o biases that the file does not have (uninitialised: outputs ~1e36, nothing accepted). No
    export writes the key any more, and a plan that would carry it is refused, naming vLLM."""
    for kind, engine in CASES:
        config = plan_export(load_heads(saved[kind]), engine, torch.zeros(V, H)).config
        assert not config.get("bias"), (kind, engine, config.get("bias"))
    heads = load_heads(saved["eagle"])  # trained with an fc bias: SGLang/reference get it as the fc.bias tensor
    assert "fc.bias" in plan_export(heads, "sglang").tensors and "fc.bias" in plan_export(heads, "eagle").tensors
    import heads.export as export_module
    from heads.checkpoint import engine_config

    # Reproduce the condition: engine keys that say "bias": true (what the EAGLE-1 exports used to carry).
    monkeypatch.setattr(export_module, "engine_config", lambda config: {**engine_config(config), "bias": True})
    for engine in ("vllm", "sglang", "eagle"):
        with pytest.raises(ValueError, match=f"--to {engine}: .*'bias': True.*vLLM.*attention biases"):
            plan_export(load_heads(saved["eagle3"]), engine)


def test_default_eagle_heads_export_to_vllm_and_sglang(target, tmp_path):
    """A head built with the defaults (training's --eagle_fc_bias false) exports to vLLM and to SGLang (zero bias)."""
    from training.config import TrainConfig
    from training.methods import heads_config

    config = heads_config(TrainConfig(method="eagle", model=TARGET_NAME), target)
    assert config.eagle_fc_bias is False
    heads = build_heads(config)
    heads.save_pretrained(tmp_path / "h")
    for engine in ("vllm", "sglang", "eagle"):
        out = export_heads(tmp_path / "h", engine, tmp_path / engine)
        assert check_eagle(out, H, V, engine) == []
    assert not load_file(str(tmp_path / "sglang" / "model.safetensors"))["fc.bias"].any()


@pytest.mark.parametrize("kind, engine, command", [
    ("eagle3", "vllm", "speculative_config={\"method\": \"eagle3\""), ("eagle3", "vllm", "vllm serve BASE"),
    ("medusa", "vllm", "\"method\": \"medusa\""), ("eagle", "sglang", "--speculative-algorithm EAGLE "),
    ("eagle3", "sglang", "--speculative-algorithm EAGLE3"), ("medusa", "tgi", "text-generation-launcher"),
    ("eagle", "eagle", "EaModel.from_pretrained")])
def test_export_readme_names_engine_and_load_command(saved, tmp_path, kind, engine, command):
    out = export_heads(saved[kind], engine, tmp_path / "out")
    card = (out / "README.md").read_text()
    assert f"`{engine}` layout" in card and command in card, card


def test_shared_lm_head_medusa_exports(tmp_path):
    """TGI loads shared-LM-head heads with one block as they are (MedusaHeadV2); vLLM gets one copy of the target's
    LM head (original_lm_head), TGI with two blocks a copy per head; every layout reads back to the same logits."""
    from heads.loading import load_model
    model = load_model(str(STORIES260K), dtype="float32")
    hidden = torch.randn(1, 3, 64)

    def shared_heads(layers):
        config = HeadsConfig.for_target("medusa", model.config, str(STORIES260K), medusa_num_heads=2,
                                        medusa_num_layers=layers, medusa_shared_lm_head=True)
        heads = build_heads(config)
        with torch.no_grad():
            for p in heads.parameters():
                p.normal_(0, 0.1)
        heads.save_pretrained(tmp_path / f"h{layers}")
        with torch.no_grad():
            return heads(hidden, lm_head=model.lm_head)

    expected = shared_heads(1)
    export_main(["--heads", str(tmp_path / "h1"), "--to", "tgi", "--output_dir", str(tmp_path / "tgi")])
    assert check_tgi_medusa(tmp_path / "tgi", 64, 512) == []
    assert sorted(load_file(str(tmp_path / "tgi" / "medusa_lm_head.safetensors"))) == [
        "0.0.linear.bias", "0.0.linear.weight", "1.0.linear.bias", "1.0.linear.weight"]
    exported = load_heads(tmp_path / "tgi", target=model)  # our loader reads the TGI layout back
    with torch.no_grad():
        torch.testing.assert_close(exported(hidden, lm_head=model.lm_head), expected, rtol=0, atol=0)

    export_main(["--heads", str(tmp_path / "h1"), "--to", "vllm", "--output_dir", str(tmp_path / "vllm"),
                 "--target", str(STORIES260K)])
    assert check_vllm_medusa(tmp_path / "vllm", 64, 512) == []
    assert json.loads((tmp_path / "vllm" / "config.json").read_text())["original_lm_head"] is True
    imported = import_checkpoint(tmp_path / "vllm", model.config, str(STORIES260K))  # a projection per head
    with torch.no_grad():
        torch.testing.assert_close(imported(hidden), expected)  # per-head matmuls: rounding only

    expected = shared_heads(2)
    with pytest.raises(ValueError, match="TGI loads shared-LM-head Medusa .* only with medusa_num_layers 1"):
        export_heads(tmp_path / "h2", "tgi", tmp_path / "refused")
    export_main(["--heads", str(tmp_path / "h2"), "--to", "tgi", "--output_dir", str(tmp_path / "tgi2"),
                 "--target", str(STORIES260K)])
    assert check_tgi_medusa(tmp_path / "tgi2", 64, 512) == []
    with torch.no_grad():
        torch.testing.assert_close(load_heads(tmp_path / "tgi2", target=model)(hidden), expected)


@pytest.mark.parametrize("kind, engine", [("medusa", "vllm"), ("medusa", "tgi"), ("eagle", "sglang"),
                                          ("eagle3", "sglang")])
def test_import_public_layouts_round_trip(saved, target, tmp_path, kind, engine):
    """A directory in an engine's layout without our 'specheads' section imports to the same head."""
    out = export_heads(saved[kind], engine, tmp_path / "public")
    config = json.loads((out / "config.json").read_text())
    config.pop("specheads", None)
    if kind == "eagle3":  # a public EAGLE-3 checkpoint that only carries SGLang's ids
        config.pop("eagle_aux_hidden_state_layer_ids")
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="heads.convert"):
        load_heads(out)
    imported = import_checkpoint(out, target.config, TARGET_NAME)
    original = load_heads(saved[kind])
    assert imported.config.target_layers == original.config.target_layers
    for a, b in zip(head_outputs(original, target), head_outputs(imported, target), strict=True):
        assert torch.equal(a, b)


def test_convert_cli_pytorch_bin_and_embedding_dropped(saved, target, tmp_path):
    """EAGLE reference checkpoints are often pytorch_model.bin with an embed_tokens copy; both handled."""
    out = export_heads(saved["eagle"], "eagle", tmp_path / "ref")
    tensors = load_file(str(out / "model.safetensors"))
    tensors["embed_tokens.weight"] = torch.zeros(V, H)
    (out / "model.safetensors").unlink()
    torch.save(tensors, out / "pytorch_model.bin")
    config = json.loads((out / "config.json").read_text())
    config.pop("specheads")
    (out / "config.json").write_text(json.dumps(config))
    target.save_pretrained(tmp_path / "target")
    convert_main(["--source", str(out), "--base_model", str(tmp_path / "target"), "--output_dir",
                  str(tmp_path / "ours")])
    imported = load_heads(tmp_path / "ours", target=target, target_name=str(tmp_path / "target"))
    original = load_heads(saved["eagle"])
    for a, b in zip(head_outputs(original, target), head_outputs(imported, target), strict=True):
        assert torch.equal(a, b)


def test_import_refuses_unknown_and_truncated(tmp_path, target):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text("{}")
    save_file({"foo": torch.zeros(2)}, str(tmp_path / "x" / "model.safetensors"))
    with pytest.raises(ValueError, match="unrecognised checkpoint"):
        import_checkpoint(tmp_path / "x", target.config, "m")
    shutil.rmtree(tmp_path / "x")
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1}))
    (tmp_path / "x" / "medusa_lm_head.safetensors").write_bytes(b"\x10\x00\x00")
    with pytest.raises(ValueError, match="corrupt or truncated"):
        import_checkpoint(tmp_path / "x", target.config, "m")


def test_export_readme_says_an_engine_drafts_the_full_vocabulary(saved):
    """EAGLE-1/Medusa layouts have no draft vocabulary: the card says acceptance there can differ from ours."""
    from dataclasses import replace

    from heads.export import load_instructions

    for kind, engine in (("eagle", "vllm"), ("medusa", "tgi")):
        config = load_heads(saved[kind]).config
        assert "reduced vocabulary" not in load_instructions(config, engine)
        card = load_instructions(replace(config, draft_vocab_size=V // 2), engine)
        assert f"reduced vocabulary in specheads ({V // 2:,} of {V:,} tokens" in card, card
