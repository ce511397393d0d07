"""The load-time verify self-check: the mode it picks per family, that it catches what it claims (deliberately
broken adapters), its on-disk cache, degraded modes staying greedy-identical, and one-line errors."""

import functools
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

import runtime.target
from heads.cli import run_cli
from runtime.cli import main
from runtime.config import DecodeConfig, SpeculationConfig
from runtime.loop import GenerationStats, generate
from runtime.proposers import Autoregressive, DraftModelProposer, PromptLookupProposer
from runtime.proposers.factory import HeadsOptions, proposer_from_heads
from runtime.target import TargetError, TargetModel
from runtime.verify_check import check_mode, choose_mode, prepare_target, verify_check
from tests.runtime.test_generate import perturbed_copy, reference
from tests.runtime.test_head_proposers import make_heads
from tests.tiny_models import ARCHITECTURES, DEGRADED, STORIES260K, stories260k, tiny_model


def _model(arch, **kwargs):
    model = tiny_model(arch, **kwargs)
    model.generation_config.eos_token_id = None  # random models emit EOS anywhere
    return model


def _run(target, proposer, prompt, new_tokens=40):
    config = DecodeConfig(max_new_tokens=new_tokens, eos_token_ids=(),
                          speculation=SpeculationConfig(max(getattr(proposer, "tree_size", 4), 1)))
    stats = GenerationStats()
    return torch.cat(list(generate(target, proposer, prompt, config, stats))), stats


def _prompt(seed=0):
    part = torch.randint(3, 256, (10,), generator=torch.Generator().manual_seed(seed))
    return torch.cat([part, part[:5]])  # a repeat, so prompt lookup finds matches


@pytest.mark.parametrize("arch", ARCHITECTURES + list(DEGRADED))
def test_mode_chosen_per_family(arch, capsys):
    model = tiny_model(arch)
    expected = DEGRADED.get(arch, "tree")
    if expected == "refused":
        with pytest.raises(TargetError, match=f"{type(model).__name__}.*recurrent state"):
            prepare_target(model)
    else:
        assert prepare_target(model).mode == expected
    line = capsys.readouterr().err.strip()
    if expected != "refused":  # a refusal prints nothing but its error line (the CLI test below)
        assert line.count("\n") == 0 and line.startswith("verify check: ")
        assert {"tree": "trees ok", "chain": "chains only", "plain": "plain decoding only"}[expected] in line


@pytest.mark.parametrize("arch", ["falcon", "bloom", "mpt"])
def test_chain_mode_is_greedy_identical(arch):
    """ALiBi families verify chains through their own causal path: draft model, prompt lookup and every kind
    of heads (trees turned into chains by the factory) reproduce HF's greedy output."""
    model, prompt = _model(arch), _prompt()
    target = prepare_target(model)
    assert target.mode == "chain"
    expected = reference(model, prompt, 40)
    out, stats = _run(target, DraftModelProposer(perturbed_copy(model), 256, mode="chain"), prompt)
    assert torch.equal(out, expected) and stats.tau > 1.2
    assert torch.equal(_run(target, PromptLookupProposer(), prompt)[0], expected)
    for kind in ("medusa", "eagle", "eagle3", "mtp"):
        built = proposer_from_heads(make_heads(kind, model), target, HeadsOptions(tree_size="3"),
                                    target_name="tiny-target")
        out, stats = _run(target, built.proposer, prompt)
        assert torch.equal(out, expected), kind
        assert all(s.drafted_nodes == s.drafted_depth for s in stats.steps), f"{kind} drafted a tree"


def test_plain_mode_is_greedy_identical_and_drafts_nothing(monkeypatch):
    """DeepSeek-V3 with fewer KV heads than query heads breaks on multi-token forwards over a cache when
    transformers' sdpa integration repeats the K/V heads itself (its path with a mask on CUDA; on CPU the target
    keeps GQA in torch's kernel and verifies trees, see ARCHITECTURES): plain decoding only, still identical."""
    import contextlib

    from runtime import target as target_module

    monkeypatch.setattr(target_module, "_grouped_kv_in_kernel", lambda enabled: contextlib.nullcontext())
    model, prompt = _model("deepseek_v3_gqa"), _prompt()
    target = prepare_target(model)
    assert target.mode == "plain"
    assert torch.equal(_run(target, Autoregressive(), prompt)[0], reference(model, prompt, 40))
    built = proposer_from_heads(make_heads("eagle", model), target, HeadsOptions(tree_size="3"))
    assert isinstance(built.proposer, Autoregressive) and "speculation off" in built.description
    with pytest.raises(ValueError, match="plain mode"):
        _run(target, PromptLookupProposer(), prompt)


