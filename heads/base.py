"""What every head module shares: the target-module passing convention, outputs, save/load methods.

Target-module convention (one rule for every head): the target's frozen input embedding and LM head are
NEVER parameters of a head. Forward methods that need them take them as keyword arguments
(`embed_tokens=`, `lm_head=`), usually obtained once with `target_modules(model)`. A head's state dict,
and therefore what is saved and pushed, holds only the head's own weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from heads.config import HeadsConfig
from heads.layers import LayerKV


@dataclass(frozen=True)
class TargetModules:
    """The target's frozen input embedding (ids [B, S] -> [B, S, H]) and LM head ([..., H] -> [..., V])."""

    embed_tokens: nn.Module
    lm_head: nn.Module


def target_modules(model: nn.Module) -> TargetModules:
    """Embedding and LM head of a transformers causal LM (`get_input_embeddings` / `get_output_embeddings`)."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embed is None or head is None:
        raise ValueError(f"{type(model).__name__}: needs both an input embedding and an LM head")
    return TargetModules(embed, head)


@dataclass(frozen=True)
class DraftOutput:
    """hidden_states [B, S, H] produced by a draft layer and its updated cache (past + S slots)."""

    hidden_states: Tensor
    past_key_value: LayerKV


class HeadsModule(nn.Module):
    """Base class: holds `config` and gives every head `save_pretrained` / `from_pretrained` / `push_to_hub`."""

    def __init__(self, config: HeadsConfig) -> None:
        super().__init__()
        self.config = config

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the head's floating-point parameters."""
        return next(p.dtype for p in self.parameters() if p.is_floating_point())

    def save_pretrained(self, directory: str | Path) -> Path:
        from heads.checkpoint import save_heads

        return save_heads(self, directory)

    @classmethod
    def from_pretrained(cls, directory_or_repo: str | Path, target: Any = None, **kwargs: Any) -> HeadsModule:
        from heads.checkpoint import load_heads

        heads = load_heads(directory_or_repo, target=target, **kwargs)
        if not isinstance(heads, cls):
            raise ValueError(f"{directory_or_repo}: holds a {heads.config.kind!r} head "
                             f"({type(heads).__name__}), not a {cls.__name__}")
        return heads

    def push_to_hub(self, repo_id: str, **kwargs: Any) -> str:
        from heads.checkpoint import push_to_hub

        return push_to_hub(self, repo_id, **kwargs)
