#!/usr/bin/env bash
# The main job on its embedded default: a small PPO run on CPU that visibly learns
# (hybridflow/conf/experiment/demo.yaml). Extra arguments are Hydra overrides, e.g. `algo=grpo`.
source "$(dirname "$0")/_env.sh"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
exec python -m hybridflow.train experiment=demo "$@"
