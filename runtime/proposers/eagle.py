"""EAGLE proposer: EAGLE-1 static trees / chains and EAGLE-2 dynamic trees from one draft decoder layer.

Alignment (heads/eagle.py): draft entry s = (feature f_s = target hidden state at position s, embedding of
token s+1) at RoPE position s; its output predicts f_{s+1}, whose logits (target LM head) give token s+2.
With the root (last committed token) at position T, the entries 0..T-1 are "committed": their features are
the target's and their tokens are committed. The output of entry T-1 gives the root's children. A drafted
node at depth j >= 1 is entry (output of its parent's entry, node token) at position T-1+j, attending to
the committed entries and to its own ancestors' entries.

Draft KV cache (kept here, never in the target): it holds exactly the committed entries. Draft-time entries
are appended to a temporary copy and thrown away, so the cache is trimmed to the accepted path by
construction; after a step the accepted nodes come back as committed entries WITH THE TARGET'S features
(from the verify forward), as EAGLE does. Entries are fed lazily at the next `propose`, when the token that
follows them is committed (after prefill the first new token is not known to `reset`).

Prompt window: the draft layer is fed at most the last `prompt_window` entries of the prompt (PROMPT_WINDOW;
None = all), at their true RoPE positions, so its first draft after a long prompt costs a bounded forward (an EAGLE
layer over a 1,000-token prompt in float32 took 0.14-0.33 s, 2-4% of a 128-token answer, paid even by a head the
guard then rests). The draft's attention sees that window and everything generated since; what the draft proposes
is still verified by the target, so the output is unchanged whatever the window.

Tree modes:
- static (EAGLE-1): a `StaticTree` shape (rank paths; a chain is [[0], [0, 0], ...]); children of a node are
  its top-ranked tokens (or, with sampling, drawn without replacement from q, lossless).
- dynamic (EAGLE-2, `DynamicTreeConfig`): the root's top_k children, then `depth - 1` times: forward the
  top_k frontier nodes of the newest layer (by cumulative draft log-probability), give each its top_k
  children; finally keep the best `total_tokens` nodes (a node only with its parent) in BFS order.
  Children are deterministic top-k, so under sampling they are point masses (probs None): lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from heads.base import target_modules
from heads.eagle import EagleDraft
from heads.layers import LayerKV, additive_mask
from runtime.layout import match_panels
from runtime.proposers.base import Draft, root_only
from runtime.proposers.draft_vocab import DraftVocab
from runtime.proposers.tree_drafting import (
    Candidates,
    check_top_k,
    deeper_can_enter,
    draft_static_tree,
    expected_bound,
    ordered_draft,
    select_nodes,
)
from runtime.sampling import SamplingConfig
from runtime.tree_search import StaticTree

PROMPT_WINDOW = 256  # prompt entries the draft layer is fed (the last ones); None: the whole prompt


@dataclass(frozen=True)
class DynamicTreeConfig:
    """EAGLE-2 dynamic tree: expand `depth` levels, `top_k` children per expanded node and `top_k` expanded
    nodes per level; keep the best `total_tokens` nodes."""

    depth: int = 5
    top_k: int = 8
    total_tokens: int = 32

    def __post_init__(self) -> None:
        for name, flag in (("depth", "--tree_depth"), ("top_k", "--tree_top_k"), ("total_tokens", "--tree_size")):
            if getattr(self, name) < 1:
                raise ValueError(f"{flag} must be >= 1, got {getattr(self, name)}")


class EagleProposer:
    """EAGLE-1/2 drafts. Subclassed by EAGLE-3 (three-layer features, reduced vocabulary)."""

    def __init__(self, heads: EagleDraft, target_model: torch.nn.Module, tree: StaticTree | None = None,
                 dynamic: DynamicTreeConfig | None = None, sampling: SamplingConfig | None = None,
                 seed: int | None = None, prompt_window: int | None = PROMPT_WINDOW):
        if (tree is None) == (dynamic is None):
            raise ValueError("EagleProposer: pass exactly one of tree (static, EAGLE-1) or dynamic (EAGLE-2)")
        self.heads = heads
        self.tree = tree
        self.dynamic = dynamic
        self.sampling = sampling or SamplingConfig()
        modules = target_modules(target_model)
        self.embed_tokens = modules.embed_tokens
        self.vocab_size = int(modules.lm_head.weight.shape[0])
        self.vocab = DraftVocab.of(heads, self.vocab_size)
        # EAGLE-1/2 project through the target's LM head: only its draft-vocabulary rows, gathered once.
        self.draft_lm_head = self.vocab.linear(modules.lm_head) if heads.config.kind == "eagle" else None
        if self.draft_lm_head is not None:
            match_panels(self.draft_lm_head, target_model)  # a reduced copy: the target's panels do not serve it
        self.hidden_state_indices = tuple(heads.config.target_layers)
        self.generator = torch.Generator().manual_seed(seed + 3) if seed is not None else None
        self.dtype = next(heads.parameters()).dtype
        if tree is not None:
            check_top_k(tree.max_rank + 1, self.draft_vocab_size, "tree: top_k (largest rank + 1)")
        if dynamic is not None:
            check_top_k(dynamic.top_k, self.draft_vocab_size, "--tree_top_k")
        if prompt_window is not None and prompt_window < 1:
            raise ValueError(f"EagleProposer: prompt_window must be >= 1 or None, got {prompt_window}")
        self.prompt_window = prompt_window
        # EAGLE-2: stop forwarding levels once no deeper node can enter the kept tree (the draft is the same; an
        # unsure head stops early, a confident chain goes deep). cost_model.DraftTimer turns it off to time every
        # level: its random context says nothing about where text stops, and the planner's cost stays an upper bound.
        self.stop_when_final = True
        # The confidence gate (EAGLE-2 trees): the accepted draft tokens a step must be able to return to pay for
        # itself, set by the guard or the hybrid before each propose from the step's break-even (0: no gate, as
        # built; --confidence_gate, on by default, docs/drafters.md#the-confidence-gate). Once
        # the root's children are known, `expected_bound` caps what any kept tree can expect (each level of a
        # child's subtree adds at most the child's probability); under the threshold the step stops there and
        # drafts nothing. The draft's path probabilities are calibrated (on 7 prompt kinds, 1,915 steps: drafts
        # expecting .25 / .50 / .69 / 1.20 tokens accepted .23 / .44 / .67 / 1.18), so a step that cannot expect
        # its cost back loses it: it pays the feed and one LM-head row instead of the deeper levels and the verify.
        self.min_expected = 0.0
        self._skipped = 0  # prompt entries left out of the draft's cache (before the window)
        self._kv: LayerKV | None = None  # committed entries skipped..skipped+c-1
        self._pending: Tensor | None = None  # [m, H] features of entries c..c+m-1 (not yet fed)
        self._last: Tensor | None = None  # [H] output of entry c-1

    # ---- what EAGLE-3 overrides ----------------------------------------------------------------------
    @property
    def draft_vocab_size(self) -> int:
        return self.vocab.size

    def features(self, hidden: dict[int, Tensor]) -> Tensor:
        """Target hidden states {index: [n, H]} -> draft input features [n, H]."""
        return hidden[self.hidden_state_indices[0]].to(self.dtype)

    def draft_logits(self, outputs: Tensor) -> Tensor:
        """Draft outputs [..., H] -> logits over the draft vocabulary [..., Vd] (float32)."""
        return self.heads.compute_logits(outputs.to(self.draft_lm_head.weight.dtype), self.draft_lm_head).float()

    def to_target(self, draft_ids: Tensor) -> Tensor:
        return self.vocab.to_target(draft_ids)

    def to_target_logits(self, logits: Tensor) -> Tensor:
        return self.vocab.to_target_logits(logits)

    def root_logits(self) -> Tensor | None:
        """Draft logits [Vd] of the root's children (from the output of the last committed entry), or None
        before the first propose (bench.calibration reads the draft's confidence from it)."""
        return None if self._last is None else self.draft_logits(self._last)

    # ---- the proposer protocol -----------------------------------------------------------------------
    @property
    def tree_size(self) -> int:
        """Non-root nodes per draft (the budget the loop should allow)."""
        return self.tree.tree.num_nodes - 1 if self.tree is not None else self.dynamic.total_tokens

    @property
    def pending_entries(self) -> int:
        """Entries whose features are known but not yet fed to the draft layer (runtime.proposers.base)."""
        return 0 if self._pending is None else int(self._pending.shape[0])

    def reset(self, prompt_ids: torch.Tensor, prefill_hidden: dict[int, torch.Tensor] | None) -> None:
        if not prefill_hidden:
            raise ValueError(f"{type(self).__name__} needs the target's hidden states (hidden_state_indices)")
        self._kv, self._last = None, None
        length = next(iter(prefill_hidden.values())).shape[0]
        self._skipped = max(length - self.prompt_window, 0) if self.prompt_window is not None else 0
        self._pending = self.features({i: h[self._skipped:] for i, h in prefill_hidden.items()})  # entries skipped..T-1

    def on_accept(self, committed_ids: torch.Tensor, draft: Draft, accepted_nodes: list[int],
                  tree_hidden: dict[int, torch.Tensor] | None) -> None:
        if not tree_hidden:
            raise ValueError(f"{type(self).__name__} needs the target's hidden states at the tree nodes")
        rows = torch.tensor(accepted_nodes, device=next(iter(tree_hidden.values())).device)
        new = self.features({i: h.index_select(0, rows) for i, h in tree_hidden.items()})  # [k+1, H]
        self._pending = new if self._pending is None else torch.cat([self._pending, new])

    def _step(self, features: Tensor, tokens: Tensor, positions: Tensor, mask: Tensor | None,
              kv: LayerKV | None, last: int | None = None) -> tuple[Tensor, LayerKV]:
        """One draft-layer call over n entries: features [n, H], tokens [n], positions [n] -> ([n, H], kv); with
        `last`, the outputs of the last `last` entries only (the others add their keys and values to kv)."""
        out = self.heads(features[None], tokens[None], embed_tokens=self.embed_tokens, position_ids=positions[None],
                         attention_mask=mask, past_key_value=kv, last=last)
        return out.hidden_states[0], out.past_key_value

    def _feed_committed(self, committed_ids: Tensor) -> int:
        """Feed pending entries whose next token is committed; returns T (the root's position)."""
        root_pos = committed_ids.numel() - 1
        start = self._skipped + (0 if self._kv is None else self._kv.length)
        count = root_pos - start
        if count > 0:
            if self._pending is None or self._pending.shape[0] < count:
                raise ValueError("EAGLE proposer: target features missing for committed tokens (call reset and "
                                 "on_accept with the loop's hidden states)")
            device = self._pending.device
            tokens = committed_ids[start + 1: root_pos + 1].to(device)
            positions = torch.arange(start, root_pos, device=device)
            # drafting reads the newest entry's output only; the others are needed as keys and values
            out, self._kv = self._step(self._pending[:count], tokens, positions, None, self._kv, last=1)
            self._last = out[-1]
            self._pending = self._pending[count:]
        return root_pos

    def _tree_mask(self, queries: list[int], forwarded: list[int], parents: list[int]) -> Tensor:
        """Additive mask [1, 1, q, c + f + q]: committed entries, forwarded ancestors, then self."""
        c = self._kv.length
        allowed = torch.zeros(len(queries), c + len(forwarded) + len(queries), dtype=torch.bool)
        allowed[:, :c] = True
        for i, node in enumerate(queries):
            ancestors = set()
            walk = parents[node]
            while walk > 0:
                ancestors.add(walk)
                walk = parents[walk]
            for j, f in enumerate(forwarded):
                allowed[i, c + j] = f in ancestors
            allowed[i, c + len(forwarded) + i] = True
        return additive_mask(allowed, self.dtype, self._last.device)

    @torch.inference_mode()
    def propose(self, committed_ids: torch.Tensor, max_tokens: int) -> Draft:
        root_pos = self._feed_committed(committed_ids)
        if max_tokens <= 0 or self._last is None:
            return root_only(committed_ids)
        root = int(committed_ids[-1])
        # Draft-time state: temporary KV (committed + forwarded nodes), outputs per node id (root: last output)
        session = _DraftSession(self, root_pos)
        if self.tree is not None:
            draft = draft_static_tree(self.tree, root, session.rows_for, self.sampling, self.generator, max_tokens,
                                      self.vocab_size, self.to_target, self.to_target_logits)
        else:
            draft = self._dynamic_draft(session, root, max_tokens)
        return Draft(tokens=draft.tokens.to(committed_ids.device), tree=draft.tree,
                     probs=None if draft.probs is None else draft.probs.to(committed_ids.device),
                     expected=draft.expected)

    def _dynamic_draft(self, session: _DraftSession, root: int, max_tokens: int) -> Draft:
        config = self.dynamic
        budget = min(config.total_tokens, max_tokens)
        candidates = Candidates.rooted(root)
        layer = [0]
        # Draft only what `select_nodes` can keep. Scores never increase along a path, so a node at depth d+1
        # is kept only after its d ancestors-or-parent, its better siblings and the better nodes of its
        # parent's level: the r-th child of the j-th best node of depth d needs d + max(r, j) <= budget.
        # Hence at most `budget` levels, and per level at most budget - d expanded nodes and children each.
        for depth in range(min(config.depth, budget)):
            width = min(config.top_k, budget - depth)
            if depth == 0:
                rows = session.rows_for(0, [0], [root], candidates.parents)
                frontier = [0]
            else:
                frontier = sorted(layer, key=lambda n: -candidates.score[n])[:width]
                frontier.sort()
                rows = session.rows_for(depth, frontier, [candidates.tokens[n] for n in frontier], candidates.parents)
            log_probs = torch.log_softmax(rows, dim=-1)  # [F, Vd]
            top = log_probs.topk(width, dim=-1)
            ids = self.to_target(top.indices)  # [F, k] target ids
            layer = []
            for node, token_row, lp_row in zip(frontier, ids.tolist(), top.values.tolist(), strict=True):
                for token, lp in zip(token_row, lp_row, strict=True):
                    layer.append(candidates.add(node, token, lp))
            if depth == 0 and self.min_expected > 0 and \
                    expected_bound(candidates, layer, budget, min(config.depth, budget)) < self.min_expected:
                return ordered_draft(candidates, [0])  # the gate: nothing worth verifying
            if self.stop_when_final and not deeper_can_enter(candidates, layer, budget):  # the kept tree is final
                break
        kept = select_nodes(candidates, budget)
        return ordered_draft(candidates, kept)


class _DraftSession:
    """One propose call's draft-side state: temporary KV with forwarded tree entries and their outputs."""

    def __init__(self, proposer: EagleProposer, root_pos: int):
        self.p = proposer
        self.root_pos = root_pos
        self.kv = proposer._kv
        self.forwarded: list[int] = []  # node ids whose entries are in self.kv after the committed ones
        self.outputs: dict[int, Tensor] = {0: proposer._last}

    def rows_for(self, depth: int, nodes: list[int], tokens: list[int], parents: list[int]) -> Tensor:
        """Draft logits [F, Vd] for the children of `nodes` (all at `depth`)."""
        p = self.p
        if depth == 0:
            return p.draft_logits(self.outputs[0])[None].expand(len(nodes), -1)
        device = self.outputs[0].device
        features = torch.stack([self.outputs[parents[n]] for n in nodes])  # [F, H]
        token_ids = torch.tensor(tokens, device=device)
        positions = torch.full((len(nodes),), self.root_pos - 1 + depth, device=device)
        mask = p._tree_mask(nodes, self.forwarded, parents)
        out, self.kv = p._step(features, token_ids, positions, mask, self.kv)
        self.forwarded.extend(nodes)
        for n, o in zip(nodes, out, strict=True):
            self.outputs[n] = o
        return p.draft_logits(out)
