"""The lean decode/verify forward (runtime.lean): in bf16 transformers' logits bit for bit on one-token steps, a verify
equal to its one-token steps, speculative output equal to plain decoding, a cache that survives compaction and
layout changes, and the load-time verify check's line; in float32 with the model's own attention, transformers'
logits bit for bit on steps and on every tree verify, and greedy output equal to transformers' `generate`."""

from __future__ import annotations

import pytest
import torch

from runtime import kernels
from runtime.layout import set_layout
from runtime.lean import LeanForward, lean_unavailable
from runtime.target import TargetModel
from runtime.tree import Tree
from runtime.verify_check import lean_matches, prepare_target
from tests.runtime.test_row_attention import TREES, assert_every_tree_verifies_as_steps
from tests.tiny_models import stories260k, tiny_model

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="no C compiler for the kernels")

LEAN_ARCHITECTURES = ["llama", "qwen2", "qwen3", "mistral"]


def _lean_target(model) -> TargetModel:
    set_layout(model, "rows+panels")
    target = TargetModel(model)
    assert lean_unavailable(model) == ""
    return target


@pytest.mark.parametrize("arch", LEAN_ARCHITECTURES + ["stories260K", "llama-odd", "llama-biases"])
def test_lean_steps_are_transformers_bits_and_its_verify_is_its_steps(arch):
    """On every family it serves (an MLP width that leaves vector-loop tails: 100; biases everywhere): one-token steps give
    transformers' logits and hidden states bit for bit, and chain / tree verifies give the lean one-token steps."""
    if arch == "stories260K":
        model = stories260k(torch.bfloat16)
    elif arch == "llama-odd":
        model = tiny_model("llama", dtype=torch.bfloat16, intermediate_size=100)
    elif arch == "llama-biases":  # biases on q/k/v/o and on gate/up/down: fused and widened once
        model = tiny_model("llama", dtype=torch.bfloat16, attention_bias=True, mlp_bias=True)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("bias"):
                    parameter.normal_(0, 0.5)
    else:
        model = tiny_model(arch, dtype=torch.bfloat16)
    target = _lean_target(model)
    assert lean_matches(target) == ""
    target.lean_wanted = True
    assert target.lean_forward() is not None
    assert_every_tree_verifies_as_steps(target, arch)


def test_lean_cache_survives_compaction_batches_and_layout_changes():
    """Keys written in place into the lean buffers: a tree verify, a kept path that is not the first nodes
    (compaction moves slots inside the buffer), then steps == the same sequence decoded step by step; a batch of rows
    (holes) == each row alone; a layout change turns the lean forward off and back on with the same bits."""
    model = stories260k(torch.bfloat16)
    target = _lean_target(model)
    target.lean_wanted = True
    gen = torch.Generator().manual_seed(3)
    prompt, tokens = torch.randint(3, 500, (13,), generator=gen), torch.randint(3, 500, (8,), generator=gen)
    tree = Tree.from_parents([-1, 0, 0, 1, 2, 2, 4, 5])
    keep = [0, 2, 5, 7]
    target.prefill(prompt)
    target.forward(tokens, tree)
    target.commit(keep)
    after = target.forward(tokens[:3], Tree.chain(2)).logits
    target.commit([])
    target.prefill(prompt)  # the same tokens one at a time (a prefill would round its keys differently)
    stepwise = []
    for token in tokens[keep]:
        target.forward(token[None], Tree.chain(0))
        target.commit([0])
    for token in tokens[:3]:
        stepwise.append(target.forward(token[None], Tree.chain(0)).logits[0])
        target.commit([0])
    assert torch.equal(after, torch.stack(stepwise))

    rows = [torch.randint(3, 500, (n,), generator=gen) for n in (5, 11)]
    target.prefill_rows(rows)
    outs = target.forward_rows([tokens[:4], tokens[:2]], [Tree.chain(3), Tree.chain(1)])
    for row, out, n in zip(rows, outs, (4, 2), strict=True):
        target.prefill(row)
        assert torch.equal(target.forward(tokens[:n], Tree.chain(n - 1)).logits, out.logits)
        target.commit([])

    # finished rows leave the batch: rows moved up in place inside the lean buffers (no copy out and back in)
    rows = [torch.randint(3, 500, (n,), generator=gen) for n in (6, 9, 4, 12)]
    target.prefill_rows(rows)
    target.forward_rows([tokens[:1]] * 4, [Tree.chain(0)] * 4)
    target.commit_rows([[0]] * 4)
    target.forward_rows([tokens[1:2]] * 4, [Tree.chain(0)] * 4)  # now the cache layers are views of the buffers
    target.commit_rows([[0]] * 4)
    buffer = target._lean.layers[0].keys
    target.select_rows([1, 3])
    assert target.cache.layers[0].keys.data_ptr() == buffer.data_ptr()
    outs = target.forward_rows([tokens[2:5], tokens[2:4]], [Tree.chain(2), Tree.chain(1)])
    for row, out, n in zip((rows[1], rows[3]), outs, (3, 2), strict=True):
        target.prefill(row)
        for token in tokens[:2]:
            target.forward(token[None], Tree.chain(0))
            target.commit([0])
        assert torch.equal(target.forward(tokens[2:2 + n], Tree.chain(n - 1)).logits, out.logits)
        target.commit([])

    target.prefill(prompt)
    lean = target.forward(tokens[:4], Tree.chain(3)).logits
    set_layout(model, "rows")
    assert target.lean_forward() is None  # no panels: the model's own forward
    set_layout(model, "rows+panels")
    assert target.lean_forward() is not None
    target.prefill(prompt)
    assert torch.equal(target.forward(tokens[:4], Tree.chain(3)).logits, lean)


