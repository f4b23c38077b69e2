#!/usr/bin/env bash
# The GSM8K peer baselines in one device call: transformers' greedy val accuracy of the GGUF file
# (benchmarks/gsm8k_hf_eval.py), then TRL's GRPOTrainer for up to TRL_STEPS steps within what is
# left of TOTAL_S (benchmarks/trl_gsm8k.py: TRL's fastest configuration that fits the GPU, its
# docstring says which), then (phase "score") our validation of the policy snapshots TRL saved
# (benchmarks/gsm8k_h200.sh score). JSON (and generations) go to $OUT.
#
# Here, once (.whl_bench/ and .gsm8k/ are git-ignored, so `carry` can name them):
#   bash benchmarks/fetch_peer_wheels.sh .whl_bench   # trl, datasets, dill, multiprocess, gguf (+ fallback/)
#   python -m hybridflow.data.prepare gsm8k --out .gsm8k   # train.parquet / val.parquet (or .jsonl)
# The model reassembled on the machine beforehand (its parts carried, then
# `bash benchmarks/gsm8k_h200.sh setup`), then one device call with carry [".whl_bench", ".gsm8k"]:
#   MODEL=/tmp/xfer/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf bash benchmarks/gsm8k_peers.sh
# (SITE is /tmp/site-packages as for gsm8k_h200.sh: only missing dependencies of the carried wheels
# are added.)
# Knobs (environment): PHASES="eval trl" | "eval" | "trl" | "trl score" | "score"; EVAL_BS (64);
#   EVAL_LIMIT (all); EVAL_ARGS (more gsm8k_hf_eval.py options, e.g. "--max-new-tokens 512");
#   TRL_STEPS (20); TRL_VAL_AT (e.g. 0,10,20; empty: none); TRL_VAL_SIZE (all); TRL_VAL_BS (64);
#   TRL_SAVE_AT (e.g. 0,5,10: HF snapshots in TRL_WORKDIR/snapshots/step_N; empty: none);
#   TRL_ARGS (more trl_gsm8k.py options, e.g. "--prompts-per-step 16" or "--grad-ckpt on");
#   TRL_RESUME=1: continue the TRL run checkpointed in TRL_WORKDIR (/tmp/trl_gsm8k) by the previous
#   call (the machine must have stayed warm) and checkpoint again if the budget stops it;
#   SCORE_S (180 with phase score after trl: kept from TRL's budget for the scoring);
#   TOTAL_S (560: the call is capped at 600 s); DATA (.gsm8k); WHEELS (.whl_bench);
#   SITE (/tmp/site-packages).
#
# Accuracy per step of TRL beside ours, like for like: TRL saves its policy at chosen steps (fp32 HF
# dirs, ~2 GB each) and OUR validation scores them (same 319 prompts, template, greedy decoding,
# stops, rules; ~7 s each + one model load) instead of TRL's own `--val-at` (transformers generate,
# ~2 device minutes per point). tests/peers/test_trl_snapshots.py shows on CPU that the step-0
# snapshot scores exactly like the GGUF file in our run. Recipe, one warm machine (it goes back after
# 30 minutes held: /tmp, the checkpoint and the snapshots with it):
#   0. carry the GGUF parts, then with carry [".whl", ".gsm8k"]:
#        bash benchmarks/gsm8k_h200.sh setup                                          (~1 min)
#   1. TRL at the experiment's own batch (64 prompts x 8, lr 3e-6, weight decay 0.01 as ours), so
#      that our run (benchmarks/results/gsm8k_h200.json, val every 5 steps) is the matched side;
#      carry [".whl_bench", ".gsm8k"]; the same command each call until its JSON says
#      steps_done == TRL_STEPS; the last call adds the scoring (PHASES="trl score"):
#        MODEL=/tmp/xfer/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf PHASES=trl TRL_RESUME=1 \
#          TRL_STEPS=10 TRL_SAVE_AT=0,5,10 TRL_ARGS="--lr 3e-6 --weight-decay 0.01" \
#          bash benchmarks/gsm8k_peers.sh
#      (scoring alone, once TRL is done; carry [".gsm8k"]:
#        bash benchmarks/gsm8k_h200.sh score /tmp/trl_gsm8k/snapshots/step_*               )
#   2. (a smaller matched pair instead, 16 prompts x 8 on both sides: TRL_ARGS="--prompts-per-step 16
#      --samples 8 --lr 3e-6 --weight-decay 0.01" and ours
#        RUN_DIR=/tmp/gsm8k_matched bash benchmarks/gsm8k_h200.sh train 540 data.prompts_per_step=16 \
#          algo.ppo_mini_batch_size=128 trainer.total_steps=20 trainer.val_every=5 trainer.save_every=0)
#   Check first: TRL's step-0 score must equal our run's step-0 val (same weights, same code).
# Device time on an H200: transformers' greedy eval of the 319 val prompts ~4 min at EVAL_BS=64
# (+1 min load; ~2 min at 320, whose accuracy moves with the batch's padding); TRL 64 x 8: ~1.5 min
# load, the first step of every call ~2.5 min (warm-up), later ones 1-1.5 min; a checkpoint for the
# next call ~10 s; scoring 2 snapshots ~1.5 min. Five TRL steps take three calls.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-}
DATA=${DATA:-.gsm8k}
WHEELS=${WHEELS:-.whl_bench}
SITE=${SITE:-/tmp/site-packages}
OUT=${OUT:-/tmp/gsm8k_peers_out}
PHASES=${PHASES:-eval trl}
TOTAL_S=${TOTAL_S:-560}
TRL_WORKDIR=${TRL_WORKDIR:-/tmp/trl_gsm8k}
mkdir -p "$OUT"

