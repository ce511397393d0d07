"""Invariant 2: greedy speculative output == model.generate(do_sample=False), token for token; the loop's
stopping rules (max_new_tokens exactly, EOS mid-step, full context), stats, adaptive k and the CLI."""

import copy

import pytest
import torch

from runtime.cli import main
from runtime.config import DecodeConfig, GenerateArguments, SpeculationConfig, SpeculationLength
from runtime.loop import GenerationStats, generate
from runtime.proposers import Autoregressive, DraftModelProposer, PromptLookupProposer
from runtime.sampling import SamplingConfig
from runtime.target import TargetModel
from tests.tiny_models import ARCHITECTURES, STORIES260K, stories260k, tiny_model


def perturbed_copy(model, scale=0.05, seed=1):
    """The target with Gaussian noise (scale x each tensor's std) on every weight: a draft that agrees often."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * scale * param.std())
    return draft


def reference(model, prompt, max_new_tokens):
    """HF's own greedy decoding: new tokens [n]."""
    out = model.generate(prompt[None], attention_mask=torch.ones(1, prompt.numel(), dtype=torch.long),
                         do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, prompt.numel():]


def run(model, proposer, prompt, max_new_tokens, k=4, **config):
    stats = GenerationStats()
    config = DecodeConfig(max_new_tokens=max_new_tokens, speculation=SpeculationConfig(k), **config)
    steps = list(generate(TargetModel(model), proposer, prompt, config, stats))
    assert all(step.ndim == 1 and step.numel() >= 1 for step in steps)
    return torch.cat(steps), stats


def _model(name):
    model = stories260k() if name == "stories260K" else tiny_model(name)
    model.generation_config.eos_token_id = None  # random models emit EOS anywhere; EOS has its own test
    return model


def _prompt(seed=0, length=12, vocab=256):
    part = torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed))
    return torch.cat([part, part[:5]])  # a repeat, so prompt lookup finds matches


@pytest.mark.parametrize("name", ARCHITECTURES + ["stories260K"])
def test_greedy_draft_model_and_prompt_lookup_equal_hf_generate(name):
    model = _model(name)
    prompt = _prompt()
    expected = reference(model, prompt, 120)
    assert expected.numel() == 120
    out, stats = run(model, DraftModelProposer(perturbed_copy(model), model.config.vocab_size), prompt, 120)
    assert torch.equal(out, expected)
    assert stats.new_tokens == 120 and stats.stop_reason == "max_new_tokens"
    assert stats.tau > 1.2, "a perturbed copy of the target must get draft tokens accepted"
    out, stats = run(model, PromptLookupProposer(), prompt, 120)
    assert torch.equal(out, expected)
    assert sum(s.accepted_length for s in stats.steps) + 1 == stats.new_tokens == 120
    cpu_costs = [1.0, 1.56, 1.7, 1.8, 1.85, 1.9]  # cost-aware length: some steps draft, some are plain, same output
    out, stats = run(model, PromptLookupProposer(step_costs=cpu_costs), prompt, 120)
    assert torch.equal(out, expected)
    assert sum(s.accepted_length for s in stats.steps) + 1 == stats.new_tokens == 120


@pytest.mark.parametrize("name,branching", [("llama", (2, 2)), ("qwen3", (3, 1, 2)), ("stories260K", (2,))])
def test_greedy_draft_tree_equals_hf_generate(name, branching):
    model = _model(name)
    prompt = _prompt(seed=3)
    draft = DraftModelProposer(perturbed_copy(model, 0.1), model.config.vocab_size, branching=branching)
    out, stats = run(model, draft, prompt, 100, k=8)
    assert torch.equal(out, reference(model, prompt, 100))
    assert max(s.drafted_nodes for s in stats.steps) > max(s.drafted_depth for s in stats.steps)  # a real tree
    assert stats.tau > 1.2


def test_sliding_window_model_past_the_window_equals_hf_generate():
    model = tiny_model("mistral", sliding_window=8)
    model.generation_config.eos_token_id = None
    prompt = _prompt(seed=4)
    out, _ = run(model, DraftModelProposer(perturbed_copy(model), 256), prompt, 60)
    assert torch.equal(out, reference(model, prompt, 60))