def test_lean_refuses_what_it_does_not_serve():
    model = tiny_model("llama", dtype=torch.bfloat16)
    assert "panel kernel" in lean_unavailable(model)  # as loaded: no panels
    assert "bfloat16" in lean_unavailable(tiny_model("llama"))
    float32 = tiny_model("llama")
    set_layout(float32, "rows+panels")
    assert "serves bfloat16 on a CPU" in lean_unavailable(float32) and lean_unavailable(float32, float32=True) == ""
    assert "not among" in lean_unavailable(tiny_model("phi3", dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="lean forward: .*panel kernel"):
        LeanForward(model)


def test_verify_check_turns_the_lean_forward_on_and_says_so(capsys, monkeypatch):
    target = prepare_target(stories260k(torch.bfloat16), use_cache=False)
    err = capsys.readouterr().err
    assert "verify check: lean forward on (bfloat16, rows+panels)" in err and target.lean_forward() is not None
    assert "bit for bit (bfloat16, rows+panels, lean)" in err
    monkeypatch.setenv("SPECHEADS_LEAN", "off")
    target = prepare_target(stories260k(torch.bfloat16), use_cache=False)
    assert "lean forward off ($SPECHEADS_LEAN)" in capsys.readouterr().err and target.lean_forward() is None
    prepare_target(stories260k(torch.float32), use_cache=False, layout="rows")  # no panels: nothing to say
    assert "lean forward" not in capsys.readouterr().err


def _float32_model(arch: str):
    if arch == "stories260K":
        return stories260k(torch.float32)
    if arch == "llama-odd":  # an MLP width whose activation leaves a scalar tail in a block of several rows
        return tiny_model("llama", intermediate_size=100)
    if arch == "llama-biases":
        model = tiny_model("llama", attention_bias=True, mlp_bias=True)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("bias"):
                    parameter.normal_(0, 0.5)
        return model
    return tiny_model(arch)


@pytest.mark.parametrize("arch", LEAN_ARCHITECTURES + ["stories260K", "llama-odd", "llama-biases"])
def test_float32_lean_with_the_models_attention_is_transformers_bit_for_bit(arch):
    """float32 exact decoding on the lean forward with the model's own attention function: one-token steps, their
    hidden states and every verify (chains of 2-16, a 12-node tree, with its hidden states at every HF index) give
    transformers' forward's numbers bit for bit; with the row kernel instead they would not (llama-odd: the
    activation's scalar tail falls on other columns when it runs per row)."""
    model = _float32_model(arch)
    set_layout(model, "rows+panels")
    target = TargetModel(model)
    assert lean_matches(target, "model") == ""
    gen = torch.Generator().manual_seed(4)
    vocab = min(target.vocab_size, 500)
    prompt = torch.randint(3, vocab, (21,), generator=gen)
    indices = tuple(range(-target.num_layers - 1, 0))
    for name, tree in TREES.items():
        tokens = torch.randint(3, vocab, (tree.num_nodes,), generator=gen)
        outs = []
        for lean in (False, True):
            target.lean_wanted, target.lean_attention = lean, "model"
            assert (target.lean_forward() is not None) == lean
            target.prefill(prompt)
            outs.append(target.forward(tokens, tree, hidden_state_indices=indices))
            target.commit([])
        assert torch.equal(outs[0].logits, outs[1].logits), f"{arch} {name}"
        assert all(torch.equal(outs[0].hidden[i], outs[1].hidden[i]) for i in indices), f"{arch} {name}"
    rows = [torch.randint(3, vocab, (n,), generator=gen) for n in (5, 11, 8)]  # a batch: rows of holes, padding
    trees = [Tree.chain(3), TREES["tree 12"], Tree.chain(0)]
    tokens = [torch.randint(3, vocab, (tree.num_nodes,), generator=gen) for tree in trees]
    batches = []
    for lean in (False, True):
        target.lean_wanted, target.lean_attention = lean, "model"
        target.prefill_rows(rows)
        batches.append(target.forward_rows(tokens, trees))
    assert all(torch.equal(a.logits, b.logits) for a, b in zip(*batches, strict=True)), arch


def test_float32_exact_decoding_takes_the_lean_forward_and_equals_generate(capsys, monkeypatch):
    """The load-time check turns the float32 lean forward on (one line); greedy prompt lookup and plain decoding on it
    equal transformers' `generate` token for token, and data.distill's runtime engine still answers on the row
    kernel (its own check); SPECHEADS_LEAN=off keeps transformers' forward."""
    from data.engines import RuntimeEngine, Sampling
    from runtime.config import DecodeConfig, SpeculationConfig
    from runtime.loop import generate
    from runtime.proposers import Autoregressive, PromptLookupProposer

    model = stories260k(torch.float32)
    target = prepare_target(model, use_cache=False, layout="rows+panels")
    assert "verify check: lean forward on (float32, rows+panels), the model's own attention" in capsys.readouterr().err
    assert target.lean_forward() is not None and target.lean_forward().attention == "model"
    gen = torch.Generator().manual_seed(2)
    for n in (5, 17, 40):
        prompt = torch.cat([torch.tensor([1]), torch.randint(3, 500, (n,), generator=gen)])
        expected = model.generate(prompt[None], attention_mask=torch.ones_like(prompt[None]), max_new_tokens=48,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):]
        for proposer in (Autoregressive(), PromptLookupProposer(max_ngram=2)):
            config = DecodeConfig(max_new_tokens=48, eos_token_ids=(),
                                  speculation=SpeculationConfig(num_speculative_tokens=5))
            assert torch.equal(torch.cat(list(generate(target, proposer, prompt, config))), expected)

    RuntimeEngine(target, Sampling(4, (2,)), batch_size=2)
    assert "answers: lean forward on (float32)" in capsys.readouterr().err and target.lean_attention == "rows"

    monkeypatch.setenv("SPECHEADS_LEAN", "off")
    target = prepare_target(stories260k(torch.float32), use_cache=False, layout="rows+panels")
    assert "lean forward off ($SPECHEADS_LEAN)" in capsys.readouterr().err and target.lean_forward() is None


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_lean_hidden_states_are_transformers_at_every_index(arch):
    """EAGLE-3 and MTP read hidden states of chosen layers: every HF index (embeddings, each layer's output, the final
    norm; negative ones too) equals transformers' forward bit for bit on a one-token step."""
    model = tiny_model(arch, dtype=torch.bfloat16, num_hidden_layers=3)
    target = _lean_target(model)
    indices = (0, 1, 2, 3, -1, -2, -4)
    prompt, token = torch.randint(3, 200, (9,), generator=torch.Generator().manual_seed(5)), torch.tensor([17])
    outputs = []
    for lean in (False, True):
        target.lean_wanted = lean
        target.prefill(prompt)
        outputs.append(target.forward(token, Tree.chain(0), hidden_state_indices=indices))
    for index in indices:
        assert torch.equal(outputs[0].hidden[index], outputs[1].hidden[index]), index
    assert torch.equal(outputs[0].logits, outputs[1].logits)


