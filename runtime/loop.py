"""The one decode loop (draft -> verify -> accept -> commit) and its per-step stats.

Every method, plain autoregressive decoding included (a proposer that drafts nothing), runs through
`generate`. It streams the new tokens of each step, stops exactly at `max_new_tokens` (drafts are capped so a
step never overshoots) and right after an EOS token (as `model.generate` does), and records per-step stats.
When the context of the target is full (max_position_embeddings) generation stops too (stop_reason "context").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from runtime.acceptance import accept
from runtime.config import DecodeConfig, SpeculationLength
from runtime.proposers.base import Draft, Proposer
from runtime.sampling import SamplingConfig, logits_to_probs, sample_token
from runtime.target import TargetModel


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

    @classmethod
    def merged(cls, stats: Sequence[GenerationStats]) -> GenerationStats:
        """One record of several runs: their steps and per-depth counts summed (tau, acceptance per depth and
        the time shares over all of them)."""
        out = cls(new_tokens=sum(s.new_tokens for s in stats), prefill_time=sum(s.prefill_time for s in stats),
                  total_time=sum(s.total_time for s in stats))
        for s in stats:
            out.steps.extend(s.steps)
            for mine, theirs in ((out.accepted_per_depth, s.accepted_per_depth),
                                 (out.drafted_per_depth, s.drafted_per_depth)):
                mine.extend([0] * (len(theirs) - len(mine)))
                for d, count in enumerate(theirs):
                    mine[d] += count
        return out

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


def _stop_reason(last_token: int, new_tokens: int, committed_length: int, eos: set[int], config: DecodeConfig,
                 max_positions: int | None) -> str:
    """Why a row stops before its next step ("" = it goes on)."""
    if last_token in eos:
        return "eos"
    if new_tokens >= config.max_new_tokens:
        return "max_new_tokens"
    # tree node at depth d sits at position committed_length - 1 + d, which must be < max_positions
    if max_positions is not None and max_positions - committed_length < 0:  # the root itself would not fit
        return "context"
    return ""


@torch.inference_mode()
def generate(target: TargetModel, proposer: Proposer, input_ids: torch.Tensor, config: DecodeConfig,
             stats: GenerationStats | None = None) -> Iterator[torch.Tensor]:
    """Stream the new tokens of each step (int64 [n] tensors, n >= 1) until max_new_tokens, EOS or full context.

    input_ids: the prompt, [T] or [1, T]. `stats` (optional) is filled as the loop runs. One sequence is the
    batch of one of `generate_batch`.
    """
    stats = stats if stats is not None else GenerationStats()
    for emitted in generate_batch(target, [proposer], [input_ids], config, [stats]):
        yield emitted[0]


@torch.inference_mode()
def generate_batch(target: TargetModel, proposers: list[Proposer], prompts: list[torch.Tensor], config: DecodeConfig,
                   stats: list[GenerationStats] | None = None,
                   size_for_batch: Callable[[int], list[int]] | None = None) -> Iterator[list[torch.Tensor]]:
    """Decode B prompts together; yield, per step, the new tokens of every row (int64 [n_b]; empty once the
    row has finished). Each row drafts with its own proposer (proposers[b], one per row: they hold per-sequence
    state), all rows are verified in ONE target forward, each row accepts its own path. A row stops at
    max_new_tokens, right after an EOS token or at a full context, and is then dropped from the batch.

    prompts: B prompts [T_b] (different lengths allowed). stats: one GenerationStats per row (filled as the loop
    runs; a step's draft/verify/overhead times are the batch step's). size_for_batch: the planner
    (runtime/planner.BatchPlanner), rows in the batch -> draft tokens for each row (0 = plain decoding), asked
    every step; None keeps each proposer's own size (or the --num_speculative_tokens schedule).
    """
    if len(proposers) != len(prompts):
        raise ValueError(f"generate_batch: {len(proposers)} proposers for {len(prompts)} prompts (one per row)")
    stats = stats if stats is not None else [GenerationStats() for _ in prompts]
    if len(stats) != len(prompts) or len({id(p) for p in proposers}) != len(proposers):
        raise ValueError("generate_batch: one GenerationStats and one distinct proposer per prompt")
    start_time = _clock(target.device)
    eos = set(config.eos_token_ids if config.eos_token_ids is not None else target.eos_token_ids())
    generator = None
    if config.seed is not None:
        generator = torch.Generator(device=target.device).manual_seed(config.seed)
    indices = tuple(proposers[0].hidden_state_indices)
    if any(tuple(p.hidden_state_indices) != indices for p in proposers):
        raise ValueError("generate_batch: every row's proposer must read the same target hidden states")

    # 0. prefill: each prompt into its row of the target's cache; its last logits give the first new token
    prompts = [p.to(target.device) for p in prompts]
    if len(prompts) > 1:
        target.check_batch_memory([p.numel() for p in prompts], config.max_new_tokens)
    outs = target.prefill_rows(prompts, indices)
    committed, emitted = [], []
    for prompt, out, proposer, row_stats in zip(prompts, outs, proposers, stats, strict=True):
        prompt = target.check_prompt(prompt)
        emitted.append(next_token(out.logits[-1], config.sampling, generator))  # [1]
        committed.append(torch.cat([prompt, emitted[-1]]))  # [T + 1]; the last token is the next draft's root
        proposer.reset(prompt, out.hidden or None)
        row_stats.prompt_length, row_stats.new_tokens = prompt.numel(), 1
    for row_stats in stats:
        row_stats.prefill_time = row_stats.total_time = _clock(target.device) - start_time
    yield emitted
    lengths = [SpeculationLength(config.speculation) for _ in prompts]
    active = list(range(len(prompts)))  # rows still decoding, in the order of the target's batch rows
    while True:
        step_start = _clock(target.device)  # step time = draft + verify + overhead (everything else)
        going = []
        for b in active:
            reason = _stop_reason(int(emitted[b][-1]), stats[b].new_tokens, committed[b].numel(), eos, config,
                                  target.max_positions)
            if reason:
                stats[b].stop_reason = reason
                stats[b].total_time = step_start - start_time
            else:
                going.append(b)
        if not going:
            break
        if going != active:  # finished rows leave the batch: they stop costing compute
            target.select_rows([active.index(b) for b in going])
            active = going
        planned = size_for_batch(len(active)) if size_for_batch is not None else None
        if planned is not None and len(planned) != len(active):
            raise ValueError(f"planner returned {len(planned)} sizes for a batch of {len(active)} rows")
        budgets = []
        for i, b in enumerate(active):
            room = config.max_new_tokens if target.max_positions is None else target.max_positions - committed[b].numel()
            size = lengths[b].current if planned is None else planned[i]
            budgets.append(min(size, config.max_new_tokens - stats[b].new_tokens - 1, room))

        # 1. draft: a candidate tree per row, rooted at its last committed token
        t0 = _clock(target.device)
        drafts = []
        for b, budget in zip(active, budgets, strict=True):
            drafts.append(proposers[b].propose(committed[b], budget))
            _check_draft(drafts[-1], committed[b], budget)
        t1 = _clock(target.device)

        # 2. verify: every row's tree nodes in ONE target forward (per-row tree masks and position_ids)
        outs = target.forward_rows([d.tokens for d in drafts], [d.tree for d in drafts], indices)
        t2 = _clock(target.device)

        # 3. accept: per row, the longest acceptable path plus the target's own bonus token
        acceptances = [accept(d, out.logits, config.sampling, config.acceptance, generator)
                       for d, out in zip(drafts, outs, strict=True)]

        # 4. commit: keep each row's accepted path in the KV cache, emit its tokens (cut after an EOS)
        target.commit_rows([a.accepted_nodes for a in acceptances])
        emitted = [emitted[b][:0] for b in range(len(prompts))]
        for b, draft, acceptance in zip(active, drafts, acceptances, strict=True):
            tokens = torch.cat([draft.tokens[acceptance.accepted_nodes[1:]],
                                draft.tokens.new_tensor([acceptance.bonus_token])])  # [accepted_length]
            hits = [i for i, token in enumerate(tokens.tolist()) if token in eos]
            emitted[b] = tokens[:hits[0] + 1] if hits else tokens
            committed[b] = torch.cat([committed[b], emitted[b]])
        t3 = _clock(target.device)
        for b, draft, acceptance, out in zip(active, drafts, acceptances, outs, strict=True):
            proposers[b].on_accept(committed[b], draft, acceptance.accepted_nodes, out.hidden or None)
        t4 = _clock(target.device)

        draft_time, verify_time = (t1 - t0) + (t4 - t3), t2 - t1
        for b, draft, acceptance in zip(active, drafts, acceptances, strict=True):
            lengths[b].update(draft.tree.max_depth, acceptance.accepted_length - 1)
            stats[b].record(StepStats(accepted_length=emitted[b].numel(), drafted_depth=draft.tree.max_depth,
                                      drafted_nodes=draft.tree.num_nodes - 1, draft_time=draft_time,
                                      verify_time=verify_time,
                                      overhead_time=(t4 - step_start) - draft_time - verify_time))
            stats[b].new_tokens += emitted[b].numel()
            stats[b].total_time = t4 - start_time
        yield emitted
