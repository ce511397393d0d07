"""The verify cost curve of a target on this device (runtime.cost_model), and the Medusa tree size auto would pick.

Any HF causal LM, or a random-weight Llama-3-8B-shaped model built on the device (no download; timing does not
depend on the weights):

    python -m bench.cost_curve --model ../shared/models/smollm2-135m-instruct --kv_length 256 --max_tokens 64
    python -m bench.cost_curve --random_llama3_8b --device cuda --dtype bfloat16 --kv_length 1024 \\
        --max_tokens 256 --output outputs/bench/verify_cost_llama3_8b.json --plot outputs/bench/verify_cost.png

Either target goes through the load-time verify check and the weight-layout choice first (a --model through
bench.common.load_target, the random model through runtime.verify_check.prepare_target), as every decode does.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import yaml
from transformers import AutoModelForCausalLM, LlamaConfig

from bench.common import load_target
from bench.report import pyplot, save_figure, write_json
from heads.cli import parse_flags, run_cli
from heads.loading import describe_dtype, resolve_dtype
from runtime.cost_model import CostCurve, verify_cost_curve
from runtime.layout import LAYOUT_HELP
from runtime.planner import choose_tree_size
from runtime.tree_search import expected_accepted_lengths
from runtime.verify_check import prepare_target


@dataclass
class CostCurveArgs:
    """Flags of `python -m bench.cost_curve`."""

    model: str = field(default="", metadata={"help": "target (Hub id, directory or GGUF); or --random_llama3_8b"})
    random_llama3_8b: bool = field(default=False, metadata={
        "help": "build a random-weight Llama-3-8B-shaped model on --device (no download)"})
    device: str = field(default="cpu", metadata={"help": "cpu or cuda"})
    weight_layout: str = field(default="auto", metadata={"help": LAYOUT_HELP})
    dtype: str = field(default="auto", metadata={"help": "auto (bfloat16 where fast, float32 elsewhere) / float32 / "
                                                "bfloat16 / float16; curves are cached per dtype"})
    kv_length: int = field(default=1024, metadata={"help": "committed tokens in the KV cache before the verify"})
    max_tokens: int = field(default=256, metadata={"help": "largest verify size (root + tree nodes)"})
    repeats: int = field(default=7, metadata={"help": "timed repeats per size (median reported; sizes up to 8 run 3x as often)"})
    accuracy: str = field(default="configs/trees/medusa_default_32.yaml", metadata={
        "help": "tree file whose 'accuracy' table gives E[tau(n)] for the auto choice printed at the end"})
    output: str = field(default="", metadata={"help": "JSON file for the curve and the auto choice"})
    plot: str = field(default="", metadata={"help": "PNG of time and relative cost vs tree tokens"})
    no_cache: bool = field(default=False, metadata={"help": "measure afresh: the curve, the verify check and the layout"})
    num_threads: int = field(default=1, metadata={"help": "torch CPU threads"})


def random_llama3_8b(device: str, dtype: torch.dtype):
    """Llama-3-8B shapes (32 layers, hidden 4096, GQA 32/8, FFN 14336, vocab 128256) with random weights,
    initialised directly on `device` (~16 GB in bf16)."""
    config = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                         rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    config._name_or_path = "random-llama3-8b-shape"
    with torch.device(device):  # weights are initialised on the device itself: no host copy, no download
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def plot_curve(curve: CostCurve, path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].plot(curve.tokens, [s * 1000 for s in curve.seconds], marker="o", linestyle="", label="median")
    ax[0].plot(curve.tokens, [s * 1000 for s in curve.fitted], label="isotonic fit")
    ax[0].legend()
    ax[0].set(xlabel="tree tokens per verify forward", ylabel="ms (median)", xscale="log",
              title=f"{curve.model}\n{curve.device}, {curve.dtype}, KV {curve.kv_length}")
    ax[1].plot(curve.tokens, curve.relative(), marker="o")
    ax[1].set(xlabel="tree tokens per verify forward", ylabel="cost / 1-token forward", xscale="log")
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    args = parse_flags(CostCurveArgs, argv)
    torch.set_num_threads(args.num_threads)
    if args.random_llama3_8b == bool(args.model):
        raise ValueError("pass exactly one of --model or --random_llama3_8b")
    if args.random_llama3_8b:
        model = random_llama3_8b(args.device, resolve_dtype(args.dtype, args.device))
        print(describe_dtype(model.dtype, args.dtype, args.device), file=sys.stderr)
        target = prepare_target(model, use_cache=not args.no_cache, layout=args.weight_layout)
    else:
        target, _ = load_target(model=args.model, dtype=args.dtype, device=args.device,
                                weight_layout=args.weight_layout, use_cache=not args.no_cache)
    curve = verify_cost_curve(target, args.kv_length, args.max_tokens, args.repeats, use_cache=not args.no_cache)
    result: dict = {"curve": asdict(curve), "fitted": curve.fitted, "relative": curve.relative()}
    print(f"{curve.model} on {curve.device} ({curve.dtype}, KV {curve.kv_length}):")
    for q, s, f, r in zip(curve.tokens, curve.seconds, curve.fitted, result["relative"], strict=True):
        print(f"  {q:4d} tokens  median {s * 1000:9.3f} ms  fitted {f * 1000:9.3f} ms  x{r:5.2f}")
    if args.accuracy:
        table = yaml.safe_load(Path(args.accuracy).read_text())["accuracy"]
        taus = expected_accepted_lengths(table, args.max_tokens - 1)
        choice = choose_tree_size(range(len(taus)), lambda n: taus[n], curve.seconds_at)
        best = choice.rows[choice.size]
        print(f"auto tree size (Medusa table of {args.accuracy}): {choice.size} nodes, E[tau] "
              f"{best['expected_tau']:.2f}, {best['tokens_per_second']:.1f} tokens/s expected "
              f"(plain: {1 / curve.seconds_at(1):.1f})")
        result["auto"] = {"accuracy_table": args.accuracy, "size": choice.size, "rows": choice.rows}
    if args.output:
        write_json(args.output, result, indent=1)
    if args.plot:
        plot_curve(curve, args.plot)
    return result


if __name__ == "__main__":
    run_cli(main)
