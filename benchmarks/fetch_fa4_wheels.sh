#!/usr/bin/env bash
# FlashAttention-4 (algo.packed_attention=fa4) for the GPU machine, which has no network: its wheels
# for Python 3.12 into .whl_fa4/, and the CUTLASS DSL's CUDA 13 library wheel (~92 MB, more than one
# device call carries) split into parts of 36 MiB in .xfer_fa4/ (00, 01, 02: each beside the working
# tree within one call's 64 MiB). List both in .git/info/exclude.
#   bash benchmarks/fetch_fa4_wheels.sh
# On the machine, a call per part (benchmarks/fa4_on_machine.sh part, then install): `part`
# copies the carried part to /tmp/xfer_fa4/; `install` carries the last part and .whl_fa4, joins
# the parts and unzips every wheel into /tmp/site-packages (the DSL's library wheels share
# nvidia_cutlass_dsl/, which pip --target does not merge), with nvidia_cutlass_dsl/dsl_packages'
# packages linked beside them.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-.venv/bin/pip}
LIBS=nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
mkdir -p .whl_fa4 .xfer_fa4
"$PIP" download -q --no-deps --python-version 3.12 --only-binary=:all: \
  --platform manylinux_2_28_x86_64 --dest .whl_fa4 \
  flash-attn-4==4.0.0b36 quack-kernels==0.6.5 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 \
  einops==0.8.2 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
  nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 \
  cuda-bindings==13.5.0 cuda-pathfinder==1.9.1 protobuf==7.36.2
rm -f .xfer_fa4/*
split -b 36M -d ".whl_fa4/$LIBS" .xfer_fa4/
rm ".whl_fa4/$LIBS"
ls -l .whl_fa4 .xfer_fa4
echo "on the machine: bash benchmarks/fa4_on_machine.sh part, then install"
