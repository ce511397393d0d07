"""MTP proposer: a chain of up to `mtp_num_depths` tokens from DeepSeek-V3-style multi-token-prediction modules.

Alignment (heads/mtp.py): depth d's entry at position s reads h_d(s) (h_0 = target hidden state) and the
embedding of token s+d+1; its output h_{d+1}(s) gives, through the module's norm and the target's LM head,
token s+d+2. Every depth keeps its own KV cache of *committed* entries: entry s of depth d is committed once
h_d(s) is known and token s+d+1 is committed. With the root (last committed token) at position T, depth d is
committed up to s = T-d-1, a staircase.

Drafting the chain y_1, y_2, ... (positions T+1, T+2, ...): depth 0's last committed output (s = T-1) gives
y_1. Depth d >= 1 runs d temporary entries s = T-d..T-1 (h_d from its committed pending state at T-d and
from depth d-1's temporary outputs after that; tokens y_1..y_d) and its output at T-1 gives y_{d+1}. The
temporary entries are dropped; accepted tokens come back as committed entries with the target's features.
With sampling each y is drawn from q (same processing as the target) and q is recorded (lossless).
"""

from __future__ import annotations

import torch
from torch import Tensor

from heads.base import target_modules
from heads.layers import LayerKV
from heads.mtp import MTPHeads
from runtime.proposers.base import Draft, root_only
from runtime.proposers.draft_vocab import DraftVocab
from runtime.proposers.tree_drafting import draft_static_tree
from runtime.sampling import SamplingConfig
from runtime.tree_search import static_tree


