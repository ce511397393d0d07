"""Shared test helpers for tests/heads: a tiny target, randomised heads and their outputs."""

from __future__ import annotations

from pathlib import Path

import torch

from heads import HeadsConfig, build_heads, target_modules
from heads.draft_vocab import build_vocab_mapping
from tests.tiny_models import tiny_model

VARIANTS = {
    "medusa": ("medusa", {"medusa_num_heads": 3, "medusa_num_layers": 2}),
    "medusa_shared": ("medusa", {"medusa_num_heads": 2, "medusa_shared_lm_head": True}),
    "eagle": ("eagle", {"eagle_fc_bias": True}),
    "eagle3": ("eagle3", {"draft_vocab_size": 96}),
    "mtp": ("mtp", {"mtp_num_depths": 2}),
    "dflash": ("dflash", {"block_size": 4, "num_draft_layers": 2}),
    "peagle": ("peagle", {"block_size": 3, "num_draft_layers": 2, "draft_vocab_size": 96}),
}
TARGET_NAME = "tiny-llama"


def tiny_target(**overrides):
    return tiny_model("llama", **overrides)


def random_heads(variant: str, target, seed: int = 0, name: str = TARGET_NAME):
    """A head of `variant` for `target` with every parameter randomised (zero init would hide bugs)."""
    kind, options = VARIANTS[variant]
    config = HeadsConfig.for_target(kind, target.config, name, **options)
    heads = build_heads(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
    if kind in ("eagle3", "peagle"):
        counts = torch.randint(0, 1000, (config.vocab_size,), generator=generator)
        heads.set_vocab_mapping(*build_vocab_mapping(counts, config.draft_vocab_size))
    return heads.eval()


def head_outputs(heads, target, seed: int = 1) -> list[torch.Tensor]:
    """Every output a runtime would use, on fixed random inputs."""
    tm = target_modules(target)
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 6, target.config.hidden_size, generator=generator)
    ids = torch.randint(0, target.config.vocab_size, (2, 6), generator=generator)
    pos = torch.arange(6)[None].expand(2, -1)
    kind = heads.config.kind
    with torch.no_grad():
        if kind == "medusa":
            return [heads(hidden, lm_head=tm.lm_head if heads.config.medusa_shared_lm_head else None)]
        if kind == "eagle":
            out = heads(hidden, ids, embed_tokens=tm.embed_tokens, position_ids=pos)
            return [out.hidden_states, out.past_key_value.key, heads.compute_logits(out.hidden_states, tm.lm_head)]
        if kind == "eagle3":
            feats = heads.project([hidden, hidden * 0.5, -hidden])
            out = heads(feats, ids, embed_tokens=tm.embed_tokens, position_ids=pos)
            logits = heads.compute_logits(out.hidden_states)
            return [out.hidden_states, logits, heads.draft_to_target(logits.argmax(-1))]
        if kind == "dflash":
            cache = heads.context_cache(heads.project([hidden, hidden * 0.5, -hidden]), pos)
            block = heads.block_ids(ids[:, -1])
            out = heads(block, embed_tokens=tm.embed_tokens, position_ids=6 + torch.arange(4)[None].expand(2, -1),
                        context=cache)
            return [cache[1].key, out, heads.compute_logits(out, tm.lm_head)]
        if kind == "peagle":
            feats = torch.cat([heads.project([hidden, hidden * 0.5, -hidden]), heads.mask_features(2)[None].expand(2, -1, -1)], 1)
            out, cache = heads(feats, torch.cat([ids, ids[:, :2]], 1), embed_tokens=tm.embed_tokens,
                               position_ids=torch.arange(8)[None].expand(2, -1))
            logits = heads.compute_logits(out)
            return [out, cache[1].value, logits, heads.draft_to_target(logits.argmax(-1))]
        outs = []
        for depth in range(heads.config.mtp_num_depths):
            out = heads(hidden, ids, depth=depth, embed_tokens=tm.embed_tokens, position_ids=pos)
            hidden = out.hidden_states
            outs.append(heads.compute_logits(hidden, depth=depth, lm_head=tm.lm_head))
        return outs


def save_random_heads(target, tmp_path_factory, variants: tuple[str, ...]) -> dict[str, Path]:
    """Random heads of each variant for `target`, saved once per test module: {variant: directory}."""
    out = {}
    for variant in variants:
        out[variant] = tmp_path_factory.mktemp(variant) / "h"
        random_heads(variant, target).save_pretrained(out[variant])
    return out
