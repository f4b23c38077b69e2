#!/usr/bin/env bash
# NeMo-RL's 8B GRPO workload on one node: bash benchmarks/scaleout_8b.sh NGPU [LAYOUT] [hydra overrides...]
# LAYOUT: dp (default: TP=1 PP=1, gen TP_g=1, the cost model's pick at 2 and 8 GPUs) or pp2
# (training PP=2, gen TP_g=1: the runner-up). Writes benchmarks/results/scaleout_8b_h200x{N}[_pp2].json
# (OUT_DIR overrides the folder). STEPS (default 4) steps; the first is reported apart.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:?usage: scaleout_8b.sh NGPU [dp|pp2] [overrides...]}; shift
LAYOUT=dp
if [[ $# -gt 0 && ( $1 == dp || $1 == pp2 ) ]]; then LAYOUT=$1; shift; fi
OUT_DIR=${OUT_DIR:-benchmarks/results}
PY=${PYTHON:-python}
case $LAYOUT in
  dp)  lay=(parallel.tensor_parallel_size=1 parallel.pipeline_parallel_size=1 rollout.tensor_parallel_size=1); tag="" ;;
  pp2) lay=(parallel.tensor_parallel_size=1 parallel.pipeline_parallel_size=2 rollout.tensor_parallel_size=1); tag="_pp2" ;;
esac
exec "$PY" benchmarks/scaleout_8b.py --nproc "$N" --steps "${STEPS:-4}" \
  --out "$OUT_DIR/scaleout_8b_h200x${N}${tag}.json" "${lay[@]}" "$@"