data_file() {  # data_file SPLIT -> DATA/SPLIT.parquet or DATA/SPLIT.jsonl
  for ext in parquet jsonl; do [ -f "$DATA/$1.$ext" ] && { echo "$DATA/$1.$ext"; return; }; done
  echo "no $DATA/$1.parquet or $DATA/$1.jsonl" >&2; exit 1
}
if [[ " $PHASES " == *" eval "* || " $PHASES " == *" trl "* ]]; then
  [ -e "$MODEL" ] || { echo "MODEL=$MODEL: set it to the .gguf file (or an HF directory)" >&2; exit 1; }
fi

python3 benchmarks/install_peer_wheels.py "$WHEELS" --target "$SITE"
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
mods="gguf transformers torch"
[[ " $PHASES " == *" trl "* ]] && mods="$mods trl datasets"
[[ " $PHASES " == *" score "* ]] && mods="$mods megatron.core hydra"  # installed by gsm8k_h200.sh setup
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
  [[ " $PHASES " == *" score "* ]] && budget=$((budget - ${SCORE_S:-180}))
  echo "TRL time budget ${budget}s"
  # shellcheck disable=SC2086  # TRL_ARGS is a list of options
  python3 benchmarks/trl_gsm8k.py --model "$MODEL" --train "$TRAIN" --val "$VAL" \
    --out "$OUT/trl_gsm8k.json" --max-steps "${TRL_STEPS:-20}" --time-budget-s "$budget" \
    --val-at "${TRL_VAL_AT:-}" ${TRL_VAL_SIZE:+--val-size "$TRL_VAL_SIZE"} --val-batch-size "${TRL_VAL_BS:-64}" \
    --save-at "${TRL_SAVE_AT:-}" --workdir "$TRL_WORKDIR" ${TRL_RESUME:+--resume} ${TRL_ARGS:-}
fi

if [[ " $PHASES " == *" score "* ]]; then
  shopt -s nullglob
  snaps=("$TRL_WORKDIR"/snapshots/step_*)
  [ ${#snaps[@]} -gt 0 ] || { echo "no snapshots in $TRL_WORKDIR/snapshots (TRL_SAVE_AT)" >&2; exit 1; }
  # shellcheck disable=SC2086  # SCORE_ARGS is a list of overrides
  OUT="$OUT" DATA="$DATA" SITE="$SITE" bash benchmarks/gsm8k_h200.sh score "${snaps[@]}" -- ${SCORE_ARGS:-}
fi
ls -la "$OUT"
