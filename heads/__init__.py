"""Draft heads (Medusa, EAGLE-1/2, EAGLE-3, MTP, and the parallel drafters DFlash and P-EAGLE): modules, config, save/load/push, export; and the shared
model loader (`heads.loading`)."""

from heads.base import DraftOutput, HeadsModule, TargetModules, target_modules
from heads.checkpoint import build_heads, check_compatible, load_heads, push_to_hub, save_heads
from heads.config import FORMAT_VERSION, HeadsConfig
from heads.draft_vocab import build_vocab_mapping, count_tokens
from heads.eagle import Eagle3Draft, EagleDraft
from heads.layers import DecoderLayer, LayerKV, causal_mask
from heads.medusa import MedusaHeads
from heads.mtp import MTPHeads
from heads.parallel import DFlashDraft, PEagleDraft

__all__ = ["FORMAT_VERSION", "DFlashDraft", "DecoderLayer", "DraftOutput", "Eagle3Draft", "EagleDraft", "HeadsConfig",
           "HeadsModule", "LayerKV", "MTPHeads", "MedusaHeads", "PEagleDraft", "TargetModules", "build_heads",
           "build_vocab_mapping", "check_compatible", "causal_mask", "count_tokens", "load_heads",
           "push_to_hub", "save_heads", "target_modules"]
