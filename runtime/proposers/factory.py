"""`proposer_from_heads`: load trained heads for a target and build the matching proposer, sized for the device.

The head directory's config (`kind`) picks the proposer: medusa -> MedusaProposer (static sparse tree),
eagle -> EagleProposer (EAGLE-2 dynamic tree by default, EAGLE-1 static tree or chain on request),
eagle3 -> Eagle3Proposer (same tree modes), mtp -> MTPProposer (chain), dflash -> DFlashProposer and peagle ->
PEagleProposer (parallel drafters: a Medusa-style tree grown from their per-position accuracies, a chain on
targets that verify chains; the block is drafted in one forward whatever the size).

The factory only builds proposers. Tree size (`--tree_size`): the number of draft tokens per step, i.e. Medusa
tree nodes, EAGLE-2 `total_tokens`, or chain length. A fixed size is built as asked; for `auto` (default) the
factory describes the family of shapes it can build (`planner.DrafterFamily`: shapes, sizes, E[tau(n)] per
shape, a constructor) and the planner (runtime/planner.plan_drafter) measures and chooses, maximising
E[tau(n)] / (t_verify(n + 1) + t_draft(n)):
- t_verify: the target's verify cost curve on this device (runtime/cost_model.py; measured once, cached on disk);
- t_draft: the proposer's own propose() time, measured on a random context (cost_model.DraftTimer);
- E[tau(n)]: from the heads' held-out accuracies that training stores in config.json `metrics`
  (`top1_accuracy_per_depth`, `topK_accuracy_per_depth`). Trees use a per-depth, per-rank table: rank 0 =
  top-1 accuracy, the top-K minus top-1 mass spread over ranks 1..K-1 with weights halving per rank (an
  approximation stated here); E[tau] of the best n-node tree under the Medusa independence model. Chains use
  1 + sum_d prod_{i<=d} top1_i.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import yaml

from heads.checkpoint import check_compatible, load_heads
from heads.config import HeadsConfig
from heads.eagle import Eagle3Draft, EagleDraft
from heads.medusa import MedusaHeads
from heads.mtp import MTPHeads
from heads.parallel import DFlashDraft, PEagleDraft
from runtime.config import HeadsOptions
from runtime.cost_model import GUARD_KV_LENGTHS, StepCosts, chain_expected_tau, measure_step_costs
from runtime.layout import match_panels
from runtime.planner import DrafterFamily, DraftProfile, Plan, plan_drafter
from runtime.proposers.base import Autoregressive
from runtime.proposers.eagle import DynamicTreeConfig, EagleProposer
from runtime.proposers.eagle3 import Eagle3Proposer
from runtime.proposers.guard import PayingGuard
from runtime.proposers.hybrid import HybridProposer
from runtime.proposers.medusa import MedusaProposer
from runtime.proposers.mtp import MTPProposer
from runtime.proposers.parallel import DFlashProposer, PEagleProposer
from runtime.sampling import SamplingConfig
from runtime.target import TargetModel
from runtime.tree_search import StaticTree, expected_accepted_lengths, grow_tree, load_tree_file, static_tree

DEFAULT_TREE_TABLE = Path(__file__).resolve().parents[2] / "configs" / "trees" / "medusa_default_64.yaml"



@dataclass(frozen=True)
class HeadsProposer:
    """What `proposer_from_heads` returns: the proposer, its heads' config, and how the size was chosen."""

    proposer: (MedusaProposer | EagleProposer | MTPProposer | DFlashProposer | PEagleProposer | Autoregressive |
               PayingGuard | HybridProposer)
    config: HeadsConfig
    size: int  # draft tokens per step (the loop's budget)
    plan: Plan | None = None  # the planner's batch-1 choice, rows: plain decoding then every shape and size
    description: str = ""
    notes: list[str] = field(default_factory=list)
    step_costs: StepCosts | None = None  # the guard's step costs by KV length (auto with allow_off)

    def profile(self) -> DraftProfile | None:
        """The planner's input for batches (runtime/planner.BatchPlanner): the chosen shape's expected tau and
        draft time at every size up to the chosen one (None for a fixed size: nothing was measured)."""
        return None if self.plan is None else self.plan.profile


