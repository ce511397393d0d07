"""Parallel-drafter proposers: DFlash and P-EAGLE (heads/parallel.py) draft every depth in ONE drafter forward.

Both produce one logits row per depth d (token T+1+d, with the root = last committed token at position T) that
does not depend on any drafted token (masked slots stand in for them). So, as for Medusa, every node at depth d
takes its children from the same row, and the candidate tree is a static shape (`StaticTree`: a chain, or a
Medusa-style tree grown from the per-position accuracies) filled by `tree_drafting.draft_static_tree`: greedy
children are the row's top-ranked tokens; with sampling they are drawn without replacement from q (lossless with
the loop's tree rejection sampling). Verification, acceptance and KV handling are the loop's.

DFlash state: each layer's keys/values of the committed context (positions 0..T-1, from the target's features of
accepted tokens; only ever appended), plus projected features not yet fed. A step: feed the new context, then one
forward of the block [root, mask x (B-1)] at positions T..T+B-1 over it; slot k's logits give depth k-1.

P-EAGLE state (as EAGLE's): each layer's cache of committed entries (entry s = (fc(target features at s), token
s+1)), features not yet fed and the output of the last committed entry. A step: one causal forward of the new
committed entries followed by block_size-1 masked entries (fc(mask_hidden), mask token) at T..T+block_size-2; the
cache keeps the committed entries only. Output at T-1 gives depth 0, at T-1+d depth d.
"""

from __future__ import annotations

import torch
from torch import Tensor

from heads.base import target_modules
from heads.layers import LayerKV
from heads.parallel import DFlashDraft, PEagleDraft
from runtime.layout import match_panels
from runtime.proposers.base import Draft, root_only
from runtime.proposers.draft_vocab import DraftVocab
from runtime.proposers.tree_drafting import check_top_k, draft_static_tree
from runtime.sampling import SamplingConfig
from runtime.tree_search import StaticTree, validate_paths


class ParallelProposer:
    """What DFlash and P-EAGLE share: the static tree filled from per-depth rows, the feature queue."""

    def __init__(self, heads: DFlashDraft | PEagleDraft, target_model: torch.nn.Module, tree: StaticTree,
                 sampling: SamplingConfig | None = None, seed: int | None = None, tree_source: str = "tree"):
        self.heads = heads
        self.depths = heads.config.draft_tokens
        validate_paths(tree.paths, tree_source, num_heads=self.depths)
        self.tree = tree
        self.sampling = sampling or SamplingConfig()
        modules = target_modules(target_model)
        self.embed_tokens = modules.embed_tokens
        self.vocab_size = int(modules.lm_head.weight.shape[0])
        self.vocab = DraftVocab.of(heads, self.vocab_size)
        check_top_k(tree.max_rank + 1, self.vocab.size, f"{tree_source}: top_k")
        self.hidden_state_indices = tuple(heads.config.target_layers)
        self.generator = torch.Generator().manual_seed(seed + 5) if seed is not None else None
        self.dtype = next(heads.parameters()).dtype
        self._pending: Tensor | None = None  # [m, H] projected features of positions not yet fed

    @property
    def tree_size(self) -> int:
        """Non-root nodes of the full tree (the draft budget the loop should allow)."""
        return self.tree.tree.num_nodes - 1

    def features(self, hidden: dict[int, Tensor]) -> Tensor:
        """Target hidden states {index: [n, H]} -> projected features [n, H]."""
        return self.heads.project([hidden[i].to(self.dtype) for i in self.hidden_state_indices])

    def on_accept(self, committed_ids: torch.Tensor, draft: Draft, accepted_nodes: list[int],
                  tree_hidden: dict[int, torch.Tensor] | None) -> None:
        if not tree_hidden:
            raise ValueError(f"{type(self).__name__} needs the target's hidden states at the tree nodes")
        rows = torch.tensor(accepted_nodes, device=next(iter(tree_hidden.values())).device)
        with torch.inference_mode():
            new = self.features({i: h.index_select(0, rows) for i, h in tree_hidden.items()})  # [k+1, H]
        self._pending = new if self._pending is None else torch.cat([self._pending, new])

    def _take_pending(self, count: int) -> Tensor:
        if self._pending is None or self._pending.shape[0] < count:
            raise ValueError(f"{type(self).__name__}: target features missing for committed tokens (call reset and "
                             "on_accept with the loop's hidden states)")
        taken, self._pending = self._pending[:count], self._pending[count:]
        return taken

    def depth_logits(self, committed_ids: Tensor, depth: int) -> Tensor | None:
        """Logits [depth, Vd] of depths 0..depth-1 (None when nothing can be drafted yet)."""
        raise NotImplementedError

    @torch.inference_mode()
    def propose(self, committed_ids: torch.Tensor, max_tokens: int) -> Draft:
        depth = min(self.tree.tree.max_depth, max_tokens)
        logits = self.depth_logits(committed_ids, depth) if depth > 0 else None
        if logits is None:
            return root_only(committed_ids)
        draft = draft_static_tree(self.tree, int(committed_ids[-1]),
                                  lambda d, nodes, tokens, parents: logits[d].expand(len(nodes), -1),
                                  self.sampling, self.generator, max_tokens, self.vocab_size, self.vocab.to_target,
                                  self.vocab.to_target_logits)
        return Draft(tokens=draft.tokens.to(committed_ids.device), tree=draft.tree,
                     probs=None if draft.probs is None else draft.probs.to(committed_ids.device))


