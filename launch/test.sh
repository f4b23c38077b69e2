#!/usr/bin/env bash
# The test suite (unit, multi-rank gloo, and the short learning tests; GPU tests skip without CUDA).
# Extra arguments go to pytest, e.g. `bash launch/test.sh tests/unit -k grpo`.
source "$(dirname "$0")/_env.sh"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec python -m pytest -q -ra "${@:-tests}"
