#!/usr/bin/env bash
# Is the slow mode of the 1.5B forward/update stages (bench_rl_step, 1 GPU) host oversubscription
# by OpenMP threads? Runs the same config with OMP_NUM_THREADS unset and 4.
B="python benchmarks/bench_rl_step.py --model qwen2_1_5b --algos grpo --steps 5"
for omp in 4 unset 4 unset 4; do
  if [ $omp = unset ]; then env -u OMP_NUM_THREADS CUDA_VISIBLE_DEVICES=0 $B --out /tmp/o.json > /tmp/o.log 2>&1
  else OMP_NUM_THREADS=$omp CUDA_VISIBLE_DEVICES=0 $B --out /tmp/o.json > /tmp/o.log 2>&1; fi
  python - "$omp" <<'PY'
import json, sys
r = json.load(open("/tmp/o.json"))["results"]["grpo"]
print("OMP", sys.argv[1], " ".join(f"{k[9:]}={[round(s[k], 3) for s in r['steps'][1:]]}"
      for k in ("timing_s/old_log_prob", "timing_s/ref", "timing_s/update_actor")))
PY
done
