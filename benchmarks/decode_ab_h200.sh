#!/usr/bin/env bash
# The generation goal of issue 12 (batch 256 >= 25% of the weight+KV read floor) in one device call:
# the GPU tests of the decode kernels and the generator (the fused RoPE + attention, the chunked
# argmax and the shared attention loop of decode._attend_blocks included),
# a traced batch-256 call (profile_decode.py --timeline: where the GPU idles, by generator phase)
# and bench_generate.py --no-hf at batch 256 without and with the two prepared kernels, each its
# own process (module switches), same machine, same call. JSON and logs land in $OUT.
#
#   bash benchmarks/decode_ab_h200.sh            # carry [".whl"]; ~6 minutes warm
# Environment: OUT (/tmp/decode_ab), SITE (/tmp/site), MODEL (conf/model/qwen2_0_5b.yaml),
# VARIANTS ("base fused argmax both"), SKIP_TESTS=1.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/decode_ab}
SITE=${SITE:-/tmp/site}
MODEL=${MODEL:-conf/model/qwen2_0_5b.yaml}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl \
  > "$OUT/pip.log" 2>&1
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 400 python3 -m pytest -q tests/gpu/test_decode_kernels_gpu.py tests/gpu/test_rollout_gpu.py \
    > "$OUT/gpu_tests.log" 2>&1
  grep -E "^E |passed|failed" "$OUT/gpu_tests.log" | tail -15
fi
timeout 200 python3 benchmarks/profile_decode.py --models "$MODEL" --batches 256 --compile --no-eager \
  --kernels triton --timeline --steps 32 --prefill --out "$OUT/timeline.json" > "$OUT/timeline.log" 2>&1
grep -E "B=256|idle" "$OUT/timeline.log" | head -20
for v in ${VARIANTS:-base fused argmax both}; do
  case $v in
    base) flags=() ;;
    fused) flags=(--fuse-rope-attention) ;;
    argmax) flags=(--triton-argmax) ;;
    both) flags=(--fuse-rope-attention --triton-argmax) ;;
    *) echo "unknown variant $v" >&2; exit 2 ;;
  esac
  timeout 240 python3 benchmarks/bench_generate.py --batches 256 --compile-decode --kv-window 64 \
    --skip-checks --no-hf --decode-kernels triton "${flags[@]}" --out "$OUT/generate_$v.json" \
    > "$OUT/generate_$v.log" 2>&1
  python3 - "$OUT/generate_$v.json" "$v" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))["results"]["256"]
print(f"{sys.argv[2]:7s} batch 256: ours {r['ours_s']:.4f} s (compiled {r.get('ours_compiled_s', float('nan')):.4f}), "
      f"floor+kv fraction {r['floor_with_kv_fraction']:.3f} "
      f"({r.get('floor_with_kv_fraction_compiled', float('nan')):.3f} compiled)")
EOF
done
