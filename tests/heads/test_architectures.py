"""Heads build from every supported target architecture's config and run on its embedding / LM head."""

import pytest
import torch

from heads import HeadsConfig, build_heads, load_heads, target_modules
from tests.tiny_models import ARCHITECTURES, tiny_model


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_heads_for_every_architecture(arch, tmp_path):
    target = tiny_model(arch)
    tm = target_modules(target)
    config = HeadsConfig.for_target("eagle3", target, f"tiny-{arch}", draft_vocab_size=128)
    assert config.model_type == target.config.model_type and config.hidden_size == 64
    assert "rope_theta" in config.rope_parameters
    hidden = torch.randn(1, 4, 64)
    ids = torch.randint(0, 256, (1, 4))
    pos = torch.arange(4)[None]
    for kind in ("eagle", "eagle3", "mtp", "medusa"):
        heads = build_heads(HeadsConfig.for_target(kind, target, f"tiny-{arch}"))
        with torch.no_grad():
            if kind == "medusa":
                logits = heads(hidden)
            elif kind == "eagle3":
                out = heads(heads.project(torch.cat([hidden] * 3, -1)), ids, embed_tokens=tm.embed_tokens,
                            position_ids=pos)
                logits = heads.compute_logits(out.hidden_states)
            elif kind == "eagle":
                out = heads(hidden, ids, embed_tokens=tm.embed_tokens, position_ids=pos)
                logits = heads.compute_logits(out.hidden_states, tm.lm_head)
            else:
                out = heads(hidden, ids, depth=0, embed_tokens=tm.embed_tokens, position_ids=pos)
                logits = heads.compute_logits(out.hidden_states, depth=0, lm_head=tm.lm_head)
        assert torch.isfinite(logits).all()
    heads.save_pretrained(tmp_path / "h")
    load_heads(tmp_path / "h", target=target, target_name=f"tiny-{arch}")
