"""Proposers: prompt lookup n-gram matching, draft-model trees and draft-side cache, vocabulary checks."""

import pytest
import torch
from transformers import AutoTokenizer

from runtime.proposers import DraftModelProposer, PromptLookupProposer, check_same_vocabulary
from runtime.proposers.prompt_lookup import longest_context, lookup_match
from runtime.sampling import SamplingConfig
from runtime.target import TargetModel
from tests.tiny_models import STORIES260K, tiny_model


def test_lookup_prefers_longest_ngram_then_the_occurrence_with_the_longest_agreeing_context():
    ids = torch.tensor([5, 6, 7, 8, 9, 1, 7, 3, 4, 6, 7])
    # 3-gram [4, 6, 7] never occurred; 2-gram [6, 7] did at 1, followed by 8 9 1
    assert lookup_match(ids, 3, 1, 3)[1].tolist() == [8, 9, 1]
    # [7] occurred at 2 (after 6, as the suffix is) and at 6 (after 1): the one after 6, though earlier
    assert lookup_match(ids, 1, 1, 2)[1].tolist() == [8, 9]
    # equal contexts: the latest occurrence ([2, 9] occurs after 1 at 1 and at 4; the suffix [2, 9] follows 3)
    assert lookup_match(torch.tensor([1, 2, 9, 4, 2, 9, 5, 3, 2, 9]), 2, 2, 1)[1].tolist() == [5]
    # a longer agreeing context beats recency: [3, 1, 2] before the first occurrence, [0, 2] before the second
    copied = torch.tensor([3, 1, 2, 7, 4, 0, 2, 7, 5, 3, 1, 2, 7])
    assert lookup_match(copied, 2, 1, 1)[1].tolist() == [4]
    assert longest_context(copied, torch.tensor([2, 6]), 2) == 2 and longest_context(copied, torch.tensor([6]), 2) == 6
    assert lookup_match(ids, 3, 3, 4)[1].tolist() == []  # [4, 6, 7] never occurred before
    assert lookup_match(torch.tensor([4]), 3, 1, 4)[1].tolist() == []
    assert lookup_match(torch.tensor([4, 4]), 3, 1, 4)[1].tolist() == [4]


def test_prompt_lookup_draft_is_a_chain_rooted_at_the_last_token():
    proposer = PromptLookupProposer(max_ngram=2)
    draft = proposer.propose(torch.tensor([1, 2, 3, 4, 1, 2]), max_tokens=3)
    assert draft.tokens.tolist() == [2, 3, 4, 1] and draft.tree.parents.tolist() == [-1, 0, 1, 2]
    assert draft.probs is None
    assert proposer.propose(torch.tensor([1, 2, 3, 4, 1, 2]), max_tokens=0).tokens.tolist() == [2]
    with pytest.raises(ValueError, match="--min_ngram"):
        PromptLookupProposer(max_ngram=1, min_ngram=2)


def test_draft_model_tree_shape_budget_and_probs():
    model = tiny_model("llama")
    sampling = SamplingConfig(temperature=1.0)
    proposer = DraftModelProposer(model, 256, sampling=sampling, branching=(3, 2), seed=0)
    committed = torch.randint(3, 256, (9,))
    proposer.reset(committed[:-1], None)
    draft = proposer.propose(committed, max_tokens=10)
    # depth 1: 3 children of the root, depth 2: 2 children each (6), depth 3: one child for the first of them
    assert draft.tree.parents.tolist() == [-1, 0, 0, 0, 1, 1, 2, 2, 3, 3, 4]
    assert draft.tokens[0] == committed[-1]
    assert len(set(draft.tokens[1:4].tolist())) == 3  # siblings drawn without replacement
    with torch.no_grad():
        expected_root_q = torch.softmax(model(committed[None]).logits[0, -1], -1)
    torch.testing.assert_close(draft.probs[0], expected_root_q, atol=1e-5, rtol=1e-4)
    assert torch.allclose(draft.probs[:5].sum(-1), torch.ones(5))  # q of the nodes that have children
    assert draft.probs[5:].abs().sum() == 0  # leaves: no children drawn


def test_draft_model_cache_tracks_the_committed_tokens():
    """After accepting a path, the draft cache equals a fresh prefill of the committed tokens it has seen."""
    model = tiny_model("qwen3")
    proposer = DraftModelProposer(model, 256, branching=(2,))
    committed = torch.randint(3, 256, (10,))
    proposer.reset(committed[:-1], None)
    generator = torch.Generator().manual_seed(0)
    for _ in range(4):
        draft = proposer.propose(committed, max_tokens=4)
        deepest = max(draft.tree.leaves(), key=lambda leaf: int(draft.tree.depth[leaf]))
        path = draft.tree.path_to(deepest)[:3]  # accept two draft tokens
        committed = torch.cat([committed, draft.tokens[path[1:]], torch.randint(3, 256, (1,), generator=generator)])
        proposer.on_accept(committed, draft, path, None)
        fresh = TargetModel(model)
        fresh.prefill(committed[:proposer.draft.prefix_len])
        for mine, ref in zip(proposer.draft.cache.layers, fresh.cache.layers, strict=True):
            torch.testing.assert_close(mine.keys, ref.keys, atol=1e-5, rtol=1e-4)


