"""Sparse-tree search (Medusa paper) and tree-file validation."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from runtime.tree_search import (
    expected_accepted_length,
    expected_accepted_lengths,
    grow_tree,
    load_tree_file,
    static_tree,
)

REPO = Path(__file__).resolve().parents[2]

# 3 heads, top-3/2/1. Node values (product of accuracies along the path), hand-computed:
#   (0)=.6  (1)=.25  (2)=.1
#   (0,0)=.3  (0,1)=.18  (1,0)=.125  (1,1)=.075  (2,0)=.05  (2,1)=.03
#   (0,0,0)=.12  (0,1,0)=.072  (1,0,0)=.05  (1,1,0)=.03 ...
TABLE = [[0.6, 0.25, 0.1], [0.5, 0.3], [0.4]]
EXPECTED_ORDER = [(0,), (0, 0), (1,), (0, 1), (1, 0), (0, 0, 0), (2,), (1, 1), (0, 1, 0)]


def test_greedy_order_matches_hand_computed_values():
    assert grow_tree(TABLE, 9) == EXPECTED_ORDER
    # six nodes: E[tau] = 1 + .6 + .3 + .25 + .18 + .125 + .12
    assert expected_accepted_length(grow_tree(TABLE, 6), TABLE) == pytest.approx(2.575)
    taus = expected_accepted_lengths(TABLE, 9)
    assert taus[:4] == pytest.approx([1.0, 1.6, 1.9, 2.15])
    gains = [b - a for a, b in zip(taus[:-1], taus[1:], strict=True)]
    assert all(g1 >= g2 for g1, g2 in zip(gains[:-1], gains[1:], strict=True))  # diminishing returns


def test_tree_conversion_bfs_parents_and_ranks():
    st = static_tree(grow_tree(TABLE, 6))
    assert [list(p) for p in st.paths] == [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    assert st.tree.parents.tolist() == [-1, 0, 0, 1, 1, 2, 3]
    assert st.ranks.tolist() == [-1, 0, 1, 0, 1, 0, 0]
    assert st.depth.tolist() == [0, 1, 1, 2, 2, 2, 3]


def _prefix_closed(nodes):
    s = set(nodes)
    return all(len(p) == 1 or p[:-1] in s for p in nodes)


def test_greedy_is_optimal_against_brute_force():
    table = [[0.7, 0.2], [0.45, 0.35], [0.8, 0.1]]
    universe = [p for d in range(1, 4) for p in itertools.product(range(2), repeat=d)]
    for n in range(1, 7):
        best = max(expected_accepted_length(c, table) for c in itertools.combinations(universe, n)
                   if _prefix_closed(c))
        assert expected_accepted_length(grow_tree(table, n), table) == pytest.approx(best)


def test_full_tree_is_exhausted():
    assert len(grow_tree([[0.5, 0.5], [0.5]], 100)) == 4  # 2 + 2*1


@pytest.mark.parametrize("body, kwargs, message", [
    ("paths: [[0], [0, 0], [1, 0]]", {}, "not prefix-closed"),
    ("paths: [[0], [0, 0], [0, 0, 0]]", {"num_heads": 2}, "deeper than the 2 heads"),
    ("paths: [[0], [5]]", {"vocab_size": 5}, "larger than the draft vocabulary"),
    ("paths: [[0], [0]]", {}, "duplicate path"),
    ("paths: [[0], [-1]]", {}, "ranks must be >= 0"),
    ("tree: [[0]]", {}, "'paths' key"),
    ("paths: [[0]]\nnum_nodes: 1", {}, "unknown key"),
])
def test_tree_file_validation_names_the_file(tmp_path, body, kwargs, message):
    f = tmp_path / "bad.yaml"
    f.write_text(body + "\n")
    with pytest.raises(ValueError, match=message) as info:
        load_tree_file(f, **kwargs)
    assert str(f) in str(info.value)


def test_missing_tree_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_tree_file(tmp_path / "nope.yaml")


def test_bad_accuracy_table():
    with pytest.raises(ValueError, match=r"accuracy\[0\]\[1\]"):
        grow_tree([[0.5, 1.5]], 3)


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs" / "trees").glob("*.yaml")))
def test_shipped_tree_files_load(name):
    st = load_tree_file(REPO / "configs" / "trees" / name)
    assert st.tree.num_nodes > 1
