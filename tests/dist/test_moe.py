"""Qwen3-MoE on 2 gloo ranks against transformers' Qwen3MoeForCausalLM (random tiny model):
logits and every gradient at EP=1 (DP=2), EP=2, TP=2 + SP (expert TP=2) and TP=2 + EP=2 (expert
TP=1), each rank loading only its experts / shards from the HF checkpoint; the gathered weights
export bit-identically (benchmarks/qwen3_moe_parity.py, at a smaller shape)."""

import importlib.util
import os

import pytest

pytest.importorskip("transformers")

from tests.dist.launcher import run_ranks  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _parity(out, layouts):
    import sys

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    spec = importlib.util.spec_from_file_location(
        "qwen3_moe_parity", os.path.join(ROOT, "benchmarks", "qwen3_moe_parity.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main(["--out", out, "--hidden", "64", "--layers", "2", "--heads", "4",
                     "--kv-heads", "2", "--head-dim", "16", "--vocab", "120", "--seq", "8",
                     "--expert-ffn", "32", "--layouts", layouts])


@pytest.mark.parametrize("layouts", [
    "ep2", pytest.param("ep1,ep2,tp2,tp2_ep2", marks=pytest.mark.slow)])
def test_moe_parity(tmp_path, layouts):
    record = run_ranks(_parity, 2, str(tmp_path / "parity.json"), layouts)[0]
    rows = {r["layout"]: r for r in record["layouts"]}
    assert set(rows) == set(layouts.split(","))
    for name, r in rows.items():
        assert r["max_abs_logit_diff"] < 1e-4 * max(1.0, r["max_abs_logit"]), (name, r)
        assert r["max_abs_grad_diff"] < 1e-5 * max(1.0, r["max_abs_grad"]) + 1e-4, (name, r)
        assert r["export_bit_identical"] is True, name
    assert rows["ep2"]["ep"] == 2
