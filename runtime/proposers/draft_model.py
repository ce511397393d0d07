"""Draft-model proposer: a smaller causal LM with the target's tokenizer drafts a chain or a top-b tree.

The draft model runs through the same `TargetModel` adapter as the target, with its own KV cache holding a
prefix of the committed tokens. Each `propose` first feeds the committed tokens the draft has not seen yet
(the root, plus the last accepted draft token and the bonus after a fully accepted step) and then grows the
tree depth by depth: one draft forward per depth, over the new nodes only (tree mask, BFS order). Depth d
(0-based) gives every frontier node `branching[d]` children (1 past the end of `branching`: a chain), while
the total stays within the step's budget. Greedy: the children are the top-b draft tokens (Draft.probs None).
Sampling: children are drawn without replacement from q = logits_to_probs(draft logits) and Draft.probs
holds q, as the lossless rejection rule requires. `on_accept` keeps the accepted nodes the draft has
already forwarded and drops the rest with the one compaction routine.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from runtime.proposers.base import Draft, root_only
from runtime.sampling import SamplingConfig, logits_to_probs
from runtime.target import TargetModel
from runtime.tree import Tree


def check_same_vocabulary(target_tokenizer: PreTrainedTokenizerBase, draft_tokenizer: PreTrainedTokenizerBase,
                          flag: str = "--draft_model") -> None:
    """Raise unless both tokenizers map the same ids to the same strings (size, specials and a sample of ids)."""
    sizes = len(target_tokenizer), len(draft_tokenizer)
    if sizes[0] != sizes[1]:
        raise ValueError(f"{flag}: its tokenizer has {sizes[1]} tokens but the target's has {sizes[0]}; "
                         "the draft model must share the target's tokenizer")
    sample = sorted({0, 1, 2, sizes[0] // 3, sizes[0] // 2, 2 * sizes[0] // 3, sizes[0] - 1})
    for name in ("eos_token_id", "bos_token_id"):
        ids = getattr(target_tokenizer, name), getattr(draft_tokenizer, name)
        if ids[0] != ids[1]:
            raise ValueError(f"{flag}: {name} {ids[1]} differs from the target's {ids[0]}")
    strings = target_tokenizer.convert_ids_to_tokens(sample), draft_tokenizer.convert_ids_to_tokens(sample)
    if strings[0] != strings[1]:
        raise ValueError(f"{flag}: token strings differ from the target's at ids {sample}: "
                         f"{strings[1]} vs {strings[0]}; the draft model must share the target's tokenizer")


class DraftModelProposer:
    """Chain (branching=()) or top-b tree drafts from a smaller causal LM sharing the target's vocabulary."""

    hidden_state_indices: tuple[int, ...] = ()

    def __init__(self, model: PreTrainedModel, target_vocab_size: int, sampling: SamplingConfig | None = None,
                 branching: tuple[int, ...] = (), seed: int | None = None, mode: str = "tree"):
        """mode: the draft model's verify mode (runtime/verify_check.py): "tree" or "chain" (chain drafts only)."""
        if mode not in ("tree", "chain"):
            raise ValueError(f"--draft_model: its self-check allows {mode!r} decoding only; drafting needs tree or "
                             f"chain forwards with rollback")
        if mode != "tree" and branching:
            raise ValueError(f"--draft_tree_branching {branching}: the draft model verifies chains only")
        self.draft = TargetModel(model, flag="--draft_model", mode=mode)
        if self.draft.vocab_size != target_vocab_size:
            raise ValueError(f"--draft_model: vocabulary of {self.draft.vocab_size} logits but the target has "
                             f"{target_vocab_size}; the draft model must share the target's vocabulary")
        if any(b < 1 for b in branching):
            raise ValueError(f"--draft_tree_branching: every value must be >= 1, got {branching}")
        self.sampling = sampling or SamplingConfig()
        self.branching = tuple(branching)
        self.generator = None
        if seed is not None:
            self.generator = torch.Generator(device=self.draft.device).manual_seed(seed + 1)
        self._num_unseen = 0  # committed tokens fed at the start of the last propose
        self._num_forwarded = 0  # draft-side tree nodes in the draft cache after the last propose

    def __copy__(self) -> DraftModelProposer:
        """Another row's drafter: the same draft weights, its own draft-side KV cache."""
        twin = object.__new__(DraftModelProposer)
        twin.__dict__.update(self.__dict__)
        twin.draft = TargetModel(self.draft.model, flag=self.draft.flag, mode=self.draft.mode)
        return twin

    def reset(self, prompt_ids: torch.Tensor, prefill_hidden: dict[int, torch.Tensor] | None) -> None:
        self.draft.prefill(prompt_ids)
        self._num_unseen = self._num_forwarded = 0

    def _children(self, logits: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits [V] -> (child tokens [c], q [V] or None when greedy); c <= count."""
        if self.sampling.is_greedy:
            return logits.topk(count).indices, None
        q = logits_to_probs(logits, self.sampling)  # [V] float32
        count = min(count, int((q > 0).sum()))
        return torch.multinomial(q, count, replacement=False, generator=self.generator), q

    @torch.inference_mode()
    def propose(self, committed_ids: torch.Tensor, max_tokens: int) -> Draft:
        unseen = committed_ids[self.draft.prefix_len:]  # [m] committed tokens not in the draft cache, root last
        m = unseen.numel()
        max_depth = max_tokens
        if self.draft.max_positions is not None:  # node at depth d sits at position prefix_len + m - 1 + d
            max_depth = min(max_depth, self.draft.max_positions - self.draft.prefix_len - m)
        self._num_unseen, self._num_forwarded = m, 0
        if max_depth <= 0:
            return root_only(committed_ids)
        # draft-side tree: the unseen tokens as a chain, the proposal hanging off the root (draft node m - 1)
        parents, tokens = list(range(-1, m - 1)), unseen.tolist()
        probs: dict[int, torch.Tensor] = {}
        frontier, depth = [m - 1], 0
        while frontier and depth < max_depth and len(tokens) - m < max_tokens:
            # depth 0 forwards the unseen chain but needs only its last (root) logits; deeper, every new node
            out = self.draft.forward(torch.tensor(tokens[self._num_forwarded:], device=self.draft.device),
                                     Tree.from_parents(parents), start=self._num_forwarded,
                                     logits_to_keep=1 if depth == 0 else 0)
            rows = out.logits if depth == 0 else out.logits[[node - self._num_forwarded for node in frontier]]  # [F, V]
            self._num_forwarded = len(tokens)
            width = self.branching[depth] if depth < len(self.branching) else 1
            next_frontier = []
            for node, logits in zip(frontier, rows, strict=True):
                room = max_tokens - (len(tokens) - m)
                if room <= 0:
                    break
                children, q = self._children(logits, min(width, room))
                if q is not None:
                    probs[node - (m - 1)] = q
                for token in children.tolist():
                    next_frontier.append(len(tokens))
                    parents.append(node)
                    tokens.append(token)
            frontier, depth = next_frontier, depth + 1
        proposal = torch.tensor(tokens[m - 1:], dtype=torch.long, device=committed_ids.device)  # [N]
        tree = Tree.from_parents([-1] + [p - (m - 1) for p in parents[m:]])
        draft_probs = None
        if not self.sampling.is_greedy:
            draft_probs = torch.zeros(tree.num_nodes, self.draft.vocab_size, device=self.draft.device)
            for node, q in probs.items():
                draft_probs[node] = q
        return Draft(tokens=proposal, tree=tree, probs=draft_probs)

    def on_accept(self, committed_ids: torch.Tensor, draft: Draft, accepted_nodes: list[int],
                  tree_hidden: dict[int, torch.Tensor] | None) -> None:
        """Keep the unseen chain and the accepted nodes already in the draft cache; drop the other nodes."""
        if self._num_forwarded == 0:
            return
        offset = self._num_unseen - 1  # proposal node i is draft-side node offset + i
        keep = list(range(self._num_unseen))
        keep += [offset + node for node in accepted_nodes[1:] if offset + node < self._num_forwarded]
        self.draft.commit(keep)
        self._num_forwarded = 0
