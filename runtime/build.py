"""Build what a decode needs from the flat arguments (`runtime.config.GenerateArguments`): the target (always
through the load-time verify check and the weight-layout choice), its tokenizer, the drafter named by --method,
and prompt ids. The API, the CLI and every measurement tool build targets here.
"""

from __future__ import annotations

import sys

import torch

from heads.loading import load_model, load_tokenizer
from runtime.config import GenerateArguments
from runtime.cost_model import VerifyTable, describe_relative_costs, measure_step_costs
from runtime.layout import check_layout
from runtime.planner import DraftProfile
from runtime.proposers import Autoregressive, DraftModelProposer, PromptLookupProposer
from runtime.proposers.base import Proposer
from runtime.proposers.draft_model import check_same_vocabulary
from runtime.proposers.factory import hybrid_from_heads, proposer_from_heads
from runtime.target import SUPPORTED_ATTENTION, TargetModel
from runtime.verify_check import prepare_target


def load_target(args: GenerateArguments, log=None, use_cache: bool = True):
    """The target named by --model (and its tokenizer), loaded in `args.model_dtype()`, self-checked by the
    load-time verify check (cached; a refused model raises TargetError) and laid out by --weight_layout.
    Flags are checked before anything loads. Prints the dtype line to `log` (stderr). `use_cache=False` runs the
    check and the layout measurement afresh. Returns (TargetModel, tokenizer)."""
    log = log or sys.stderr
    if args.attn_implementation not in SUPPORTED_ATTENTION:
        raise ValueError(f"--attn_implementation {args.attn_implementation}: an attention backend that ignores "
                         f"custom masks cannot verify candidate trees; use one of {SUPPORTED_ATTENTION}")
    check_layout(args.weight_layout)
    args.decode_config()
    args.resolved_method()
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, dtype=args.model_dtype(), attn_implementation=args.attn_implementation,
                       device=args.device)
    target = prepare_target(model, layout=args.weight_layout, log=log, use_cache=use_cache)
    print(args.dtype_line(target.dtype), file=log)
    return target, tokenizer


def build_proposer(args: GenerateArguments, target: TargetModel, tokenizer) -> Proposer:
    """The proposer named by --method (loading --draft_model when needed)."""
    return build_drafter(args, target, tokenizer)[0]


def build_drafter(args: GenerateArguments, target: TargetModel, tokenizer) -> tuple[Proposer, DraftProfile | None]:
    """The proposer named by --method and, for heads with --tree_size auto, the planner's profile of it."""
    method = args.resolved_method()
    if method == "autoregressive":
        return Autoregressive(), None
    if target.mode == "plain":  # the load-time verify check allows no drafts for this model
        print(f"[verify] --method {method}: speculation off, the target runs plain decoding only", file=sys.stderr)
        return Autoregressive(), None
    if method == "prompt_lookup":
        costs = lookup_step_costs(target, args.speculation().max_speculative_tokens) \
            if args.draft_length() == "cost" else None
        return PromptLookupProposer(max_ngram=args.max_ngram, min_ngram=args.min_ngram, step_costs=costs), None
    if method == "hybrid":  # prompt lookup and the heads in one tree per step
        built = hybrid_from_heads(args.heads, target, args.heads_options(), sampling=args.decode_config().sampling,
                                  seed=args.seed, target_name=args.model, max_lookup=args.max_speculative_tokens,
                                  max_ngram=args.max_ngram, min_ngram=args.min_ngram)
        print(f"[hybrid] {built.description}", file=sys.stderr)
        return built.proposer, None
    if method == "heads":  # the head config's kind picks Medusa / EAGLE / EAGLE-3 / MTP; auto size measured here
        built = proposer_from_heads(args.heads, target, args.heads_options(), sampling=args.decode_config().sampling,
                                    seed=args.seed, target_name=args.model)
        print(f"[heads] {built.description}", file=sys.stderr)
        return built.proposer, built.profile()
    draft_tokenizer = load_tokenizer(args.draft_model)
    check_same_vocabulary(tokenizer, draft_tokenizer)
    draft = load_model(args.draft_model, dtype=target.dtype, attn_implementation=args.attn_implementation,
                       device=args.device)
    draft_mode = prepare_target(draft, flag="--draft_model").mode  # the draft model gets the same self-check
    return DraftModelProposer(draft, target_vocab_size=target.vocab_size, sampling=args.decode_config().sampling,
                              branching=args.branching() if target.mode == draft_mode == "tree" else (),
                              seed=args.seed, mode=draft_mode), None


def lookup_step_costs(target: TargetModel, max_tokens: int) -> VerifyTable:
    """Prompt lookup's cost-aware length: the device's verify cost for 1..max_tokens + 1 tokens relative to a plain
    step, at the KV lengths the guard and the hybrid measure (256, 1,024, 2,048, interpolated to each step's KV
    length; measured once per model / device / dtype and cached; `runtime.cost_model`), printed."""
    costs = measure_step_costs(target, max_tokens + 1)
    by_kv = "; ".join(f"KV {kv}: {describe_relative_costs(curve.relative_to_plain(max_tokens + 1))}"
                      for kv, curve in zip(costs.kv_lengths, costs.curves, strict=True))
    print(f"[prompt lookup] draft length per step by cost at the sequence's KV length; verify cost vs a plain step "
          f"{by_kv}", file=sys.stderr)
    return VerifyTable(costs)


def encode_prompt(tokenizer, prompt: str | list[dict[str, str]]) -> torch.Tensor:
    """Prompt text (or a conversation [{role, content}, ...] ending in a user turn) -> ids [T], through the chat
    template when the tokenizer has one (else the turns' texts joined by newlines)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    return torch.tensor(tokenizer("\n".join(m["content"] for m in messages))["input_ids"], dtype=torch.long)
