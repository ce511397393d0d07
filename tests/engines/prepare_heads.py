"""Engine check, our side: heads of every kind vLLM runs, exported `--to vllm` (and EAGLE-3 `--to speculators`), and
what our runtime accepts.

    python tests/engines/prepare_heads.py --work_dir outputs/engine_check     (run by tests/engines/check_vllm.sh)

Writes `<work_dir>/plan.json` for `run_vllm.py` (which runs in vLLM's own venv and imports nothing of ours):
the plain HF directory of the target, the prompts as token ids, and per head kind the exported directory, vLLM's
speculative method and our runtime's greedy output and accepted-token counts per chain position, for a chain of
`--chain` drafts per step (= vLLM's `num_speculative_tokens`). Heads are trained for `--train_steps` steps
(EAGLE-3: `--eagle3_train_steps`) on the target's own answers to the check's prompts, so that every draft position
accepts something and the comparison covers each (0 = random heads, which accept nearly nothing: a weak comparison).

Kinds `dflash` and `peagle` are the parallel drafters (2 layers, the default target layers) exported `--to speculators`
and loaded the same way; vLLM must resolve method dflash / eagle3 with parallel drafting from config.json.

Kind `speculators` is the EAGLE-3 heads exported `--to speculators` (config.json names the verifier and the drafts
per step): vLLM loads it the way `vllm serve DIR` does, `LLM(model=DIR)`, with no speculative config of ours.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from heads.cli import parse_flags  # noqa: E402

# kind -> (training --method, vLLM speculative_config method). MTP: no engine loads user-trained MTP modules.
# `speculators`: the eagle3 heads in the speculators layout; vLLM takes the method from its config.json.
# `speculators_nbr`: the same heads set to compute norm_before_residual (the residual after hidden_norm, as many
# published speculators checkpoints do): vLLM reads the key as written and must accept what our runtime accepts.
KINDS = {"speculators": ("eagle3", None), "speculators_nbr": ("eagle3", None), "eagle3": ("eagle3", "eagle3"),
         "eagle": ("eagle", "eagle"), "medusa": ("medusa", "medusa"), "dflash": ("dflash", None),
         "peagle": ("peagle", None)}
# Parallel drafters, exported --to speculators (zero config): the method vLLM must resolve from config.json
# (speculators_model_type peagle is vLLM's eagle3 with parallel drafting).
PARALLEL = {"dflash": "dflash", "peagle": "eagle3"}


@dataclass
class PrepareFlags:
    work_dir: str = field(default="outputs/engine_check", metadata={"help": "Where heads, exports and plan.json go."})
    model: str = field(default="../shared/models/smollm2-135m-instruct", metadata={"help": "Target model."})
    prompts: str = field(default="../shared/data/mt_bench_question.jsonl",
                         metadata={"help": "MT-Bench questions (first turns are the prompts)."})
    num_prompts: int = field(default=3, metadata={"help": "Prompts per head kind."})
    prompt_offset: int = field(default=0, metadata={"help": "Skip this many rows of --prompts."})
    max_tokens: int = field(default=32, metadata={"help": "New tokens per prompt (vLLM max_tokens)."})
    chain: int = field(default=3, metadata={"help": "Drafts per step: our chain length = num_speculative_tokens."})
    train_steps: int = field(default=40, metadata={"help": "Training steps per head (0 = random heads)."})
    eagle3_train_steps: int = field(default=40, metadata={"help": "Training steps of the EAGLE-3 heads (used by "
                                                                  "kinds eagle3 and speculators); 0 = random."})
    kinds: str = field(default="speculators,eagle3,eagle,medusa",
                       metadata={"help": f"Comma-separated subset of {list(KINDS)}."})


def run(command: list[str], log: Path) -> None:
    """Run a step of the check as a user would (a CLI in a subprocess); its output goes to `log`."""
    with log.open("w") as out:
        done = subprocess.run(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"failed ({done.returncode}): {' '.join(command)}; see {log}")


def train_heads(flags: PrepareFlags, kind: str, data: Path, out: Path) -> Path:
    """A small head of `kind`: a few training steps (`training/train_heads.py`), or random when 0 steps."""
    steps = flags.eagle3_train_steps if kind == "eagle3" else flags.train_steps
    heads_dir = out / f"heads_{steps}steps_self"  # kept between runs of the check; a new step count retrains
    if (heads_dir / "config.json").is_file():
        return heads_dir
    out.mkdir(parents=True, exist_ok=True)
    if steps == 0:
        from heads import HeadsConfig, build_heads
        from heads.loading import load_model
        target = load_model(flags.model)
        options = {"medusa_num_heads": flags.chain} if kind == "medusa" else {}
        options.update({"draft_vocab_size": 4096} if kind == "eagle3" else {})
        heads = build_heads(HeadsConfig.for_target(kind, target, flags.model, **options))
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in heads.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
        heads.save_pretrained(heads_dir)
        return heads_dir
    method = KINDS[kind][0]
    command = [sys.executable, "training/train_heads.py", "--method", method, "--model", flags.model,
               "--dataset", str(data), "--output_dir", str(out / "run"), "--heads_dir", str(heads_dir),
               "--max_steps", str(steps), "--per_device_batch_size", "1", "--max_length", "256",
               # every row trains (the check's own prompts); evaluation reads the same rows
               "--eval_dataset", str(data), "--eval_samples", "1",
               "--learning_rate", "0.003", "--eval_steps", "0", "--save_steps", "0",
               "--progress_bar", "false", "--report_to", "none"]
    if kind == "medusa":
        command += ["--num_heads", str(flags.chain)]  # vLLM drafts one token per Medusa head
    if kind == "eagle3":
        command += ["--draft_vocab_size", "4096", "--ttt_steps", "3"]
    elif kind in PARALLEL:  # DFlash: a block of chain + 1 slots; P-EAGLE: chain depths; 2 layers, default target layers
        command += ["--block_size", str(flags.chain + 1 if kind == "dflash" else flags.chain), "--num_layers", "2",
                    "--draft_vocab_size", "4096" if kind == "peagle" else str(10**9)]
    else:  # vLLM drafts EAGLE-1 / Medusa over the full vocabulary: no reduced draft vocabulary on our side either
        command += ["--draft_vocab_size", str(10**9)]
    run(command, out / "train.log")
    return heads_dir


def first_turns(path: str, count: int, offset: int = 0) -> list[str]:
    """The first user turns of rows offset.. of a JSONL file (MT-Bench `turns`, or GSM8K `question`)."""
    with open(REPO / path if not Path(path).is_absolute() else path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [row["turns"][0] if "turns" in row else row["question"] for row in rows[offset:offset + count]]


def replay_steps(stats, max_tokens: int, chain: int) -> list[int]:
    """Accepted drafts per chain position over the steps vLLM takes for `max_tokens` new tokens.

    vLLM always drafts `chain` tokens and stops scheduling once `max_tokens` are out; our loop shortens the
    last drafts to the budget. So ours runs with room to spare and only the steps that start before
    `max_tokens` tokens are out are counted (the first token comes from the prefill).
    """
    accepted = [0] * chain
    emitted = 1
    for step in stats.steps:
        if emitted >= max_tokens:
            break
        assert step.drafted_depth == chain, f"our chain drafted {step.drafted_depth}, expected {chain}"
        for position in range(min(step.accepted_length - 1, chain)):
            accepted[position] += 1
        emitted += step.accepted_length
    return accepted


def main(argv: list[str] | None = None) -> None:
    flags = parse_flags(PrepareFlags, argv)
    torch.set_num_threads(1)
    from heads.export import main as export_main
    from heads.loading import load_model, load_tokenizer, model_path
    from runtime.build import encode_prompt
    from runtime.config import DecodeConfig, HeadsOptions, SpeculationConfig
    from runtime.loop import GenerationStats, generate
    from runtime.proposers.factory import proposer_from_heads
    from runtime.sampling import SamplingConfig
    from runtime.target import TargetModel

    work = Path(flags.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    kinds = [k for k in flags.kinds.split(",") if k]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise ValueError(f"--kinds: unknown {unknown}; vLLM runs {list(KINDS)} (MTP: no engine loads user MTP)")
    # The heads learn the target's own greedy answers to the check's prompts (self-distilled, float32, one prompt per
    # batch), so that every draft position accepts something and the comparison with vLLM covers each of them.
    data = work / "data_self"
    if (flags.train_steps or flags.eagle3_train_steps) and not (data / "manifest.json").is_file():
        run([sys.executable, "-m", "data.distill", "--model", flags.model, "--prompts", flags.prompts,
             "--max_prompts", str(flags.prompt_offset + flags.num_prompts), "--dtype", "float32", "--batch_size", "1",
             "--max_new_tokens", str(flags.max_tokens + flags.chain + 1), "--max_length", "256",
             "--output_dir", str(data)], work / "data.log")

    base = model_path(flags.model)  # plain HF directory (a GGUF is converted once, cached)
    tokenizer = load_tokenizer(flags.model)
    target = TargetModel(load_model(flags.model, dtype="float32"))
    prompts = [encode_prompt(tokenizer, text) for text in first_turns(flags.prompts, flags.num_prompts, flags.prompt_offset)]
    # Room to spare so that no step before max_tokens has a shortened chain (see replay_steps).
    decode = DecodeConfig(max_new_tokens=flags.max_tokens + flags.chain + 1, sampling=SamplingConfig(),
                          acceptance="greedy", speculation=SpeculationConfig(num_speculative_tokens=flags.chain))
    plan = {"base": str(base), "prompts": [p.tolist() for p in prompts], "max_tokens": flags.max_tokens,
            "chain": flags.chain, "train_steps": {k: flags.eagle3_train_steps if KINDS[k][0] == "eagle3" else
                                                  flags.train_steps for k in kinds}, "kinds": {}}
    ours: dict[str, tuple[list, list]] = {}  # heads directory -> our outputs and acceptance (computed once)
    for kind in kinds:
        method = KINDS[kind][0]
        out = work / method
        heads_dir = train_heads(flags, method, data, out)
        if kind == "speculators_nbr":
            heads_dir = with_norm_before_residual(heads_dir, out / "heads_norm_before_residual")
        if kind.startswith("speculators") or kind in PARALLEL:  # the verifier as vLLM loads it (a GGUF target's
            exported = out / kind                               # plain HF copy), our chain length
            export_main(["--heads", str(heads_dir), "--to", "speculators", "--output_dir", str(exported),
                         "--verifier", str(base), "--speculative_tokens", str(flags.chain)])
            traps = write_traps(exported, out) if kind == "speculators" else {}
        else:
            exported = out / "vllm"
            export_main(["--heads", str(heads_dir), "--to", "vllm", "--output_dir", str(exported)])
        if str(heads_dir) in ours:
            outputs, accepted = ours[str(heads_dir)]
            plan["kinds"][kind] = {"export": str(exported), "method": KINDS[kind][1], "ours_outputs": outputs,
                                   "ours_accepted_per_pos": accepted, "expected_method": PARALLEL.get(kind, "eagle3")}
            if kind == "speculators":
                plan["kinds"][kind]["traps"] = traps
            print(f"[ours] {kind}: exported {exported}; accepted per position {accepted}", flush=True)
            continue
        options = HeadsOptions(tree_size=str(flags.chain), eagle_tree="static", allow_off=False)
        if kind in ("medusa", *PARALLEL):  # a chain: the top-1 token of each head / drafted position (what vLLM drafts)
            options = HeadsOptions(tree=str(write_chain_tree(out, flags.chain)), allow_off=False)
        proposer = proposer_from_heads(heads_dir, target, options, seed=0, target_name=flags.model).proposer
        outputs, accepted = [], [0] * flags.chain
        for prompt in prompts:
            stats = GenerationStats()
            tokens = torch.cat(list(generate(target, proposer, prompt, decode, stats)))[: flags.max_tokens]
            outputs.append(tokens.tolist())
            accepted = [a + b for a, b in zip(accepted, replay_steps(stats, flags.max_tokens, flags.chain),
                                              strict=True)]
        ours[str(heads_dir)] = outputs, accepted
        plan["kinds"][kind] = {"export": str(exported), "method": KINDS[kind][1], "ours_outputs": outputs,
                               "ours_accepted_per_pos": accepted, "expected_method": PARALLEL.get(kind, "eagle3")}
        if kind == "speculators":
            plan["kinds"][kind]["traps"] = traps
        if kind == "eagle":  # the SGLang export (fc.bias shipped) must be refused by vLLM, not silently misloaded
            export_main(["--heads", str(heads_dir), "--to", "sglang", "--output_dir", str(out / "sglang")])
            plan["kinds"][kind]["wrong_engine_export"] = str(out / "sglang")
        print(f"[ours] {kind}: exported {exported}; accepted per position {accepted}", flush=True)
    (work / "plan.json").write_text(json.dumps(plan, indent=1))
    print(f"[ours] plan -> {work / 'plan.json'}")


def with_norm_before_residual(heads_dir: Path, out: Path) -> Path:
    """A copy of EAGLE-3 heads whose config says norm_before_residual: the same weights, another computation."""
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(heads_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["specheads"]["norm_before_residual"] = True
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def write_traps(exported: Path, out: Path) -> dict[str, str]:
    """Two copies of the speculators export, each with one key as a careless exporter writes it: vLLM must still
    give plain vLLM's output, and its acceptance shows whether these heads can tell the key's meaning apart.

    - `norm_before_residual absent`: vLLM's reader then uses true (ours computes false);
    - `aux ids as layer outputs`: eagle_aux_hidden_state_layer_ids minus one (SGLang's "output of layer k" ids)
      where vLLM means hidden_states indices."""
    traps = {}
    for name, edit in (("norm_before_residual absent", lambda c: c.pop("norm_before_residual")),
                       ("aux ids as layer outputs", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[
                           i - 1 for i in c["eagle_aux_hidden_state_layer_ids"]]))):
        directory = out / ("trap_" + name.split()[0])
        shutil.rmtree(directory, ignore_errors=True)
        shutil.copytree(exported, directory)
        config = json.loads((directory / "config.json").read_text())
        edit(config)
        (directory / "config.json").write_text(json.dumps(config, indent=2))
        traps[name] = str(directory)
    return traps


def write_chain_tree(out: Path, chain: int) -> Path:
    """A static tree YAML that is a chain of `chain` top-1 drafts (configs/trees format)."""
    path = out / f"chain{chain}.yaml"
    path.write_text("paths:\n" + "".join(f"- {[0] * d}\n" for d in range(1, chain + 1)))
    return path


if __name__ == "__main__":
    main()
