#!/usr/bin/env bash
# The GSM8K run on one H200 (issue: the real job), in device calls of at most 10 minutes each.
# The GGUF file travels in parts (../shared/gpu/split_for_carry.sh) to /tmp/xfer/parts; the wheels
# (.whl: megatron-core, hydra, omegaconf, antlr4, gguf) and the prepared data (.gsm8k: output of
# `python -m hybridflow.data.prepare gsm8k --out .gsm8k`) are carried with the call.
#
#   bash benchmarks/gsm8k_h200.sh setup                  # install wheels, assemble + verify the GGUF
#   bash benchmarks/gsm8k_h200.sh hf_eval               # transformers' greedy accuracy on the val set
#   bash benchmarks/gsm8k_h200.sh train SECONDS [k=v..] # GRPO with validation; stops (checkpoint)
#                                                         before SECONDS; run again to resume
# Everything lands in $OUT (metrics.jsonl, val_generations.jsonl, hf_eval.json, logs).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gsm8k_out}
mkdir -p "$OUT"
GGUF=/tmp/xfer/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
RUN_DIR=/tmp/gsm8k_run
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1

setup() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  if [ ! -f "$GGUF" ]; then
    cat /tmp/xfer/parts/* > "$GGUF.tmp"
    echo "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32  $GGUF.tmp" | sha256sum -c
    mv "$GGUF.tmp" "$GGUF"
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
}

hf_eval() {
  python3 benchmarks/gsm8k_hf_eval.py --model "$GGUF" --val .gsm8k/val.parquet \
    --out "$OUT/hf_eval.json" "$@" 2>&1 | tee "$OUT/hf_eval.log"
}

train() {
  local budget=$1; shift
  python3 -m hybridflow.train experiment=gsm8k_qwen_coder_0_5b model.gguf_path="$GGUF" \
    data.train_files=.gsm8k/train.parquet data.val_files=.gsm8k/val.parquet \
    trainer.output_dir="$RUN_DIR" trainer.progress_bar=false trainer.time_budget_s="$budget" "$@" \
    2>&1 | tee -a "$OUT/train.log"
  cp "$RUN_DIR/metrics.jsonl" "$RUN_DIR/val_generations.jsonl" "$OUT/" 2>/dev/null || true
}

"$@"
