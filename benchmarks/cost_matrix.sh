#!/usr/bin/env bash
# The H200 configurations behind the cost model's calibration and its leave-one-out check
# (benchmarks/results/rl_*.json; README "Cost model validation"). Run on a 2-GPU machine:
#   bash benchmarks/cost_matrix.sh x1 $OUT    # 1-GPU configs, two at a time (one per GPU)
#   bash benchmarks/cost_matrix.sh x2 $OUT    # 2-GPU configs (DP=2, TP=2)
# then: python -m hybridflow.cost.calibrate benchmarks/results/rl_*.json \
#         -o benchmarks/results/calibration.json --validation benchmarks/results/cost_validation.json
set -u
part=$1; out=$2; mkdir -p "$out"
B="python benchmarks/bench_rl_step.py"
one() {  # one() GPU NAME ARGS...: a 1-GPU config on GPU $1, log next to its JSON
  local gpu=$1 name=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpu $B "$@" --out "$out/$name.json" > "$out/$name.log" 2>&1 \
    || echo "FAILED $name (see $name.log)"
}
two() {  # two() NAME ARGS...: a 2-GPU config
  local name=$1; shift
  timeout 300 $B --nproc 2 "$@" --out "$out/$name.json" > "$out/$name.log" 2>&1 \
    || echo "FAILED $name (see $name.log)"
}
case $part in
x1)
  one 0 rl_0_5b_x1_mb8 --algos grpo,ppo & one 1 rl_1_5b_x1_mb8 --model qwen2_1_5b --algos grpo,ppo & wait
  one 0 rl_0_5b_x1_mb16f32 --algos grpo --micro 16 --fmicro 32 &
  one 1 rl_1_5b_x1_mb16f32 --model qwen2_1_5b --algos grpo --micro 16 --fmicro 32 & wait
  one 0 rl_0_5b_x1_p16r512 --algos grpo --prompts 16 --response 512 --micro 4 &
  one 1 rl_1_5b_x1_p16n4r128 --model qwen2_1_5b --algos ppo --prompts 16 --samples 4 --response 128 & wait
  ;;
x2)
  two rl_0_5b_x2_dp2_mb8 --algos grpo
  two rl_0_5b_x2_dp2_mb16f32 --algos grpo --micro 16 --fmicro 32
  two rl_0_5b_x2_tp2g1_mb8 --algos grpo --tp 2 --tp-gen 1
  two rl_0_5b_x2_tp2g1_mb16f32 --algos grpo --tp 2 --tp-gen 1 --micro 16 --fmicro 32
  two rl_1_5b_x2_tp2g1_mb8 --model qwen2_1_5b --algos grpo --tp 2 --tp-gen 1
  two rl_1_5b_x2_tp2g1_mb16f32 --model qwen2_1_5b --algos grpo --tp 2 --tp-gen 1 --micro 16 --fmicro 32
  two rl_1_5b_x2_dp2_mb8 --model qwen2_1_5b --algos grpo
  ;;
x2tpg)  # generation at TP_g = 2 (NCCL all-reduces inside the decode CUDA graphs)
  two rl_0_5b_x2_tp2g2_mb8 --algos grpo --tp 2 --tp-gen 2
  ;;
*) echo "part: x1 | x2 | x2tpg"; exit 2;;
esac
for f in "$out"/*.log; do echo "== $f"; tail -n 14 "$f"; done
