#!/usr/bin/env bash
# A/B of the decode options on one GPU in one device call: the GPU tests of the decode kernels, then
# bench_generate.py --no-hf at batch $BATCH for each variant below (flags building a DecodeOptions,
# rollout.kernel_options.*), each its own process, same machine, same call; list a variant twice
# (ABAB) to see the call's noise. Everything lands in $WORK, packed as $OUT/decode_ab.tgz (a device
# call returns at most 8 files); the summary prints. Measured results go to docs/perf_log.md.
#
#   bash benchmarks/decode_ab_h200.sh            # carry [".whl"]; ~6 minutes warm
# Environment: OUT (/tmp/decode_ab), WORK (/tmp/decode_ab_work), SITE (/tmp/site-packages),
# SKIP_TESTS=1, VARIANTS (names below, in order), MODEL (hybridflow/conf/model/qwen2_0_5b.yaml),
# BATCH (256).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/decode_ab}
WORK=${WORK:-/tmp/decode_ab_work}
SITE=${SITE:-/tmp/site-packages}
mkdir -p "$OUT" "$WORK"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl \
  > "$WORK/pip.log" 2>&1
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_decode_kernels_gpu.py \
    > "$WORK/gpu_tests.log" 2>&1
  grep -E "^E |passed|failed" "$WORK/gpu_tests.log" | tail -15
fi
i=0
for v in ${VARIANTS:-defaults nopdl defaults nopdl}; do
  i=$((i + 1))  # each run its own JSON / log (a variant may repeat: ABAB)
  case $v in
    defaults) flags=() ;;  # rollout.kernel_options' defaults
    nopdl) flags=(--pdl off) ;;  # Triton kernels launched plainly
    pf_*) IFS=_ read -r -a names <<< "${v#pf_}"  # pf_qkv_proj: those GEMMs' weights hinted; pf_none
          [ "${names[*]}" = none ] && names=(); flags=(--prefetch-weights "${names[@]}") ;;
    pfrows_*) flags=(--prefetch-min-rows "${v#pfrows_}") ;;  # pfrows_64: the hints from 64 rows
    fc1rows_*) flags=(--swiglu-gemm-min-rows "${v#fc1rows_}") ;;  # fc1rows_100000: cuBLAS fc1
    *) echo "unknown variant $v" >&2; exit 2 ;;
  esac
  timeout 240 python3 benchmarks/bench_generate.py --batches "${BATCH:-256}" --compile-decode \
    --kv-window 64 --model "${MODEL:-hybridflow/conf/model/qwen2_0_5b.yaml}" --skip-checks --no-hf \
    --decode-kernels triton "${flags[@]}" \
    --out "$WORK/generate_${i}_$v.json" > "$WORK/generate_${i}_$v.log" 2>&1
  python3 - "$WORK/generate_${i}_$v.json" "$v" "${BATCH:-256}" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))["results"][sys.argv[3]]
except (OSError, KeyError, ValueError) as e:
    print(f"{sys.argv[2]:8s} no result ({type(e).__name__}): see its log"); sys.exit(0)
print(f"{sys.argv[2]:8s} batch {sys.argv[3]}: ours {r['ours_s']:.4f} s (compiled {r.get('ours_compiled_s', float('nan')):.4f}), "
      f"floor+kv fraction {r['floor_with_kv_fraction']:.3f} "
      f"({r.get('floor_with_kv_fraction_compiled', float('nan')):.3f} compiled)")
PY
done
tar czf "$OUT/decode_ab.tgz" -C "$WORK" .
