#!/usr/bin/env bash
# Download the peer-baseline wheels the H200 machines lack (no network there) into DIR (default
# .whl_bench): TRL 1.16 and its data stack on top, and under DIR/fallback the requirements the
# machine may lack, which benchmarks/install_peer_wheels.py installs only where the machine's own
# packages do not meet them (it never shadows torch, transformers, accelerate, numpy, pandas, ...).
#   bash benchmarks/fetch_peer_wheels.sh [DIR]        # then carry [".whl_bench"] (about 2 MB)
# PEER_PYARROW=1 adds pyarrow (datasets 5.2 wants >= 24; ~45 MB, carried in its own call if needed).
set -euo pipefail
dir=${1:-.whl_bench}
mkdir -p "$dir/fallback"
get() {  # DEST SPEC...: cp312 manylinux / pure wheels, no dependencies
  local dest=$1; shift
  python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    -d "$dest" "$@"
}
get "$dir" trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 gguf==0.19.0
get "$dir/fallback" xxhash "fsspec<=2026.9.0,>=2023.1.0" psutil tqdm filelock jinja2 markupsafe \
  pyyaml
if [ "${PEER_PYARROW:-0}" = 1 ]; then
  get "$dir/fallback" "pyarrow>=24.0.0"
fi
ls -la "$dir" "$dir/fallback"
