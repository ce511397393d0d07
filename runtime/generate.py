"""The one decode loop (draft -> verify -> accept -> commit) and the `python -m runtime.generate` CLI.

Every method, plain autoregressive decoding included (a proposer that drafts nothing), runs through
`generate`. It streams the new tokens of each step, stops exactly at `max_new_tokens` (drafts are capped so a
step never overshoots) and right after an EOS token (as `model.generate` does), and records per-step stats.
When the context of the target is full (max_position_embeddings) generation stops too (stop_reason "context").

    python -m runtime.generate --model ../shared/models/smollm2-135m-instruct --method prompt_lookup \
        --prompt "Repeat after me: the quick brown fox jumps over the lazy dog." --max_new_tokens 64
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from runtime.acceptance import accept
from runtime.config import DecodeConfig, GenerateArguments, SpeculationLength
from runtime.proposers.base import Draft, Proposer
from runtime.sampling import SamplingConfig, logits_to_probs, sample_token
from runtime.target import SUPPORTED_ATTENTION, TargetModel
from runtime.verify_check import prepare_target


@dataclass(frozen=True)
class StepStats:
    """One draft -> verify -> accept -> commit step."""

    accepted_length: int  # tokens emitted this step: accepted draft tokens + the bonus token
    drafted_depth: int  # depth of the draft tree (chain length); 0 = nothing drafted
    drafted_nodes: int  # non-root nodes in the draft tree
    draft_time: float  # seconds in the proposer (propose + on_accept)
    verify_time: float  # seconds in the target forward (`TargetModel.forward`, its tree mask included)
    overhead_time: float = 0.0  # the rest of the step: checks, acceptance, KV compaction, bookkeeping


@dataclass
class GenerationStats:
    """Filled by `generate` while it runs. tau counts the bonus token, so plain decoding has tau = 1.0."""

    prompt_length: int = 0
    new_tokens: int = 0
    prefill_time: float = 0.0
    total_time: float = 0.0
    stop_reason: str = ""  # "max_new_tokens", "eos" or "context"
    steps: list[StepStats] = field(default_factory=list)
    accepted_per_depth: list[int] = field(default_factory=list)  # [d-1]: steps whose depth-d token was accepted
    drafted_per_depth: list[int] = field(default_factory=list)  # [d-1]: steps that drafted a depth-d token

    def record(self, step: StepStats) -> None:
        self.steps.append(step)
        for counts, depth in ((self.accepted_per_depth, step.accepted_length - 1),
                              (self.drafted_per_depth, step.drafted_depth)):
            counts.extend([0] * (depth - len(counts)))
            for d in range(depth):
                counts[d] += 1

    @property
    def tau(self) -> float:
        """Mean accepted length per verify step, bonus included (the prefill's first token is not a step)."""
        return sum(s.accepted_length for s in self.steps) / len(self.steps) if self.steps else 1.0

    @property
    def acceptance_per_depth(self) -> list[float]:
        """P(depth-d draft token accepted | a depth-d token was drafted), d = 1, 2, ..."""
        accepted = self.accepted_per_depth + [0] * (len(self.drafted_per_depth) - len(self.accepted_per_depth))
        return [a / d for a, d in zip(accepted, self.drafted_per_depth, strict=True)]

    @property
    def draft_time(self) -> float:
        return sum(s.draft_time for s in self.steps)

    @property
    def verify_time(self) -> float:
        return sum(s.verify_time for s in self.steps)

    @property
    def overhead_time(self) -> float:
        return sum(s.overhead_time for s in self.steps)

    @property
    def tokens_per_second(self) -> float:
        """New tokens over the wall time of the whole call (prefill included)."""
        return self.new_tokens / self.total_time if self.total_time > 0 else 0.0

    def summary(self) -> dict[str, float | int | str | list[float]]:
        return {"tau": self.tau, "tokens_per_second": self.tokens_per_second, "new_tokens": self.new_tokens,
                "steps": len(self.steps), "prefill_time": self.prefill_time, "draft_time": self.draft_time,
                "verify_time": self.verify_time, "overhead_time": self.overhead_time, "total_time": self.total_time,
                "stop_reason": self.stop_reason,
                "acceptance_per_depth": self.acceptance_per_depth}


def next_token(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """The target's own next token from logits [V]: argmax when greedy, else a sample. Returns [1] int64."""
    if sampling.is_greedy:
        return logits.argmax(dim=-1, keepdim=True)
    return sample_token(logits_to_probs(logits, sampling), generator).reshape(1)


def _check_draft(draft: Draft, committed_ids: torch.Tensor, budget: int) -> None:
    if draft.tree.num_nodes - 1 > budget:
        raise ValueError(f"proposer drafted {draft.tree.num_nodes - 1} nodes, more than the budget {budget}")
    if draft.tokens.shape != (draft.tree.num_nodes,) or int(draft.tokens[0]) != int(committed_ids[-1]):
        raise ValueError("proposer draft must have one token per tree node, rooted at the last committed token")


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@torch.inference_mode()
def generate(target: TargetModel, proposer: Proposer, input_ids: torch.Tensor, config: DecodeConfig,
             stats: GenerationStats | None = None) -> Iterator[torch.Tensor]:
    """Stream the new tokens of each step (int64 [n] tensors, n >= 1) until max_new_tokens, EOS or full context.

    input_ids: the prompt, [T] or [1, T]. `stats` (optional) is filled as the loop runs.
    """
    stats = stats if stats is not None else GenerationStats()
    start_time = _clock(target.device)
    eos = set(config.eos_token_ids if config.eos_token_ids is not None else target.eos_token_ids())
    generator = None
    if config.seed is not None:
        generator = torch.Generator(device=target.device).manual_seed(config.seed)
    indices = tuple(proposer.hidden_state_indices)

    # 0. prefill: the prompt into the target's cache; its last logits give the first new token
    prompt = target.check_prompt(input_ids.to(target.device))
    out = target.prefill(prompt, indices)
    emitted = next_token(out.logits[-1], config.sampling, generator)  # [1]
    committed = torch.cat([prompt, emitted])  # [T + 1]; the last token is the root of the next draft
    proposer.reset(prompt, out.hidden or None)
    stats.prompt_length, stats.new_tokens = prompt.numel(), 1
    stats.prefill_time = _clock(target.device) - start_time
    stats.total_time = stats.prefill_time
    yield emitted
    length = SpeculationLength(config.speculation)
    while True:
        step_start = _clock(target.device)  # step time = draft + verify + overhead (everything else)
        if int(emitted[-1]) in eos:
            stats.stop_reason = "eos"
            break
        if stats.new_tokens >= config.max_new_tokens:
            stats.stop_reason = "max_new_tokens"
            break
        # tree node at depth d sits at position len(committed) - 1 + d, which must be < max_positions
        room = config.max_new_tokens if target.max_positions is None else target.max_positions - committed.numel()
        if room < 0:  # the root itself would sit past the last position
            stats.stop_reason = "context"
            break
        budget = min(length.current, config.max_new_tokens - stats.new_tokens - 1, room)

        # 1. draft: a candidate tree rooted at the last committed token
        t0 = _clock(target.device)
        draft = proposer.propose(committed, budget)
        _check_draft(draft, committed, budget)
        t1 = _clock(target.device)

        # 2. verify: every tree node in ONE target forward (tree mask, position_ids = prefix_len + depth)
        out = target.forward(draft.tokens, draft.tree, hidden_state_indices=indices)

        t2 = _clock(target.device)

        # 3. accept: the longest acceptable path plus the target's own bonus token
        acceptance = accept(draft, out.logits, config.sampling, config.acceptance, generator)

        # 4. commit: keep the accepted path in the KV cache, emit its tokens (cut after an EOS)
        target.commit(acceptance.accepted_nodes)
        emitted = torch.cat([draft.tokens[acceptance.accepted_nodes[1:]],
                             draft.tokens.new_tensor([acceptance.bonus_token])])  # [accepted_length]
        hits = [i for i, token in enumerate(emitted.tolist()) if token in eos]
        if hits:
            emitted = emitted[:hits[0] + 1]
        committed = torch.cat([committed, emitted])
        t3 = _clock(target.device)
        proposer.on_accept(committed, draft, acceptance.accepted_nodes, out.hidden or None)
        t4 = _clock(target.device)

        length.update(draft.tree.max_depth, acceptance.accepted_length - 1)
        draft_time, verify_time = (t1 - t0) + (t4 - t3), t2 - t1
        stats.record(StepStats(accepted_length=emitted.numel(), drafted_depth=draft.tree.max_depth,
                               drafted_nodes=draft.tree.num_nodes - 1, draft_time=draft_time, verify_time=verify_time,
                               overhead_time=(t4 - step_start) - draft_time - verify_time))
        stats.new_tokens += emitted.numel()
        stats.total_time = t4 - start_time
        yield emitted
    stats.total_time = _clock(target.device) - start_time


def build_proposer(args: GenerateArguments, target: TargetModel, tokenizer) -> Proposer:
    """The proposer named by --method (loading --draft_model when needed)."""
    from runtime.proposers import Autoregressive, DraftModelProposer, PromptLookupProposer
    method = args.resolved_method()
    if method == "autoregressive":
        return Autoregressive()
    if target.mode == "plain":  # the load-time verify check allows no drafts for this model
        print(f"[verify] --method {method}: speculation off, the target runs plain decoding only", file=sys.stderr)
        return Autoregressive()
    if method == "prompt_lookup":
        return PromptLookupProposer(max_ngram=args.max_ngram, min_ngram=args.min_ngram)
    if method == "heads":  # the head config's kind picks Medusa / EAGLE / EAGLE-3 / MTP; auto size measured here
        from runtime.proposers.factory import proposer_from_heads
        built = proposer_from_heads(args.heads, target, args.heads_options(), sampling=args.decode_config().sampling,
                                    seed=args.seed, target_name=args.model)
        print(f"[heads] {built.description}", file=sys.stderr)
        return built.proposer
    from heads.loading import load_model, load_tokenizer
    from runtime.proposers.draft_model import check_same_vocabulary
    draft_tokenizer = load_tokenizer(args.draft_model)
    check_same_vocabulary(tokenizer, draft_tokenizer)
    draft = load_model(args.draft_model, dtype=target.dtype, attn_implementation=args.attn_implementation,
                       device=args.device)
    draft_mode = prepare_target(draft, flag="--draft_model").mode  # the draft model gets the same self-check
    return DraftModelProposer(draft, target_vocab_size=target.vocab_size, sampling=args.decode_config().sampling,
                              branching=args.branching() if target.mode == draft_mode == "tree" else (),
                              seed=args.seed, mode=draft_mode)


def encode_prompt(tokenizer, prompt: str | list[dict[str, str]]) -> torch.Tensor:
    """Prompt text (or a conversation [{role, content}, ...] ending in a user turn) -> ids [T], through the chat
    template when the tokenizer has one (else the turns' texts joined by newlines)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    return torch.tensor(tokenizer("\n".join(m["content"] for m in messages))["input_ids"], dtype=torch.long)


def main(argv: list[str] | None = None) -> GenerationStats:
    from heads.cli import parse_flags
    from heads.loading import load_model, load_tokenizer

    args = parse_flags(GenerateArguments, argv)  # `--config file.yaml` gives defaults, flags override
    torch.set_num_threads(args.num_threads)
    if args.attn_implementation not in SUPPORTED_ATTENTION:
        raise ValueError(f"--attn_implementation {args.attn_implementation}: an attention backend that ignores "
                         f"custom masks cannot verify candidate trees; use one of {SUPPORTED_ATTENTION}")
    config = args.decode_config()
    args.resolved_method()
    tokenizer = load_tokenizer(args.model)
    target = prepare_target(load_model(args.model, dtype=args.model_dtype(), attn_implementation=args.attn_implementation,
                                    device=args.device))
    print(args.dtype_line(target.dtype), file=sys.stderr)
    proposer = build_proposer(args, target, tokenizer)
    input_ids = encode_prompt(tokenizer, args.prompt)
    stats = GenerationStats()
    generated: list[int] = []
    printed = ""
    for tokens in generate(target, proposer, input_ids, config, stats):
        generated.extend(tokens.tolist())
        text = tokenizer.decode(generated, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            sys.stdout.write(text[len(printed):])
            sys.stdout.flush()
            printed = text
    print()
    rates = ", ".join(f"{r:.2f}" for r in stats.acceptance_per_depth)
    print(f"[{args.resolved_method()}] new tokens {stats.new_tokens} in {len(stats.steps) + 1} forwards, "
          f"tau {stats.tau:.2f}, {stats.tokens_per_second:.1f} tokens/s, stop: {stats.stop_reason}, "
          f"acceptance per depth [{rates}]")
    return stats


if __name__ == "__main__":
    from heads.cli import run_cli

    run_cli(main)