def accuracy_table(config: HeadsConfig) -> list[list[float]] | None:
    """Per-depth, per-rank accuracy table from the heads' training metrics (see module docstring), or None."""
    metrics = config.metrics or {}
    top1 = metrics.get("top1_accuracy_per_depth")
    if not top1:
        return None
    ranked = [(int(m.group(1)), key) for key in metrics
              if (m := re.fullmatch(r"top(\d+)_accuracy_per_depth", key)) and int(m.group(1)) > 1]
    table = []
    for d, first in enumerate(top1):
        row = [float(first)]
        if ranked:
            k, key = max(ranked)
            rest = max(float(metrics[key][d]) - float(first), 0.0)
            weights = [0.5 ** r for r in range(k - 1)]
            row += [rest * w / sum(weights) for w in weights]
        table.append([min(max(a, 0.0), 1.0) for a in row])
    return table


def _chain_table(table: list[list[float]] | None, target: TargetModel) -> list[list[float]] | None:
    """Top-1 column only when the target verifies chains (a tree grown from it is a chain)."""
    return table if table is None or target.mode == "tree" else [row[:1] for row in table]


def default_table(num_heads: int) -> list[list[float]]:
    table = yaml.safe_load(DEFAULT_TREE_TABLE.read_text())["accuracy"]
    return [table[min(h, len(table) - 1)] for h in range(num_heads)]


def _load(heads: str | Path | torch.nn.Module, target: TargetModel, target_name: str | None, revision: str | None):
    if isinstance(heads, torch.nn.Module):
        check_compatible(heads.config, target.model, target_name=target_name, source="--heads")
        module = heads.to(device=target.device, dtype=target.dtype).eval()
    else:
        module = load_heads(heads, target=target.model, target_name=target_name, revision=revision,
                            device=target.device, dtype=target.dtype)
    match_panels(module, target.model)
    return module


def proposer_from_heads(heads: str | Path | torch.nn.Module, target: TargetModel, options: HeadsOptions | None = None,
                        sampling: SamplingConfig | None = None, seed: int | None = None,
                        target_name: str | None = None, revision: str | None = None) -> HeadsProposer:
    """Load heads (directory, Hub id, or an already built head module) for `target` and build the proposer.

    target_name: the target as the user named it (e.g. the --model string) for the base-model check; heads
    trained for another target raise ValueError naming both models (heads.checkpoint.check_compatible).
    A fixed size (--tree_size N, --tree FILE) is built as asked; `auto` asks the planner
    (runtime/planner.plan_drafter) for the shape and size; with `options.allow_off`, when plain decoding is
    predicted faster the proposer is `Autoregressive` (speculation off, size 0), and the description says so.
    """
    options = options or HeadsOptions()
    module = _load(heads, target, target_name, revision)
    config = module.config
    if target.mode == "plain":  # the load-time verify check allows no drafts for this target
        return HeadsProposer(Autoregressive(), config, 0, None,
                             "speculation off: the target runs plain decoding only (verify check)")
    if target.mode == "chain":  # no tree attention for this target: EAGLE drafts chains, Medusa a top-1 chain
        options = replace(options, eagle_tree="static", tree="")
    built = _family(module, target, options, sampling or SamplingConfig(), seed)
    if isinstance(built, HeadsProposer):  # a fixed size or tree file: nothing to plan
        return built
    family, notes = built
    plan = plan_drafter(family, target, options.cost_kv_length, allow_off=options.allow_off)
    if plan.off:
        plain, *rows = plan.rows
        best = max(r["tokens_per_second"] for r in rows)
        return HeadsProposer(Autoregressive(), config, 0, plan,
                             f"speculation off: plain decoding is predicted faster here ({plain['tokens_per_second']:.2f}"
                             f" vs at best {best:.2f} tokens/s for {config.kind} heads; pass --tree_size N to force "
                             f"drafting)", notes)
    if len(family.shapes) > 1:
        notes.append(f"auto shape: {_shape_text(plan.shape)} among {len(family.shapes)} (depth, top_k) pairs")
    fixed = options.fixed_size
    label = f"{family.kind}{' ' + _shape_text(plan.shape) if plan.shape else ''}, " \
            f"{'auto ' if fixed is None else ''}size {plan.size}"
    proposer = family.make(plan.shape, plan.size)
    costs = None
    if options.allow_off:  # planned from held-out accuracy: checked against this sequence's acceptance as it runs
        proposer, costs = guarded(proposer, target, plan.size, plan.chosen["expected_tau"], options.cost_kv_length,
                                  options.confidence_gate)
        label += f", guarded (drafts while this sequence accepts at least a drafted step's cost in plain steps: " \
                 f"{costs.describe(plan.size + 1)})"
    return HeadsProposer(proposer, config, plan.size, plan, label, notes, costs)