def test_autoregressive_is_plain_decoding():
    model = _model("qwen2")
    prompt = _prompt(seed=5)
    out, stats = run(model, Autoregressive(), prompt, 40)
    assert torch.equal(out, reference(model, prompt, 40))
    assert stats.tau == 1.0 and len(stats.steps) == 39 and stats.acceptance_per_depth == []


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7, 33])
def test_max_new_tokens_exactly_respected(max_new_tokens):
    model = _model("llama")
    prompt = _prompt(seed=6)
    out, stats = run(model, DraftModelProposer(model, 256), prompt, max_new_tokens, k=5)  # self-draft: all accepted
    assert out.numel() == stats.new_tokens == max_new_tokens
    assert torch.equal(out, reference(model, prompt, max_new_tokens))


def test_eos_mid_step_stops_right_after_it():
    model = _model("llama")
    prompt = _prompt(seed=7)
    plain = reference(model, prompt, 100).tolist()
    # an EOS token whose first occurrence is inside a self-draft step of 6 tokens (steps end at i % 6 == 0)
    position = next(i for i in range(8, 100) if plain.index(plain[i]) == i and i % 6 != 0)
    eos = plain[position]
    model.generation_config.eos_token_id = [255 if eos != 255 else 254, eos]  # a list, as some models have
    expected = reference(model, prompt, 100)
    assert expected.tolist() == plain[:position + 1]
    out, stats = run(model, DraftModelProposer(model, 256), prompt, 100, k=5)
    assert torch.equal(out, expected)
    assert stats.stop_reason == "eos"
    assert stats.steps[-1].accepted_length < 6  # the last step was cut after the EOS


def test_generation_stops_when_the_context_is_full():
    model = tiny_model("llama", max_position_embeddings=40)
    model.generation_config.eos_token_id = None
    prompt = _prompt(seed=8, length=25)  # 30 tokens
    out, stats = run(model, PromptLookupProposer(), prompt, 100)
    assert stats.stop_reason == "context" and out.numel() == 11  # positions 30..39 fed, plus the last token
    assert torch.equal(out, reference(model, prompt, 11))


def test_bad_max_new_tokens():
    with pytest.raises(ValueError, match="--max_new_tokens"):
        DecodeConfig(max_new_tokens=0)
    with pytest.raises(ValueError, match="--max_new_tokens"):
        DecodeConfig(max_new_tokens=-3)


def test_empty_prompt_through_the_loop():
    with pytest.raises(ValueError, match="prompt: empty"):
        next(generate(TargetModel(tiny_model("llama")), Autoregressive(), torch.tensor([], dtype=torch.long),
                      DecodeConfig(max_new_tokens=5)))


def test_adaptive_speculation_length():
    length = SpeculationLength(SpeculationConfig(4, adaptive=True, min_speculative_tokens=1, max_speculative_tokens=9))
    history = []
    for drafted, accepted in [(4, 4), (6, 6), (8, 8), (9, 2), (8, 0), (7, 7)]:
        length.update(drafted, accepted)
        history.append(length.current)
    assert history == [6, 8, 9, 8, 7, 9]
    fixed = SpeculationLength(SpeculationConfig(4))
    fixed.update(4, 4)
    assert fixed.current == 4


def test_adaptive_k_grows_when_everything_is_accepted():
    model = _model("llama")
    config = SpeculationConfig(2, adaptive=True, max_speculative_tokens=12)
    stats = GenerationStats()
    out = torch.cat(list(generate(TargetModel(model), DraftModelProposer(model, 256), _prompt(), DecodeConfig(
        max_new_tokens=60, speculation=config), stats)))
    assert torch.equal(out, reference(model, _prompt(), 60))
    assert [s.drafted_depth for s in stats.steps[:5]] == [2, 4, 6, 8, 10]


