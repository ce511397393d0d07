#!/usr/bin/env bash
# The README's main job on a tiny setting from a COLD cache: the same three commands (2 processes under
# `accelerate launch`: distil, keeping the hidden states -> train; then the bench), the same recipes with smaller sizes,
# SPECHEADS_CACHE and the Hugging Face caches pointed at an empty temporary directory, so the GGUF conversion,
# the verify check, the layout choice, the kernel build and the cost curves are all built from nothing by two
# processes at once. Run by .ci/run; about 3-4 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export SPECHEADS_CACHE="$work/cache" HF_HOME="$work/hf" HF_DATASETS_CACHE="$work/hf/datasets" \
       OMP_NUM_THREADS=1 WANDB_MODE=offline HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
launch=(accelerate launch --config_file configs/accelerate/cpu_2proc.yaml)
out="$work/outputs"
start=$(date +%s)
"${launch[@]}" -m data.distill --config configs/distill_smollm2_main.yaml --output_dir "$out/distill" \
    --features_dir "$out/features" --max_new_tokens 16 --batch_size 4 --shard_size 4 \
    --sources sharegpt=../shared/data/sharegpt_prompts.jsonl:13 gsm8k=../shared/data/gsm8k_train.jsonl:3
"${launch[@]}" training/train_heads.py --config configs/eagle_smollm2_main.yaml --dataset "$out/distill" \
    --features "$out/features" --output_dir "$out/run" --heads_dir "$out/heads" --num_epochs 1 --max_steps 2 \
    --eval_samples 2 --save_steps 0 --draft_vocab_size 512 --per_device_batch_size 2
python -m bench.speed --config configs/bench_smollm2_eagle.yaml --heads "$out/heads" --max_prompts 1 \
    --max_new_tokens 16 --warmup_tokens 4 --output_json "$out/bench.json"
python - "$out/bench.json" <<'PY'
import json, sys
result = json.load(open(sys.argv[1]))
overall, env = result["overall"], result["environment"]
assert overall["greedy_identical"] is not None, overall
print(f"smoke: bench ok: layout {env['weight_layout']}, dtype {env['dtype']}, cpu {env['cpu']}, plain "
      f"{overall['plain']['tokens_per_second']:.1f} tok/s, identical {overall['identical_to_plain']}")
PY
test -f "$(ls -d "$SPECHEADS_CACHE"/converted/*/ | head -1)COMPLETE.json"
echo "smoke: the main job's pipeline passed from a cold cache in $(( $(date +%s) - start )) s"