def hybrid_from_heads(heads: str | Path | torch.nn.Module, target: TargetModel, options: HeadsOptions | None = None,
                      sampling: SamplingConfig | None = None, seed: int | None = None, target_name: str | None = None,
                      revision: str | None = None, max_lookup: int = 8, max_ngram: int = 3,
                      min_ngram: int = 1) -> HeadsProposer:
    """Prompt lookup and the heads in one tree per step (runtime.proposers.hybrid). The heads are sized as for
    `--method heads` but never turned off up front (with `auto` the planner's best drafting shape and size): the
    hybrid decides per step, from both sources' acceptance in the sequence and the step costs at its KV length
    (verify over up to size + 1 + max_lookup tokens and the head's draft time, measured at a few KV lengths)."""
    options = replace(options or HeadsOptions(), allow_off=False)
    built = proposer_from_heads(heads, target, options, sampling, seed, target_name, revision)
    if target.mode == "plain" or built.size < 1:
        return built
    if built.plan is not None:
        expected_tau = float(built.plan.chosen["expected_tau"])
    else:  # a fixed size: the chain of its top-1 accuracies, or no promise at all (the probes will tell)
        table = accuracy_table(built.config)
        expected_tau = chain_expected_tau(need_table_column(table))(built.size) if table else 1.0
    costs = measure_step_costs(target, built.size + 1 + max_lookup, built.proposer, options.cost_kv_length)
    proposer = HybridProposer(built.proposer, built.size, expected_tau, costs, max_lookup, max_ngram, min_ngram,
                              trees=target.mode == "tree", gate=options.confidence_gate)
    label = (f"hybrid: prompt lookup (up to {max_lookup} tokens) + {built.description} (expected tau "
             f"{expected_tau:.2f}); per step the split that pays most at the sequence's KV length; head step cost "
             f"{costs.describe(built.size + 1)}")
    return HeadsProposer(proposer, built.config, proposer.tree_size, built.plan, label, built.notes, costs)


def guarded(proposer, target: TargetModel, size: int, expected_tau: float,
            kv_length: int = GUARD_KV_LENGTHS[0], gate: bool = True) -> tuple[PayingGuard, StepCosts]:
    """`proposer` under a PayingGuard whose break-even is its step's cost at the sequence's KV length (verify over
    size + 1 tokens plus its propose() time, over a plain step), measured here at `kv_length` (the planner's) and
    at the longer lengths of GUARD_KV_LENGTHS; the guard times this sequence's steps against that model
    (runtime.proposers.guard.StepClock)."""
    costs = measure_step_costs(target, size + 1, proposer, kv_length)
    return PayingGuard(proposer, lambda kv_length: costs.relative(size + 1, kv_length), expected_tau,
                       timed=costs, verify_tokens=size + 1, gate=gate), costs


def _shape_text(shape: dict[str, int]) -> str:
    return " ".join(f"{key} {value}" for key, value in shape.items())


