"""runtime.kernels: the compiled small-row product equals F.linear, does not depend on the rows beside it, and is
refused cleanly where it cannot be built."""

from __future__ import annotations

import pytest
import torch

from runtime import kernels

pytestmark = pytest.mark.skipif(kernels.library() is None, reason=f"no panel kernel: {kernels.unavailable_reason()}")


@pytest.mark.parametrize(("out_features", "in_features", "bias"), [(64, 48, False), (37, 29, True), (5, 576, True)])
def test_panel_linear_equals_linear_for_every_row_count(out_features, in_features, bias):
    generator = torch.Generator().manual_seed(out_features)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=generator))
    panels = kernels.pack_panels(linear.weight)
    assert panels.shape == (-(-out_features // 8), in_features, 8) and panels.is_contiguous()
    x = torch.randn(2, 15, in_features, generator=generator)  # 30 rows: three passes of 10
    with torch.no_grad():
        full = kernels.panel_linear(x, panels, out_features, linear.bias)
        torch.testing.assert_close(full, linear(x), rtol=1e-5, atol=1e-4)
        flat = full.reshape(-1, out_features)
        for rows in (1, 2, 3, 4, 5, 7, 8, 12, 13, 16):
            part = kernels.panel_linear(x.reshape(-1, in_features)[:rows], panels, out_features, linear.bias)
            assert torch.equal(part, flat[:rows])  # batch-invariant: the same FMA chain per output, bit for bit


@pytest.mark.parametrize(("weight_dtype", "io_dtype"), [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                      (torch.float32, torch.bfloat16)])
def test_bfloat16_panels_and_rows_sum_in_float32_and_round_once(weight_dtype, io_dtype):
    """bfloat16 weights stay bfloat16 in the panels (half the bytes); bfloat16 rows are widened, summed in float32 and
    rounded once to nearest even: equal to float32 F.linear on the same values rounded the way torch rounds, except
    where the float32 sums differ in their last bit and that bit decides the rounding; batch-invariant, any row count
    (the layout sends bf16 prefill through it too)."""
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(203, 96, generator=generator).to(weight_dtype)
    bias = torch.randn(203, generator=generator)
    panels = kernels.pack_panels(weight)
    assert panels.dtype == weight_dtype and panels.shape == (26, 96, 8)
    x = torch.randn(40, 96, generator=generator).to(io_dtype)
    out = kernels.panel_linear(x, panels, 203, bias)
    assert out.dtype == io_dtype
    exact = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    reference = exact.to(io_dtype)  # the exact sum rounded once: what a float32 sum rounds to but for ties of ulps
    mismatch = (out != reference).float().mean().item()
    assert mismatch < (0.01 if io_dtype == torch.bfloat16 else 1.0)
    spacing = 2.0 ** -7 if io_dtype == torch.bfloat16 else 2.0 ** -20
    assert ((out.double() - exact).abs() <= exact.abs() * spacing + 1e-4).all()
    for rows in (1, 2, 4, 5, 8, 12, 13, 25):
        assert torch.equal(kernels.panel_linear(x[:rows], panels, 203, bias), out[:rows])


def test_threads_split_panels_without_changing_a_bit():
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(200, 64, generator=generator)
    x = torch.randn(6, 64, generator=generator)
    panels = kernels.pack_panels(weight)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.panel_linear(x, panels, 200)
        torch.set_num_threads(2)
        two = kernels.panel_linear(x, panels, 200)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_bad_input_and_a_missing_compiler_are_named(tmp_path, monkeypatch):
    panels = kernels.pack_panels(torch.randn(16, 8))
    with pytest.raises(ValueError, match="does not fit panels"):
        kernels.panel_linear(torch.randn(2, 9), panels, 16)
    with pytest.raises(ValueError, match="float32 or bfloat16 on a CPU"):
        kernels.panel_linear(torch.randn(2, 8, dtype=torch.float64), panels, 16)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(RuntimeError, match="no-such-cc"):
        kernels.build(tmp_path)
    assert not (tmp_path / "kernels").exists()


@pytest.mark.skipif(not kernels.bf16_dot(), reason="no AVX512-BF16 dot kernel on this CPU (or SPECHEADS_CPU_BF16=emulated)")
@pytest.mark.parametrize(("out_features", "in_features"), [(203, 96), (16, 2), (37, 576)])
def test_dot_panels_sum_bf16_rows_in_float32_batch_invariantly(out_features, in_features):
    """AVX512-BF16 dot panels: bfloat16 rows times bfloat16 weights, products exact and summed in float32 (within a
    bf16 rounding of the exact sum), every output the same chain whatever the number of rows beside it."""
    generator = torch.Generator().manual_seed(in_features)
    weight = torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=generator)
    panels = kernels.pack_panels(weight, dot=True)
    assert panels.shape == (-(-out_features // 16), in_features // 2, 16, 2) and panels.dtype == torch.bfloat16
    x = torch.randn(30, in_features, generator=generator).to(torch.bfloat16)
    out = kernels.panel_linear(x, panels, out_features, bias)
    exact = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    assert ((out.double() - exact).abs() <= exact.abs() * 2.0 ** -7 + 1e-3).all()
    assert (out != exact.to(torch.bfloat16)).float().mean().item() < 0.01
    for rows in range(1, 14):
        assert torch.equal(kernels.panel_linear(x[:rows], panels, out_features, bias), out[:rows])


@pytest.mark.skipif(not kernels.bf16_dot(), reason="no AVX512-BF16 dot kernel on this CPU (or SPECHEADS_CPU_BF16=emulated)")
def test_dot_panels_refuse_float32_rows_and_odd_widths():
    panels = kernels.pack_panels(torch.randn(16, 8).to(torch.bfloat16), dot=True)
    with pytest.raises(ValueError, match="bfloat16 rows for dot panels"):
        kernels.panel_linear(torch.randn(2, 8), panels, 16)
    with pytest.raises(ValueError, match="even in_features"):
        kernels.pack_panels(torch.randn(16, 7).to(torch.bfloat16), dot=True)
    with pytest.raises(ValueError, match="even in_features"):
        kernels.pack_panels(torch.randn(16, 8), dot=True)


def test_emulated_cpu_kind_keeps_the_widening_kernel(monkeypatch):
    """SPECHEADS_CPU_BF16=emulated runs the AVX2 machines' code path (widen and FMA) on any CPU."""
    monkeypatch.setenv("SPECHEADS_CPU_BF16", "emulated")
    assert not kernels.bf16_dot()
