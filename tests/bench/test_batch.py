"""bench.batch (`python -m bench.speed --batch_sizes`): the planner's profile of a drafter measured from its runs
(the end-to-end batch bench is in test_speed.py)."""

from __future__ import annotations

import pytest

from bench.batch import profile_from_stats
from runtime.loop import GenerationStats, StepStats


def test_profile_from_measured_acceptance():
    """A drafter without held-out accuracy (prompt lookup, draft model): tau(n) = 1 + sum of the measured
    per-depth acceptance up to n, draft time = the measured mean per step."""
    stats = GenerationStats()
    for accepted in (3, 1, 2, 1):  # tokens emitted per step (bonus included), chains of 2 drafted every step
        stats.record(StepStats(accepted_length=accepted, drafted_depth=2, drafted_nodes=2, draft_time=0.01,
                               verify_time=0.1))
    profile = profile_from_stats([stats], 3, "test")
    assert profile.sizes == [1, 2, 3]
    assert profile.expected_tau == pytest.approx([1.5, 1.75, 1.75])  # depth 1: 2/4 accepted, depth 2: 1/4
    assert profile.draft_seconds == pytest.approx([0.01] * 3)
