"""Invariant 4: KV compaction after a tree step == recomputing the cache from scratch on the accepted sequence."""

import pytest
import torch
from transformers import DynamicCache

from runtime.kv_cache import compact_cache
from runtime.target import TargetModel
from runtime.tree import Tree
from tests.tiny_models import tiny_model

PARENTS = [-1, 0, 0, 1, 1, 2, 3, 5, 6]  # paths: 0-1-3-6-8, 0-1-4, 0-2-5-7


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("gpt2", {}), ("phi3", {}),
                                            ("gemma2", {"sliding_window": 8})])
def test_compaction_equals_recompute(arch, overrides):
    model = tiny_model(arch, **overrides)
    generator = torch.Generator().manual_seed(0)
    sequence = torch.randint(3, 256, (11,), generator=generator)
    target = TargetModel(model)
    target.prefill(sequence[:-1])
    tree = Tree.from_parents(PARENTS)
    for step, path in enumerate([[0, 1, 3, 6], [0, 2, 5, 7], [0], [0, 1, 4]]):
        tokens = torch.randint(3, 256, (tree.num_nodes,), generator=generator)
        tokens[0] = sequence[-1]
        target.forward(tokens, tree)
        target.commit(path)
        # committed: the old root and the accepted draft tokens; then a fresh root (e.g. the bonus token)
        sequence = torch.cat([sequence, tokens[path[1:]], torch.randint(3, 256, (1,), generator=generator)])
        # recompute from scratch on the committed tokens (everything but the new root)
        fresh = TargetModel(model)
        fresh.prefill(sequence[:-1])
        assert target.prefix_len == fresh.prefix_len == sequence.numel() - 1, step
        for mine, ref in zip(target.cache.layers, fresh.cache.layers, strict=True):
            torch.testing.assert_close(mine.keys, ref.keys, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(mine.values, ref.values, atol=1e-5, rtol=1e-4)
        # and the next forward from the compacted cache gives the same logits
        chain = Tree.chain(2)
        probe = torch.cat([sequence[-1:], torch.randint(3, 256, (2,), generator=generator)])
        torch.testing.assert_close(target.forward(probe, chain).logits, fresh.forward(probe, chain).logits,
                                   atol=1e-5, rtol=1e-4)
        target.commit([0])
        sequence = torch.cat([sequence, probe[1:2]])


def test_compaction_moves_slots_and_crops():
    cache = DynamicCache()
    keys = torch.arange(8.0).reshape(1, 1, 8, 1).expand(1, 2, 8, 3).contiguous()
    cache.update(keys, keys + 100, layer_idx=0)
    compact_cache(cache, prefix_len=3, num_nodes=5, keep=[0, 2, 4])
    assert cache.layers[0].keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 5, 7]
    assert cache.layers[0].values[0, 1, :, 0].tolist() == [100, 101, 102, 103, 105, 107]
    with pytest.raises(ValueError, match="increasing"):
        compact_cache(cache, prefix_len=3, num_nodes=3, keep=[1, 0])
    with pytest.raises(ValueError, match="expected prefix"):
        compact_cache(cache, prefix_len=3, num_nodes=5, keep=[0])


def test_batch_compaction_equals_each_row_recomputed():
    """Three rows of different lengths (holes after the shorter ones), each accepting its own path through
    the same tree: every row's valid slots equal a fresh single-sequence prefill of its committed tokens."""
    model = tiny_model("llama")
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(3, 256, (n,), generator=generator) for n in (4, 12, 7)]
    target = TargetModel(model)
    target.prefill_rows([s[:-1] for s in sequences])
    tree = Tree.from_parents(PARENTS)
    for paths in ([[0, 1, 3, 6], [0], [0, 2, 5, 7]], [[0, 2], [0, 1, 3, 6, 8], [0, 1, 4]]):
        drafts = []
        for s in sequences:
            tokens = torch.randint(3, 256, (tree.num_nodes,), generator=generator)
            tokens[0] = s[-1]
            drafts.append(tokens)
        target.forward_rows(drafts, [tree] * 3)
        target.commit_rows(paths)
        sequences = [torch.cat([s, d[p[1:]], torch.randint(3, 256, (1,), generator=generator)])
                     for s, d, p in zip(sequences, drafts, paths, strict=True)]
        assert target.row_lengths == [s.numel() - 1 for s in sequences]
        assert target.slots == max(target.row_lengths) == target.cache.get_seq_length()
        for b, s in enumerate(sequences):
            fresh = TargetModel(model)
            fresh.prefill(s[:-1])
            n = s.numel() - 1
            for mine, ref in zip(target.cache.layers, fresh.cache.layers, strict=True):
                torch.testing.assert_close(mine.keys[b:b + 1, :, :n], ref.keys, atol=1e-5, rtol=1e-4)
                torch.testing.assert_close(mine.values[b:b + 1, :, :n], ref.values, atol=1e-5, rtol=1e-4)
