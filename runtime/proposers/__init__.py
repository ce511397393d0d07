"""Drafters: every one implements the `Proposer` protocol of runtime/proposers/base.py."""

from runtime.proposers.base import Autoregressive, Draft, Proposer, per_row, root_only
from runtime.proposers.draft_model import DraftModelProposer, check_same_vocabulary
from runtime.proposers.prompt_lookup import PromptLookupProposer

__all__ = ["Autoregressive", "Draft", "DraftModelProposer", "Proposer", "PromptLookupProposer",
           "check_same_vocabulary", "per_row", "root_only"]
