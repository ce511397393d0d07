"""The one KV-cache compaction routine: keep the accepted tree nodes of every row, in contiguous slots, drop the rest.

After a tree forward the cache holds `slots` committed-region slots followed by `num_nodes` tree slots (node j
of every row in slot slots + j). Row b's committed tokens fill slots 0..lengths[b]-1 of the committed region;
a batch of rows of different lengths leaves holes after the shorter rows (one sequence never has holes:
lengths == [slots]). Accepting a path in row b means its nodes' keys/values must end up in slots
lengths[b], lengths[b] + 1, ... in path order. We move the kept slots down with `index_select` (source and
destination may overlap, so we gather first) and drop the tail beyond the longest row with the cache's public
`crop(-n)` (transformers 5.x takes only a negative count there).
"""

from __future__ import annotations

import torch
from transformers import Cache


def _check_keep(keep: list[int], num_nodes: int) -> None:
    if any(b <= a for a, b in zip(keep[:-1], keep[1:], strict=True)) or (keep and not 0 <= keep[0] <= keep[-1] < num_nodes):
        raise ValueError(f"keep must be increasing node ids in [0, {num_nodes}), got {keep}")


def compact_rows(cache: Cache, lengths: list[int], slots: int, num_nodes: int, keeps: list[list[int]]) -> list[int]:
    """Keep tree nodes `keeps[b]` of row b right after its `lengths[b]` committed slots; drop the others.

    cache: layers with keys/values [B, H, slots + num_nodes, D] -> [B, H, max_b(lengths[b] + len(keeps[b])), D].
    Returns the new committed lengths per row.
    """
    if len(keeps) != len(lengths) or any(length > slots for length in lengths):
        raise ValueError(f"compaction: {len(keeps)} keep lists for {len(lengths)} rows of lengths {lengths} "
                         f"in {slots} slots")
    for keep in keeps:
        _check_keep(keep, num_nodes)
    if cache.get_seq_length() != slots + num_nodes:
        raise ValueError(f"cache holds {cache.get_seq_length()} slots, expected prefix {slots} + "
                         f"{num_nodes} tree nodes")
    moves = [(b, length, keep) for b, (length, keep) in enumerate(zip(lengths, keeps, strict=True))
             if not (length == slots and keep == list(range(len(keep))))]  # else the kept nodes already sit right
    if len(lengths) == 1 and moves:  # one sequence: slice the batch axis as a whole (the single-sequence path)
        _, length, keep = moves[0]
        source = slots + torch.tensor(keep, dtype=torch.long)
        for layer in cache.layers:
            source = source.to(layer.keys.device)
            layer.keys[..., length:length + len(keep), :] = layer.keys.index_select(-2, source)
            layer.values[..., length:length + len(keep), :] = layer.values.index_select(-2, source)
    elif moves:  # a batch: every row's moves in one gather and one scatter per tensor (not one per row)
        rows = torch.cat([torch.full((len(keep),), b, dtype=torch.long) for b, _, keep in moves])  # [M]
        source = torch.cat([slots + torch.tensor(keep, dtype=torch.long) for _, _, keep in moves])  # [M]
        target = torch.cat([length + torch.arange(len(keep)) for _, length, keep in moves])  # [M]
        for layer in cache.layers:
            device = layer.keys.device
            rows, source, target = rows.to(device), source.to(device), target.to(device)
            layer.keys[rows, :, target, :] = layer.keys[rows, :, source, :]  # right side gathered first: [M, H, D]
            layer.values[rows, :, target, :] = layer.values[rows, :, source, :]
    new_lengths = [length + len(keep) for length, keep in zip(lengths, keeps, strict=True)]
    surplus = slots + num_nodes - max(new_lengths)
    if surplus > 0:
        cache.crop(-surplus)
    return new_lengths


def compact_cache(cache: Cache, prefix_len: int, num_nodes: int, keep: list[int]) -> None:
    """One sequence: keep tree nodes `keep` (ids in [0, num_nodes), increasing) right after the prefix.

    cache: layers with keys/values [1, H, prefix_len + num_nodes, D] -> [1, H, prefix_len + len(keep), D].
    """
    compact_rows(cache, [prefix_len], prefix_len, num_nodes, [keep])
