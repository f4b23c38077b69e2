#!/usr/bin/env bash
# The product's defaults against the speed configuration on one H200, in one device call.
# Workloads w1_0_5b and w1_1_5b (bench_vs_trl.py's: Qwen2-0.5B / Qwen2-1.5B shapes, random init,
# 8 prompts x 8 samples, 128-token prompts + 256 forced response tokens), GRPO. Side "default" is
# bench_rl_step.py with no configuration flags (the auto options decided at start-up); side "speed"
# is bench_rl_step.py --speed. benchmarks/ab_rl_step.py alternates them, one process per run, in
# ABBA order over 2 rounds; each run is 1 warm-up step + 4 timed. Writes $OUT/defaults_h200.json
# (per workload default_step_s, speed_step_s, speed_vs_default, per-stage medians, every run;
# machine, versions, command) and every run's log under $OUT/logs/.
#
#   bash benchmarks/defaults_h200.sh               # carry [".whl"] (megatron-core, hydra, omegaconf, antlr4)
#   SMOKE=1 OUT=/tmp/d bash benchmarks/defaults_h200.sh   # CPU, tiny model: the plumbing only
#
# Time on an H200, estimated: wheels ~20 s; a run ~40-60 s (imports and model build ~25 s, the
# warm-up step ~17-20 s with graph capture and compilation, 4 steps of 0.6-1.2 s), 4 runs a round:
# ~3.5 min per round, ~7 min in all. A round that would end past 7.5 minutes is not started
# (DEADLINE_S), a run past 3 minutes is ended (RUN_TIMEOUT_S), and none runs on past 8.5 minutes;
# the JSON (rewritten after every pair of runs) says what ran.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/defaults_h200}
mkdir -p "$OUT"
if [ "${SMOKE:-0}" != 1 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/site-packages .whl/*.whl
  export PYTHONPATH=/tmp/site-packages:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
PY=${PYTHON:-python3}
if [ "${SMOKE:-0}" = 1 ]; then
  models=w1_0_5b=tiny
  speed="--speed --override trainer.precision=fp32 --override rollout.decode_kernels=torch"
  speed="$speed --override rollout.compile_decode=false"  # the speed options CPU cannot run
  common=(--algos grpo --steps 3 --prompts 2 --samples 4 --response 8)
else
  nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader || true
  models=w1_0_5b=qwen2_0_5b,w1_1_5b=qwen2_1_5b
  speed="--speed"
  common=(--algos grpo --steps 5 --prompts 8 --samples 8 --response 256)
fi
# the deadline counts from ab_rl_step's start; the wheels took their seconds already
$PY benchmarks/ab_rl_step.py --sides default speed --b-args="$speed" --models "$models" --rounds 2 \
  --deadline-s "$((${DEADLINE_S:-450} - SECONDS))" --run-timeout-s "${RUN_TIMEOUT_S:-180}" \
  --logdir "$OUT/logs" --out "$OUT/defaults_h200.json" -- "${common[@]}"
echo "total ${SECONDS} s"
