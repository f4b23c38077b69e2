#!/usr/bin/env bash
# The generation goal of issue 12 (batch 256 >= 25% of the weight+KV read floor) in one device call:
# the GPU tests of the decode kernels, the Triton decode GEMMs' tile sweep (bench_triton_gemm.py at
# 256 rows: its best configs are handed to the generate runs), then bench_generate.py --no-hf at
# batch 256 for each variant of the decode kernels' module switches, each its own
# process (module switches), same machine, same call. Everything lands in $WORK, packed as
# $OUT/decode_ab.tgz (a device call returns at most 8 files); the summary prints.
#
#   bash benchmarks/decode_ab_h200.sh            # carry [".whl"]; ~8 minutes warm
# Environment: OUT (/tmp/decode_ab), WORK (/tmp/decode_ab_work), SITE (/tmp/site), SKIP_TESTS=1,
# SKIP_SWEEP=1, SWEEP_S (240: the sweep's time limit), SWEEP_GEMMS ("fc1"), VARIANTS (names
# below, in order), MODEL (hybridflow/conf/model/qwen2_0_5b.yaml), BATCH (256).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/decode_ab}
WORK=${WORK:-/tmp/decode_ab_work}
SITE=${SITE:-/tmp/site}
mkdir -p "$OUT" "$WORK"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl \
  > "$WORK/pip.log" 2>&1
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_decode_kernels_gpu.py \
    > "$WORK/gpu_tests.log" 2>&1
  grep -E "^E |passed|failed" "$WORK/gpu_tests.log" | tail -15
fi
CONFIGS=()  # --gemm-configs from the sweep (decode's rows): swiglu=... linear=...
if [ -z "${SKIP_SWEEP:-}" ]; then
  timeout "${SWEEP_S:-240}" python3 benchmarks/bench_triton_gemm.py --gemms ${SWEEP_GEMMS:-fc1} \
    --rows 256 --out "$WORK/triton_gemm.json" > "$WORK/triton_gemm.log" 2>&1
  grep -E "M=" "$WORK/triton_gemm.log"
  python3 - "$WORK/triton_gemm.json" > "$WORK/gemm_configs.txt" <<'EOF'
import json, sys
try:
    cases = json.load(open(sys.argv[1]))["cases"]
except (OSError, ValueError):
    cases = []
cfg = lambda b: ",".join(str(b[k]) for k in ("block_m", "block_n", "block_k", "warps", "stages", "group_m",
                                             "split"))
picks = {"fc1": "swiglu", "qkv": "linear", "fc2": "linear_long_k"}  # proj: the qkv pick (one table)
print(" ".join(f"{picks[c['gemm']]}={cfg(c['best'])}" for c in cases if c["gemm"] in picks))
EOF
  read -r -a CONFIGS < "$WORK/gemm_configs.txt"
fi
echo "gemm configs: ${CONFIGS[*]:-the module tables}"
i=0
for v in ${VARIANTS:-defaults nopdl defaults nopdl}; do
  i=$((i + 1))  # each run its own JSON / log (a variant may repeat: ABAB)
  case $v in
    off) flags=(--fuse-rope-attention off --triton-argmax off --step-kernel off --triton-gemms) ;;
    defaults) flags=() ;;  # the module defaults as committed
    qkv) flags=(--triton-gemms fc1 qkv) ;;
    proj) flags=(--triton-gemms fc1 proj) ;;
    qkv_proj) flags=(--triton-gemms fc1 qkv proj) ;;
    fc2) flags=(--triton-gemms fc1 fc2) ;;
    prefill) flags=(--prefill-swiglu-gemm on) ;;
    nofold) flags=(--fold-small-launches off) ;;
    fc2out) flags=(--fc2-into-residual off) ;;  # fc2 written out, added by the next norm
    nopdl) flags=(--pdl off) ;;  # Triton kernels launched plainly
    pf_*) IFS=_ read -r -a names <<< "${v#pf_}"  # pf_qkv_proj: those GEMMs' weights hinted; pf_none
          [ "${names[*]}" = none ] && names=(); flags=(--prefetch-weights "${names[@]}") ;;
    attn_*) IFS=_ read -r _ w st pp <<< "$v"; flags=(--attn-config "$w,$st,$pp") ;;  # attn_4_2_2
    *) echo "unknown variant $v" >&2; exit 2 ;;
  esac
  [ ${#CONFIGS[@]} -gt 0 ] && flags+=(--gemm-configs "${CONFIGS[@]}")
  timeout 240 python3 benchmarks/bench_generate.py --batches "${BATCH:-256}" --compile-decode \
    --kv-window 64 --model "${MODEL:-conf/model/qwen2_0_5b.yaml}" --skip-checks --no-hf \
    --decode-kernels triton "${flags[@]}" \
    --out "$WORK/generate_${i}_$v.json" > "$WORK/generate_${i}_$v.log" 2>&1
  python3 - "$WORK/generate_${i}_$v.json" "$v" "${BATCH:-256}" <<'EOF'
import json, sys
try:
    r = json.load(open(sys.argv[1]))["results"][sys.argv[3]]
except (OSError, KeyError, ValueError) as e:
    print(f"{sys.argv[2]:8s} no result ({type(e).__name__}): see its log"); sys.exit(0)
print(f"{sys.argv[2]:8s} batch {sys.argv[3]}: ours {r['ours_s']:.4f} s (compiled {r.get('ours_compiled_s', float('nan')):.4f}), "
      f"floor+kv fraction {r['floor_with_kv_fraction']:.3f} "
      f"({r.get('floor_with_kv_fraction_compiled', float('nan')):.3f} compiled)")
EOF
done
tar czf "$OUT/decode_ab.tgz" -C "$WORK" .
