#!/usr/bin/env bash
# One node, N processes: `NPROC=8 bash launch/torchrun.sh parallel.tensor_parallel_size=2 ...`
# NPROC defaults to the number of GPUs (2 on a CPU-only machine, over gloo).
source "$(dirname "$0")/_env.sh"
if [ -z "${NPROC:-}" ]; then
  NPROC="$(python -c 'import torch; print(torch.cuda.device_count() or 2)')"
fi
PORT="${MASTER_PORT:-$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec torchrun --nnodes 1 --nproc_per_node "$NPROC" --master_addr 127.0.0.1 --master_port "$PORT" \
  -m hybridflow.train "$@"
