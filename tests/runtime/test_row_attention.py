"""Batch-invariant attention (runtime.kernels.row_attention, used by TargetModel for decode and verify in
bfloat16): each query row gives the same bits whatever else is in the call, so a k-token verify equals k one-token
steps bit for bit and speculative decoding in bfloat16 equals plain bfloat16 decoding token for token."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime import kernels
from runtime.config import DecodeConfig, SpeculationConfig
from runtime.layout import set_layout
from runtime.loop import GenerationStats, generate
from runtime.proposers import Autoregressive, DraftModelProposer, PromptLookupProposer, per_row
from runtime.target import TargetModel
from runtime.tree import Tree
from runtime.verify_check import prepare_target, verify_equals_steps
from tests.runtime.test_batch import prompts, run_batch
from tests.runtime.test_generate import perturbed_copy
from tests.runtime.test_head_proposers import PROPOSERS, make_proposer, perm_target
from tests.tiny_models import ARCHITECTURES, ATTENTION, DEGRADED, stories260k, tiny_model

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="no C compiler for the kernels")

# softcapped (eager) attention is not the row kernel's: gemma2 keeps the model's own attention (verify_check says so)
INVARIANT_ARCHITECTURES = [a for a in ARCHITECTURES if a not in ATTENTION]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_is_its_own_reduction(dtype):
    """A row among others under a mask == the same row alone over only its allowed keys (compacted): bit-equal;
    and within rounding of sdpa (GQA, a value dimension other than the key dimension)."""
    gen = torch.Generator().manual_seed(0)
    q = (torch.randn(2, 6, 7, 16, generator=gen) * 3).to(dtype)
    k = torch.randn(2, 2, 45, 16, generator=gen).to(dtype)
    v = torch.randn(2, 2, 45, 24, generator=gen).to(dtype)
    allowed = torch.rand(2, 7, 45, generator=gen) > 0.4
    allowed[:, :, 0] = True
    out = kernels.row_attention(q, k, v, allowed, 0.25)
    assert out.shape == (2, 7, 6, 24) and out.dtype == dtype
    for b in range(2):
        for i in range(7):
            keys = allowed[b, i].nonzero()[:, 0]
            alone = kernels.row_attention(q[b:b + 1, :, i:i + 1], k[b:b + 1, :, keys], v[b:b + 1, :, keys],
                                          torch.ones(1, 1, len(keys), dtype=torch.bool), 0.25)
            assert torch.equal(alone[0, 0], out[b, i])
    expected = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(3, 1),
                                              v.float().repeat_interleave(3, 1), attn_mask=allowed[:, None],
                                              scale=0.25).transpose(1, 2)
    torch.testing.assert_close(out.float(), expected, atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=1e-2)


def _steps_equal_verify(target: TargetModel, prompt: torch.Tensor, tokens: torch.Tensor, tree: Tree) -> list[int]:
    """Nodes whose verify logits differ (in any bit) from feeding their path one token at a time."""
    target.prefill(prompt)
    verified = target.forward(tokens, tree).logits
    target.commit([])
    differ = []
    for node in range(tree.num_nodes):
        path, n = [], node
        while n >= 0:
            path.append(n)
            n = int(tree.parents[n])
        target.prefill(prompt)
        for step in reversed(path):
            logits = target.forward(tokens[step:step + 1], Tree.chain(0)).logits[0]
            target.commit([0])
        if not torch.equal(logits, verified[node]):
            differ.append(node)
    return differ


TREES = {"chain 2": Tree.chain(1), "chain 4": Tree.chain(3), "chain 8": Tree.chain(7), "chain 16": Tree.chain(15),
         "tree 12": Tree.from_parents([-1, 0, 0, 1, 1, 2, 3, 3, 4, 6, 7, 9])}


@pytest.mark.parametrize("arch", INVARIANT_ARCHITECTURES + ["stories260K"])
def test_bf16_verify_is_bit_equal_to_one_token_steps(arch):
    model = stories260k(torch.bfloat16) if arch == "stories260K" else tiny_model(arch, dtype=torch.bfloat16)
    set_layout(model, "rows+panels")  # the Linear layers through the batch-invariant panel kernel (auto in bf16)
    target = TargetModel(model)
    assert target._rows_attention
    assert_every_tree_verifies_as_steps(target, arch)


def assert_every_tree_verifies_as_steps(target: TargetModel, label: str) -> None:
    """Every tree of TREES, verified after a seeded prompt, gives the logits of its paths fed one token at a time."""
    gen = torch.Generator().manual_seed(1)
    vocab = min(target.vocab_size, 500)
    prompt = torch.randint(3, vocab, (21,), generator=gen)
    for name, tree in TREES.items():
        tokens = torch.randint(3, vocab, (tree.num_nodes,), generator=gen)
        assert _steps_equal_verify(target, prompt, tokens, tree) == [], f"{label} {name}"


# --------------------------------------------------------------- bf16 speculative == plain bf16, token for token

def _loop(model, proposer, prompt: torch.Tensor, new_tokens: int, lean: bool = False) -> tuple[torch.Tensor, GenerationStats]:
    config = DecodeConfig(max_new_tokens=new_tokens, eos_token_ids=(),
                          speculation=SpeculationConfig(num_speculative_tokens=getattr(proposer, "tree_size", 6)))
    stats = GenerationStats()
    target = TargetModel(model)
    target.lean_wanted = lean  # runtime.lean's forward for steps and verifies (what the verify check turns on)
    assert (target.lean_forward() is not None) == lean
    return torch.cat(list(generate(target, proposer, prompt, config, stats))), stats


def _plain_loop(model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Our plain bfloat16 decoding (the reference a bf16 user compares with): the loop with no drafter, on
    transformers' forward."""
    return _loop(model, Autoregressive(), prompt, new_tokens)[0]