def test_draft_vocabulary_size_mismatch_names_the_flag():
    with pytest.raises(ValueError, match="--draft_model: vocabulary of 256 logits but the target has 512"):
        DraftModelProposer(tiny_model("llama"), target_vocab_size=512)


class _FakeTokenizer:
    def __init__(self, base, rename):
        self.base, self.rename = base, rename
        self.eos_token_id, self.bos_token_id = base.eos_token_id, base.bos_token_id

    def __len__(self):
        return len(self.base)

    def convert_ids_to_tokens(self, ids):
        return [self.rename if i == ids[-1] else t for i, t in zip(ids, self.base.convert_ids_to_tokens(ids),
                                                                    strict=True)]


def test_tokenizer_mismatch_names_the_flag():
    tokenizer = AutoTokenizer.from_pretrained(STORIES260K)
    check_same_vocabulary(tokenizer, AutoTokenizer.from_pretrained(STORIES260K))
    with pytest.raises(ValueError, match="--draft_model: token strings differ"):
        check_same_vocabulary(tokenizer, _FakeTokenizer(tokenizer, "something-else"))
    bigger = AutoTokenizer.from_pretrained(STORIES260K)
    bigger.add_tokens(["<extra_token>"])
    with pytest.raises(ValueError, match=r"--draft_model: its tokenizer has 513 tokens but the target's has 512"):
        check_same_vocabulary(tokenizer, bigger)


def test_cost_aware_lookup_length_pays_for_its_verify():
    from runtime.proposers.prompt_lookup import best_draft_length, expected_tokens, learn

    assert expected_tokens([0.5, 0.5], 2) == pytest.approx(1.75) and expected_tokens([0.5], 0) == 1.0
    cpu = [1.0, 1.56, 1.7, 1.8, 1.85]  # verifying 2 tokens costs 1.56 plain steps
    assert best_draft_length([0.3, 0.7, 0.7, 0.7], cpu, 4) == 0  # not copying: plain steps are faster
    assert best_draft_length([0.9, 0.9, 0.9, 0.9], cpu, 4) == 4  # copying: the whole match
    assert best_draft_length([0.9, 0.9, 0.9, 0.9], cpu, 2) == 2  # never beyond the match
    assert best_draft_length([0.3, 0.7], [1.0, 1.0, 1.0], 2) == 2  # flat verify cost (a GPU): any chance pays
    # a margin: a draft promising 1.1x a plain step's rate is taken at required_gain 1.0, not at 1.2
    assert best_draft_length([0.76], cpu, 1) == 1 and best_draft_length([0.76], cpu, 1, required_gain=1.2) == 0
    assert best_draft_length([0.9, 0.9, 0.9, 0.9], cpu, 4, required_gain=1.2) == 4
    acceptance = [0.5, 0.5, 0.5]
    learn(acceptance, [7, 8, 9], [7, 4], rate=0.5)  # depth 1 hit, depth 2 missed, depth 3 not observed
    assert acceptance == [0.75, 0.25, 0.5]


def test_cost_aware_lookup_waits_for_evidence_drafts_where_text_repeats_and_stops_where_it_misses():
    cpu = [1.0, 1.56, 1.7, 1.8, 1.85]
    proposer = PromptLookupProposer(max_ngram=1, step_costs=cpu)
    proposer.reset(None, None)
    context = [1, 2, 3, 4, 1]  # [1] matched: candidate [2, 3, 4, 1]
    assert proposer.propose(torch.tensor(context), 4).tree.num_nodes - 1 == 0  # the prior alone does not pay
    lengths = []
    for token in (2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1):  # the text repeats: learned from plain steps too
        context.append(token)
        lengths.append(proposer.propose(torch.tensor(context), 4).tree.num_nodes - 1)
    assert lengths[-1] == 4 and proposer.acceptance[1][0] > 0.8
    for token in (50, 1, 51, 1, 52, 1, 53, 1):  # after each 1 the target writes something new: drafts stop
        context.append(token)
        lengths.append(proposer.propose(torch.tensor(context), 4).tree.num_nodes - 1)
    assert lengths[-1] == 0 and proposer.acceptance[1][0] < 0.5
