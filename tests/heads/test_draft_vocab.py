"""Draft vocabularies for Medusa / EAGLE-1/2 / MTP heads: saved next to the weights, reloaded, set by the CLI."""

import datasets
import pytest
import torch
from safetensors.torch import load_file

from heads import load_heads
from heads.checkpoint import DRAFT_VOCAB_FILE, weights_file
from heads.draft_vocab import build_vocab_mapping, coverage
from heads.vocab import main
from tests.heads.helpers import random_heads


@pytest.mark.parametrize("variant", ["medusa", "medusa_shared", "eagle", "mtp"])
def test_draft_vocab_round_trip(variant, target, tmp_path):
    heads = random_heads(variant, target)
    plain = set(load_file(str(heads.save_pretrained(tmp_path / "plain") / weights_file(heads.config.kind))))
    assert not (tmp_path / "plain" / DRAFT_VOCAB_FILE).exists() and not load_heads(tmp_path / "plain").has_draft_vocab
    counts = torch.randint(0, 100, (target.config.vocab_size,), generator=torch.Generator().manual_seed(0))
    heads.set_vocab_mapping(*build_vocab_mapping(counts, 40))
    directory = heads.save_pretrained(tmp_path / "vocab")
    # the engine-facing weights file is unchanged; d2t/t2d live in their own file
    assert set(load_file(str(directory / weights_file(heads.config.kind)))) == plain
    loaded = load_heads(directory, target=target)
    assert loaded.config.draft_vocab_size == 40 and loaded.has_draft_vocab
    assert torch.equal(loaded.d2t, heads.d2t) and torch.equal(loaded.t2d, heads.t2d)


def test_missing_draft_vocab_file(target, tmp_path):
    heads = random_heads("eagle", target)
    heads.set_vocab_mapping(*build_vocab_mapping(torch.arange(target.config.vocab_size), 10))
    directory = heads.save_pretrained(tmp_path / "h")
    (directory / DRAFT_VOCAB_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=DRAFT_VOCAB_FILE):
        load_heads(directory)


def test_coverage():
    counts = torch.tensor([0, 5, 1, 3])
    assert coverage(counts, [1, 2, 4], torch.tensor([1, 1, 0, 2])) == {1: 0.25, 2: 0.75, 4: 1.0}


def test_vocab_cli(target, tmp_path, capsys):
    vocab = target.config.vocab_size
    rows = datasets.Dataset.from_dict({"input_ids": [[7, 7, 7, 9, 9, 3], [9, 3, 3, 5]],
                                       "loss_mask": [[1, 1, 1, 1, 1, 0], [1, 1, 1, 0]]})
    rows.save_to_disk(str(tmp_path / "data"))
    random_heads("mtp", target).save_pretrained(tmp_path / "mtp")
    main(["--heads", str(tmp_path / "mtp"), "--dataset", str(tmp_path / "data"), "--size", "3"])
    loaded = load_heads(tmp_path / "mtp")
    assert loaded.t2d.nonzero().flatten().tolist() == [3, 7, 9]  # counted on assistant tokens only
    assert "covering 100.0%" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--size"):
        main(["--heads", str(tmp_path / "mtp"), "--dataset", str(tmp_path / "data"), "--size", str(vocab + 1)])
    random_heads("eagle3", target).save_pretrained(tmp_path / "e3")
    with pytest.raises(ValueError, match="EAGLE-3"):
        main(["--heads", str(tmp_path / "e3"), "--dataset", str(tmp_path / "data"), "--size", "3"])