class MTPProposer:
    """Chain drafts from MTP modules; `chain_length` <= mtp_num_depths."""

    def __init__(self, heads: MTPHeads, target_model: torch.nn.Module, chain_length: int | None = None,
                 sampling: SamplingConfig | None = None, seed: int | None = None):
        depths = heads.num_depths
        chain_length = depths if chain_length is None else chain_length
        if not 1 <= chain_length <= depths:
            raise ValueError(f"--tree_size {chain_length}: MTP drafts a chain of 1..{depths} tokens "
                             f"(the heads have {depths} depths)")
        self.heads = heads
        self.chain = static_tree([[0] * d for d in range(1, chain_length + 1)], "MTP chain", num_heads=depths)
        self.sampling = sampling or SamplingConfig()
        modules = target_modules(target_model)
        self.embed_tokens = modules.embed_tokens
        self.vocab_size = int(modules.lm_head.weight.shape[0])
        self.vocab = DraftVocab.of(heads, self.vocab_size)
        self.draft_lm_head = self.vocab.linear(modules.lm_head)  # the draft-vocabulary rows, gathered once
        self.hidden_state_indices = tuple(heads.config.target_layers)
        self.generator = torch.Generator().manual_seed(seed + 4) if seed is not None else None
        self.dtype = next(heads.parameters()).dtype
        self._kv: list[LayerKV | None] = []
        self._known: list[Tensor | None] = []  # [d]: h_d for positions committed[d] .. (not yet fed to depth d)
        self._last: Tensor | None = None  # h_1(T-1): depth 0's output at the last committed entry

    @property
    def tree_size(self) -> int:
        return self.chain.tree.num_nodes - 1

    @property
    def pending_entries(self) -> int:
        """Entries whose target hidden states are known but not yet fed to depth 0 (runtime.proposers.base)."""
        return 0 if not self._known or self._known[0] is None else int(self._known[0].shape[0])

    def reset(self, prompt_ids: torch.Tensor, prefill_hidden: dict[int, torch.Tensor] | None) -> None:
        if not prefill_hidden:
            raise ValueError("MTPProposer needs the target's hidden states (hidden_state_indices)")
        depths = self.heads.num_depths
        self._kv = [None] * depths
        self._known = [prefill_hidden[self.hidden_state_indices[0]].to(self.dtype)] + [None] * (depths - 1)
        self._last = None

    def on_accept(self, committed_ids: torch.Tensor, draft: Draft, accepted_nodes: list[int],
                  tree_hidden: dict[int, torch.Tensor] | None) -> None:
        if not tree_hidden:
            raise ValueError("MTPProposer needs the target's hidden states at the tree nodes")
        hidden = tree_hidden[self.hidden_state_indices[0]]
        new = hidden.index_select(0, torch.tensor(accepted_nodes, device=hidden.device)).to(self.dtype)
        self._known[0] = new if self._known[0] is None else torch.cat([self._known[0], new])

    def _run(self, depth: int, hidden: Tensor, tokens: Tensor, start: int, kv: LayerKV | None,
             last: int | None = None) -> tuple[Tensor, LayerKV]:
        """Depth `depth` over entries start..start+n-1 (causal over its cache): hidden [n, H], tokens [n]; the
        outputs of the last `last` entries only, when given."""
        positions = torch.arange(start, start + hidden.shape[0], device=hidden.device)
        out = self.heads(hidden[None], tokens[None].to(hidden.device), depth=depth, embed_tokens=self.embed_tokens,
                         position_ids=positions[None], past_key_value=kv, last=last)
        return out.hidden_states[0], out.past_key_value

    def _logits(self, depth: int, h: Tensor) -> Tensor:
        """h_{depth+1} [..., H] -> logits over the draft vocabulary [..., Vd] (float32)."""
        return self.heads.compute_logits(h.to(self.draft_lm_head.weight.dtype), depth=depth,
                                         lm_head=self.draft_lm_head).float()

    def _feed_committed(self, committed_ids: Tensor) -> int:
        root_pos = committed_ids.numel() - 1
        for depth in range(self.heads.num_depths):
            start = 0 if self._kv[depth] is None else self._kv[depth].length
            count = root_pos - depth - start  # entries start..T-depth-1
            known = self._known[depth]
            if count <= 0:
                continue
            if known is None or known.shape[0] < count:
                raise ValueError("MTP proposer: hidden states missing for committed tokens (call reset and "
                                 "on_accept with the loop's hidden states)")
            tokens = committed_ids[start + depth + 1: root_pos + 1]
            deepest = depth + 1 == self.heads.num_depths  # no depth reads its outputs: only depth 0's newest is kept
            out, self._kv[depth] = self._run(depth, known[:count], tokens, start, self._kv[depth],
                                             last=1 if deepest else None)
            self._known[depth] = known[count:]
            if depth == 0:
                self._last = out[-1]
            if depth + 1 < self.heads.num_depths:
                nxt = self._known[depth + 1]
                self._known[depth + 1] = out if nxt is None else torch.cat([nxt, out])
        return root_pos

    @torch.inference_mode()
    def propose(self, committed_ids: torch.Tensor, max_tokens: int) -> Draft:
        root_pos = self._feed_committed(committed_ids)
        if max_tokens <= 0 or self._last is None or root_pos < self.chain.tree.max_depth:
            return root_only(committed_ids)  # the staircase needs T >= depth committed entries per depth
        drafted: list[int] = []  # y_1, y_2, ...
        previous: list[Tensor] = []  # depth d-1's temporary outputs h_d(T-d+1..T-1)

        def rows_for(depth: int, nodes: list[int], tokens: list[int], parents: list[int]) -> Tensor:
            nonlocal previous
            if depth == 0:
                previous = []
                return self._logits(0, self._last)[None]
            drafted.append(tokens[0])  # y_depth
            h = torch.cat([self._known[depth][:1], *[p[None] for p in previous]])  # [depth, H] at T-depth..T-1
            ys = torch.tensor(drafted, device=h.device)
            out, _ = self._run(depth, h, ys, root_pos - depth, self._kv[depth])
            previous = list(out)
            return self._logits(depth, out[-1])[None]

        draft = draft_static_tree(self.chain, int(committed_ids[-1]), rows_for, self.sampling, self.generator,
                                  max_tokens, self.vocab_size, self.vocab.to_target, self.vocab.to_target_logits)
        return Draft(tokens=draft.tokens.to(committed_ids.device), tree=draft.tree,
                     probs=None if draft.probs is None else draft.probs.to(committed_ids.device))
