"""The cost model's LoRA time (Workload.lora_rank): the update without the frozen base's weight
gradients plus the adapters' traffic and launches, the merge before generation and the restore
after it; the LoRA records' fit against their full-parameter baselines, which leaves every other
coefficient as it was."""
import json
from dataclasses import replace
from pathlib import Path

import pytest

from hybridflow.cost.calibrate import fit, load_records, lora_families, parse_record, predict
from hybridflow.cost.efficiency import Calibration, shipped_calibration
from hybridflow.cost.flops import (LORA_MERGE_BYTES_PER_PARAM, lora_bytes_per_token_layer,
                                   lora_merge_work)
from hybridflow.cost.memory import lora_params
from hybridflow.cost.shapes import load_shape
from hybridflow.cost.timing import GRAD_ACCUM_BW_EFF, stage_terms

ROOT = Path(__file__).resolve().parents[2]
COST = ROOT / "benchmarks/results/cost"
BENCH = COST / "lora_update_h200.json"
DENSE = [COST / "rl_1_5b_x1_mb8.json", COST / "rl_0_5b_x1_mb64f64_kv64_tk_fe.json"]
LORA_COEFS = ("lora_bw_efficiency", "lora_layer_pass_s", "lora_merge_block_s")


def _recipe():
    rec = next(r for r in load_records([COST / "varlen_gsm8k.json"])
               if r["name"] == "gsm8k-grpo-today-recipe")
    return parse_record(rec)


def _terms(run, **change):
    w = replace(run.workload, **change)
    return stage_terms(run.shape, run.gpu, run.plan, w, shipped_calibration())


def test_adapter_bytes_and_merge_work_by_hand():
    """Qwen2.5-Coder-0.5B (h 896, q 896, kv 128, ffn 4864, 24 layers): the four fused linears'
    activation traffic per token and layer, and the merge's weights and 4,096-row blocks (qkv 1,
    proj 1, fc1 3, fc2 1 per layer)."""
    s = load_shape("qwen2_5_coder_0_5b")
    h, qkv, f = 896, 896 + 2 * 128, 4864
    linears = [(h, qkv), (h, h), (h, 2 * f), (f, h)]
    fwd = sum(2 * (i + 2 * o) for i, o in linears)
    bwd = sum(2 * (3 * i + 2 * o) for i, o in linears)
    assert lora_bytes_per_token_layer(s) == (fwd, bwd)
    assert lora_bytes_per_token_layer(s, tp=2) == (fwd / 2, bwd / 2)
    assert lora_merge_work(s) == (24 * sum(i * o for i, o in linears), 24 * 6)
    # TP=2: the column-parallel weights' rows halve (fc1 9,728 -> 4,864 rows: 2 blocks)
    params, blocks = lora_merge_work(s, tp=2)
    assert params == 24 * sum(i * o for i, o in linears) // 2 and blocks == 24 * 5


def test_lora_update_skips_the_base_weight_gradients():
    """The LoRA update's GPU work is the full update's minus one forward's matmul FLOPs (the
    frozen weights' gradients, the LM head's at the response positions) plus the adapters' FLOPs;
    the adapters' bytes are charged at lora_bw_efficiency and, eager, their launches per layer
    pass; the optimizer's traffic covers the adapters only."""
    run = _recipe()
    full = _terms(run)["update_actor"]
    lora = _terms(run, lora_rank=32)["update_actor"]
    coef = "inv_fused_train_mfu"
    s, peak = run.shape, run.gpu.bf16_tflops * 1e12
    from hybridflow.cost.varlen import pass_work
    w = run.workload
    work = pass_work(w, w.num_sequences, w.micro_batch_tokens, 1, False)
    wgrad = (2 * (s.num_dense_params - s.embedding_params) * work.tokens
             + 2 * s.embedding_params * work.head_tokens)
    adapters = 2 * lora_params(s, 32) * 3 * work.tokens
    assert lora.x[coef] == pytest.approx(full.x[coef] + (adapters - wgrad) / peak, rel=1e-9)
    assert 0.25 < wgrad / (full.x[coef] * peak) < 0.34   # about a third of the update's FLOPs
    fwd, bwd = lora_bytes_per_token_layer(s)
    assert lora.x["inv_lora_bw_eff"] == pytest.approx(
        work.tokens * (fwd + bwd) * s.num_layers / (run.gpu.hbm_gbps * 1e9), rel=1e-9)
    assert lora.x["lora_layer_pass_s"] == full.x["layer_pass_overhead_s"] \
        == s.num_layers * work.micro * 3
    adam = [sum(x for k, c, x in t.parts if k == "optimizer" and c is None) for t in (lora, full)]
    assert adam[0] / adam[1] == pytest.approx(lora_params(s, 32) / s.num_params, rel=1e-9)
    assert "grad_accum" not in dict((k, x) for k, _, x in lora.parts)   # fused into the GEMMs
    padded = _terms(run, lora_rank=32, train_cuda_graphs=True, graph_min_fill=0.0)["update_actor"]
    assert "lora_layer_pass_s" not in padded.x and padded.x["inv_lora_bw_eff"] > 0
    # by default the pass's small last micro-batch runs eager: its launches, adapters' included
    graphed = _terms(run, lora_rank=32, train_cuda_graphs=True)["update_actor"]
    assert graphed.x["lora_layer_pass_s"] == graphed.x["layer_pass_overhead_s"] == s.num_layers * 3
    assert graphed.x["graphed_layer_pass_s"] == s.num_layers * (work.micro - 1) * 3


