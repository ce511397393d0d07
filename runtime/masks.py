"""The one tree-attention mask builder: additive float 4D masks over (committed prefix + tree nodes).

Layout of the key axis: `prefix_len` committed tokens already in the KV cache (slot s has position s),
then the tree nodes 0..N-1 in BFS order (node j has position prefix_len + depth[j]). A query node sees every
prefix slot and its own ancestors (itself included). For sliding-window layers a key is additionally
allowed only if `key_pos > query_pos - window` (Hugging Face's window semantics, computed on positions,
not on slot indices). Masks are additive in the model dtype: 0 where allowed, `finfo(dtype).min`
elsewhere (a boolean mask is silently wrong under eager attention; a mask of another dtype than the
model is silently wrong under sdpa in fp64).
"""

from __future__ import annotations

import torch

from heads.layers import additive_mask
from runtime.tree import Tree


def allowed_keys(tree: Tree, prefix_len: int, window: int | None = None) -> torch.Tensor:
    """Boolean visibility [N, prefix_len + N]: node i may attend to key slot s.

    window: sliding-window size W (None = full attention); key allowed iff key_pos > query_pos - W.
    """
    n = tree.num_nodes
    allowed = torch.cat([torch.ones(n, prefix_len, dtype=torch.bool), tree.ancestors], dim=1)  # [N, P+N]
    if window is not None:
        query_pos = prefix_len + tree.depth  # [N]
        key_pos = torch.cat([torch.arange(prefix_len), prefix_len + tree.depth])  # [P+N]
        allowed &= key_pos[None, :] > (query_pos[:, None] - window)
    return allowed


def tree_attention_mask(tree: Tree, prefix_len: int, dtype: torch.dtype, start: int = 0,
                        window: int | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
    """Additive mask [1, 1, N - start, prefix_len + N] for the query nodes start..N-1 of `tree`.

    Nodes 0..start-1 are already in the cache right after the prefix (a tree grown depth by depth).
    """
    return additive_mask(allowed_keys(tree, prefix_len, window)[start:], dtype, device)


def rows_attention_mask(trees: list[Tree], row_lengths: list[int], slots: int, dtype: torch.dtype,
                        window: int | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
    """Additive mask [B, 1, N, slots + N] for B rows verified in ONE forward (N = the largest tree).

    Cache layout: row b's committed tokens sit in slots 0..row_lengths[b]-1 of the first `slots` slots (the
    slots after them are holes, left because other rows are longer), its tree nodes in slots slots..slots+N_b-1.
    Row b's node j sees its own prefix and ancestors (as `allowed_keys` with prefix row_lengths[b]); padding
    queries (j >= N_b) see only their own slot, so no softmax row is empty.
    """
    if len(trees) == 1 and row_lengths[0] == slots:  # one row without holes: the single-sequence mask
        return tree_attention_mask(trees[0], slots, dtype, window=window, device=device)
    batch, n = len(trees), max(tree.num_nodes for tree in trees)
    lengths = torch.tensor(row_lengths)  # [B]
    depth = torch.zeros(batch, n, dtype=torch.long)  # [B, N]
    ancestors = torch.zeros(batch, n, n, dtype=torch.bool)  # [B, N, N]
    for b, tree in enumerate(trees):
        k = tree.num_nodes
        depth[b, :k], ancestors[b, :k, :k] = tree.depth, tree.ancestors
    padding = torch.arange(n)[None, :] >= torch.tensor([tree.num_nodes for tree in trees])[:, None]  # [B, N]
    ancestors |= torch.diag_embed(padding)  # a padding query sees its own slot only
    prefix = (torch.arange(slots)[None, None, :] < lengths[:, None, None]) & ~padding[:, :, None]  # [B, N, slots]
    allowed = torch.cat([prefix, ancestors], dim=2)  # [B, N, slots + N]
    if window is not None:  # Hugging Face's window rule on positions: key_pos > query_pos - window
        query_pos = lengths[:, None] + depth  # [B, N]
        key_pos = torch.cat([torch.arange(slots).expand(batch, slots), query_pos], dim=1)  # [B, slots + N]
        allowed &= key_pos[:, None, :] > query_pos[:, :, None] - window
    return additive_mask(allowed, dtype, device)