def _bf16(model):
    model = model.to(torch.bfloat16)
    set_layout(model, "rows+panels")
    return model


@pytest.mark.parametrize("lean", [False, True], ids=["transformers", "lean"])
@pytest.mark.parametrize("name", PROPOSERS + ["prompt_lookup", "draft_model"])
def test_bf16_speculative_equals_plain_bf16(name, lean):
    """Heads that predict the target well (many multi-token verifies), prompt lookup and a draft model: greedy
    output in bfloat16 is the plain bfloat16 loop's, token for token, on transformers' forward and on the lean one."""
    model, sigma = perm_target("llama")
    model = _bf16(model)
    prompt = torch.cat([torch.randint(3, 256, (9,), generator=torch.Generator().manual_seed(2))] * 2)
    if name == "prompt_lookup":
        proposer = PromptLookupProposer()
    elif name == "draft_model":
        proposer = DraftModelProposer(_bf16(perturbed_copy(model).float()), model.config.vocab_size, branching=(2, 1))
    else:
        proposer = make_proposer(name, model, sigma)
    tokens, stats = _loop(model, proposer, prompt, 60, lean)
    assert torch.equal(tokens, _plain_loop(model, prompt, 60))
    assert stats.tau > 1.3, f"{name}: drafts must be accepted for the check to mean something (tau {stats.tau:.2f})"


def test_bf16_batch_rows_equal_each_prompt_alone():
    """Rows of different lengths verified together (holes in the cache, per-row masks) == each prompt decoded
    alone by the plain bfloat16 loop."""
    model = _bf16(stories260k())
    model.generation_config.eos_token_id = None
    batch = prompts([5, 17, 9, 30])
    expected = [_plain_loop(model, p, 40) for p in batch]
    for proposer in (PromptLookupProposer(), DraftModelProposer(_bf16(perturbed_copy(stories260k())),
                                                                model.config.vocab_size, branching=(2, 1))):
        out, stats = run_batch(model, per_row(proposer, len(batch)), batch, 40, k=6)
        assert all(torch.equal(o, e) for o, e in zip(out, expected, strict=True))
        assert max(s.tau for s in stats) > 1.05


def test_verify_check_says_whether_verify_equals_steps(capsys):
    """bfloat16: the load-time check prints whether a 16-token verify equals one-token steps bit for bit: always yes
    on the batch-invariant layout auto picks; on torch's own BLAS (rows) it says what this CPU's BLAS does (a 16-row
    product reduces in another order than a 1-row one on AVX512 CPUs; torch's emulated bf16 on an AVX2 CPU may not;
    whether it does can depend on the tokens: on an AVX512-BF16 CPU an 11-token probe was equal where the 16-token
    one was not), checked against the same probe rerun on the prepared model."""
    same, differs = "== 16 one-token steps bit for bit", "differs from one-token steps"
    for layout in ("auto", "rows"):
        target = prepare_target(stories260k(torch.bfloat16), use_cache=False, layout=layout)
        lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("verify check: a 16-token")]
        expected = same if layout == "auto" or verify_equals_steps(target) else differs
        assert len(lines) == 1 and expected in lines[0], (layout, lines)
    prepare_target(stories260k(torch.float32), use_cache=False)  # float32: no such line (exact up to near-ties)
    assert "verify check: a 16-token" not in capsys.readouterr().err


def test_verify_check_says_it_for_chain_mode_models_too(capsys):
    """A bfloat16 model the check degrades to chains (ALiBi Falcon) still gets the verify == steps line: speculation
    verifies chains on it, so whether they round like steps is the user's question there too."""
    assert DEGRADED["falcon"] == "chain"
    target = prepare_target(tiny_model("falcon", dtype=torch.bfloat16), use_cache=False)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("verify check: a 16-token")]
    assert target.mode == "chain" and len(lines) == 1, lines
