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

from heads.checkpoint import load_heads, push_to_hub, save_heads
from heads.config import HEAD_CLASSES, KINDS, OWN_LM_HEAD_KINDS, HeadsConfig
from heads.draft_vocab import draft_logits_to_target, draft_to_target_ids, validate_vocab_mapping
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

    def __init_subclass__(cls, kind: str | None = None, **kwargs: Any) -> None:
        """`class MedusaHeads(HeadsModule, kind="medusa")` registers the class for its kind (heads.checkpoint
        builds heads by kind through heads.config.HEAD_CLASSES)."""
        super().__init_subclass__(**kwargs)
        if kind is not None:
            if kind not in KINDS:
                raise ValueError(f"{cls.__name__}: kind {kind!r} is not one of {KINDS}")
            HEAD_CLASSES[kind] = cls

    def __init__(self, config: HeadsConfig) -> None:
        super().__init__()
        self.config = config
        if config.draft_vocab_size:
            # Placeholder until set_vocab_mapping (load_heads installs the saved one): the first Vd target ids.
            t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
            t2d[: config.draft_vocab_size] = True
            self._install_draft_vocab(torch.zeros(config.draft_vocab_size, dtype=torch.int64), t2d)

    def _install_draft_vocab(self, d2t: Tensor, t2d: Tensor) -> None:
        """Register d2t/t2d as buffers (EAGLE-3: saved in the weights; other kinds: kept out of the engine-facing
        weights file and saved next to it by heads.checkpoint)."""
        persistent = self.config.kind in OWN_LM_HEAD_KINDS
        self.register_buffer("d2t", d2t.clone(), persistent=persistent)
        self.register_buffer("t2d", t2d.clone(), persistent=persistent)

    def set_vocab_mapping(self, d2t: Tensor, t2d: Tensor) -> None:
        """Install the draft vocabulary d2t int64 [Vd] / t2d bool [V] (heads.draft_vocab.build_vocab_mapping); validated.

        EAGLE-3: Vd is fixed by its own reduced `lm_head` (config.draft_vocab_size). Medusa, EAGLE-1/2 and MTP
        draft through full-vocabulary projections, so any Vd works: only the drafting logits are restricted to
        those rows (the target still verifies every token), and `config.draft_vocab_size` records Vd.
        """
        fixed = self.config.kind in OWN_LM_HEAD_KINDS
        size = self.config.draft_vocab_size if fixed else int(d2t.numel())
        validate_vocab_mapping(d2t, t2d, self.config.vocab_size, size, f"{type(self).__name__}.set_vocab_mapping")
        if fixed:
            self.d2t.copy_(d2t)
            self.t2d.copy_(t2d)
            return
        device = next(self.parameters()).device
        self.config.draft_vocab_size = size
        self._install_draft_vocab(d2t.to(device), t2d.to(device))

    @property
    def has_draft_vocab(self) -> bool:
        """True when drafting uses a reduced vocabulary (`d2t`/`t2d`); False: the full target vocabulary."""
        return bool(self.config.draft_vocab_size) and hasattr(self, "d2t")

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the head's floating-point parameters."""
        return next(p.dtype for p in self.parameters() if p.is_floating_point())

    def save_pretrained(self, directory: str | Path) -> Path:
        return save_heads(self, directory)

    @classmethod
    def from_pretrained(cls, directory_or_repo: str | Path, target: Any = None, **kwargs: Any) -> HeadsModule:
        heads = load_heads(directory_or_repo, target=target, **kwargs)
        if not isinstance(heads, cls):
            raise ValueError(f"{directory_or_repo}: holds a {heads.config.kind!r} head "
                             f"({type(heads).__name__}), not a {cls.__name__}")
        return heads

    def push_to_hub(self, repo_id: str, **kwargs: Any) -> str:
        return push_to_hub(self, repo_id, **kwargs)


class OwnLMHeadDraft(HeadsModule):
    """A draft with its own `norm` and reduced-vocabulary `lm_head` and the `d2t` buffer (EAGLE-3, P-EAGLE): logits
    over the draft vocabulary and their mapping to target ids."""

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        """Pre-norm output [..., H] -> draft-vocabulary logits [..., draft_vocab_size]."""
        return self.lm_head(self.norm(hidden_states))

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        """Draft ids [...] -> target ids [...]."""
        return draft_to_target_ids(draft_ids, self.d2t)

    def logits_to_target(self, draft_logits: Tensor) -> Tensor:
        """Draft logits [..., Vd] -> [..., V] with -inf outside the draft vocabulary."""
        return draft_logits_to_target(draft_logits, self.d2t, self.config.vocab_size)
