#!/usr/bin/env bash
# The test suite on every core (pytest-xdist; GPU tests skip without CUDA), in two tiers
# (docs/testing.md):
#   bash launch/test.sh          the default tier, what CI runs: every test not marked `slow`
#   bash launch/test.sh --all    everything: the default tier and the slow end-to-end tests
# Extra arguments go to pytest, e.g. `bash launch/test.sh tests/unit -k grpo` or `-n 0` for one
# process. pytest's exit status is the script's: 5 when nothing was selected.
source "$(dirname "$0")/_env.sh"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
tier=(-m "not slow")
if [ "${1:-}" = "--all" ]; then
  tier=()
  shift
fi
# loadscope: a module's tests stay on one worker, so its module-scoped fixtures (multi-rank runs
# shared by several tests) run once
exec python -m pytest -q -ra -n auto --dist loadscope --durations=15 "${tier[@]}" "${@:-tests}"
