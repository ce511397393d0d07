"""Draft time per step of every head kind next to one plain decode step, and draft-vocabulary coverage.

    python -m bench.draft_cost --model ../shared/models/smollm2-135m-instruct --output_json dc.json

Heads are random-initialised with the target's geometry (timing does not depend on the weights). For each kind
(Medusa with own projections / with the shared target LM head, EAGLE-2 dynamic tree depth 5 top-k 8, EAGLE-1
chain, EAGLE-3 dynamic tree, MTP chain, DFlash and P-EAGLE chains: one drafter forward for the whole block, 2 layers;
DFlash's block is 8 slots, or size + 1 when larger), each draft size and each draft-vocabulary size, it times
`proposer.propose` (runtime.cost_model.DraftTimer: median of 3 on a random context of --kv_length
tokens) and one plain decode step (runtime.cost_model, 1 token at the same context length).

Coverage (--counts_prompts, --coverage_prompts): the draft vocabulary of size N is counted on the assistant
answers of a ShareGPT file (tokenised with the target's tokenizer); its coverage is the share of the target's
own greedy tokens on MT-Bench first-turn answers that fall inside it (a token outside it cannot be drafted).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.common import load_target
from bench.report import write_json
from heads import HeadsConfig, build_heads
from heads.cli import parse_flags, run_cli
from heads.draft_vocab import build_vocab_mapping, count_tokens, coverage
from runtime.cost_model import DraftTimer, verify_cost_curve
from runtime.proposers.eagle import DynamicTreeConfig, EagleProposer
from runtime.proposers.eagle3 import Eagle3Proposer
from runtime.proposers.factory import default_table
from runtime.proposers.medusa import MedusaProposer
from runtime.proposers.mtp import MTPProposer
from runtime.proposers.parallel import DFlashProposer, PEagleProposer
from runtime.tree_search import grow_tree, static_tree

KINDS = ("medusa", "medusa_shared", "eagle2", "eagle1_chain", "eagle3", "mtp", "dflash", "peagle")
HEAD_OPTIONS = {"medusa": ("medusa", dict(medusa_num_heads=4)),
                "medusa_shared": ("medusa", dict(medusa_num_heads=4, medusa_shared_lm_head=True)),
                "eagle2": ("eagle", {}), "eagle1_chain": ("eagle", {}), "eagle3": ("eagle3", {}),
                "mtp": ("mtp", dict(mtp_num_depths=4)),
                "dflash": ("dflash", dict(num_draft_layers=2)), "peagle": ("peagle", dict(num_draft_layers=2))}


@dataclass
class DraftCostArgs:
    model: str = field(default="../shared/models/smollm2-135m-instruct", metadata={"help": "Target model."})
    dtype: str = field(default="auto", metadata={"help": "auto (bf16 where fast, else fp32), float32, bfloat16."})
    kinds: str = field(default=",".join(KINDS), metadata={"help": f"Comma-separated subset of {KINDS}."})
    sizes: str = field(default="1,2,4,8", metadata={"help": "Draft sizes (tokens per step)."})
    vocab_sizes: str = field(default="2048,4096,8192,16384,0", metadata={"help": "Draft vocabulary sizes; 0 = full."})
    kv_length: int = field(default=256, metadata={"help": "Context length of the timed steps."})
    counts_prompts: str = field(default="../shared/data/sharegpt_sample.jsonl", metadata={
        "help": "ShareGPT JSONL whose assistant ('gpt') answers are counted for the draft vocabulary."})
    coverage_prompts: str = field(default="../shared/data/mt_bench_question.jsonl", metadata={
        "help": "MT-Bench JSONL: the target's greedy first-turn answers measure coverage ('' to skip)."})
    coverage_max_prompts: int = field(default=16, metadata={"help": "MT-Bench questions answered for coverage (one batch)."})
    coverage_new_tokens: int = field(default=128, metadata={"help": "Greedy tokens per MT-Bench answer."})
    num_draft_layers: int = field(default=2, metadata={"help": "Decoder layers of the DFlash / P-EAGLE drafters."})
    output_json: str = field(default="", metadata={"help": "Write the results here (JSON)."})


def sharegpt_counts(path: str, tokenizer, vocab_size: int) -> torch.Tensor:
    """Token counts [V] of the assistant answers of a ShareGPT JSONL file."""
    answers = []
    for line in Path(path).read_text().split("\n"):
        row = json.loads(line) if line.strip() else {}
        answers += [turn["value"] for turn in row.get("conversations", []) if turn.get("from") == "gpt"]
    ids = tokenizer(answers, add_special_tokens=False)["input_ids"]
    return count_tokens(ids, vocab_size)


@torch.inference_mode()
def greedy_answer_counts(model, tokenizer, path: str, max_prompts: int, new_tokens: int) -> torch.Tensor:
    """Token counts [V] of the target's greedy answers (up to EOS) to the first turns of an MT-Bench file,
    generated as one left-padded batch."""
    questions = [json.loads(line)["turns"][0] for line in Path(path).read_text().split("\n") if line.strip()]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=False) for q in questions[:max_prompts]]
    tokenizer.padding_side = "left"
    eos = tokenizer.eos_token_id
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(**batch, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    counts = torch.zeros(model.get_output_embeddings().weight.shape[0], dtype=torch.int64)
    for row in out[:, batch["input_ids"].shape[1]:]:
        ends = (row == eos).nonzero()
        counts += torch.bincount(row[: int(ends[0]) if ends.numel() else row.numel()], minlength=counts.numel())
    return counts


def build_proposer(kind: str, model, size: int, counts: torch.Tensor, vocab_size: int, num_draft_layers: int = 2):
    """A random-weight proposer of `kind` drafting `size` tokens over the `vocab_size` most counted ids (0: full)."""
    head_kind, options = HEAD_OPTIONS[kind]
    if head_kind in ("dflash", "peagle"):
        options = dict(options, num_draft_layers=num_draft_layers)
    if head_kind in ("eagle3", "peagle"):
        options = dict(options, draft_vocab_size=vocab_size or counts.numel())
    if head_kind in ("dflash", "peagle"):
        options = dict(options, block_size=max(size + 1, 8) if head_kind == "dflash" else max(size, 2))
    config = HeadsConfig.for_target(head_kind, model, "draft-cost", **options)
    torch.manual_seed(0)
    heads = build_heads(config).to(model.dtype).eval()
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.02)
    if vocab_size:
        heads.set_vocab_mapping(*build_vocab_mapping(counts, vocab_size))
    if head_kind in ("dflash", "peagle"):
        chain = static_tree([[0] * d for d in range(1, size + 1)], num_heads=heads.config.draft_tokens)
        return (DFlashProposer if head_kind == "dflash" else PEagleProposer)(heads, model, chain)
    if kind.startswith("medusa"):
        tree = static_tree(grow_tree(default_table(heads.num_heads), size), "grown tree", num_heads=heads.num_heads)
        return MedusaProposer(heads, model, tree)
    if kind == "mtp":
        return MTPProposer(heads, model, min(size, heads.num_depths))
    cls = Eagle3Proposer if kind == "eagle3" else EagleProposer
    if kind == "eagle1_chain":
        return cls(heads, model, tree=static_tree([[0] * d for d in range(1, size + 1)]))
    return cls(heads, model, dynamic=DynamicTreeConfig(depth=5, top_k=8, total_tokens=size))


def main(argv: list[str] | None = None) -> dict:
    torch.set_num_threads(1)
    args = parse_flags(DraftCostArgs, argv)
    # the weights as loaded (rows): the timings are those of the model as transformers lays it out
    target, tokenizer = load_target(model=args.model, dtype=args.dtype, weight_layout="rows", log=sys.stdout)
    model = target.model
    vocab = model.get_output_embeddings().weight.shape[0]
    counts = sharegpt_counts(args.counts_prompts, tokenizer, vocab)
    vocab_sizes = [int(v) for v in args.vocab_sizes.split(",")]
    result: dict = {"model": args.model, "dtype": str(model.dtype), "kv_length": args.kv_length,
                    "num_draft_layers": args.num_draft_layers,
                    "counted_tokens": int(counts.sum())}
    if args.coverage_prompts:
        answers = greedy_answer_counts(model, tokenizer, args.coverage_prompts, args.coverage_max_prompts,
                                       args.coverage_new_tokens)
        shares = coverage(counts, [v or vocab for v in vocab_sizes], answers)
        result["coverage"] = {str(v or vocab): s for v, s in shares.items()}
        result["coverage_tokens"] = int(answers.sum())
        print(f"coverage of {int(answers.sum())} greedy MT-Bench answer tokens: "
              + ", ".join(f"{v}: {s:.1%}" for v, s in shares.items()))
    plain = verify_cost_curve(target, kv_length=args.kv_length, max_tokens=2, repeats=9, use_cache=False).seconds_at(1)
    result["plain_step_ms"] = plain * 1e3
    print(f"plain decode step at KV {args.kv_length}: {plain * 1e3:.2f} ms")
    timers: dict[tuple[int, ...], DraftTimer] = {}
    rows = []
    for kind in args.kinds.split(","):
        for size in (int(s) for s in args.sizes.split(",")):
            row = {"kind": kind, "size": size}
            for vocab_size in vocab_sizes:
                proposer = build_proposer(kind, model, size, counts, vocab_size, args.num_draft_layers)
                indices = tuple(proposer.hidden_state_indices)
                if indices not in timers:
                    timers[indices] = DraftTimer(target, args.kv_length, indices)
                seconds = timers[indices].seconds(proposer)
                row[str(vocab_size or vocab)] = seconds * 1e3
            rows.append(row)
            print(f"{kind:14s} size {size}: " + ", ".join(
                f"V={v or vocab} {row[str(v or vocab)]:.2f} ms ({row[str(v or vocab)] / (plain * 1e3):.0%})"
                for v in vocab_sizes), flush=True)
    result["draft_ms"] = rows
    if args.output_json:
        write_json(args.output_json, result)
    return result


if __name__ == "__main__":
    run_cli(main)