# ------------------------------------------------------------- broken adapters: the check catches them


def _wrap_forward(model, change):
    """Replace model.forward by change(original, kwargs) (functools.wraps keeps the signature visible)."""
    original = model.forward

    @functools.wraps(original)
    def forward(*args, **kwargs):
        return change(original, args, kwargs)

    model.forward = forward
    return model


def _is_4d(mask) -> bool:
    return isinstance(mask, dict) or (mask is not None and mask.ndim == 4)  # dict: one mask per layer type


def _ignore_4d_mask(original, args, kwargs):
    if _is_4d(kwargs.get("attention_mask")):
        kwargs["attention_mask"] = None  # the model's own causal mask instead of the tree mask
    return original(*args, **kwargs)


def _reject_4d_mask(original, args, kwargs):
    if _is_4d(kwargs.get("attention_mask")):
        raise ValueError("4D attention masks are not supported")
    return original(*args, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_check_catches_a_mask_the_model_ignores(dtype):
    model = _wrap_forward(tiny_model("llama", dtype=dtype), _ignore_4d_mask)
    with pytest.raises(Exception, match="tree forward, path .* differs from the model's causal forward"):
        check_mode(model, "tree")
    result = choose_mode(model)
    assert result.mode == "chain" and "relative error" in result.reason and "trees on eager" in result.reason
    assert check_mode(tiny_model("llama", dtype=dtype), "tree") < 0.05  # the same model unbroken passes


def test_check_catches_a_model_that_rejects_4d_masks():
    result = choose_mode(_wrap_forward(tiny_model("qwen3"), _reject_4d_mask))
    assert result.mode == "chain" and "4D attention masks are not supported" in result.reason


def test_check_catches_a_broken_compaction(monkeypatch):
    """Compaction that only crops (keeps the first nodes, not the accepted ones): trees fail, chains (whose
    accepted nodes are always the first ones) pass."""
    def crop_only(cache, lengths, slots, num_nodes, keeps):
        cache.crop(-(num_nodes - len(keeps[0]))) if num_nodes > len(keeps[0]) else None
        return [length + len(keep) for length, keep in zip(lengths, keeps, strict=True)]

    monkeypatch.setattr(runtime.target, "compact_rows", crop_only)
    with pytest.raises(Exception, match="compacted cache"):
        check_mode(tiny_model("llama"), "tree")
    assert choose_mode(tiny_model("llama")).mode == "chain"


def test_check_switches_attention_when_only_the_other_one_works():
    model = tiny_model("llama", attn="sdpa")
    original = model.forward

    @functools.wraps(original)
    def forward(*args, **kwargs):
        if model.config._attn_implementation == "sdpa":
            return _ignore_4d_mask(original, args, kwargs)
        return original(*args, **kwargs)

    model.forward = forward
    result = choose_mode(model)
    assert (result.mode, result.attn_implementation) == ("tree", "eager")
    assert model.config._attn_implementation == "eager"


def test_fp64_and_bf16_models_pass():
    assert choose_mode(tiny_model("qwen3", dtype=torch.float64)).max_error < 1e-9
    assert choose_mode(tiny_model("llama", dtype=torch.bfloat16)).mode == "tree"


# ------------------------------------------------------------- cache


def test_result_cached_per_model_and_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    tiny_model("mpt").save_pretrained(tmp_path / "mpt")
    load = functools.partial(AutoModelForCausalLM.from_pretrained, tmp_path / "mpt", attn_implementation="eager")
    first = verify_check(load())
    assert not first.cached and first.mode == "chain"
    assert not verify_check(tiny_model("mpt")).cached  # built in memory: never cached
    monkeypatch.setattr("runtime.verify_check.choose_mode", lambda model: pytest.fail("cached: must not re-check"))
    second = verify_check(load())
    assert second.cached and (second.mode, second.reason) == (first.mode, first.reason)
    assert "cached" in second.line()
    weights = next((tmp_path / "mpt").glob("*.safetensors"))
    os.utime(weights, (weights.stat().st_atime, weights.stat().st_mtime + 10))  # new mtime: checked again
    with pytest.raises(pytest.fail.Exception, match="must not re-check"):
        verify_check(load())


# ------------------------------------------------------------- one-line errors from the CLI


def _cli(monkeypatch, capsys, model, *flags, lines=None):
    monkeypatch.setenv("SPECHEADS_CACHE", str(capsys and __import__("tempfile").mkdtemp()))
    monkeypatch.setattr("runtime.build.load_model", lambda *args, **kwargs: model)
    with pytest.raises(SystemExit) as exit_info:
        run_cli(main, ["--model", str(STORIES260K), "--prompt", "Once upon a time", "--max_new_tokens", "40",
                       *flags])
    assert exit_info.value.code == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("[transformers]")]
    assert lines is None or len(err) == lines, err
    return err[-1]


