"""Temperature / top-k / top-p processing and token sampling (runtime/sampling.py)."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from runtime.sampling import SamplingConfig, logits_to_probs, sample_token


def test_config_validation_and_greedy_flag():
    assert SamplingConfig().is_greedy and not SamplingConfig(temperature=0.7).is_greedy
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=-0.1)
    with pytest.raises(ValueError, match="top_k"):
        SamplingConfig(top_k=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=1.5)


def test_greedy_is_the_argmax_point_mass_lowest_id_on_ties():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 1.0, 2.0, 0.0]])
    probs = logits_to_probs(logits, SamplingConfig())
    assert probs.dtype == torch.float32
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))


def test_temperature_scales_logits():
    logits = torch.randn(3, 7, dtype=torch.float64)
    probs = logits_to_probs(logits, SamplingConfig(temperature=0.5))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, torch.softmax(logits.float() / 0.5, -1))


def test_top_k_keeps_the_k_most_likely():
    logits = torch.tensor([1.0, 4.0, 2.0, 3.0, 0.0])
    probs = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert torch.equal(probs > 0, torch.tensor([False, True, False, True, False]))
    torch.testing.assert_close(probs.sum(), torch.tensor(1.0))
    full = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_k=10))  # k >= V: off
    torch.testing.assert_close(full, torch.softmax(logits, -1))


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([0.05, 0.5, 0.15, 0.3]))
    keep = {0.5: [1], 0.8: [1, 3], 0.81: [1, 3, 2], 0.99: [0, 1, 2, 3], 0.01: [1]}
    for top_p, kept in keep.items():
        probs = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_p=top_p))
        assert sorted((probs > 0).nonzero().flatten().tolist()) == sorted(kept), top_p
        torch.testing.assert_close(probs.sum(), torch.tensor(1.0))


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.3, 5, 1.0), (0.8, 0, 0.6),
                                                     (0.9, 12, 0.85)])
def test_matches_transformers_warpers(temperature, top_k, top_p):
    """Same distribution as HF generate's temperature -> top-k -> top-p warpers (batch [B, V])."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    expected = torch.softmax(warpers(None, logits.clone()), -1)
    got = logits_to_probs(logits, SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p))
    torch.testing.assert_close(got, expected)


def test_leading_dimensions_are_kept():
    logits = torch.randn(2, 3, 11)
    assert logits_to_probs(logits, SamplingConfig(temperature=1.0, top_p=0.9)).shape == (2, 3, 11)
    assert sample_token(logits_to_probs(logits, SamplingConfig(temperature=1.0)), None).shape == (2, 3)
    with pytest.raises(ValueError, match="logits must have shape"):
        logits_to_probs(torch.empty(3, 0), SamplingConfig())


def test_sample_token_is_reproducible_and_follows_probs():
    probs = torch.tensor([0.1, 0.6, 0.0, 0.3])
    a = sample_token(probs.expand(20000, 4), torch.Generator().manual_seed(1))
    b = sample_token(probs.expand(20000, 4), torch.Generator().manual_seed(1))
    assert a.dtype == torch.int64 and torch.equal(a, b)
    freq = torch.bincount(a, minlength=4).float() / a.numel()
    assert freq[2] == 0 and (freq - probs).abs().max() < 0.02  # 0.02 ~ 6 standard deviations at n = 20000
    assert int(sample_token(torch.tensor([0.0, 0.0, 1.0]), None)) == 2


def test_sample_token_rejects_invalid_rows():
    with pytest.raises(ValueError, match="non-negative"):
        sample_token(torch.tensor([0.5, -0.1, 0.6]), None)
    with pytest.raises(ValueError, match="positive sum"):
        sample_token(torch.zeros(2, 3), None)
