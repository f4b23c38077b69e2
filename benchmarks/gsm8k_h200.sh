#!/usr/bin/env bash
# The GSM8K run on one H200 (hybridflow/conf/experiment/gsm8k_qwen_coder_0_5b.yaml), in device calls
# of at most 10 minutes each. The wheels (.whl: megatron-core 0.16.1, hydra-core, omegaconf,
# antlr4-python3-runtime 4.9.3 and gguf 0.19.0, for Python 3.12) and the prepared data (.gsm8k: output
# of `python -m hybridflow.data.prepare gsm8k --out .gsm8k`) are carried with the call; the GGUF file
# (`bash launch/fetch_qwen_coder.sh DIR`) is larger than one call carries, so it travels in parts
# (`split -b 40M -d DIR/<file>.gguf .xfer/`: a part and the ~10 MB working tree, which grows,
# within one call's 64 MiB), one call each copying its part to /tmp/xfer/parts/, and `setup`
# reassembles and checks it. List .whl/ .whl_bench/ .gsm8k/ .xfer/ in .git/info/exclude.
#
#   bash benchmarks/gsm8k_h200.sh setup                  # install wheels, assemble + verify the GGUF
#   bash benchmarks/gsm8k_h200.sh hf_eval               # transformers' greedy accuracy on the val set
#   bash benchmarks/gsm8k_h200.sh train SECONDS [k=v..] # GRPO with validation; stops (checkpoint)
#                                                         before SECONDS; run again to resume
#   bash benchmarks/gsm8k_h200.sh variant NAME SECONDS [k=v..] # 60 steps of a variant of the recipe
#                                                         (benchmarks/gsm8k_variants.py names them) in
#                                                         RUN_DIR=/tmp/gsm8k_NAME, outputs in OUT/NAME;
#                                                         run again to resume; one at a time
#   bash benchmarks/gsm8k_h200.sh step [STEPS] [k=v..]  # the recipe's step time: STEPS (24) steps
#                                                         without validation or checkpoints, medians
#                                                         over steps 2.. -> $OUT/gsm8k_step_h200.json
#                                                         (and the run's metrics.jsonl and
#                                                         rollout_lengths.jsonl; with
#                                                         trainer.profile_steps, each profiled
#                                                         step's stage summary and op table)
#                                                         (experiment=NAME among the overrides: that
#                                                         experiment's step, e.g. the tools recipe)
#   bash benchmarks/gsm8k_h200.sh ab STEPS NAME...      # `step STEPS` of each named variant
#                                                         (gsm8k_variants.py; base: the defaults) one
#                                                         after another on this machine -> OUT/NAME/
#                                                         (gsm8k_step_h200.json, metrics.jsonl) and
#                                                         OUT/ab_summary.json, one line per variant
#   bash benchmarks/gsm8k_h200.sh score DIR... [-- k=v..] # our validation of HF snapshots (TRL's,
#                                                         trl_gsm8k.py --save-at) in one process
#   bash benchmarks/gsm8k_h200.sh pack [NAME]           # everything under $OUT as one $OUT/NAME.tgz
#                                                         (out.tgz): a device call brings back only
#                                                         a few files, so end a call with it
# Everything lands in $OUT (metrics.jsonl, val_generations.jsonl, val_scores.jsonl, hf_eval.json,
# trl_scores.json, trl_score_val_scores.jsonl, logs; gpu_clocks.csv beside each trainer run: the
# card's SM clock, power, temperature and clock-event reasons, benchmarks/gpu_clocks.py).
# Environment: OUT, DATA (.gsm8k), SITE (/tmp/site-packages: a folder of that name, see
# fa4_on_machine.sh), RUN_DIR (/tmp/gsm8k_run: train's output_dir and checkpoints; another dir for
# another run), SCORE_DIR (/tmp/gsm8k_score: emptied by each score).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gsm8k_out}
mkdir -p "$OUT"
GGUF=/tmp/xfer/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
DATA=${DATA:-.gsm8k}
SITE=${SITE:-/tmp/site-packages}
RUN_DIR=${RUN_DIR:-/tmp/gsm8k_run}
SCORE_DIR=${SCORE_DIR:-/tmp/gsm8k_score}
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1

clocks_on() {  # the card's SM clock, power, temperature and clock-event reasons each second -> $1
  python3 benchmarks/gpu_clocks.py record "$1" > /dev/null 2>&1 &
  CLOCKS_PID=$!
}

clocks_off() {
  [ -n "${CLOCKS_PID:-}" ] || return 0
  kill "$CLOCKS_PID" 2>/dev/null || true
  wait "$CLOCKS_PID" 2>/dev/null || true
  CLOCKS_PID=
}
trap clocks_off EXIT  # a failed run does not leave its sampler behind

