"""push_to_hub against a local stand-in for the Hub: it uploads exactly the saved directory."""

import shutil
from pathlib import Path

import pytest
import torch

import heads.checkpoint as checkpoint
from heads import load_heads
from tests.heads.helpers import TARGET_NAME, head_outputs, random_heads, tiny_target


class FakeHub:
    """Records create_repo / upload_folder calls and keeps a copy of every uploaded folder."""

    def __init__(self, root: Path):
        self.root = root
        self.calls = []

    def api(self, token=None):
        hub = self

        class Api:
            def create_repo(self, repo_id, **kwargs):
                hub.calls.append(("create_repo", repo_id, kwargs))

            def upload_folder(self, *, repo_id, folder_path, **kwargs):
                hub.calls.append(("upload_folder", repo_id, kwargs))
                dest = hub.root / repo_id
                if dest.exists():
                    shutil.rmtree(dest)
                shutil.copytree(folder_path, dest)
                return f"https://hub.local/{repo_id}/commit/1"

        return Api()

    def snapshot_download(self, repo_id, revision=None):
        return str(self.root / repo_id)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    fake = FakeHub(tmp_path / "hub")
    monkeypatch.setattr(checkpoint, "HfApi", fake.api)
    import huggingface_hub
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake.snapshot_download)
    return fake


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("variant", ["medusa", "eagle3", "mtp", "dflash", "peagle"])
def test_push_uploads_exactly_the_saved_directory(variant, hub, tmp_path):
    target = tiny_target()
    heads = random_heads(variant, target)
    url = heads.push_to_hub("me/my-heads", private=True)
    assert url == "https://hub.local/me/my-heads/commit/1"
    assert [c[0] for c in hub.calls] == ["create_repo", "upload_folder"]
    assert hub.calls[0][2]["private"] is True
    heads.save_pretrained(tmp_path / "local")
    assert _files(hub.root / "me/my-heads") == _files(tmp_path / "local")
    # and loading by repo id gives the same outputs
    loaded = load_heads("me/my-heads", target=target, target_name=TARGET_NAME)
    for a, b in zip(head_outputs(heads, target), head_outputs(loaded, target), strict=True):
        assert torch.equal(a, b)


def test_push_directory_refuses_non_head_directories(hub, tmp_path):
    (tmp_path / "x").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        checkpoint.push_directory(tmp_path / "x", "me/x")
    assert hub.calls == []
