"""The one KV-cache compaction routine: keep the accepted tree nodes, in contiguous slots, drop the rest.

After a tree forward the cache holds `prefix_len` committed slots followed by `num_nodes` tree slots (node j
in slot prefix_len + j). Accepting a path means its nodes' keys/values must end up in slots
prefix_len, prefix_len + 1, ... in path order, and every other tree slot must go. We move the kept slots
down with `index_select` (source and destination may overlap, so we gather first) and drop the tail with
the cache's public `crop(-n)` (transformers 5.x takes only a negative count there).
"""

from __future__ import annotations

import torch
from transformers import Cache


def compact_cache(cache: Cache, prefix_len: int, num_nodes: int, keep: list[int]) -> None:
    """Keep tree nodes `keep` (ids in [0, num_nodes), increasing) right after the prefix; drop the others.

    cache: layers with keys/values [B, H, prefix_len + num_nodes, D] -> [B, H, prefix_len + len(keep), D].
    """
    if any(b <= a for a, b in zip(keep[:-1], keep[1:], strict=True)) or (keep and not 0 <= keep[0] <= keep[-1] < num_nodes):
        raise ValueError(f"keep must be increasing node ids in [0, {num_nodes}), got {keep}")
    if cache.get_seq_length() != prefix_len + num_nodes:
        raise ValueError(f"cache holds {cache.get_seq_length()} slots, expected prefix {prefix_len} + "
                         f"{num_nodes} tree nodes")
    kept = len(keep)
    if keep != list(range(kept)):  # nothing to move when the kept nodes already sit first
        source = prefix_len + torch.tensor(keep, dtype=torch.long)
        for layer in cache.layers:
            source = source.to(layer.keys.device)
            layer.keys[..., prefix_len:prefix_len + kept, :] = layer.keys.index_select(-2, source)
            layer.values[..., prefix_len:prefix_len + kept, :] = layer.values.index_select(-2, source)
    if num_nodes > kept:
        cache.crop(-(num_nodes - kept))