def _family(module, target: TargetModel, options: HeadsOptions, sampling: SamplingConfig,
            seed: int | None) -> HeadsProposer | tuple[DrafterFamily, list[str]]:
    """The proposer itself for a fixed size or tree file; else the family of shapes the planner chooses from."""
    config = module.config
    fixed = options.fixed_size
    table = _chain_table(accuracy_table(config), target)
    notes: list[str] = []
    sizes = list(range(1, options.max_tree_size + 1))
    indices = tuple(config.target_layers)

    def need_table() -> list[list[float]]:
        if table is None:
            raise ValueError(f"--tree_size auto: the heads ({config.base_model_name_or_path}, kind {config.kind}) "
                             f"have no measured accuracy (config.json metrics.top1_accuracy_per_depth, written by "
                             f"training/train_heads.py); pass --tree_size N or --tree FILE")
        return table

    if isinstance(module, MedusaHeads):
        def make_medusa(tree: StaticTree) -> MedusaProposer:
            return MedusaProposer(module, target.model, tree, sampling, seed, tree_source=options.tree or "tree")

        if options.tree:
            if fixed is not None:
                raise ValueError("pass either --tree FILE or --tree_size N for Medusa heads, not both")
            proposer = make_medusa(load_tree_file(options.tree, num_heads=module.num_heads, vocab_size=config.vocab_size))
            return HeadsProposer(proposer, config, proposer.tree_size, None, f"medusa tree {options.tree}")
        grown_from = table[: module.num_heads] if table is not None else None
        if grown_from is None:
            grown_from = _chain_table(default_table(module.num_heads), target)
            notes.append(f"no measured accuracy in the heads: tree grown from the illustrative table of "
                         f"{DEFAULT_TREE_TABLE.name}")

        def make(shape: dict, n: int) -> MedusaProposer:
            return make_medusa(static_tree(grow_tree(grown_from, n), "grown tree", num_heads=module.num_heads))

        if fixed is not None:
            proposer = make({}, fixed)
            return HeadsProposer(proposer, config, proposer.tree_size, None, f"medusa grown tree, {fixed} nodes", notes)
        taus = expected_accepted_lengths(need_table()[: module.num_heads], options.max_tree_size)
        return DrafterFamily("medusa grown tree", [{}], lambda shape: [n for n in sizes if n < len(taus)],
                             lambda shape, n: taus[n], make, indices), notes

    if isinstance(module, (DFlashDraft, PEagleDraft)):
        return _parallel_family(module, target, options, sampling, seed, table, notes, sizes, indices)

    if isinstance(module, MTPHeads):
        def make(shape: dict, n: int) -> MTPProposer:
            return MTPProposer(module, target.model, n, sampling, seed)

        if fixed is not None:
            return HeadsProposer(make({}, fixed), config, fixed, None, f"mtp chain of {fixed}")
        tau = chain_expected_tau(need_table_column(need_table()))
        return DrafterFamily("mtp chain", [{}], lambda shape: [n for n in sizes if n <= module.num_depths],
                             lambda shape, n: tau(n), make, indices), notes

    if isinstance(module, (EagleDraft, Eagle3Draft)):
        cls = Eagle3Proposer if isinstance(module, Eagle3Draft) else EagleProposer
        name = config.kind
        if options.eagle_tree == "static":
            if options.tree:
                if fixed is not None:
                    raise ValueError("pass either --tree FILE or --tree_size N, not both")
                tree = load_tree_file(options.tree, vocab_size=module.config.draft_vocab_size
                                      if isinstance(module, Eagle3Draft) else config.vocab_size)
                proposer = cls(module, target.model, tree=tree, sampling=sampling, seed=seed)
                return HeadsProposer(proposer, config, proposer.tree_size, None, f"{name} static tree {options.tree}")

            def make_chain(shape: dict, n: int) -> EagleProposer:
                return cls(module, target.model, tree=static_tree([[0] * d for d in range(1, n + 1)]),
                           sampling=sampling, seed=seed)

            if fixed is not None:
                return HeadsProposer(make_chain({}, fixed), config, fixed, None, f"{name} chain of {fixed}")
            tau = chain_expected_tau(need_table_column(need_table()))
            return DrafterFamily(f"{name} chain", [{}], lambda shape: sizes, lambda shape, n: tau(n), make_chain,
                                 indices), notes
        if options.tree:
            raise ValueError("--tree is a static tree: pass --eagle_tree static with it")

        def make_shape(shape: dict, n: int) -> EagleProposer:
            return cls(module, target.model, dynamic=DynamicTreeConfig(shape["depth"], shape["top_k"], n),
                       sampling=sampling, seed=seed)

        shapes = [{"depth": d, "top_k": k} for d in options.depth_grid() for k in options.top_k_grid()]
        if fixed is not None and len(shapes) == 1:
            return HeadsProposer(make_shape(shapes[0], fixed), config, fixed, None,
                                 f"{name} dynamic tree depth {shapes[0]['depth']} top_k {shapes[0]['top_k']} "
                                 f"total {fixed}")
        tables = {(s["depth"], s["top_k"]): expected_accepted_lengths(
            [row[:s["top_k"]] for row in need_table()[:s["depth"]]], options.max_tree_size) for s in shapes}

        def shape_sizes(shape: dict) -> list[int]:
            taus = tables[(shape["depth"], shape["top_k"])]
            return [fixed] if fixed is not None else [n for n in sizes if n < len(taus)] or [1]

        def shape_tau(shape: dict, n: int) -> float:
            taus = tables[(shape["depth"], shape["top_k"])]
            return taus[min(n, len(taus) - 1)]

        return DrafterFamily(f"{name} dynamic tree", shapes, shape_sizes, shape_tau, make_shape, indices), notes
    raise ValueError(f"--heads: unsupported head kind {config.kind!r}")