def test_lora_adds_the_merge_and_keeps_the_reference_pass():
    """reshard: the merge's bytes at the element-wise efficiency plus lora_merge_block_s per
    block; other: the restore; ref (adapters off) costs what the full model's does;
    old_log_prob (adapters on) adds their forward traffic and launches."""
    run = _recipe()
    full, lora = _terms(run), _terms(run, lora_rank=32)
    params, blocks = lora_merge_work(run.shape)
    assert lora["reshard"].x == {"lora_merge_block_s": blocks}
    assert lora["reshard"].const == pytest.approx(
        LORA_MERGE_BYTES_PER_PARAM * params / (run.gpu.hbm_gbps * 1e9 * GRAD_ACCUM_BW_EFF))
    assert not full["reshard"].parts
    assert lora["other"].const > full["other"].const
    assert lora["ref"].parts == full["ref"].parts and lora["gen"].parts == full["gen"].parts
    full, lora = _terms(run, skip_old_log_prob=False), \
        _terms(run, skip_old_log_prob=False, lora_rank=32)
    assert set(lora["old_log_prob"].x) - set(full["old_log_prob"].x) == \
        {"inv_lora_bw_eff", "lora_layer_pass_s"}


def test_critic_lora_skips_the_critic_base_gradients():
    """PPO with critic LoRA: the critic's update loses its layers' weight-gradient FLOPs, its
    values pass pays the adapters' traffic; the actor's stages are untouched."""
    run = _recipe()
    ppo = dict(algorithm="ppo")
    full, lora = _terms(run, **ppo), _terms(run, **ppo, critic_lora_rank=16)
    coef = "inv_fused_train_mfu"
    assert lora["update_critic"].x[coef] < 0.75 * full["update_critic"].x[coef]
    assert "inv_lora_bw_eff" in lora["values"].x
    for stage in ("reshard", "gen", "ref", "update_actor"):
        assert lora[stage].parts == full[stage].parts, stage


def test_records_pair_each_lora_side_with_a_full_baseline():
    """The benchmark records carry bench_lora_update's medians; each LoRA record's baseline is a
    full-parameter record of its family with the same train_cuda_graphs, marked baseline_only;
    the GSM8K LoRA record pairs with the recipe of the same call."""
    src = json.loads((ROOT / "benchmarks/results/train_graphs_packed_h200.json").read_text())
    records = load_records([BENCH, COST / "varlen_gsm8k.json"])
    lora, baseline = lora_families(records)
    names = [r["name"] for r, lo in zip(records, lora) if lo]
    assert names == ["lora-update-bench-call1-lora", "lora-update-bench-call2-lora",
                     "lora-update-bench-call2-lora-graphs", "gsm8k-grpo-today-lora"]
    for i, rec in enumerate(records):
        if not lora[i]:
            assert baseline[i] is None
            continue
        base = records[baseline[i]]
        assert base["family"] == rec["family"]
        graphs = rec["config"].get("train_cuda_graphs", False)
        assert base["config"].get("train_cuda_graphs", False) == graphs
        assert base["config"] | {"lora_rank": 32} == rec["config"] if "bench" in rec["name"] \
            else base["name"] == "gsm8k-grpo-today-recipe"
        if "bench" in rec["name"]:
            assert base["baseline_only"] is True
            call, side = rec["source_run"].split("update_bench.")[1].split(".results.")
            assert rec["metrics"]["timing_s/update_actor"] == pytest.approx(
                src["update_bench"][call]["results"][side]["update_median_s"], abs=1e-6)
    lengths = next(r for r in records if "bench" in r["name"])["config"]["response_lengths"]
    assert len(lengths) == 512 and sum(lengths) / 512 == pytest.approx(
        src["lengths"]["response_mean"], abs=1e-6)