def test_sampling_runs_are_reproducible_and_sized():
    model = _model("llama")
    sampling = SamplingConfig(temperature=0.9, top_k=40, top_p=0.95)

    def sample(seed):
        draft = DraftModelProposer(perturbed_copy(model), 256, sampling=sampling, branching=(2,), seed=seed)
        return run(model, draft, _prompt(), 50, k=5, sampling=sampling, seed=seed)

    (a, stats), (b, _), (c, _) = sample(0), sample(0), sample(1)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.numel() == 50 and stats.tau > 1.0


def test_cli_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "--num_speculative_tokens" in capsys.readouterr().out


def test_cli_streams_text_and_prints_tau(capsys):
    stats = main(["--model", str(STORIES260K), "--prompt", "Once upon a time", "--max_new_tokens", "24",
                  "--draft_model", str(STORIES260K), "--num_speculative_tokens", "auto"])
    printed = capsys.readouterr().out
    assert "tau" in printed and "tokens/s" in printed and "[draft_model]" in printed
    assert stats.new_tokens == 24 and stats.tau > 2  # self-draft: everything accepted
    assert len(printed.splitlines()[0]) > 20  # the story text itself


def test_cli_prompt_lookup_by_cost(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))  # the verify cost curve is measured and cached here
    stats = main(["--model", str(STORIES260K), "--prompt", "Once upon a time", "--max_new_tokens", "24",
                  "--method", "prompt_lookup", "--num_speculative_tokens", "cost", "--max_speculative_tokens", "4"])
    assert "[prompt lookup] draft length per step by cost" in capsys.readouterr().err
    assert stats.new_tokens == 24 and max(s.drafted_depth for s in stats.steps) <= 4
    assert list((tmp_path / "cost_curves").iterdir())  # measured once, then read back


def test_cli_arguments():
    assert GenerateArguments(num_speculative_tokens="auto").speculation().adaptive
    assert GenerateArguments(draft_tree_branching="2,2").branching() == (2, 2)
    with pytest.raises(ValueError, match="--num_speculative_tokens"):
        GenerateArguments(num_speculative_tokens="many").speculation()
    by_cost = GenerateArguments(method="prompt_lookup", num_speculative_tokens="cost", max_speculative_tokens=8)
    assert by_cost.speculation().num_speculative_tokens == 8 and not by_cost.speculation().adaptive
    with pytest.raises(ValueError, match="--num_speculative_tokens cost: only for --method prompt_lookup"):
        GenerateArguments(draft_model=str(STORIES260K), num_speculative_tokens="cost").speculation()
    with pytest.raises(ValueError, match="--method"):
        GenerateArguments(method="medusa").resolved_method()
    with pytest.raises(ValueError, match="--draft_model"):
        GenerateArguments(method="draft_model").resolved_method()


def test_cli_config_file(tmp_path, capsys):
    config = tmp_path / "generate.yaml"
    config.write_text(f"model: {STORIES260K}\nmax_new_tokens: 5\nmethod: autoregressive\n")
    stats = main(["--config", str(config), "--prompt", "Once upon a time"])
    assert stats.new_tokens == 5 and stats.tau == 1.0
    with pytest.raises(ValueError, match="--prompt: empty text"):  # before the model loads: no such model is fine
        main(["--model", str(tmp_path / "no_model"), "--prompt", "  "])
    config.write_text("max_new_token: 5\n")
    with pytest.raises(ValueError, match="max_new_token"):
        main(["--config", str(config)])


@pytest.mark.slow
def test_smollm2_greedy_prompt_lookup_equals_hf_generate():
    """The real 135M chat model (49k vocabulary, GGUF via heads.loading), chat template, EOS from its config."""
    from heads.loading import load_model, load_tokenizer
    from runtime.build import encode_prompt
    from tests.tiny_models import SMOLLM2

    model, tokenizer = load_model(str(SMOLLM2)), load_tokenizer(str(SMOLLM2))
    prompt = encode_prompt(tokenizer, "Explain what a hash table is, and repeat the key definition twice.")
    out, stats = run(model, PromptLookupProposer(), prompt, 100)
    expected = reference(model, prompt, 100)
    assert torch.equal(out, expected)
    assert stats.stop_reason == ("eos" if expected.numel() < 100 else "max_new_tokens")
