"""runtime.layout: transposed weight storage changes kernels, not values; auto measures; transformers' reference
runs on the weights as loaded."""

from __future__ import annotations

import json

import pytest
import torch

from bench.common import hf_generation_config, run_hf, run_ours
from runtime import layout
from runtime.config import DecodeConfig, SpeculationConfig
from runtime.layout import as_loaded, choose_layout, layout_of, linear_weights, model_fingerprint, set_layout
from runtime.proposers import PromptLookupProposer
from runtime.target import TargetModel
from tests.tiny_models import stories260k


def test_transposed_storage_keeps_values_and_ties():
    model = stories260k()
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
        set_layout(model, "transposed")
        assert layout_of(model) == "transposed" and model.lm_head.weight is model.model.embed_tokens.weight
        assert all(not w.is_contiguous() and w.t().is_contiguous() for w in linear_weights(model))
        after = model(ids).logits
        set_layout(model, "transposed")  # idempotent
        assert layout_of(model) == "transposed"
        set_layout(model, "rows")
        assert layout_of(model) == "rows" and all(w.is_contiguous() for w in linear_weights(model))
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="rows.*transposed"):
        set_layout(model, "columns")


@pytest.mark.parametrize("storage", ["rows", "transposed"])
def test_packed_copy_serves_many_rows_and_keeps_single_row_kernels(storage):
    """`+packed`: products of 2+ rows through oneDNN's packed copy (same values to rounding), one row and autograd
    through the stored weight (bit-identical), ties kept, removed cleanly."""
    model = stories260k()
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before, one_before = model(ids).logits, model(ids[:, :1]).logits
        set_layout(model, f"{storage}+packed")
        assert layout_of(model) == f"{storage}+packed"
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert all(m.__dict__.get(layout._PACKED) is not None for m in layout.linear_modules(model))
        after, one_after = model(ids).logits, model(ids[:, :1]).logits
    if storage == "rows":  # one row: the very kernel it ran before packing
        assert torch.equal(one_after, one_before)
    torch.testing.assert_close(one_after, one_before, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    loss = model(ids, labels=ids).loss  # grad mode: the stored weight, so training still works
    loss.backward()
    assert model.lm_head.weight.grad is not None
    set_layout(model, storage)
    assert layout_of(model) == storage and "forward" not in model.lm_head.__dict__
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=1e-5, atol=1e-5)


def test_packed_from_n_rows_keeps_fewer_rows_on_the_stored_kernel():
    model = stories260k()
    ids = torch.randint(0, 512, (1, 3), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        two_before, three_before = model(ids[:, :2]).logits, model(ids).logits
        set_layout(model, "rows+packed3")
        assert layout_of(model) == "rows+packed3"
        assert torch.equal(model(ids[:, :2]).logits, two_before)  # 2 rows: the stored weight's kernel
        torch.testing.assert_close(model(ids).logits, three_before, rtol=1e-5, atol=1e-5)
        set_layout(model, "rows+packed2")
        assert layout_of(model) == "rows+packed"  # 2 is the default and the canonical name drops it
    for bad in ("rows+packed1", "packed", "rows+packed0", "transposed+pack"):
        with pytest.raises(ValueError, match="--weight_layout"):
            layout.check_layout(bad)


def test_panels_serve_few_rows_and_leave_prefill_and_autograd_to_the_stored_weight():
    """`+panels`: 1-16 rows through the compiled kernel (same values to rounding), more rows and autograd through the
    stored weight (bit-identical), ties kept, removed cleanly; bf16 refused naming the flag."""
    from runtime import kernels

    if kernels.library() is None:
        pytest.skip(kernels.unavailable_reason())
    model = stories260k()
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before, few_before = model(ids).logits, model(ids[:, :5]).logits
        set_layout(model, "transposed+panels")
        assert layout_of(model) == "transposed+panels"
        assert model.lm_head.weight is model.model.embed_tokens.weight
        panels = [m.__dict__.get(layout._PANELS) for m in layout.linear_modules(model)]
        assert all(p is not None for p in panels) and model.lm_head.__dict__[layout._PANELS] is not None
        after, few_after = model(ids).logits, model(ids[:, :5]).logits
    set_layout(model, "rows")
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)  # 24 rows: the stored weight's kernel, panels never used
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(few_after, few_before, rtol=1e-5, atol=1e-5)
    set_layout(model, "rows+panels")
    loss = model(ids[:, :5], labels=ids[:, :5]).loss  # grad mode: the stored weight
    loss.backward()
    assert model.lm_head.weight.grad is not None
    set_layout(model, "rows")
    assert layout_of(model) == "rows" and "forward" not in model.lm_head.__dict__
    with pytest.raises(ValueError, match="--weight_layout \\+panels.*float32 or bfloat16"):
        set_layout(stories260k().to(torch.float64), "rows+panels")


