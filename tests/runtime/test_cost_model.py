"""Verification cost model: curve interpolation, size choice, measurement and on-disk cache."""

from __future__ import annotations

import dataclasses
import json

import pytest

from runtime.cost_model import (
    CostCurve,
    chain_expected_tau,
    load_curve,
    measure_curve,
    save_curve,
    target_verify_forward,
    verify_cost_curve,
)
from runtime.planner import choose_tree_size
from runtime.target import TargetModel
from runtime.tree_search import expected_accepted_lengths
from tests.tiny_models import tiny_model


def test_interpolation_and_extrapolation():
    curve = CostCurve(tokens=[1, 5, 9], seconds=[1.0, 2.0, 4.0])
    assert curve.seconds_at(1) == 1.0
    assert curve.seconds_at(3) == pytest.approx(1.5)
    assert curve.seconds_at(7) == pytest.approx(3.0)
    assert curve.seconds_at(11) == pytest.approx(5.0)  # slope of the last segment
    assert curve.relative() == pytest.approx([1.0, 2.0, 4.0])
    assert curve.relative_to_plain(4) == pytest.approx([1.0, 1.25, 1.5, 1.75])  # every n, interpolated
    noisy = CostCurve(tokens=[1, 2, 4, 8], seconds=[2.0, 1.0, 3.0, 2.0])
    assert noisy.fitted == pytest.approx([1.5, 1.5, 2.5, 2.5])  # pooled: never cheaper with more tokens
    assert noisy.seconds_at(2) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="increasing"):
        CostCurve(tokens=[2, 1], seconds=[1.0, 1.0])


def test_choice_flat_vs_steep_cost():
    taus = expected_accepted_lengths([[0.6, 0.2, 0.1], [0.4, 0.1], [0.3]], 20)
    sizes = range(len(taus))
    flat = choose_tree_size(sizes, lambda n: taus[n], lambda q: 1.0)  # GPU-like: extra tokens are free
    assert flat.size == len(taus) - 1  # the whole tree (ties -> the smaller one, none here: gains > 0)
    steep = choose_tree_size(sizes, lambda n: taus[n], lambda q: float(q))  # cost proportional to tokens
    assert steep.size == 0  # speculation never pays: tau(n) < n + 1
    # hand check: cost 1 + 0.1 (q - 1); tau(1) = 1.6 / 1.1 = 1.4545, tau(2) = 1.84 / 1.2 = 1.533,
    # tau(3) = 2.04 / 1.3 = 1.569, tau(4) = 2.14 / 1.4 = 1.529 -> 3
    mid = choose_tree_size(range(5), lambda n: taus[n], lambda q: 1 + 0.1 * (q - 1))
    assert taus[:5] == pytest.approx([1.0, 1.6, 1.84, 2.04, 2.14])
    assert mid.size == 3
    with_draft = choose_tree_size(range(1, 5), lambda n: taus[n], lambda q: 1 + 0.1 * (q - 1), lambda n: 3.0)
    assert with_draft.size == 4  # a large fixed draft cost favours bigger trees: 2.14/4.4 > 2.04/4.3


def test_chain_expected_tau():
    tau = chain_expected_tau([0.5, 0.5])
    assert [tau(n) for n in range(4)] == pytest.approx([1.0, 1.5, 1.75, 1.75])


def test_measure_and_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    model = TargetModel(tiny_model("llama"))
    curve = verify_cost_curve(model, kv_length=16, max_tokens=6, repeats=2)
    assert curve.tokens == [1, 2, 3, 4, 6] and all(s > 0 for s in curve.seconds)
    files = list((tmp_path / "cost_curves").glob("*.json"))
    assert len(files) == 1 and load_curve(files[0]) == curve

    def must_not_run(q):
        raise AssertionError("cached curve must not be re-measured")

    assert verify_cost_curve(model, kv_length=16, max_tokens=6, run_forward=must_not_run) == curve


def test_verify_forward_restores_cache_length():
    target = TargetModel(tiny_model("qwen3"))
    run = target_verify_forward(target, kv_length=8)
    calls = []
    timings = measure_curve(lambda q: (calls.append(q), run(q)), [1, 5], repeats=2, warmup=1, small_factor=1)
    assert len(timings) == 2 and calls == [1, 5, 1, 5, 1, 5]
    assert target.cache.get_seq_length() == 8 and target.prefix_len == 8


