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


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean [q, kv] -> additive float mask [1, 1, q, kv] in `dtype` on `device` (0 allowed, finfo.min masked)."""
    allowed = allowed.to(device)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


def tree_attention_mask(tree: Tree, prefix_len: int, dtype: torch.dtype, start: int = 0,
                        window: int | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
    """Additive mask [1, 1, N - start, prefix_len + N] for the query nodes start..N-1 of `tree`.

    Nodes 0..start-1 are already in the cache right after the prefix (a tree grown depth by depth).
    """
    return additive_mask(allowed_keys(tree, prefix_len, window)[start:], dtype, device)