class DFlashProposer(ParallelProposer):
    """DFlash drafts: one block forward per step over the cached context keys/values."""

    def __init__(self, heads: DFlashDraft, target_model: torch.nn.Module, tree: StaticTree,
                 sampling: SamplingConfig | None = None, seed: int | None = None, tree_source: str = "tree"):
        super().__init__(heads, target_model, tree, sampling, seed, tree_source)
        # the target's LM head over the draft vocabulary's rows, gathered once
        self.draft_lm_head = self.vocab.linear(target_modules(target_model).lm_head)
        if self.draft_lm_head is not target_modules(target_model).lm_head:
            match_panels(self.draft_lm_head, target_model)
        self._kv: list[LayerKV] | None = None  # per layer: context positions 0..c-1

    def reset(self, prompt_ids: torch.Tensor, prefill_hidden: dict[int, torch.Tensor] | None) -> None:
        if not prefill_hidden:
            raise ValueError("DFlashProposer needs the target's hidden states (hidden_state_indices)")
        self._kv = None
        with torch.inference_mode():
            self._pending = self.features(prefill_hidden)  # context positions 0..T-1

    def _feed_context(self, root_pos: int) -> None:
        start = 0 if self._kv is None else self._kv[0].length
        count = root_pos - start
        if count <= 0:
            return
        context = self._take_pending(count)[None]  # [1, count, H]
        positions = torch.arange(start, root_pos, device=context.device)[None]
        new = self.heads.context_cache(context, positions)
        self._kv = new if self._kv is None else [LayerKV(torch.cat([old.key, kv.key], -2),
                                                         torch.cat([old.value, kv.value], -2))
                                                 for old, kv in zip(self._kv, new, strict=True)]

    def depth_logits(self, committed_ids: Tensor, depth: int) -> Tensor | None:
        root_pos = committed_ids.numel() - 1
        self._feed_context(root_pos)
        if self._kv is None:
            return None
        device = self._kv[0].key.device
        block = self.heads.block_ids(committed_ids[-1:].to(device))  # [1, B]
        positions = torch.arange(root_pos, root_pos + self.heads.block_size, device=device)[None]
        out = self.heads(block, embed_tokens=self.embed_tokens, position_ids=positions, context=self._kv)
        return self.heads.compute_logits(out[0, 1: depth + 1], self.draft_lm_head).float()


class PEagleProposer(ParallelProposer):
    """P-EAGLE drafts: committed entries and the masked depths in one causal forward per step."""

    def __init__(self, heads: PEagleDraft, target_model: torch.nn.Module, tree: StaticTree,
                 sampling: SamplingConfig | None = None, seed: int | None = None, tree_source: str = "tree"):
        super().__init__(heads, target_model, tree, sampling, seed, tree_source)
        self._kv: list[LayerKV] | None = None  # per layer: committed entries 0..c-1
        self._last: Tensor | None = None  # [H] output of entry c-1

    def reset(self, prompt_ids: torch.Tensor, prefill_hidden: dict[int, torch.Tensor] | None) -> None:
        if not prefill_hidden:
            raise ValueError("PEagleProposer needs the target's hidden states (hidden_state_indices)")
        self._kv, self._last = None, None
        with torch.inference_mode():
            self._pending = self.features(prefill_hidden)  # entries 0..T-1

    def depth_logits(self, committed_ids: Tensor, depth: int) -> Tensor | None:
        root_pos = committed_ids.numel() - 1
        start = 0 if self._kv is None else self._kv[0].length
        count = max(root_pos - start, 0)
        if count == 0 and self._last is None:
            return None
        masked = depth - 1
        parts, tokens = [], []
        if count:
            parts.append(self._take_pending(count))
            tokens.append(committed_ids[start + 1: root_pos + 1].to(parts[0].device))
        device = parts[0].device if parts else self._last.device
        if masked:
            parts.append(self.heads.mask_features(masked).to(self.dtype))
            tokens.append(torch.full((masked,), self.heads.config.mask_token_id, dtype=torch.long, device=device))
        if parts:
            positions = torch.arange(start, start + count + masked, device=device)[None]
            out, kv = self.heads(torch.cat(parts)[None], torch.cat(tokens)[None], embed_tokens=self.embed_tokens,
                                 position_ids=positions, past_key_values=self._kv)  # causal over cache + entries
            out = out[0]
            if count:
                self._kv = [layer.crop(start + count) for layer in kv]  # the committed entries only
                self._last = out[count - 1]
            rows = torch.cat([self._last[None], out[count: count + masked]])
        else:
            rows = self._last[None]
        return self.heads.compute_logits(rows).float()
