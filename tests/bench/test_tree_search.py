"""bench.tree_search: Medusa heads' measured accuracy table, the tree file written from it, and the CLI."""

from __future__ import annotations

import json

import torch

from bench.tree_search import main, measure_accuracy_table, write_tree_file
from heads import HeadsConfig, build_heads
from runtime.tree_search import grow_tree, load_tree_file
from tests.runtime.test_head_proposers import make_heads, perm_target, reference
from tests.tiny_models import STORIES260K, stories260k

TABLE = [[0.6, 0.25, 0.1], [0.5, 0.3], [0.4]]  # tests/runtime/test_tree_search.py's hand-computed table


def test_tree_file_round_trip(tmp_path):
    f = tmp_path / "t.yaml"
    write_tree_file(f, grow_tree(TABLE, 6), "python -m bench.tree_search ...", accuracy=TABLE)
    text = f.read_text()
    assert text.startswith("# python -m bench.tree_search")
    st = load_tree_file(f, num_heads=3, vocab_size=10)
    assert st.tree.parents.tolist() == [-1, 0, 0, 1, 1, 2, 3]


def test_measured_accuracy_table():
    model, sigma = perm_target("llama")
    prompt = torch.randint(3, 256, (10,), generator=torch.Generator().manual_seed(3))
    sequence = torch.cat([prompt, reference(model, prompt, 40)])
    good = measure_accuracy_table(model, make_heads("medusa", model, sigma), [(sequence, 10)], top_k=4)
    bad = measure_accuracy_table(model, make_heads("medusa", model), [(sequence, 10)], top_k=4)
    assert len(good) == 4 and all(len(row) == 4 and sum(row) <= 1 + 1e-9 for row in good)
    assert min(row[0] for row in good) > 0.8 and max(row[0] for row in bad) < 0.2


def test_tree_search_cli(tmp_path):
    model = stories260k()
    config = HeadsConfig.for_target("medusa", model, str(STORIES260K), medusa_num_heads=3)
    build_heads(config).save_pretrained(tmp_path / "heads")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["Once upon a time", "Lily saw a dog"]))
    out = tmp_path / "tree.yaml"
    main(["--model", str(STORIES260K), "--heads", str(tmp_path / "heads"),
          "--prompts", str(prompts), "--num_nodes", "10", "--max_new_tokens", "20", "--top_k", "4",
          "--output", str(out)])
    tree = load_tree_file(out, num_heads=3)
    assert tree.tree.num_nodes == 11 and out.read_text().startswith("# python -m bench.tree_search --model")