def test_bfloat16_panels_serve_every_row_count():
    """A bfloat16 model's panels are bfloat16 and serve prefill too (torch emulates bf16 products on CPUs without
    AVX512-BF16/AMX): 24 rows (prefill) and 5 rows go through the kernel and stay within bf16 rounding of the stored
    weight's forward (the kernel's own row-count invariance is tested in test_kernels; torch's bf16 attention is not
    invariant to the number of queries)."""
    from runtime import kernels

    if kernels.library() is None:
        pytest.skip(kernels.unavailable_reason())
    model = stories260k().to(torch.bfloat16)
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits.float()
        set_layout(model, "rows+panels")
        assert model.lm_head.__dict__[layout._PANELS].dtype == torch.bfloat16
        after, few = model(ids).logits, model(ids[:, :5]).logits
    assert (after[:, :5] - few).abs().max() < 0.25
    assert (after.float() - before).abs().max() < 0.25 and (after.float().argmax(-1) == before.argmax(-1)).float().mean() > 0.9


def test_float32_weights_that_are_bf16_values_get_bf16_panels_with_the_same_products():
    """A bf16 checkpoint loaded in float32: every weight is a bfloat16 value, so `+panels` stores bf16 panels (half
    the bytes) and every product equals the float32 panels' to the last bit; the layout name does not change."""
    from runtime import kernels

    if kernels.library() is None:
        pytest.skip(kernels.unavailable_reason())
    model = stories260k()
    with torch.no_grad():
        for weight in linear_weights(model):
            weight.copy_(weight.to(torch.bfloat16).float())
    set_layout(model, "rows+panels")
    assert layout_of(model) == "rows+panels"
    module = model.model.layers[0].mlp.down_proj
    assert module.__dict__[layout._PANELS].dtype == torch.bfloat16
    x = torch.randn(5, module.in_features, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(module(x), kernels.panel_linear(x, kernels.pack_panels(module.weight), module.out_features))


def test_panels_bf16_round_float32_weights_for_every_row_count_and_leave_the_stored_weight():
    """`+panels_bf16`: the panels hold the weights rounded to bfloat16 and serve prefill too, so the forward is the
    rounded model's in float32 (activations, attention, cache and the tied embedding lookups stay as they were); back
    to `rows`, the stored weights
    give the original logits bit for bit; refused for weights that are not float32; speculative output equals plain
    decoding on the same layout."""
    import copy

    from runtime import kernels
    from runtime.proposers import Autoregressive

    if kernels.library() is None:
        pytest.skip(kernels.unavailable_reason())
    model = stories260k()
    rounded = copy.deepcopy(model)
    rounded.model.embed_tokens.weight = torch.nn.Parameter(model.model.embed_tokens.weight.clone())  # lookups unrounded
    with torch.no_grad():
        for weight in linear_weights(rounded):
            weight.copy_(weight.to(torch.bfloat16).float())
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before, reference = model(ids).logits, rounded(ids).logits
        set_layout(model, "transposed+panels_bf16")
        assert layout_of(model) == "transposed+panels_bf16"
        assert model.lm_head.__dict__[layout._PANELS].dtype == torch.bfloat16
        after, few = model(ids).logits, model(ids[:, :5]).logits
    torch.testing.assert_close(after, reference, rtol=1e-4, atol=1e-4)  # 24 rows: the panels too
    torch.testing.assert_close(few, reference[:, :5], rtol=1e-4, atol=1e-4)
    assert (after - before).abs().max() > 10 * (after - reference).abs().max()  # the rounding shows
    target = TargetModel(model)
    prompt = torch.tensor([1, 403, 407, 261, 400, 292, 327, 471, 263, 403, 407])
    config = DecodeConfig(max_new_tokens=40, eos_token_ids=(), speculation=SpeculationConfig(num_speculative_tokens=4))
    plain = run_ours(target, Autoregressive(), prompt, config)
    ours = run_ours(target, PromptLookupProposer(), prompt, config)
    assert ours.tokens == plain.tokens and ours.stats.drafted_per_depth[0] > 0
    set_layout(model, "rows")
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    with pytest.raises(ValueError, match="\\+panels_bf16.*bfloat16"):
        set_layout(stories260k().to(torch.bfloat16), "rows+panels_bf16")


def test_panels_win_only_when_faster_overall_and_not_slower_at_one_token():
    base = [0.060, 0.090, 0.100, 0.110, 0.130]
    assert layout.panels_win(base, [0.058, 0.065, 0.075, 0.080, 0.100])
    assert not layout.panels_win(base, [0.066, 0.065, 0.075, 0.080, 0.100])  # plain decoding 10% slower
    assert not layout.panels_win(base, [0.059, 0.088, 0.098, 0.108, 0.125])  # under MIN_GAIN summed


def test_panels_win_when_their_one_token_step_is_clearly_faster_whatever_verifies_cost():
    """Measured on an AVX512-BF16 CPU in bf16: a 1-token step 62 ms rows+packed, 42 ms with panels, while the packed
    copy verifies 2-8 tokens faster. Plain decoding (every drafter's fallback) must run on the fastest one-row
    layout, so panels are kept although they lose summed over the verify sizes."""
    base = [0.062, 0.039, 0.038, 0.040, 0.045]
    panels = [0.042, 0.035, 0.044, 0.050, 0.072]
    assert sum(panels) > sum(base) and layout.panels_win(base, panels)
    assert not layout.panels_win(base, [0.060, 0.035, 0.044, 0.050, 0.072])  # within MIN_GAIN at 1 token: summed


def test_packed_min_rows_is_where_packing_wins_from_there_on():
    probe = (2, 3, 4, 8)
    base = [0.090, 0.100, 0.123, 0.137]
    assert layout.packed_min_rows(probe, base, [0.095, 0.097, 0.110, 0.123]) == 3
    assert layout.packed_min_rows(probe, base, [0.080, 0.090, 0.110, 0.120]) == 2
    assert layout.packed_min_rows(probe, base, [0.080, 0.090, 0.110, 0.138]) is None  # slower at the largest
    assert layout.packed_min_rows(probe, base, [0.080, 0.101, 0.110, 0.120]) == 4  # slower at 3
    assert layout.packed_min_rows(probe, base, [0.095, 0.099, 0.121, 0.136]) is None  # under MIN_GAIN in all


@pytest.mark.parametrize("weights", ["transposed", "transposed+packed", "rows+panels", "transposed+panels"])
def test_greedy_identity_against_transformers_on_the_weights_as_loaded(weights):
    """Our loop (plain and prompt lookup) on re-laid weights == transformers' generate on the loaded ones; the tree
    verify forward equals per-path forwards."""
    from runtime import kernels
    from runtime.verify_check import check_mode

    if weights.endswith("+panels") and kernels.library() is None:
        pytest.skip(f"no panel kernel here: {kernels.unavailable_reason()}")
    model = stories260k()
    target = TargetModel(model)
    set_layout(model, weights)
    prompt = torch.tensor([1, 403, 407, 261, 400, 292, 327, 471, 263, 403, 407])
    config = DecodeConfig(max_new_tokens=40, eos_token_ids=(), speculation=SpeculationConfig(num_speculative_tokens=4))
    reference = run_hf(model, prompt, hf_generation_config(model, config), None)
    assert layout_of(model) == weights  # put back after the reference run
    ours = run_ours(target, PromptLookupProposer(), prompt, config)
    assert ours.tokens == reference.tokens and ours.stats.drafted_per_depth[0] > 0  # it drafted
    assert check_mode(model, "tree") < 1e-4  # tree forward == per-path causal forwards (raises beyond tolerance)


def test_as_loaded_restores_the_layout_after_an_error():
    model = stories260k()
    set_layout(model, "transposed")
    with pytest.raises(RuntimeError), as_loaded(model):
        assert layout_of(model) == "rows"
        raise RuntimeError("boom")
    assert layout_of(model) == "transposed"


def test_auto_measures_once_and_keys_cost_curves(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    model = stories260k()
    target = TargetModel(model)
    assert choose_layout(target, "auto") == "rows"  # under MIN_PARAMETERS: nothing measured
    assert not (tmp_path / "layouts").exists()
    rows_key = model_fingerprint(model)
    assert choose_layout(target, "transposed") == "transposed" and model_fingerprint(model) == rows_key + "-transposed"
    monkeypatch.setattr(layout, "MIN_PARAMETERS", 0)
    target.max_positions = 64  # measured within the model's context (256 would not fit)
    chosen = choose_layout(target, "auto")
    assert [f.suffix for f in (tmp_path / "layouts").iterdir()] == [".json"] and layout_of(model) == chosen

    def fail(*args, **kwargs):
        raise AssertionError("measured again instead of reading the cache")

    monkeypatch.setattr(layout, "measure_layouts", fail)
    monkeypatch.setattr(layout, "measure_packing", fail)
    monkeypatch.setattr(layout, "measure_panels", fail)
    assert choose_layout(target, "auto") == chosen  # read back: the same kernels on every run
    assert choose_layout(target, "rows+packed") == "rows+packed"
    assert choose_layout(target, "rows+packed2") == "rows+packed"
    assert model_fingerprint(model) == rows_key + "-rows+packed"
    with pytest.raises(ValueError, match="--weight_layout"):
        choose_layout(target, "fast")


def test_auto_skips_packing_that_would_not_fit(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    model = stories260k()
    needed = sum(w.numel() * w.element_size() for w in linear_weights(model))
    assert layout.packing_fits(model, available=2 * needed)[0]
    fits, why = layout.packing_fits(model, available=needed)
    assert not fits and "GiB available" in why
    monkeypatch.setattr(layout, "MIN_PARAMETERS", 0)
    monkeypatch.setattr(layout, "available_memory_bytes", lambda: needed)
    monkeypatch.setattr(layout, "measure_packing", lambda *a, **k: pytest.fail("measured packing that cannot fit"))
    target = TargetModel(model)
    target.max_positions = 64
    assert not choose_layout(target, "auto").endswith("+packed")
    saved = json.loads(next((tmp_path / "layouts").iterdir()).read_text())
    assert "verify_seconds" not in saved  # measured on a later run, when the copy fits


def test_bf16_weights_pack_or_are_refused_cleanly():
    """oneDNN packs bf16 weights only on CPUs with native bf16; elsewhere an error naming the flag, nothing left
    half-packed."""
    model = stories260k().to(torch.bfloat16)
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = model(ids).logits.float()
    try:
        set_layout(model, "rows+packed")
    except ValueError as error:
        assert "--weight_layout +packed" in str(error) and "bfloat16" in str(error)
        assert layout_of(model) == "rows" and not any(layout._PACKED in m.__dict__ for m in layout.linear_modules(model))
        return
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits.float(), before, rtol=2e-2, atol=2e-2)


def test_packing_leaves_foreign_forward_wrappers_alone():
    """A Linear whose forward another library replaced (accelerate's hooks do) keeps that forward, unpacked."""
    model = stories260k()
    wrapped = model.lm_head
    calls = []

    def hooked(x, original=wrapped.forward):
        calls.append(x.shape)
        return original(x)

    wrapped.forward = hooked
    set_layout(model, "rows+packed")
    assert wrapped.__dict__["forward"] is hooked and layout._PACKED not in wrapped.__dict__
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    assert calls
    set_layout(model, "rows")
    assert wrapped.__dict__["forward"] is hooked
