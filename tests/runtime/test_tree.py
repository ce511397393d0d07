"""Tree topology, the tree mask, and invariant 1: one tree forward == a plain causal forward per path."""

import pytest
import torch

from runtime.masks import allowed_keys, tree_attention_mask
from runtime.target import TargetModel
from runtime.tree import Tree
from tests.tiny_models import ARCHITECTURES, stories260k, tiny_model

# 12 nodes, depth up to 4, several children per node (BFS order)
PARENTS = [-1, 0, 0, 0, 1, 1, 2, 4, 4, 6, 7, 9]


def test_chain_matches_from_parents():
    for length in (0, 1, 5):
        fast, slow = Tree.chain(length), Tree.from_parents([-1] + list(range(length)))
        for name in ("parents", "depth", "ancestors"):
            assert torch.equal(getattr(fast, name), getattr(slow, name)), name


def test_tree_topology():
    tree = Tree.from_parents(PARENTS)
    assert tree.depth.tolist() == [0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4]
    assert tree.children(0) == [1, 2, 3] and tree.children(4) == [7, 8]
    assert tree.path_to(10) == [0, 1, 4, 7, 10]
    assert sorted(p[-1] for p in tree.paths()) == sorted(tree.leaves()) == [3, 5, 8, 10, 11]
    with pytest.raises(ValueError, match="parents"):
        Tree.from_parents([-1, 0, 3, 1])


def test_mask_prefix_ancestors_and_window():
    tree = Tree.from_parents([-1, 0, 0, 1])
    allowed = allowed_keys(tree, prefix_len=3)
    assert allowed.tolist() == [[1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0],
                                [1, 1, 1, 1, 0, 1, 0], [1, 1, 1, 1, 1, 0, 1]]
    # window 3: node 3 sits at position 3 + 2 = 5 and sees positions 3, 4, 5 only (key_pos > 5 - 3)
    windowed = allowed_keys(tree, prefix_len=3, window=3)
    assert windowed[3].tolist() == [0, 0, 0, 1, 1, 0, 1]
    mask = tree_attention_mask(tree, 3, torch.float64, start=2)
    assert mask.shape == (1, 1, 2, 7) and mask.dtype == torch.float64
    assert mask[0, 0, 0, 5] == 0 and mask[0, 0, 0, 4] == torch.finfo(torch.float64).min


def _tree_matches_paths(model, prefix_len=13, parents=PARENTS, seed=0, atol=2e-5, scale_tol=None):
    """Prefill a random prefix, forward a random-token tree in one call, compare every node with a causal
    no-cache forward over prefix + its root-to-node path (logits and two hidden-state indices).

    scale_tol: instead of atol / rtol 1e-4, allow |tree - path| <= scale_tol * max|path| per tensor (reduced
    precision, whose rounding error scales with the largest values)."""

    def assert_close(actual, expected):
        if scale_tol is None:
            torch.testing.assert_close(actual, expected, atol=atol, rtol=1e-4)
        else:
            expected = expected.float()
            torch.testing.assert_close(actual.float(), expected, atol=scale_tol * expected.abs().max().item(), rtol=0)

    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.get_text_config().vocab_size
    prefix = torch.randint(3, vocab, (prefix_len,), generator=generator)
    tree = Tree.from_parents(parents)
    tokens = torch.randint(3, vocab, (tree.num_nodes,), generator=generator)
    target = TargetModel(model)
    target.prefill(prefix[:-1])  # the root (prefix[-1]) is the tree's node 0, not yet in the cache
    tokens[0] = prefix[-1]
    out = target.forward(tokens, tree, hidden_state_indices=(1, -1))
    assert out.logits.shape == (tree.num_nodes, vocab)
    with torch.no_grad():
        for leaf_path in tree.paths():
            ids = torch.cat([prefix[:-1], tokens[leaf_path]])[None]
            ref = model(input_ids=ids, output_hidden_states=True)
            rows = slice(prefix_len - 1, None)
            assert_close(out.logits[leaf_path], ref.logits[0, rows])
            for index in (1, -1):
                assert_close(out.hidden[index][leaf_path], ref.hidden_states[index][0, rows])


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tree_forward_equals_causal_forward_per_path(arch):
    _tree_matches_paths(tiny_model(arch))


def test_tree_forward_eager_attention():
    _tree_matches_paths(tiny_model("llama", attn="eager"))
    _tree_matches_paths(tiny_model("gpt2", attn="eager"))


def test_tree_forward_stories260k():
    _tree_matches_paths(stories260k(), prefix_len=20)


@pytest.mark.parametrize("arch,overrides", [
    ("mistral", {"sliding_window": 8}),
    ("phi3", {"sliding_window": 8}),
    ("qwen2", {"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 1}),
    ("gemma2", {"sliding_window": 8}),
    ("gemma3_text", {"sliding_window": 8}),
])
def test_tree_forward_sliding_window_past_the_window(arch, overrides):
    """Prefix 13 > window 8 and tree depth 4: the windowed per-layer-type masks must match HF's own."""
    model = tiny_model(arch, **overrides)
    assert TargetModel(model).windows is not None
    _tree_matches_paths(model, prefix_len=13)
    _tree_matches_paths(model, prefix_len=30, seed=1)


def test_tree_forward_fp64_is_exact():
    _tree_matches_paths(tiny_model("qwen3", dtype=torch.float64), atol=1e-12)


# bf16: the tree forward and a per-path forward run different kernel shapes, so they agree to rounding only.
# Stated tolerance: every logit and hidden state within 4 bf16 epsilons (4 * 2^-7 = 3.1%) of the largest
# magnitude of its tensor; measured: at most ~1% (llama 0.026 on logits of max 3.2, stories260K 0.14 of 15.7).
BF16_SCALE_TOL = 4 * torch.finfo(torch.bfloat16).eps


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tree_forward_equals_causal_forward_per_path_bf16(arch):
    _tree_matches_paths(tiny_model(arch, dtype=torch.bfloat16), scale_tol=BF16_SCALE_TOL)


def test_tree_forward_stories260k_bf16():
    _tree_matches_paths(stories260k(dtype=torch.bfloat16), prefix_len=20, scale_tol=BF16_SCALE_TOL)


@pytest.mark.parametrize("window", [None, 3, 8])
def test_rows_mask_places_each_rows_single_sequence_mask(window):
    """The batch mask, row by row: prefix slots of the row (holes after it hidden), its own tree's
    single-sequence mask at the tree slots (windowed on positions), padding queries see only themselves."""
    from runtime.masks import rows_attention_mask

    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        sizes = torch.randint(1, 9, (4,), generator=generator).tolist()
        trees = [Tree.from_parents([-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, k)])
                 for k in sizes]
        lengths = torch.randint(1, 30, (4,), generator=generator).tolist()
        slots, n = max(lengths), max(sizes)
        mask = rows_attention_mask(trees, lengths, slots, torch.float32, window)  # [B, 1, N, slots + N]
        assert mask.shape == (4, 1, n, slots + n)
        for b, (tree, length) in enumerate(zip(trees, lengths, strict=True)):
            visible = mask[b, 0] == 0
            single = allowed_keys(tree, length, window)  # [k, length + k]
            k = tree.num_nodes
            assert torch.equal(visible[:k, :length], single[:, :length])
            assert not visible[:k, length:slots].any()  # holes
            assert torch.equal(visible[:k, slots:slots + k], single[:, length:])
            assert not visible[:k, slots + k:].any()  # other rows' padding slots
            for j in range(k, n):  # padding queries
                assert visible[j].nonzero().flatten().tolist() == [slots + j]
