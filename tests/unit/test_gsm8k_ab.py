"""benchmarks/gsm8k_h200.sh ab: each named variant's `step` run with its overrides
(gsm8k_variants.py), one after another, and their summary; the trainer stood in for by a shim
that writes the metrics a run would (the GPU call runs the real one)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHIM = """#!/usr/bin/env bash
if [ "$1" = "-m" ] && [ "$2" = "hybridflow.train" ]; then
  out=""; n=0; extra=""
  for a in "$@"; do
    case $a in trainer.output_dir=*) out=${a#*=};; trainer.total_steps=*) n=${a#*=};;
      rollout.*|parallel.*) extra="$extra $a";; esac
  done
  mkdir -p "$out"
  for i in $(seq 1 "$n"); do
    echo "{\\"step\\": $i, \\"timing_s/step\\": $((10 + i)).0, \\"timing_s/gen\\": 1.5,"\\
         "\\"perf/max_memory_allocated_gb\\": 4.0, \\"overrides\\": \\"${extra# }\\"}"
  done > "$out/metrics.jsonl"
  exit 0
fi
exec %s "$@"
"""


def test_ab_runs_each_variant_with_its_overrides(tmp_path):
    shim = tmp_path / "bin" / "python3"
    shim.parent.mkdir()
    shim.write_text(SHIM % sys.executable)
    shim.chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{shim.parent}:{os.environ['PATH']}", OUT=str(out))
    subprocess.run(["bash", "benchmarks/gsm8k_h200.sh", "ab", "3", "base", "nospec", "graphs"],
                   check=True, cwd=ROOT, env=env, capture_output=True)
    summary = json.loads((out / "ab_summary.json").read_text())["variants"]
    assert set(summary) == {"base", "nospec", "graphs"}
    for name, want in (("base", ""), ("nospec", "rollout.speculative.enable=false"),
                       ("graphs", "parallel.train_cuda_graphs=true")):
        rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["overrides"] for r in rows] == [want] * 3
        assert summary[name]["step_s"] == 12.5 and summary[name]["steps_timed"] == 2
        step = json.loads((out / name / "gsm8k_step_h200.json").read_text())
        assert step["command"].endswith(want) and step["ours_step_s"] == 12.5


FAKE_SMI = """#!/usr/bin/env bash
case "$*" in *--format=csv,noheader) exit 0 ;; esac  # the probe: this driver knows the field
trap 'exit 0' TERM
echo '2026/12/07 15:00:00.000, 1980, 2619, 512.3, 55, 0x0000000000000000'
echo '2026/12/07 15:00:01.000, 1755, 2619, 699.8, 61, 0x0000000000000004'
while true; do sleep 0.05; done
"""

# the trainer's stand-in waits until the sampler beside it has written both lines
WAIT = """  for _ in $(seq 200); do
    [ "$(wc -l < "$OUT/gpu_clocks.csv" 2>/dev/null || echo 0)" -ge 3 ] && break; sleep 0.05
  done
"""


def test_ab_records_the_cards_clocks_beside_each_variant(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = SHIM.replace('  mkdir -p "$out"\n', WAIT + '  mkdir -p "$out"\n')
    (bin_dir / "python3").write_text(shim % sys.executable)
    (bin_dir / "nvidia-smi").write_text(FAKE_SMI)
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(out))
    subprocess.run(["bash", "benchmarks/gsm8k_h200.sh", "ab", "3", "base", "nospec"],
                   check=True, cwd=ROOT, env=env, capture_output=True, timeout=120)
    summary = json.loads((out / "ab_summary.json").read_text())["variants"]
    for name in ("base", "nospec"):
        clocks = summary[name]["gpu_clocks"]
        assert clocks["samples"] == 2 and clocks["sm_mhz_min"] == 1755
        assert clocks["reasons_busy_share"] == {"sw_power_cap": 0.5}
    # every sampler stopped with its run
    left = subprocess.run(["pgrep", "-f", f"gpu_clocks.py record {out}"], capture_output=True)
    assert left.returncode == 1


def test_pack_leaves_one_archive_of_every_file(tmp_path):
    """gsm8k_h200.sh pack NAME: a call's outputs (nested folders included) as the one file
    $OUT/NAME.tgz, since a device call brings back only a few files."""
    import tarfile

    out = tmp_path / "out"
    (out / "base").mkdir(parents=True)
    (out / "base" / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "ab_summary.json").write_text("{}")
    subprocess.run(["bash", "benchmarks/gsm8k_h200.sh", "pack", "call1"], cwd=ROOT, check=True,
                   env={**os.environ, "OUT": str(out)})
    assert sorted(os.listdir(out)) == ["call1.tgz"]
    with tarfile.open(out / "call1.tgz") as t:
        assert t.extractfile("./base/metrics.jsonl").read() == b'{"step": 1}\n'
        assert {"./ab_summary.json", "./base/metrics.jsonl"} <= set(t.getnames())
