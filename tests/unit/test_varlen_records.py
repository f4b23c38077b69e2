"""benchmarks/varlen_records.run_lengths: a GSM8K record's response lengths are the run's own
(its rollout_lengths.jsonl beside its metrics, pooled) where the run wrote them, else fitted to
its step statistics."""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import varlen_records  # noqa: E402


def test_a_run_with_its_lengths_beside_is_costed_at_them(tmp_path, monkeypatch):
    monkeypatch.setattr(varlen_records, "ROOT", str(tmp_path))
    shape = {"mean": 300.0, "clip_ratio": 0.01, "min": 90.0}
    (tmp_path / "run").mkdir()
    stats = {"step": 1, "response_length/mean": 300.0, "response_length/max": 1024.0,
             "response_length/min": 90.0, "response_length/clip_ratio": 0.01}
    (tmp_path / "run" / "dapo_metrics.jsonl").write_text(json.dumps(stats) + "\n")
    fitted, origin = varlen_records.run_lengths("run/dapo_metrics.jsonl", shape, 512)
    assert origin == {} and fitted == varlen_records.lengths(300.0, shape, 512)
    steps = [{"step": s, "response_lengths": [100 + s, 200, 1024, 400]} for s in (1, 2)]
    (tmp_path / "run" / "dapo_rollout_lengths.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in steps))
    exact, origin = varlen_records.run_lengths("run/dapo_metrics.jsonl", shape, 512)
    assert origin == {"lengths_from": "run/dapo_rollout_lengths.jsonl"}
    assert set(exact) == {101, 102, 200, 400, 1024}  # the pooled lengths, not a fit
    # a plain metrics.jsonl pairs with rollout_lengths.jsonl
    (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps(stats) + "\n")
    (tmp_path / "run" / "rollout_lengths.jsonl").write_text(json.dumps(steps[0]) + "\n")
    exact, origin = varlen_records.run_lengths("run/metrics.jsonl", shape, 512)
    assert origin["lengths_from"] == "run/rollout_lengths.jsonl"
    assert set(exact) == {101, 200, 400, 1024}