setup() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl
  if [ ! -f "$GGUF" ]; then
    cat /tmp/xfer/parts/* > "$GGUF.tmp"
    echo "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32  $GGUF.tmp" | sha256sum -c
    mv "$GGUF.tmp" "$GGUF"
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
}

hf_eval() {
  python3 benchmarks/gsm8k_hf_eval.py --model "$GGUF" --val "$DATA/val.parquet" \
    --out "$OUT/hf_eval.json" "$@" 2>&1 | tee "$OUT/hf_eval.log"
}

train() {
  local budget=$1; shift
  clocks_on "$OUT/gpu_clocks.csv"
  python3 -m hybridflow.train experiment=gsm8k_qwen_coder_0_5b model.gguf_path="$GGUF" \
    data.train_files="$DATA/train.parquet" data.val_files="$DATA/val.parquet" \
    trainer.output_dir="$RUN_DIR" trainer.progress_bar=false trainer.time_budget_s="$budget" "$@" \
    2>&1 | tee -a "$OUT/train.log"
  clocks_off
  cp "$RUN_DIR/metrics.jsonl" "$RUN_DIR/rollout_lengths.jsonl" "$RUN_DIR/val_generations.jsonl" \
    "$RUN_DIR/val_scores.jsonl" "$OUT/" 2>/dev/null || true
}

overrides_of() {  # a variant's overrides (benchmarks/gsm8k_variants.py)
  python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from gsm8k_variants import VARIANTS; print(VARIANTS[sys.argv[1]])" "$1"
}

variant() {
  local name=$1 budget=$2; shift 2
  local opts
  opts=$(overrides_of "$name")
  local exp=(experiment=gsm8k_qwen_coder_0_5b)
  [[ $opts == experiment=* ]] && exp=()
  mkdir -p "$OUT/$name"
  clocks_on "$OUT/$name/gpu_clocks.csv"
  # shellcheck disable=SC2086  # the variant's overrides are words
  python3 -m hybridflow.train "${exp[@]}" model.gguf_path="$GGUF" data.train_files="$DATA/train.parquet" \
    data.val_files="$DATA/val.parquet" trainer.output_dir="/tmp/gsm8k_$name" trainer.progress_bar=false \
    trainer.total_steps=60 trainer.save_every=0 trainer.time_budget_s="$budget" $opts "$@" \
    2>&1 | tee -a "$OUT/$name/train.log"
  clocks_off
  cp "/tmp/gsm8k_$name/metrics.jsonl" "/tmp/gsm8k_$name/rollout_lengths.jsonl" \
    "/tmp/gsm8k_$name/val_scores.jsonl" "$OUT/$name/" 2>/dev/null || true
}

step() {
  local steps=${1:-24}; [ $# -gt 0 ] && shift
  local dir=/tmp/gsm8k_step
  rm -rf "$dir"
  local exp=experiment=gsm8k_qwen_coder_0_5b  # or the experiment the overrides name (tools)
  for a in "$@"; do [[ $a == experiment=* ]] && exp=$a; done
  local cmd=(python3 -m hybridflow.train "$exp" model.gguf_path="$GGUF"
    data.train_files="$DATA/train.parquet" data.val_files="$DATA/val.parquet" trainer.output_dir="$dir"
    trainer.progress_bar=false trainer.total_steps="$steps" trainer.val_before_train=false
    trainer.val_every=0 trainer.save_every=0)
  for a in "$@"; do [[ $a == experiment=* ]] || cmd+=("$a"); done
  # a call's time limit (timeout's TERM) keeps the steps run so far
  trap 'clocks_off; cp "$dir/metrics.jsonl" "$dir/rollout_lengths.jsonl" \
    "$dir"/profile/step*_rank0.json "$dir"/profile/step*_rank0.txt "$OUT/" 2>/dev/null; exit 143' TERM
  clocks_on "$OUT/gpu_clocks.csv"
  "${cmd[@]}" 2>&1 | tee "$OUT/step.log"
  clocks_off
  trap - TERM
  cp "$dir/metrics.jsonl" "$OUT/metrics.jsonl"
  cp "$dir/rollout_lengths.jsonl" "$OUT/" 2>/dev/null || true
  cp "$dir"/profile/step*_rank0.json "$dir"/profile/step*_rank0.txt "$OUT/" 2>/dev/null || true
  python3 benchmarks/gsm8k_report.py --step-only --metrics "$dir/metrics.jsonl" \
    --command "${cmd[*]}" --out "$OUT/gsm8k_step_h200.json"
}

ab() {  # STEPS NAME...: the named variants' step times in one call, each after the other
  local steps=$1; shift
  local root=$OUT name opts
  for name in "$@"; do
    opts=$(overrides_of "$name")
    OUT=$root/$name
    mkdir -p "$OUT"
    # shellcheck disable=SC2086  # the variant's overrides are words
    step "$steps" $opts > "$OUT/ab.log" 2>&1 || { tail -20 "$OUT/ab.log"; OUT=$root; return 1; }
  done
  OUT=$root
  python3 benchmarks/gsm8k_variants.py --runs "$root" --out "$root/ab_summary.json"
}

score() {  # the experiment's validation (prompts, template, greedy, stops, rules) of each snapshot
  local dirs=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do dirs+=("$1"); shift; done
  [ $# -gt 0 ] && shift  # the "--"
  [ ${#dirs[@]} -gt 0 ] || { echo "score: no snapshot directories given" >&2; exit 1; }
  rm -rf "$SCORE_DIR"
  python3 benchmarks/score_snapshots.py "${dirs[@]}" --out "$OUT/trl_scores.json" --run-dir "$SCORE_DIR" -- \
    experiment=gsm8k_qwen_coder_0_5b data.train_files="$DATA/train.parquet" data.val_files="$DATA/val.parquet" \
    trainer.progress_bar=false "$@" 2>&1 | tee -a "$OUT/score.log"
  cp "$SCORE_DIR/metrics.jsonl" "$OUT/trl_score_metrics.jsonl"
  cp "$SCORE_DIR/val_generations.jsonl" "$OUT/trl_score_val_generations.jsonl" 2>/dev/null || true
  cp "$SCORE_DIR/val_scores.jsonl" "$OUT/trl_score_val_scores.jsonl" 2>/dev/null || true
}

pack() {  # NAME: $OUT's files as one $OUT/NAME.tgz, the files themselves removed
  local tmp
  tmp=$(mktemp -d)
  tar czf "$tmp/${1:-out}.tgz" -C "$OUT" .
  find "$OUT" -mindepth 1 -delete
  mv "$tmp/${1:-out}.tgz" "$OUT/"
  rmdir "$tmp"
}

"$@"
