#!/usr/bin/env bash
# FlashAttention-4 (algo.packed_attention=fa4) on a GPU machine without network, from what
# benchmarks/fetch_fa4_wheels.sh left here (.whl_fa4/ and the library wheel's two parts in
# .xfer_fa4/), in two device calls while the machine stays warm (it keeps /tmp):
#   carry [".xfer_fa4/00"]:                              bash benchmarks/fa4_on_machine.sh part
#   carry [".xfer_fa4/01", ".whl_fa4"] (+ .whl, ...):     bash benchmarks/fa4_on_machine.sh install
# `install` joins the parts into the CUTLASS DSL's library wheel, unzips every wheel into SITE (the
# folder gsm8k_h200.sh puts on PYTHONPATH; the DSL's wheels share nvidia_cutlass_dsl/, which
# `pip --target` does not merge), links each package of nvidia_cutlass_dsl/dsl_packages into SITE
# (what the DSL's .pth file would add to sys.path; .pth files are not read from PYTHONPATH), and
# imports flash_attn.cute and cutlass from there. Then `gsm8k_h200.sh` runs pick fa4 (auto).
# SITE's last folder is named site-packages: quack-kernels (flash-attn-4's dependency) keys the
# compile cache of its GEMMs with custom epilogues (commit 4f87182) by the code of the functions
# they reference, taking only those under a site-packages (or dist-packages) folder for installed
# code; from any other folder it walks the CUTLASS DSL's own functions and fails at their
# ContextVar (quack-kernels 0.6.5 with the DSL 4.8.1).
# Environment: SITE (/tmp/site-packages), PARTS (/tmp/xfer_fa4: where the first part waits), SRC
# (.xfer_fa4), WHEELS (.whl_fa4).
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=${SITE:-/tmp/site-packages}
PARTS=${PARTS:-/tmp/xfer_fa4}
SRC=${SRC:-.xfer_fa4}
WHEELS=${WHEELS:-.whl_fa4}

part() {
  mkdir -p "$PARTS"
  cp "$SRC/00" "$PARTS/00"
  ls -l "$PARTS"
}

install() {
  [ -f "$PARTS/00" ] || { echo "no $PARTS/00: run 'part' in the call before (carry $SRC/00)" >&2; exit 1; }
  [ -f "$SRC/01" ] || { echo "no $SRC/01: carry it with this call" >&2; exit 1; }
  local joined
  joined="$(dirname "$PARTS")/cutlass_dsl_libs.whl"  # unzipped, not installed: any name serves
  cat "$PARTS/00" "$SRC/01" > "$joined"
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
