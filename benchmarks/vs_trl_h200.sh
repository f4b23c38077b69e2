#!/usr/bin/env bash
# TRL 1.16's GRPOTrainer on the w1_0_5b and w1_1_5b workloads of bench_vs_trl.py (Qwen2-0.5B /
# Qwen2-1.5B shapes, random init, 8 prompts x 8 samples, 128 + 256 forced tokens) on one H200, in one
# device call of under 9 minutes. TRL's side only (bench_vs_trl.py --sides trl): ours is measured by
# bench_vs_trl.py's own calls or defaults_h200.sh.
#   1. TRL's fastest configuration that fits (bench_vs_trl.py's defaults): the 64 completions of a
#      step from one generate call, one 64-completion update pass, gradient checkpointing only if
#      the update does not fit without it; fp32 weights under bf16 autocast. 1 warm-up + 4 timed
#      steps per workload -> $OUT/vs_trl_h200.json
#   2. if the time left allows, the configuration of the earlier results (the same with gradient
#      checkpointing on), 1 + 3 steps -> $OUT/vs_trl_h200_grad_ckpt.json
#   3. if the time left allows, the fastest configuration with the model held in bf16 (pure-bf16
#      AdamW, as many TRL users run it; it loses 1e-6 updates to rounding), 1 + 3 steps
#      -> $OUT/vs_trl_h200_bf16_weights.json
# Each phase's log is in $OUT/*.log; a table of all of them is printed last.
#
#   bash benchmarks/vs_trl_h200.sh     # carry [".whl_bench"] (or [".whl", ".whl_bench"]): megatron-core,
#                                      # hydra, omegaconf, antlr4 + trl 1.16, datasets, dill, multiprocess
#   SMOKE=1 OUT=/tmp/v bash benchmarks/vs_trl_h200.sh    # CPU, tiny model: the plumbing only
#
# Time on an H200, estimated from earlier TRL runs of these workloads: wheels ~20 s; per workload
# ~15 s of imports, model build and weight save (~5 s at 0.5B, ~15 s at 1.5B), the memory probe a few
# seconds, the warm-up step ~20-30 s, then steps of ~5-7 s (0.5B) / ~7-9 s (1.5B) without
# checkpointing: phase 1 ~3 min; phase 2 ~2.5 min; phase 3 ~2 min. Phases 2 and 3 start only if
# their estimate (phase 1's time) fits before LIMIT_S (520 s); each phase is cut at what is left.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/vs_trl_h200}
SITE=${SITE:-/tmp/site-packages}
LIMIT_S=${LIMIT_S:-520}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
if [ "${SMOKE:-0}" = 1 ]; then
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  args=(--model-yaml hybridflow/conf/model/tiny.yaml --device cpu --prompt-len 16 --response 8
        --prompts 2 --samples 2)
else
  for d in .whl .whl_bench; do
    if [ -d "$d" ]; then $PY benchmarks/install_peer_wheels.py "$d" --target "$SITE"; fi
  done
  export PYTHONPATH=$SITE:$PWD
  nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader || true
  args=()
fi
$PY -c "import torch, transformers, trl, datasets; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'trl', trl.__version__, 'datasets', datasets.__version__)"

phase() {  # phase NAME STEPS EST_S [bench_vs_trl.py options]: run if EST_S fits in what is left
  local name=$1 steps=$2 est=$3; shift 3
  local left=$((LIMIT_S - SECONDS))
  if [ "$est" -gt "$left" ]; then echo "$name: skipped (needs ~${est} s, ${left} s left)"; return 0; fi
  local t0=$SECONDS
  timeout --kill-after=10 "$left" $PY benchmarks/bench_vs_trl.py --sides trl --workloads w1_0_5b,w1_1_5b \
    --trl-steps "$steps" "${args[@]}" "$@" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1 \
    || echo "$name: exit $? after $((SECONDS - t0)) s (see $name.log; finished workloads are in its JSON)"
  echo "$name: $((SECONDS - t0)) s"
  PHASE_S=$((SECONDS - t0))
}
PHASE_S=0
phase vs_trl_h200 5 0
est=$((PHASE_S * 85 / 100))  # a step fewer than phase 1
phase vs_trl_h200_grad_ckpt 4 "$est" --trl-grad-ckpt on
phase vs_trl_h200_bf16_weights 4 "$est" --trl-weights bf16

$PY - "$OUT" <<'EOF'
import json, pathlib, sys
print(f"{'phase':26s}{'workload':10s}{'trl s':>8s}  {'ckpt':5s} {'weights':27s}{'peak GiB':>9s}  steps")
for name in ("vs_trl_h200", "vs_trl_h200_grad_ckpt", "vs_trl_h200_bf16_weights"):
    p = pathlib.Path(sys.argv[1]) / f"{name}.json"
    if not p.is_file():
        continue
    for w, e in json.loads(p.read_text())["workloads"].items():
        if w == "gsm8k" or "trl_step_s" not in e:  # gsm8k: copied from gsm8k_h200.json, not run
            continue
        c = e["config"]["trl"]
        print(f"{name:26s}{w:10s}{e['trl_step_s']:8.2f}  {str(c['gradient_checkpointing']):5s} {c['weights']:27s}"
              f"{e['trl_peak_memory_gb'] or 0:9.1f}  {[round(s, 2) for s in e['trl_step_s_all']]}")
EOF
echo "total ${SECONDS} s"