def test_refused_model_is_one_line_exit_2(monkeypatch, capsys):
    line = _cli(monkeypatch, capsys, tiny_model("mamba"), lines=1)
    assert line.startswith("error: --model") and "MambaForCausalLM" in line and "cannot be rolled back" in line


def test_model_raising_inside_verification_is_one_line(monkeypatch, capsys):
    """A context limit the config does not state: the forward raises once positions pass 30, after the
    self-check (which stays below) passed. The error names the model class and the step."""
    def limited(original, args, kwargs):
        positions = kwargs.get("position_ids")
        if positions is not None and int(positions.max()) >= 30:
            raise IndexError("index out of range in self")
        return original(*args, **kwargs)

    line = _cli(monkeypatch, capsys, _wrap_forward(stories260k(), limited), "--method", "prompt_lookup",
                "--num_speculative_tokens", "5")  # a fixed length: no cost curve is measured before generating
    assert "LlamaForCausalLM" in line and "verify forward" in line and "IndexError" in line
    target = TargetModel(_wrap_forward(stories260k(), limited))
    with pytest.raises(TargetError, match="prefill forward of 40 tokens"):
        target.prefill(torch.arange(3, 43))


def test_loader_falls_back_to_eager_when_a_family_has_no_sdpa(tmp_path):
    """Bloom/MPT/Mamba have no sdpa path: the loader says so in one warning and loads eager, so that the verify
    check (not transformers' load error) decides what the model supports."""
    from heads.loading import load_model

    tiny_model("bloom").save_pretrained(tmp_path / "bloom")
    with pytest.warns(UserWarning, match="--attn_implementation sdpa.*loaded with eager"):
        model = load_model(str(tmp_path / "bloom"), attn_implementation="sdpa")
    assert model.config._attn_implementation == "eager"


def test_grouped_kv_switch_is_set_only_around_our_own_cpu_forwards(monkeypatch):
    """On CPU with sdpa the target asks transformers to keep grouped K/V heads in torch's kernel for its own forwards
    (TRANSFORMERS_SDPA_FORCE_GQA), and for nothing else: the switch is gone after each forward, and a value the
    user set is left alone."""
    import os

    monkeypatch.delenv("TRANSFORMERS_SDPA_FORCE_GQA", raising=False)
    seen = []

    def record(original, args, kwargs):
        seen.append(os.environ.get("TRANSFORMERS_SDPA_FORCE_GQA"))
        return original(*args, **kwargs)

    model, prompt = _model("llama"), _prompt()  # 4 query heads over 2 K/V heads
    expected = reference(model, prompt, 12)  # transformers' generate: no switch
    target = TargetModel(_wrap_forward(model, record))
    out, _ = _run(target, PromptLookupProposer(), prompt, new_tokens=12)
    assert torch.equal(out, expected)
    assert seen and set(seen) == {"1"} and "TRANSFORMERS_SDPA_FORCE_GQA" not in os.environ
    monkeypatch.setenv("TRANSFORMERS_SDPA_FORCE_GQA", "0")
    seen.clear()
    _run(target, PromptLookupProposer(), prompt, new_tokens=4)
    assert set(seen) == {"0"} and os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] == "0"