def test_small_sizes_are_timed_more_often(monkeypatch):
    """Sizes up to SMALL_SIZES (whose ratios are the break-evens) run small_factor times as often as larger ones,
    interleaved, and each size's time is the median of its runs."""
    from runtime import timing

    clock = iter(range(10_000))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: float(next(clock)))
    calls = []
    delays = {1: [5, 1, 4, 9, 3, 7], 16: [8, 6]}  # extra clock ticks each run takes, in run order

    def run(q):
        calls.append(q)
        if len(calls) > 2:  # past the warm-up (one untimed call per size)
            for _ in range(delays[q].pop(0)):
                next(clock)

    timings = timing.measure_curve(run, [1, 16], repeats=2, warmup=1, small_factor=3)
    assert calls == [1, 16, 1, 16, 1, 1, 1, 16, 1, 1]
    assert timings == [5.5, 8.0]  # 1 tick + the median extra ticks of each size (of 1's six runs, of 16's two)


def test_load_curve_reads_the_runtime_cache_and_bench_cost_curve_output(tmp_path):
    """`bench.lookup_replay --curve` takes either file: a bare curve, or `bench.cost_curve --output`'s record that
    wraps it under "curve"."""
    curve = CostCurve(tokens=[1, 2, 4], seconds=[1.0, 1.2, 1.5])
    save_curve(curve, tmp_path / "bare.json")
    (tmp_path / "record.json").write_text(json.dumps({"curve": dataclasses.asdict(curve), "relative": [1.0]}))
    assert load_curve(tmp_path / "bare.json") == curve == load_curve(tmp_path / "record.json")


def test_equal_expected_trees_take_the_widest_top_k():
    """Shapes the held-out table values alike (same size and depth, same expected tau) differ only in how far the
    dynamic tree may branch at run time: the planner takes the largest top_k, whatever their draft-time noise."""
    from runtime.planner import best_row, widest_equal

    def row(size, depth, top_k, tau, tps):
        return dict(size=size, depth=depth, top_k=top_k, expected_tau=tau, tokens_per_second=tps)

    rows = [dict(size=0, expected_tau=1.0, tokens_per_second=26.0),
            row(3, 2, 2, 1.68, 38.6), row(3, 2, 4, 1.68, 38.4), row(3, 2, 8, 1.68, 38.3),
            row(3, 3, 8, 1.68, 37.5), row(1, 2, 8, 1.43, 37.4)]
    assert widest_equal(rows, best_row(rows)) == rows[3]
    # a wider shape the table values higher or lower is a different tree: not a tie
    rows[3] = row(3, 2, 8, 1.70, 38.3)
    assert widest_equal(rows, best_row(rows)) == rows[2]
    # plain decoding, or a family without shapes, is kept as it is
    assert widest_equal(rows, rows[0]) == rows[0]
    assert widest_equal([dict(size=2, expected_tau=1.5, tokens_per_second=30.0)],
                        dict(size=2, expected_tau=1.5, tokens_per_second=30.0))["size"] == 2


def test_costs_beyond_the_measured_kv_lengths_never_fall_to_zero():
    """A noisy curve measured cheaper at the longer KV length: beyond it the costs hold at the lowest measured value
    instead of falling along the segment to 0 s, and so below the first one (a steep first segment extended back
    towards KV 0); a rising end segment still extends, and between the points the interpolation is unchanged. And a
    modelled time of 0 is skipped by the guard's clock instead of divided by (it raised ZeroDivisionError in a
    batched test with stories260K)."""
    from runtime.cost_model import StepCosts, interpolate
    from runtime.proposers.guard import RatioMean

    assert interpolate([256, 504], [0.002, 0.0015], 4000) == pytest.approx(0.0015)
    assert interpolate([256, 504], [0.002, 0.0015], 380) == pytest.approx(0.00175)
    assert interpolate([256, 1024], [0.040, 0.048], 2048) == pytest.approx(0.0587, rel=1e-3)
    assert interpolate([256, 1024], [0.010, 0.050], 128) == pytest.approx(0.010)  # a steep first segment held
    assert interpolate([256, 1024], [0.010, 0.011], 128) == pytest.approx(0.010)
    assert interpolate([256, 1024], [0.012, 0.010], 128) == pytest.approx(0.012 + 0.002 / 6)  # falling: extended
    curve_short = CostCurve(tokens=[1, 3], seconds=[0.002, 0.003])
    curve_long = CostCurve(tokens=[1, 3], seconds=[0.0014, 0.0016])
    costs = StepCosts([256, 504], [curve_short, curve_long], [0.001, 0.0008])
    assert costs.verify_seconds(3, 5000) == pytest.approx(0.0016)
    assert costs.plain_seconds(5000) == pytest.approx(0.0014) and costs.draft(5000) == pytest.approx(0.0008)
    ratio = RatioMean()
    ratio.observe(0.01, 0.0)
    assert ratio.weight == 0 and ratio.mean() == 1.0
