"""The target adapter: bad input gets a clear error naming the argument, hidden states, context limits."""

import pytest
import torch

from runtime.target import TargetModel, attention_windows
from runtime.tree import Tree
from tests.tiny_models import ARCHITECTURES, ATTENTION, tiny_config, tiny_model


def test_empty_prompt():
    with pytest.raises(ValueError, match="prompt: empty"):
        TargetModel(tiny_model("llama")).prefill(torch.tensor([], dtype=torch.long))


def test_prompt_longer_than_context_names_length_and_limit():
    target = TargetModel(tiny_model("llama", max_position_embeddings=32))
    with pytest.raises(ValueError, match=r"prompt: 33 tokens .*32 positions"):
        target.prefill(torch.randint(3, 256, (33,)))
    target.prefill(torch.randint(3, 256, (32,)))  # exactly the context is fine


def test_gpt2_context_uses_n_positions():
    assert TargetModel(tiny_model("gpt2", n_positions=64)).max_positions == 64


@pytest.mark.parametrize("backend", ["flex_attention"])
def test_attention_backend_that_ignores_custom_masks_is_refused(backend):
    with pytest.raises(ValueError, match="--attn_implementation flex_attention: an attention backend that ignores"):
        TargetModel(tiny_model("llama", attn=backend))


def test_flash_attention_flag_is_refused_by_the_cli():
    from runtime.cli import main
    with pytest.raises(ValueError, match="--attn_implementation flash_attention_2"):
        main(["--model", "unused", "--attn_implementation", "flash_attention_2"])


def test_unsupported_layer_type_is_refused():
    config = tiny_config("qwen2")
    config.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(ValueError, match="chunked_attention"):
        attention_windows(config)


def test_forward_checks():
    target = TargetModel(tiny_model("llama"))
    with pytest.raises(ValueError, match="prefill"):
        target.forward(torch.tensor([5]), Tree.chain(0))
    target.prefill(torch.randint(3, 256, (5,)))
    with pytest.raises(ValueError, match="tokens: expected shape"):
        target.forward(torch.tensor([5, 6]), Tree.chain(2))
    with pytest.raises(ValueError, match="hidden_state_indices"):
        target.forward(torch.tensor([5]), Tree.chain(0), hidden_state_indices=(7,))


def test_prefill_hidden_states_and_positions_past_context():
    model = tiny_model("qwen3", max_position_embeddings=16)
    target = TargetModel(model)
    prompt = torch.randint(3, 256, (10,))
    out = target.prefill(prompt, hidden_state_indices=(0, 2, -1))
    assert out.logits.shape == (1, 256) and set(out.hidden) == {0, 2, -1}
    assert all(h.shape == (10, 64) for h in out.hidden.values())
    with torch.no_grad():
        ref = model(prompt[None], output_hidden_states=True)
    torch.testing.assert_close(out.logits[0], ref.logits[0, -1], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out.hidden[2], ref.hidden_states[2][0], atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="beyond the context"):
        target.forward(torch.randint(3, 256, (7,)), Tree.chain(6))  # positions 10..16


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_hidden_states_caught_by_hooks_equal_output_hidden_states(arch):
    """Hidden states come from hooks on the layers they name (output_hidden_states costs every step); they must be
    transformers' own, bit for bit, on a prefill and on a tree forward after it."""
    model = tiny_model(arch, attn=ATTENTION.get(arch))
    target = TargetModel(model)
    indices = (0, 1, target.num_layers, -1)
    prompt = torch.randint(3, 256, (9,))
    tree = Tree.from_parents([-1, 0, 0, 1])
    out = target.prefill(prompt, hidden_state_indices=indices)
    assert target._capture.checked.get(indices) is True
    step = torch.randint(3, 256, (tree.num_nodes,))
    tree_out = target.forward(step, tree, hidden_state_indices=indices)
    reference = TargetModel(model)
    reference._capture.modules = None  # transformers' output_hidden_states only
    ref = reference.prefill(prompt, hidden_state_indices=indices)
    ref_tree = reference.forward(step, tree, hidden_state_indices=indices)
    for i in indices:
        assert torch.equal(out.hidden[i], ref.hidden[i]) and torch.equal(tree_out.hidden[i], ref_tree.hidden[i])
    assert torch.equal(tree_out.logits, ref_tree.logits)


def test_hooks_that_do_not_serve_fall_back_and_say_why(capsys, monkeypatch):
    """Where the one-time check of the hooks fails (here: they raise), transformers' output_hidden_states serves the
    hidden states, and one line on stderr says so and why."""
    model = tiny_model("llama")
    target = TargetModel(model)

    def broken(indices):
        raise RuntimeError("no such layer")

    monkeypatch.setattr(target._capture, "catching", broken)
    prompt = torch.randint(3, 256, (9,))
    out = target.prefill(prompt, hidden_state_indices=(-1,))
    assert target._capture.checked[(-1,)] is False
    with torch.no_grad():
        ref = model(prompt[None], output_hidden_states=True)
    assert torch.equal(out.hidden[-1], ref.hidden_states[-1][0])
    err = capsys.readouterr().err
    assert "hooks not used (RuntimeError: no such layer); output_hidden_states serves them" in err


def test_eos_ids_from_generation_config():
    model = tiny_model("llama")
    model.generation_config.eos_token_id = [2, 7]
    assert TargetModel(model).eos_token_ids() == (2, 7)


def test_bf16_attention_runs_in_float32_on_cpus_without_native_bf16(monkeypatch):
    """A bfloat16 model on a CPU without AVX512-BF16/AMX: inside our forwards transformers' sdpa receives q/k/v in
    float32 (torch's bf16 kernel is emulated there) and returns bf16; outside them the registry is untouched; with
    native bf16 nothing is wrapped. The tree forward still equals per-path forwards (runtime.verify_check)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from runtime import target as target_module
    from runtime.verify_check import check_mode

    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    seen = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append(query.dtype)
        return original(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", spy)
    for native, expected in ((False, torch.float32), (True, torch.bfloat16)):
        monkeypatch.setattr(target_module, "fast_bf16", lambda device, native=native: native)
        model = tiny_model("llama").to(torch.bfloat16)
        target = TargetModel(model)
        seen.clear()
        logits = target.prefill(torch.randint(3, 256, (7,))).logits
        assert logits.dtype == torch.bfloat16 and set(seen) == {expected}
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is spy
    monkeypatch.setattr(target_module, "fast_bf16", lambda device: False)
    assert check_mode(tiny_model("llama").to(torch.bfloat16), "tree") < 5e-2