def _parallel_family(module: DFlashDraft | PEagleDraft, target: TargetModel, options: HeadsOptions,
                     sampling: SamplingConfig, seed: int | None, table: list[list[float]] | None, notes: list[str],
                     sizes: list[int], indices: tuple[int, ...]) -> HeadsProposer | tuple[DrafterFamily, list[str]]:
    """DFlash / P-EAGLE: trees grown from the per-position accuracy table (depth d = drafted position d), as Medusa's
    from its heads'; a fixed size without measured accuracy drafts a chain of that many positions."""
    config = module.config
    cls = DFlashProposer if isinstance(module, DFlashDraft) else PEagleProposer
    depths = config.draft_tokens
    fixed = options.fixed_size
    source = options.tree or "tree"

    def build(tree: StaticTree) -> DFlashProposer | PEagleProposer:
        return cls(module, target.model, tree, sampling, seed, tree_source=source)

    if options.tree:
        if fixed is not None:
            raise ValueError(f"pass either --tree FILE or --tree_size N for {config.kind} heads, not both")
        proposer = build(load_tree_file(options.tree, num_heads=depths, vocab_size=proposer_vocab(module)))
        return HeadsProposer(proposer, config, proposer.tree_size, None, f"{config.kind} tree {options.tree}")
    if fixed is not None and fixed > depths and (table is None or target.mode != "tree"):
        raise ValueError(f"--tree_size {fixed}: {config.kind} heads draft a chain of at most {depths} tokens "
                         f"(block_size {config.block_size})")

    def make(shape: dict, n: int) -> DFlashProposer | PEagleProposer:
        if table is None:
            return build(static_tree([[0] * d for d in range(1, n + 1)], "chain", num_heads=depths))
        return build(static_tree(grow_tree(table[:depths], n), "grown tree", num_heads=depths))

    if fixed is not None:
        proposer = make({}, fixed)
        shape = "chain" if table is None or target.mode != "tree" else "grown tree"
        return HeadsProposer(proposer, config, proposer.tree_size, None, f"{config.kind} {shape}, {fixed} nodes",
                             notes)
    if table is None:
        raise ValueError(f"--tree_size auto: the heads ({config.base_model_name_or_path}, kind {config.kind}) have "
                         f"no measured accuracy (config.json metrics.top1_accuracy_per_depth, written by "
                         f"training/train_heads.py); pass --tree_size N or --tree FILE")
    taus = expected_accepted_lengths(table[:depths], options.max_tree_size)
    kind = f"{config.kind} {'grown tree' if target.mode == 'tree' else 'chain'}"
    return DrafterFamily(kind, [{}], lambda shape: [n for n in sizes if n < len(taus)], lambda shape, n: taus[n],
                         make, indices), notes


def proposer_vocab(module: DFlashDraft | PEagleDraft) -> int:
    """The vocabulary a parallel drafter ranks tokens over (its draft vocabulary, or the target's)."""
    return module.config.draft_vocab_size or module.config.vocab_size


def need_table_column(table: list[list[float]]) -> list[float]:
    """Top-1 accuracy per depth (column 0 of the table)."""
    return [row[0] for row in table]
