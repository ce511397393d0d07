"""Medusa heads with the shared (target) LM head: parameters, the one logits function, refusals."""

import pytest
import torch

from heads import HeadsConfig, build_heads, target_modules
from tests.heads.helpers import TARGET_NAME, random_heads


def test_shared_heads_hold_only_residual_blocks(target):
    hidden = target.config.hidden_size
    shared = random_heads("medusa_shared", target)  # 2 heads x 1 block
    assert sum(p.numel() for p in shared.parameters()) == 2 * (hidden * hidden + hidden)
    assert all(".linear." in name for name in shared.state_dict())
    config = HeadsConfig.for_target("medusa", target.config, TARGET_NAME, medusa_num_heads=2)
    separate = build_heads(config)
    assert sum(p.numel() for p in separate.parameters()) == 2 * (hidden * hidden + hidden + 256 * hidden)


def test_compute_logits_over_lm_head_rows_equals_selected_columns(target):
    """A reduced draft vocabulary passes only its LM-head rows: the logits are those columns of the full ones."""
    heads = random_heads("medusa_shared", target)
    weight = target_modules(target).lm_head.weight
    hidden = torch.randn(3, 5, target.config.hidden_size, generator=torch.Generator().manual_seed(0))
    rows = torch.tensor([3, 17, 200, 255])
    with torch.no_grad():
        full = heads(hidden, lm_head=target_modules(target).lm_head)  # [2, 3, 5, 256]
        torch.testing.assert_close(heads.compute_logits(hidden, weight), full, rtol=0, atol=0)
        reduced = heads.compute_logits(hidden, weight[rows], num_heads=1)  # [1, 3, 5, 4]
    assert reduced.shape == (1, 3, 5, 4)
    torch.testing.assert_close(reduced, full[:1, ..., rows])


def test_own_projections_restricted_to_rows_equal_selected_columns(target):
    heads = random_heads("medusa", target)  # 3 heads x 2 blocks, own projections
    hidden = torch.randn(2, 4, target.config.hidden_size, generator=torch.Generator().manual_seed(0))
    rows = torch.tensor([0, 5, 99])
    with torch.no_grad():
        full = heads.compute_logits(hidden)  # [3, 2, 4, 256]
        own = torch.stack([head[-1].weight[rows] for head in heads.heads[:2]])  # [2, 3, H]
        reduced = heads.compute_logits(hidden, own, num_heads=2)
    torch.testing.assert_close(reduced, full[:2, ..., rows])


def test_refusals(target):
    shared = random_heads("medusa_shared", target)
    separate = random_heads("medusa", target)
    hidden = torch.randn(1, 2, target.config.hidden_size)
    with pytest.raises(ValueError, match="needs lm_head_rows"):
        shared.compute_logits(hidden)
    with pytest.raises(ValueError, match="pass no lm_head_rows, or one"):
        separate.compute_logits(hidden, target_modules(target).lm_head.weight)
    with pytest.raises(ValueError, match=r"must be \[V', 64\] or \[2, V', 64\]"):
        shared.compute_logits(hidden, torch.zeros(3, 5, 64))
    with pytest.raises(ValueError, match="no projection to initialise"):
        shared.init_from_lm_head(target_modules(target).lm_head.weight)
    with pytest.raises(ValueError, match="medusa_num_layers >= 1"):
        HeadsConfig.for_target("medusa", target.config, TARGET_NAME, medusa_shared_lm_head=True,
                               medusa_num_layers=0)
    biased = torch.nn.Linear(target.config.hidden_size, 256, bias=True)
    with pytest.raises(ValueError, match="LM head has a bias"):
        shared(hidden, lm_head=biased)
