"""The Python API, in the Hugging Face style: load a target with its drafter in one call, then `generate`.

    from runtime.api import SpeculativeModel

    model = SpeculativeModel.from_pretrained("../shared/models/smollm2-135m-instruct", heads="outputs/heads/eagle")
    out = model.generate("Write a haiku about the sea.", max_new_tokens=64)    # -> GenerationOutput
    print(out.text, out.stats.tau)
    outs = model.generate(["First prompt", "Second prompt"], max_new_tokens=64)  # batched: list of outputs
    ids = model.generate(torch.tensor([1, 2, 3]), max_new_tokens=8).token_ids    # input ids in, ids out
    for piece in model.stream("Tell me a story."):                               # one sequence, text pieces
        print(piece, end="", flush=True)

Drafters: `heads=` (Medusa / EAGLE-1/2 / EAGLE-3 / MTP, picked from their config), `draft_model=`, or
`method="prompt_lookup"` (the default without heads or draft model) / `"autoregressive"`. Any other keyword
of `runtime.config.GenerateArguments` (the flags of `python -m runtime.generate`: tree_size, tree_depth,
dtype, exact, device, ...) is accepted by `from_pretrained`; the options of one call (`max_new_tokens`,
`do_sample`, `temperature`, `top_p`, `top_k`, `eos_token_id`, `seed`, `acceptance`) by `generate` /
`stream`, or as a `SpecGenerationConfig`.

Batches: a list of prompts decodes together (runtime/loop.generate_batch): each row drafts its own tree,
all rows are verified in one target forward. With heads and `tree_size="auto"`, the planner
(runtime/planner.py) sizes the drafts per batch size from the heads' measured accuracy and the verify cost
over rows x tokens measured on this device, down to plain decoding when the batch fills the hardware. A target
whose load-time verify check allows no tree attention decodes a list one prompt at a time.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace

import torch

from runtime.build import build_drafter, encode_prompt, load_target
from runtime.config import DecodeConfig, GenerateArguments
from runtime.cost_model import batch_cost_curve
from runtime.loop import GenerationStats, generate_batch
from runtime.planner import BatchPlanner, DraftProfile
from runtime.proposers.base import Proposer, per_row
from runtime.sampling import SamplingConfig
from runtime.target import TargetModel


@dataclass(frozen=True)
class SpecGenerationConfig:
    """The options of one generate call (as transformers' GenerationConfig names them)."""

    max_new_tokens: int = 128
    do_sample: bool = False
    temperature: float = 1.0  # used when do_sample
    top_p: float = 1.0
    top_k: int = 0
    eos_token_id: int | list[int] | None = None  # None: the model's generation_config; [] never stops early
    seed: int | None = 0
    acceptance: str = "rejection"  # greedy / typical (lossy) / rejection (lossless)

    def decode_config(self, base: DecodeConfig) -> DecodeConfig:
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"temperature: do_sample=True needs a temperature > 0, got {self.temperature}")
        sampling = SamplingConfig(temperature=self.temperature if self.do_sample else 0.0, top_k=self.top_k,
                                  top_p=self.top_p)
        eos = self.eos_token_id
        eos = None if eos is None else tuple([eos] if isinstance(eos, int) else eos)
        return replace(base, max_new_tokens=self.max_new_tokens, sampling=sampling, acceptance=self.acceptance,
                       eos_token_ids=eos, seed=self.seed)


@dataclass
class GenerationOutput:
    """One sequence's result: new token ids, their text (None when the input was token ids) and stats."""

    token_ids: list[int]
    text: str | None
    stats: GenerationStats