def test_float32_answers_take_the_lean_forward_within_rounding_of_transformers(capsys, monkeypatch):
    """data.distill's runtime engine in float32: the lean forward is turned on after its check (one line), its logits
    and features stay within float32 rounding of transformers' forward on a batch of more rows than the panel kernel
    takes (the BLAS products), and its greedy answers equal transformers' `generate` prompt by prompt; with
    SPECHEADS_LEAN=off transformers' forward answers."""
    from data.engines import RuntimeEngine, Sampling

    model = stories260k(torch.float32)
    set_layout(model, "rows+panels")
    target = TargetModel(model)
    engine = RuntimeEngine(target, Sampling(10, (2,)), batch_size=20, feature_layers=(5,))
    assert "answers: lean forward on (float32)" in capsys.readouterr().err
    assert engine.describe()["forward"] == "lean" and target.lean_forward() is not None
    gen = torch.Generator().manual_seed(11)
    prompts = [[1, *torch.randint(3, 500, (int(n),), generator=gen).tolist()] for n in torch.randint(4, 30, (20,), generator=gen)]
    answers = engine.generate(prompts)
    for prompt, answer in zip(prompts, answers, strict=True):
        ids = torch.tensor([prompt])
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                                  eos_token_id=2, pad_token_id=0)[0, len(prompt):].tolist()
        assert answer.tokens == expected[:len(answer.tokens)] and len(answer.tokens) in (len(expected), 10)
        sequence = torch.tensor([answer.sequence[:-1]])
        with torch.inference_mode():
            reference = model(sequence, output_hidden_states=True).hidden_states[5][0]
        assert torch.allclose(answer.features[5], reference, rtol=0, atol=1e-4 * float(reference.abs().max()))

    target.lean_wanted = False
    monkeypatch.setenv("SPECHEADS_LEAN", "off")
    engine = RuntimeEngine(target, Sampling(10, (2,)), batch_size=20, feature_layers=(5,))
    assert "lean forward off ($SPECHEADS_LEAN)" in capsys.readouterr().err and engine.describe()["forward"] == "transformers"
    assert [a.tokens for a in engine.generate(prompts)] == [a.tokens for a in answers]


