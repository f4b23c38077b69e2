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
