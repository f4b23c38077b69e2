#!/usr/bin/env bash
# The GSM8K peer baselines of issue 16 in one device call: transformers' greedy val accuracy of the
# GGUF file (benchmarks/gsm8k_hf_eval.py), then TRL's GRPOTrainer for up to TRL_STEPS steps within
# what is left of TOTAL_S (benchmarks/trl_gsm8k.py). JSON (and the eval generations) go to $OUT.
#
# Here, once (.whl_bench/ and .gsm8k/ are git-ignored, so `carry` can name them):
#   cp -r /work/cache/whl_bench .whl_bench            # trl, datasets, dill, multiprocess, gguf (+ fallback/)
#   python -m hybridflow.data.prepare gsm8k --out .gsm8k   # train.parquet / val.parquet (or .jsonl)
# The model reassembled on the machine beforehand (`bash benchmarks/gsm8k_h200.sh setup`, after the
# chunked carry of shared/gpu/README.md), then one device call with carry [".whl_bench", ".gsm8k"]:
#   MODEL=/tmp/xfer/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf bash benchmarks/gsm8k_peers.sh
# (SITE is /tmp/site as for gsm8k_h200.sh: only missing dependencies of the carried wheels are added.)
# Knobs (environment): PHASES="eval trl" | "eval" | "trl"; EVAL_BS (64); EVAL_LIMIT (all);
#   EVAL_ARGS (more gsm8k_hf_eval.py options, e.g. "--max-new-tokens 512");
#   TRL_STEPS (20); TRL_VAL_AT (e.g. 0,10,20; empty: none); TRL_VAL_SIZE (all); TRL_VAL_BS (64);
#   TRL_ARGS (more trl_gsm8k.py options, e.g. "--prompts-per-step 16 --micro-batch 64");
#   TRL_RESUME=1: continue the TRL run checkpointed in /tmp/trl_gsm8k by the previous call (the machine
#   must have stayed warm) and checkpoint again if the budget stops it; e.g. 20 steps over 3 calls:
#   PHASES=trl TRL_RESUME=1 TRL_STEPS=20 TRL_VAL_AT=0,5,10,15,20 TRL_ARGS="--prompts-per-step 16", 3 times;
#   TOTAL_S (560: the call is capped at 600 s); DATA (.gsm8k); WHEELS (.whl_bench); SITE (/tmp/site).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:?set MODEL to the .gguf file (or an HF directory)}
DATA=${DATA:-.gsm8k}
WHEELS=${WHEELS:-.whl_bench}
SITE=${SITE:-/tmp/site}
OUT=${OUT:-/tmp/gsm8k_peers_out}
PHASES=${PHASES:-eval trl}
TOTAL_S=${TOTAL_S:-560}
mkdir -p "$OUT"

data_file() {  # data_file SPLIT -> DATA/SPLIT.parquet or DATA/SPLIT.jsonl
  for ext in parquet jsonl; do [ -f "$DATA/$1.$ext" ] && { echo "$DATA/$1.$ext"; return; }; done
  echo "no $DATA/$1.parquet or $DATA/$1.jsonl" >&2; exit 1
}
[ -e "$MODEL" ] || { echo "MODEL=$MODEL does not exist" >&2; exit 1; }

python3 benchmarks/install_peer_wheels.py "$WHEELS" --target "$SITE"
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
mods="gguf transformers torch"
[[ " $PHASES " == *" trl "* ]] && mods="$mods trl datasets"
# shellcheck disable=SC2086  # a list of module names
python3 - $mods <<'EOF'  # fail here, in seconds, rather than after the eval
import importlib, sys
print(" ".join(f"{m} {getattr(importlib.import_module(m), '__version__', '?')}" for m in sys.argv[1:]))
EOF
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null || true

VAL=$(data_file val)
if [[ " $PHASES " == *" eval "* ]]; then
  # shellcheck disable=SC2086  # EVAL_ARGS is a list of options
  python3 benchmarks/gsm8k_hf_eval.py --model "$MODEL" --val "$VAL" --batch-size "${EVAL_BS:-64}" \
    ${EVAL_LIMIT:+--limit "$EVAL_LIMIT"} --out "$OUT/gsm8k_hf_eval.json" \
    --generations "$OUT/gsm8k_hf_generations.jsonl" ${EVAL_ARGS:-}
fi

if [[ " $PHASES " == *" trl "* ]]; then
  TRAIN=$(data_file train)
  budget=$((TOTAL_S - SECONDS - 10))
  echo "TRL time budget ${budget}s"
  # shellcheck disable=SC2086  # TRL_ARGS is a list of options
  python3 benchmarks/trl_gsm8k.py --model "$MODEL" --train "$TRAIN" --val "$VAL" \
    --out "$OUT/trl_gsm8k.json" --max-steps "${TRL_STEPS:-20}" --time-budget-s "$budget" \
    --val-at "${TRL_VAL_AT:-}" ${TRL_VAL_SIZE:+--val-size "$TRL_VAL_SIZE"} --val-batch-size "${TRL_VAL_BS:-64}" \
    --workdir /tmp/trl_gsm8k ${TRL_RESUME:+--resume} ${TRL_ARGS:-}
fi
ls -la "$OUT"
