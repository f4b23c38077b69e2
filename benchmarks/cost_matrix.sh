#!/usr/bin/env bash
# The H200 configurations behind the cost model's calibration and its leave-one-out check
# (benchmarks/results/cost/rl_*.json; each record's JSON holds the command that made it). Run on a
# 2-GPU machine:
#   bash benchmarks/cost_matrix.sh x1 DIR     # 1-GPU configs, one after another on GPU 0
#   bash benchmarks/cost_matrix.sh x1kv DIR   # ... with the generator kept and a 64-column KV window
#   bash benchmarks/cost_matrix.sh x1tk DIR   # ... plus the fused decode kernels, and recompute
#   bash benchmarks/cost_matrix.sh x1ch DIR   # ... plus the chunked LM head
#   bash benchmarks/cost_matrix.sh x2 DIR     # 2-GPU configs (DP=2, TP=2); x2tpg, x2big likewise
# One config at a time: the passes are host-bound at these sizes and a neighbour's host load would
# show in them (a first pass ran 1-GPU configs two side by side; its numbers are not used).
# then: python -m hybridflow.cost.calibrate benchmarks/results/cost/rl_*.json \
#         -o benchmarks/results/calibration.json --validation benchmarks/results/cost_validation.json
set -u
part=$1; out=$2; mkdir -p "$out"
# The trainer options of the time these records were measured, stated so that today's auto
# defaults decide none of them: bf16, 8-row micro-batches, generator rebuilt every step, no KV
# window, eager PyTorch decode; a part's own flags and overrides come after them and win.
PINNED="--micro 8 --override trainer.precision=bf16 --override algo.use_dynamic_bsz=false
  --override rollout.free_cache_engine=true --override rollout.compact_finished_rows=false
  --override rollout.decode_kv_window=0 --override rollout.decode_kernels=torch
  --override rollout.compile_decode=false"
B="python benchmarks/bench_rl_step.py $PINNED"
one() {  # one() NAME ARGS...: a 1-GPU config, log next to its JSON
  local name=$1; shift
  CUDA_VISIBLE_DEVICES=0 timeout 300 $B "$@" --out "$out/$name.json" > "$out/$name.log" 2>&1 \
    || echo "FAILED $name (see $name.log)"
}
two() {  # two() NAME ARGS...: a 2-GPU config
  local name=$1; shift
  timeout 300 $B --nproc 2 "$@" --out "$out/$name.json" > "$out/$name.log" 2>&1 \
    || echo "FAILED $name (see $name.log)"
}
case $part in
x1)
  one rl_0_5b_x1_mb8 --algos grpo,ppo --old-log-prob
  one rl_1_5b_x1_mb8 --model qwen2_1_5b --algos grpo,ppo --old-log-prob
  one rl_0_5b_x1_mb16f32 --algos grpo --micro 16 --fmicro 32 --old-log-prob
  one rl_1_5b_x1_mb16f32 --model qwen2_1_5b --algos grpo --micro 16 --fmicro 32 --old-log-prob
  one rl_0_5b_x1_p16r512 --algos grpo --prompts 16 --response 512 --micro 4 --old-log-prob
  one rl_1_5b_x1_p16n4r128 --model qwen2_1_5b --algos ppo --prompts 16 --samples 4 --response 128 \
    --old-log-prob
  ;;
x1kv)  # the generator kept and a 64-column KV window, no old_log_prob pass (redundant with one
       # mini-batch per step), 16- and 64-sequence update micro-batches
  for m in 0_5b 1_5b; do
    for mb in 16 64; do
      one rl_${m}_x1_mb${mb}f64_kv64 --model qwen2_$m --algos grpo --micro $mb --fmicro 64 \
        --override data.synthetic_length=120 --override actor_optim.lr=1e-6 \
        --override rollout.free_cache_engine=false --override rollout.decode_kv_window=64
    done
  done
  ;;
x1tk)  # + the fused decode kernels (rollout.decode_kernels=triton, compile_decode): activation
       # checkpointing at 64-sequence micro-batches, and 32-sequence micro-batches at 1.5B
  tk="--algos grpo --fmicro 64 --override data.synthetic_length=120
      --override actor_optim.lr=1e-6 --override rollout.free_cache_engine=false
      --override rollout.decode_kv_window=64 --override rollout.decode_kernels=triton
      --override rollout.compile_decode=true"
  one rl_1_5b_x1_mb64f64_kv64_rc_tk --model qwen2_1_5b --micro 64 --recompute $tk
  one rl_0_5b_x1_mb64f64_kv64_rc_tk --model qwen2_0_5b --micro 64 --recompute $tk
  one rl_1_5b_x1_mb32f64_kv64_tk --model qwen2_1_5b --micro 32 $tk
  ;;
x1ch)  # x1tk's options + the LM head in 4,096-token chunks (parallel.lm_head_chunk_tokens)
  ch="--algos grpo --fmicro 64 --override data.synthetic_length=120
      --override actor_optim.lr=1e-6 --override rollout.free_cache_engine=false
      --override rollout.decode_kv_window=64 --override rollout.decode_kernels=triton
      --override rollout.compile_decode=true --override parallel.lm_head_chunk_tokens=4096"
  one rl_1_5b_x1_mb64f64_kv64_rc_ch4k_tk --model qwen2_1_5b --micro 64 --recompute $ch
  one rl_0_5b_x1_mb64f64_kv64_rc_ch4k_tk --model qwen2_0_5b --micro 64 --recompute $ch
  one rl_1_5b_x1_mb64f64_kv64_ch4k_tk --model qwen2_1_5b --micro 64 $ch
  ;;
x2)
  two rl_0_5b_x2_dp2_mb8 --algos grpo --old-log-prob
  two rl_0_5b_x2_dp2_mb16f32 --algos grpo --micro 16 --fmicro 32 --old-log-prob
  two rl_0_5b_x2_tp2g1_mb8 --algos grpo --tp 2 --tp-gen 1 --old-log-prob
  two rl_0_5b_x2_tp2g1_mb16f32 --algos grpo --tp 2 --tp-gen 1 --micro 16 --fmicro 32 --old-log-prob
  two rl_1_5b_x2_tp2g1_mb8 --model qwen2_1_5b --algos grpo --tp 2 --tp-gen 1 --old-log-prob
  two rl_1_5b_x2_tp2g1_mb16f32 --model qwen2_1_5b --algos grpo --tp 2 --tp-gen 1 --micro 16 --fmicro 32 \
    --old-log-prob
  two rl_1_5b_x2_dp2_mb8 --model qwen2_1_5b --algos grpo --old-log-prob
  ;;
x2tpg)  # generation at TP_g = 2 (NCCL all-reduces inside the decode CUDA graphs)
  two rl_0_5b_x2_tp2g2_mb8 --algos grpo --tp 2 --tp-gen 2 --old-log-prob
  ;;
x2big)  # a GPU-bound model: Qwen2-7B at TP=2 (84 GiB of 141 per GPU)
  two rl_7b_x2_tp2g1_mb8 --model qwen2_7b --algos grpo --tp 2 --tp-gen 1 --steps 4 --old-log-prob
  ;;
*) echo "part: x1 | x1kv | x1tk | x1ch | x2 | x2tpg | x2big"; exit 2;;
esac
for f in "$out"/*.log; do echo "== $f"; tail -n 13 "$f" | grep -v "^values\|^update_critic\|^reward\|^adv"; done