def test_float32_answers_keep_transformers_forward_where_the_check_fails(capsys, monkeypatch):
    """A lean forward further from transformers' than the tolerance (here: a tolerance of 0) stays off, in one line."""
    import runtime.verify_check as verify_check
    from data.engines import RuntimeEngine, Sampling

    monkeypatch.setattr(verify_check, "LEAN_DATA_TOLERANCE", 0.0)
    model = stories260k(torch.float32)
    set_layout(model, "rows+panels")
    target = TargetModel(model)
    engine = RuntimeEngine(target, Sampling(4, (2,)), batch_size=2)
    assert "answers: lean forward off (float32: " in capsys.readouterr().err
    assert engine.describe()["forward"] == "transformers" and target.lean_forward() is None


def test_float32_lean_stays_off_where_it_is_not_transformers_bits(capsys, monkeypatch):
    """Deliberately broken model-attention lean forwards: one off in the last bit of its attention, one that raises;
    the check keeps transformers' forward and says why, in one line."""
    import runtime.lean as lean_module

    original = lean_module._Layer._attend

    def nudged(self, query, keys, values, allowed, mask):
        out = original(self, query, keys, values, allowed, mask)
        return out if self.attention_mode == "rows" else torch.nextafter(out, out + 1)

    monkeypatch.setattr(lean_module._Layer, "_attend", nudged)
    target = prepare_target(stories260k(torch.float32), use_cache=False, layout="rows+panels")
    assert ("lean forward off (float32, rows+panels): its step logits differ from transformers' forward"
            in capsys.readouterr().err) and target.lean_forward() is None

    def broken(self, query, keys, values, allowed, mask):
        raise RuntimeError("boom")

    monkeypatch.setattr(lean_module._Layer, "_attend", broken)
    target = prepare_target(stories260k(torch.float32), use_cache=False, layout="rows+panels")
    err = capsys.readouterr().err
    assert "lean forward off (float32, rows+panels): its forward failed (TargetError: " in err and "boom" in err
    assert target.lean_forward() is None