def test_lora_records_leave_the_rest_of_the_fit_unchanged():
    """Adding the LoRA benchmark (its baselines included) moves only the LoRA coefficients; the
    merge's, which no update benchmark informs, keeps its prior; a workload without LoRA is
    predicted the same whatever their values."""
    without = fit(load_records(DENSE)).to_dict()
    with_lora = fit(load_records(DENSE + [BENCH])).to_dict()
    prior = Calibration()
    for k, v in with_lora.items():
        if k in ("lora_bw_efficiency", "lora_layer_pass_s"):
            assert v != getattr(prior, k) and without[k] == getattr(prior, k), k
        else:
            assert v == pytest.approx(without[k], rel=1e-12), k
    run = _recipe()
    calib = shipped_calibration()
    other = replace(calib, lora_bw_efficiency=0.01, lora_layer_pass_s=1.0, lora_merge_block_s=1.0)
    assert predict(run, calib) == predict(run, other)


def test_fit_recovers_planted_coefficients_through_the_baseline():
    """Records made by the model itself with planted LoRA coefficients, each beside a baseline
    whose measurement misses the model by a call-specific amount that the LoRA record shares: the
    fit (the rest of the model held at the planted values: no other record) takes the miss out and
    recovers the planted values from the priors."""
    planted = replace(shipped_calibration(), lora_bw_efficiency=0.6, lora_layer_pass_s=2.5e-4,
                      lora_merge_block_s=5e-4)
    defaults = Calibration()
    start = replace(planted, **{k: getattr(defaults, k) for k in LORA_COEFS})
    config = json.loads(BENCH.read_text())["records"][0]["config"]
    records = []
    for i, (tokens, graphs, miss) in enumerate([(20480, False, 0.2), (40960, False, -0.1),
                                                (20480, True, 0.05)]):
        base = {"name": f"full{i}", "family": f"call{i}", "baseline_only": True,
                "config": {**config, "micro_batch_tokens": tokens, "train_cuda_graphs": graphs}}
        run = parse_record({**base, "metrics": {}})
        base["metrics"] = {"timing_s/update_actor":
                           predict(run, planted)["timing_s/update_actor"] + miss}
        lora = {"name": f"lora{i}", "family": f"call{i}",
                "config": {**base["config"], "lora_rank": 32}}
        p = predict(parse_record({**lora, "metrics": {}}), planted)
        lora["metrics"] = {"timing_s/update_actor": p["timing_s/update_actor"] + miss,
                           "timing_s/reshard": p["timing_s/reshard"]}
        records += [base, lora]
    got = fit(records, base=start)
    for k in LORA_COEFS:
        assert getattr(start, k) != getattr(planted, k)
        assert getattr(got, k) == pytest.approx(getattr(planted, k), rel=1e-3), k
    assert replace(got, **{k: getattr(start, k) for k in LORA_COEFS}) == start


def test_shipped_fit_and_held_out_gsm8k_lora_step():
    """The shipped calibration fits every record (its LoRA coefficients are the fit's); the
    GSM8K LoRA step, predicted with its family (the recipe of the same call included) left out,
    is within 10% on the step and the update, and the merge within 10% in-sample."""
    records = load_records(sorted(COST.glob("*.json")))
    fitted, shipped = fit(records), shipped_calibration()
    for k in LORA_COEFS:
        assert getattr(fitted, k) == pytest.approx(getattr(shipped, k), rel=1e-6)
    rec = next(r for r in records if r["name"] == "gsm8k-grpo-today-lora")
    held = fit([r for r in records if r.get("family") != "grpo_today"])
    run = parse_record(rec)
    pred = predict(run, held)
    for key in ("timing_s/step", "timing_s/update_actor"):
        assert pred[key] == pytest.approx(run.metrics[key], rel=0.10), key
    merge = predict(run, shipped)["timing_s/reshard"]
    assert merge == pytest.approx(run.metrics["timing_s/reshard"], rel=0.10)


def test_lora_model_flops_for_mfu():
    """The actor MFU's useful FLOPs with LoRA: the full update's less the frozen base's weight
    gradients (one forward's matmuls, the LM head at the response positions), plus the adapters'
    forward and backward."""
    from hybridflow.cost.timing import actor_model_flops
    from hybridflow.cost.workload import Workload

    s = load_shape("qwen2_1_5b")
    w = Workload(prompts_per_step=8, samples_per_prompt=8, prompt_len=128, response_len=256)
    lora = replace(w, lora_rank=16)
    tokens = w.tokens_per_step
    wgrad = 2 * (s.num_dense_params - s.embedding_params) * tokens \
        + 2 * s.embedding_params * tokens * w.head_fraction
    assert actor_model_flops(s, lora) == pytest.approx(
        actor_model_flops(s, w) - wgrad + 6 * lora_params(s, 16) * tokens, rel=1e-12)