class SpeculativeModel:
    """A target model with its drafter; `generate` / `stream` run the one decode loop."""

    def __init__(self, target: TargetModel, tokenizer, proposer: Proposer, args: GenerateArguments,
                 profile: DraftProfile | None = None):
        self.target = target
        self.tokenizer = tokenizer
        self.proposer = proposer
        self.args = args
        self.profile = profile  # what the planner sizes batches from (heads with tree_size auto), else None
        self._planner: BatchPlanner | None = None
        self._planner_sizes: list[int] = []

    @classmethod
    def from_pretrained(cls, model: str, **options) -> SpeculativeModel:
        """model: Hub id, local directory or .gguf file; options: fields of GenerateArguments (heads=...,
        draft_model=..., method=..., tree_size=..., dtype=..., device=...). Unknown options are an error."""
        known = {f.name for f in fields(GenerateArguments)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"from_pretrained: unknown options {unknown}; known: {sorted(known - {'model'})}")
        return cls.from_args(GenerateArguments(model=model, **options))

    @classmethod
    def from_args(cls, args: GenerateArguments) -> SpeculativeModel:
        target, tokenizer = load_target(args)
        proposer, profile = build_drafter(args, target, tokenizer)
        return cls(target, tokenizer, proposer, args, profile)

    # ------------------------------------------------------------------------------------------ generation

    def _config(self, config: SpecGenerationConfig | None, options: dict) -> DecodeConfig:
        config = replace(config or SpecGenerationConfig(max_new_tokens=self.args.max_new_tokens), **options)
        return config.decode_config(self.args.decode_config())

    def _encode(self, prompt: str | list[dict[str, str]] | torch.Tensor | list[int], index: int | None = None):
        where = "" if index is None else f" {index}"
        if isinstance(prompt, torch.Tensor) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
            ids = torch.as_tensor(prompt, dtype=torch.long)
            return ids[0] if ids.ndim == 2 and ids.shape[0] == 1 else ids, False
        if isinstance(prompt, str) and not prompt.strip():
            raise ValueError(f"prompt{where}: empty text; a prompt needs at least one token")
        return encode_prompt(self.tokenizer, prompt), True

    def planner(self, rows: int) -> BatchPlanner | None:
        """The per-batch size choice (heads with tree_size auto on a tree-mode target). The verify cost is measured
        (and cached on disk) at batch sizes 1, 2, 4, ... up to the first power of two >= rows, on first need."""
        if self.profile is None or self.target.mode != "tree":
            return None
        needed = 1 << (rows - 1).bit_length()
        if self._planner is None or max(self._planner_sizes) < needed:
            self._planner_sizes = [1 << i for i in range(needed.bit_length())]
            cost = batch_cost_curve(self.target, self._planner_sizes, kv_length=self.args.heads_options().cost_kv_length,
                                    max_tokens=max(self.profile.sizes, default=0) + 1)
            self._planner = BatchPlanner(self.profile, cost.seconds)
            print(f"[planner] {self._planner.describe(self._planner_sizes)}", file=sys.stderr)
        return self._planner

    def _run(self, prompts: list, config: DecodeConfig, stats: list[GenerationStats]) -> Iterator[list[torch.Tensor]]:
        proposers = per_row(self.proposer, len(prompts))
        planner = self.planner(len(prompts)) if len(prompts) > 1 else None
        return generate_batch(self.target, proposers, prompts, config, stats, planner)

    def generate(self, inputs, config: SpecGenerationConfig | None = None,
                 **options) -> GenerationOutput | list[GenerationOutput]:
        """inputs: a prompt (text, or a conversation [{role, content}, ...]), token ids ([T] tensor or list of
        ints), or a list of prompts (batched; returns a list). Options override `config` field by field."""
        decode = self._config(config, options)
        if isinstance(inputs, list) and not inputs:
            raise ValueError("inputs: an empty list of prompts")
        batched = isinstance(inputs, list) and not all(isinstance(t, int) for t in inputs) and \
            not (inputs and isinstance(inputs[0], dict))
        items = inputs if batched else [inputs]
        encoded = [self._encode(item, i if batched else None) for i, item in enumerate(items)]
        prompts = [ids for ids, _ in encoded]
        stats = [GenerationStats() for _ in prompts]
        tokens: list[list[int]] = [[] for _ in prompts]
        groups = [list(range(len(prompts)))] if self.target.mode == "tree" else [[i] for i in range(len(prompts))]
        for group in groups:  # one batch, or one prompt at a time for a target without tree attention
            for step in self._run([prompts[i] for i in group], decode, [stats[i] for i in group]):
                for i, new in zip(group, step, strict=True):
                    tokens[i].extend(new.tolist())
        outputs = [GenerationOutput(ids, self.tokenizer.decode(ids, skip_special_tokens=True) if is_text else None, s)
                   for ids, (_, is_text), s in zip(tokens, encoded, stats, strict=True)]
        return outputs if batched else outputs[0]

    def stream(self, prompt, config: SpecGenerationConfig | None = None, stats: GenerationStats | None = None,
               **options) -> Iterator[str]:
        """Text pieces of one sequence as each step commits them (multi-byte characters held back until
        complete); pass `stats` to read tau, tokens/s and per-depth acceptance afterwards."""
        decode = self._config(config, options)
        ids, _ = self._encode(prompt)
        stats = stats if stats is not None else GenerationStats()
        generated: list[int] = []
        printed = ""
        for step in self._run([ids], decode, [stats]):
            generated.extend(step[0].tolist())
            text = self.tokenizer.decode(generated, skip_special_tokens=True)
            if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                yield text[len(printed):]
                printed = text
