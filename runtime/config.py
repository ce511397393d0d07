"""Generation and speculation settings: the loop's config and the flat CLI arguments of runtime.generate."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from heads.loading import describe_dtype
from runtime.sampling import SamplingConfig

ACCEPTANCE_RULES = ("greedy", "typical", "rejection")
METHODS = ("autoregressive", "prompt_lookup", "draft_model", "heads", "hybrid")
HEADS_BUDGET = 1024  # with --heads the proposer sizes its own drafts (--tree_size); the loop only caps them


@dataclass(frozen=True)
class SpeculationConfig:
    """How many tokens the proposer may draft per step.

    Fixed: always `num_speculative_tokens`. Adaptive (`adaptive=True`, CLI `--num_speculative_tokens auto`),
    the schedule of transformers' assisted generation ("heuristic"): start at `num_speculative_tokens`;
    after a step where every drafted token was accepted grow by 2, otherwise shrink by 1, kept within
    [min_speculative_tokens, max_speculative_tokens].
    """

    num_speculative_tokens: int = 5
    adaptive: bool = False
    min_speculative_tokens: int = 1
    max_speculative_tokens: int = 16

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 0:
            raise ValueError(f"--num_speculative_tokens must be an int >= 0, 'auto' or 'cost', got "
                             f"{self.num_speculative_tokens}")
        if not 0 <= self.min_speculative_tokens <= self.max_speculative_tokens:
            raise ValueError("--min_speculative_tokens/--max_speculative_tokens: need 0 <= min <= max, got "
                             f"{self.min_speculative_tokens}, {self.max_speculative_tokens}")


class SpeculationLength:
    """The current draft budget k, updated after each step per `SpeculationConfig`."""

    def __init__(self, config: SpeculationConfig):
        self.config = config
        self.current = config.num_speculative_tokens
        if config.adaptive:
            self.current = min(max(self.current, config.min_speculative_tokens), config.max_speculative_tokens)

    def update(self, num_drafted: int, num_accepted: int) -> None:
        """num_drafted: draft depth offered this step; num_accepted: drafted tokens accepted (bonus excluded)."""
        if not self.config.adaptive or num_drafted == 0:
            return
        step = 2 if num_accepted == num_drafted else -1
        self.current = min(max(self.current + step, self.config.min_speculative_tokens),
                           self.config.max_speculative_tokens)


@dataclass(frozen=True)
class DecodeConfig:
    """Everything the decode loop needs besides the models and the prompt."""

    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    acceptance: str = "rejection"  # greedy / typical (lossy) / rejection; greedy sampling -> exact match
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    eos_token_ids: tuple[int, ...] | None = None  # None: the target's generation_config; (): never stop early
    seed: int | None = None  # seeds the generator used for sampling and acceptance

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise ValueError(f"--max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        if self.acceptance not in ACCEPTANCE_RULES:
            raise ValueError(f"--acceptance must be one of {ACCEPTANCE_RULES}, got {self.acceptance!r}")


EAGLE_TREES = ("dynamic", "static")


AUTO_DEPTHS = (2, 3, 4, 5, 6)
AUTO_TOP_KS = (2, 4, 8)


def _int_or_auto(value: str | int, flag: str, grid: tuple[int, ...]) -> list[int]:
    if str(value) == "auto":
        return list(grid)
    if not re.fullmatch(r"\d+", str(value)) or int(value) < 1:
        raise ValueError(f"{flag} must be 'auto' or an int >= 1, got {value!r}")
    return [int(value)]


@dataclass(frozen=True)
class HeadsOptions:
    """How to draft with trained heads (flat; the CLIs expose each field as a flag)."""

    tree_size: str = "auto"  # "auto" or an int (Medusa nodes / EAGLE-2 total_tokens / chain length)
    tree: str = ""  # static tree YAML (Medusa; EAGLE with eagle_tree="static"); fixes the size
    eagle_tree: str = "dynamic"  # EAGLE/EAGLE-3: "dynamic" (EAGLE-2) or "static" (EAGLE-1: --tree or a chain)
    tree_depth: str = "5"  # EAGLE-2 expansion depth, or "auto" (tried: 2..6)
    tree_top_k: str = "8"  # EAGLE-2 children per expanded node and nodes per level, or "auto" (2, 4, 8)
    max_tree_size: int = 64  # largest size `auto` considers
    cost_kv_length: int = 256  # context length at which the verify cost is measured
    allow_off: bool = True  # auto may turn speculation off when plain decoding is predicted faster
    # EAGLE-2 under the guard or in the hybrid: a step whose root children cannot expect the step's cost back drafts
    # nothing further (runtime.proposers.eagle: min_expected); a declined step is charged on the ledger. On by default
    # since declined steps are charged (docs/drafters.md#the-confidence-gate)
    confidence_gate: bool = True

    def __post_init__(self) -> None:
        if self.eagle_tree not in EAGLE_TREES:
            raise ValueError(f"--eagle_tree must be one of {EAGLE_TREES}, got {self.eagle_tree!r}")
        if self.fixed_size is not None and self.fixed_size < 1:
            raise ValueError(f"--tree_size must be 'auto' or an int >= 1, got {self.tree_size!r}")
        if self.max_tree_size < 1:
            raise ValueError(f"--max_tree_size must be >= 1, got {self.max_tree_size}")
        self.depth_grid()
        self.top_k_grid()

    def depth_grid(self) -> list[int]:
        """--tree_depth N -> [N]; auto -> the depths the auto choice tries."""
        return _int_or_auto(self.tree_depth, "--tree_depth", AUTO_DEPTHS)

    def top_k_grid(self) -> list[int]:
        """--tree_top_k K -> [K]; auto -> the top_k values the auto choice tries."""
        return _int_or_auto(self.tree_top_k, "--tree_top_k", AUTO_TOP_KS)

    @property
    def fixed_size(self) -> int | None:
        """None for 'auto', else the int size (ValueError naming --tree_size for anything else)."""
        if str(self.tree_size) == "auto":
            return None
        if not re.fullmatch(r"\d+", str(self.tree_size)):
            raise ValueError(f"--tree_size must be 'auto' or an int >= 1, got {self.tree_size!r}")
        return int(self.tree_size)


@dataclass
class GenerateArguments:
    """Flags of `python -m runtime.generate` (flat; parsed with transformers.HfArgumentParser)."""

    model: str = field(default="../shared/models/smollm2-135m-instruct",
                       metadata={"help": "target: Hub id, local directory or .gguf file"})
    prompt: str = field(default="Write a short story about a robot who learns to paint.",
                        metadata={"help": "user message (chat template applied when the tokenizer has one)"})
    method: str = field(default="prompt_lookup", metadata={"help": f"drafter: one of {METHODS}; "
                                                           "--draft_model alone implies draft_model"})
    draft_model: str | None = field(default=None, metadata={"help": "draft model (same tokenizer as --model)"})
    heads: str | None = field(default=None, metadata={"help": "trained heads (directory or Hub id; Medusa, EAGLE, "
                                                      "EAGLE-3 or MTP, picked from their config); implies --method heads"})
    tree_size: str = field(default="auto", metadata={"help": "heads: draft tokens per step (Medusa tree nodes, "
                                                      "EAGLE-2 total_tokens, chain length) or 'auto' (cost model)"})
    tree: str = field(default="", metadata={"help": "heads: static tree YAML (configs/trees/*.yaml) for Medusa, "
                                            "or EAGLE with --eagle_tree static"})
    eagle_tree: str = field(default="dynamic", metadata={"help": "EAGLE/EAGLE-3: dynamic (EAGLE-2) or static "
                                                         "(EAGLE-1: --tree FILE, else a chain)"})
    tree_depth: str = field(default="5", metadata={"help": "EAGLE-2: expansion depth, or 'auto'"})
    tree_top_k: str = field(default="8", metadata={"help": "EAGLE-2: children per expanded node / nodes per level, "
                                                   "or 'auto'"})
    confidence_gate: bool = field(default=True, metadata={"help": "EAGLE-2 guarded or in the hybrid: a step whose "
                                  "root children cannot expect the step's cost back in accepted tokens drafts nothing "
                                  "(false: draft the whole tree whenever the guard or the hybrid drafts)"})
    max_tree_size: int = field(default=64, metadata={"help": "heads: largest size --tree_size auto considers"})
    max_new_tokens: int = field(default=128, metadata={"help": "stop after this many new tokens"})
    temperature: float = field(default=0.0, metadata={"help": "0 = greedy"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling mass (1 = off)"})
    top_k: int = field(default=0, metadata={"help": "keep the k most likely tokens (0 = off)"})
    acceptance: str = field(default="rejection", metadata={"help": f"acceptance rule: {ACCEPTANCE_RULES}"})
    num_speculative_tokens: str = field(default="", metadata={
        "help": "draft length k per step; 'auto' (grow by 2 when all accepted, else shrink by 1); or 'cost' (prompt "
                "lookup: per step the length that pays for its verify on this device, from the measured verify cost "
                "curve and the acceptance learned so far; 0 = a plain step). Default: cost for prompt lookup, 5 "
                "for a draft model"})
    max_speculative_tokens: int = field(default=16, metadata={"help": "upper bound for 'auto' and 'cost'; hybrid: "
                                                              "the longest prompt-lookup chain it adds to the head's"})
    draft_tree_branching: str = field(default="", metadata={"help": "draft-model tree: comma-separated top-b "
                                                            "children per depth, e.g. '2,2' (empty = chain)"})
    max_ngram: int = field(default=3, metadata={"help": "prompt lookup: longest n-gram to match"})
    min_ngram: int = field(default=1, metadata={"help": "prompt lookup: shortest n-gram to match"})
    dtype: str = field(default="auto", metadata={"help": "auto (bfloat16 on CUDA and on CPUs with AVX512-BF16 or "
                                                "AMX, float32 elsewhere) / float32 / bfloat16 / float16 / float64"})
    exact: bool = field(default=False, metadata={"help": "force float32, where greedy output is token-identical to "
                                                 "plain greedy decoding (overrides --dtype)"})
    weight_layout: str = field(default="auto", metadata={
        "help": "CPU memory layout of the target's Linear weights: auto (measured: transposed storage where its "
                "1-token step is at least 5 percent faster, plus a oneDNN-packed copy for products of N+ rows from "
                "the verify size (2/3/4/8) where packing wins from there on, or panels where they win; cached), "
                "rows (as loaded), transposed, rows+packed or transposed+packed (from 2 rows), ...+packedN (from "
                "N rows), rows+panels or transposed+panels (our compiled kernel: float32 weights for 1-16 rows, "
                "bfloat16 weights, or float32 ones that are all bf16 values, for every row count; auto takes it "
                "where it is faster), ...+panels_bf16 (float32 weights rounded to bfloat16 in the panels: half the "
                "bytes, activations stay float32; explicit only, it changes the weights); "
                "a packed or panel copy costs one more copy of the Linear weights (half of one in bf16)"})
    attn_implementation: str = field(default="sdpa", metadata={"help": "sdpa or eager (custom 4D masks)"})
    device: str = field(default="cpu", metadata={"help": "torch device"})
    seed: int = field(default=0, metadata={"help": "random seed for sampling"})
    num_threads: int = field(default=1, metadata={"help": "torch CPU threads"})

    def model_dtype(self) -> str:
        """The dtype to load the target (and draft model) in: float32 under --exact, else --dtype."""
        return "float32" if self.exact else self.dtype

    def dtype_line(self, dtype: torch.dtype) -> str:
        """The one line printed once the target is loaded: which dtype runs and why (--exact says what it overrides)."""
        line = describe_dtype(dtype, self.model_dtype(), self.device)
        if self.exact:
            overridden = f"; overrides --dtype {self.dtype}" if self.dtype not in ("float32", "fp32") else ""
            line += f" (--exact: greedy output token-identical to plain decoding{overridden})"
        return line

    def speculation(self) -> SpeculationConfig:
        """--num_speculative_tokens K|auto|cost -> SpeculationConfig (with --heads: the proposer's own size; with
        cost the proposer picks its length per step, up to --max_speculative_tokens)."""
        if self.resolved_method() in ("heads", "hybrid"):
            return SpeculationConfig(num_speculative_tokens=HEADS_BUDGET, max_speculative_tokens=HEADS_BUDGET)
        length = self.draft_length()
        if length == "auto":
            return SpeculationConfig(num_speculative_tokens=5, adaptive=True,
                                     max_speculative_tokens=self.max_speculative_tokens)
        if length == "cost":
            if self.resolved_method() != "prompt_lookup":
                raise ValueError(f"--num_speculative_tokens cost: only for --method prompt_lookup (heads size their "
                                 f"drafts with --tree_size auto), got --method {self.resolved_method()}")
            return SpeculationConfig(num_speculative_tokens=self.max_speculative_tokens,
                                     max_speculative_tokens=self.max_speculative_tokens)
        try:
            k = int(length)
        except ValueError:
            raise ValueError(f"--num_speculative_tokens: expected an int, 'auto' or 'cost', got "
                             f"{self.num_speculative_tokens!r}") from None
        return SpeculationConfig(num_speculative_tokens=k, max_speculative_tokens=max(k, self.max_speculative_tokens))

    def draft_length(self) -> str:
        """--num_speculative_tokens as given, or the method's default: 'cost' for prompt lookup, '5' otherwise."""
        if self.num_speculative_tokens:
            return str(self.num_speculative_tokens)
        return "cost" if self.resolved_method() == "prompt_lookup" else "5"

    def branching(self) -> tuple[int, ...]:
        """--draft_tree_branching '2,2' -> (2, 2)."""
        if not self.draft_tree_branching.strip():
            return ()
        try:
            values = tuple(int(v) for v in self.draft_tree_branching.split(","))
        except ValueError:
            raise ValueError(f"--draft_tree_branching: expected comma-separated ints, got "
                             f"{self.draft_tree_branching!r}") from None
        if any(v < 1 for v in values):
            raise ValueError(f"--draft_tree_branching: every value must be >= 1, got {values}")
        return values

    def resolved_method(self) -> str:
        if self.heads is not None and self.method == "prompt_lookup":
            return "heads"
        if self.draft_model is not None and self.method == "prompt_lookup":
            return "draft_model"
        if self.method not in METHODS:
            raise ValueError(f"--method must be one of {METHODS}, got {self.method!r}")
        if self.method == "draft_model" and self.draft_model is None:
            raise ValueError("--method draft_model needs --draft_model")
        if self.method in ("heads", "hybrid") and self.heads is None:
            raise ValueError(f"--method {self.method} needs --heads DIR_OR_HUB_ID")
        return self.method

    def heads_options(self) -> HeadsOptions:
        """The --tree_* flags as HeadsOptions."""
        return HeadsOptions(tree_size=self.tree_size, tree=self.tree, eagle_tree=self.eagle_tree,
                            tree_depth=self.tree_depth, tree_top_k=self.tree_top_k, max_tree_size=self.max_tree_size,
                            confidence_gate=self.confidence_gate)

    def decode_config(self) -> DecodeConfig:
        sampling = SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)
        return DecodeConfig(max_new_tokens=self.max_new_tokens, sampling=sampling, acceptance=self.acceptance,
                            speculation=self.speculation(), seed=self.seed)
