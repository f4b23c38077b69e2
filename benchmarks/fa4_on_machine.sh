#!/usr/bin/env bash
# FlashAttention-4 (algo.packed_attention=fa4) on a GPU machine without network, from what
# benchmarks/fetch_fa4_wheels.sh left here (.whl_fa4/ and the library wheel's parts in .xfer_fa4/,
# 00 01 ...), in device calls while the machine stays warm (it keeps /tmp): one call per part but
# the last, then the last part with the wheels:
#   carry [".xfer_fa4/00"]:                              bash benchmarks/fa4_on_machine.sh part
#   carry [".xfer_fa4/01"]:                              bash benchmarks/fa4_on_machine.sh part
#   carry [".xfer_fa4/02", ".whl_fa4"] (+ .whl, ...):     bash benchmarks/fa4_on_machine.sh install
# `install` joins the parts (those waiting in PARTS and any carried with it, in name order) into the
# CUTLASS DSL's library wheel, unzips every wheel into SITE (the folder gsm8k_h200.sh puts on
# PYTHONPATH; the DSL's wheels share nvidia_cutlass_dsl/, which `pip --target` does not merge),
# links each package of nvidia_cutlass_dsl/dsl_packages into SITE (what the DSL's .pth file would
# add to sys.path; .pth files are not read from PYTHONPATH), and imports flash_attn.cute and
# cutlass from there. Then `gsm8k_h200.sh` runs pick fa4 (auto).
# SITE's last folder is named site-packages: quack-kernels (flash-attn-4's dependency) keys the
# compile cache of its GEMMs with custom epilogues (commit 4f87182) by the code of the functions
# they reference, taking only those under a site-packages (or dist-packages) folder for installed
# code; from any other folder it walks the CUTLASS DSL's own functions and fails at their
# ContextVar (quack-kernels 0.6.5 with the DSL 4.8.1).
# Environment: SITE (/tmp/site-packages), PARTS (/tmp/xfer_fa4: where the earlier parts wait), SRC
# (.xfer_fa4), WHEELS (.whl_fa4).
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=${SITE:-/tmp/site-packages}
PARTS=${PARTS:-/tmp/xfer_fa4}
SRC=${SRC:-.xfer_fa4}
WHEELS=${WHEELS:-.whl_fa4}

copy_carried() {  # the parts carried with this call -> PARTS; prints how many
  mkdir -p "$PARTS"
  local f n=0
  for f in "$SRC"/[0-9][0-9]; do
    if [ -f "$f" ]; then cp "$f" "$PARTS/"; n=$((n + 1)); fi
  done
  echo "$n"
}

part() {
  [ "$(copy_carried)" -gt 0 ] || {
    echo "no part in $SRC/ (00, 01, ...): carry one with this call" >&2; exit 1; }
  ls -l "$PARTS"
}

install() {
  copy_carried >/dev/null  # the last part, carried with this call
  compgen -G "$PARTS/[0-9][0-9]" >/dev/null || {
    echo "no part in $PARTS: run 'part' in a call before (carry $SRC/00)" >&2; exit 1; }
  local joined
  joined="$(dirname "$PARTS")/cutlass_dsl_libs.whl"  # unzipped, not installed: any name serves
  cat "$PARTS"/[0-9][0-9] > "$joined"
  python3 -m zipfile -t "$joined" >/dev/null 2>&1 || {
    echo "the parts in $PARTS ($(cd "$PARTS" && echo [0-9][0-9])) do not join into the library" \
      "wheel: a part is missing (carry each of $SRC/ in turn with 'part')" >&2; exit 1; }
  mkdir -p "$SITE"
  for w in "$WHEELS"/*.whl "$joined"; do
    python3 -m zipfile -e "$w" "$SITE"
  done
  local d
  for d in "$SITE"/nvidia_cutlass_dsl/dsl_packages/*; do
    ln -sfn "$d" "$SITE/$(basename "$d")"
  done
  PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" python3 -c \
    "import cutlass, flash_attn.cute; print('flash-attn-4 ready:', flash_attn.cute.__file__)"
}

case ${1:-} in
  part|install) "$1" ;;
  *) echo "usage: $0 part|install" >&2; exit 2 ;;
esac
