"""The cost model for quantized rollouts (rollout.quantization): the fitted decode costs of fp8 and
int4 against the H200 generation records, that those records leave the dense fit alone, and the
estimator's choice of a quantization mode."""
import json
from dataclasses import replace
from pathlib import Path

import pytest

from hybridflow.cost import estimate_cost
from hybridflow.cost.calibrate import (fit, load_records, parse_record, predict,
                                       predict_vs_measured, quantized_families)
from hybridflow.cost.efficiency import Calibration, shipped_calibration
from hybridflow.cost.timing import stage_breakdown
from hybridflow.cost.validate import QUANT_KEY, validation

ROOT = Path(__file__).resolve().parents[2]
COST = ROOT / "benchmarks/results/cost"
QUANT = COST / "quant_gen_h200.json"
DENSE = [COST / "rl_1_5b_x1_mb8.json", COST / "rl_0_5b_x1_mb64f64_kv64_tk_fe.json"]
QUANT_COEFS = ("fp8_decode_layer_s", "int4_decode_efficiency")
# the fitted form's stated in-sample error (docs/cost_model.md), predicted from each call's bf16
ERROR = {"fp8": 0.08, "int4": 0.12}


def _from_bf16(records, calib):
    """(mode, measured, predicted) of each quantized record: its call's bf16 measurement plus the
    predicted difference, as the fit sees it."""
    _, baseline = quantized_families(records)
    out = []
    for rec, b in zip(records, baseline):
        if b is None:
            continue
        q, bf16 = parse_record(rec), parse_record(records[b])
        gen = "timing_s/gen"
        pred = bf16.metrics[gen] + predict(q, calib)[gen] - predict(bf16, calib)[gen]
        out.append((q.workload.rollout_quantization, q.metrics[gen], pred))
    return out


def test_records_are_the_benchmark_measurements():
    """Every record carries a generation time of bench_quantized's JSON, at its mode, model and
    batch, and each family holds one bf16 record of the same call."""
    bench = json.loads((ROOT / "benchmarks/results/quantized_rollout_h200.json").read_text())
    records = load_records([QUANT])
    assert len(records) == 12
    for rec in records:
        c = rec["config"]
        key = {"none": "bf16"}.get(c["rollout_quantization"], c["rollout_quantization"])
        assert rec["metrics"]["timing_s/gen"] == bench["generation"][key][c["model"]][
            str(c["prompts_per_step"])]
    in_set, baseline = quantized_families(records)
    assert all(in_set)
    for rec, b in zip(records, baseline):
        quantized = rec["config"]["rollout_quantization"] != "none"
        assert (b is not None) is quantized
        if quantized:
            assert records[b]["family"] == rec["family"]
            assert records[b]["config"] | {"rollout_quantization": "none"} == \
                rec["config"] | {"rollout_quantization": "none"}


def test_shipped_fit_reproduces_quantized_records():
    """The shipped calibration is the fit to every record, and its quantized coefficients predict
    each quantized generation from its call's bf16 measurement within the stated error; the model
    alone (no fit) predicts every quantized mode faster than bf16, as the bytes term says."""
    records = load_records(sorted(COST.glob("*.json")))
    fitted, shipped = fit(records), shipped_calibration()
    for k in QUANT_COEFS:
        assert getattr(fitted, k) == pytest.approx(getattr(shipped, k), rel=1e-6)
    rows = _from_bf16(load_records([QUANT]), shipped)
    assert sorted(m for m, *_ in rows) == ["fp8"] * 4 + ["int4"] * 4
    for mode, measured, predicted in rows:
        assert predicted == pytest.approx(measured, rel=ERROR[mode]), mode
    bytes_only = replace(shipped, fp8_decode_layer_s=0.0, int4_decode_efficiency=1e9)
    for mode, measured, predicted in _from_bf16(load_records([QUANT]), bytes_only):
        assert predicted < measured


def test_leave_one_out_predicts_each_family_from_the_others():
    """Each (shape, batch) family left out, its fp8 / int4 generation predicted from its bf16
    measurement by the others' fit: fp8 within 11%, int4 within 12%; the
    validation judges these generation-only configs on that row, their bf16 ones on gen."""
    records = load_records(DENSE + [QUANT])
    rows = predict_vs_measured(records)
    quant = {r["name"]: r for r in rows if r["metric"] == QUANT_KEY}
    assert len(quant) == 8
    for name, r in quant.items():
        assert abs(r["error_pct"]) < (11 if name.endswith("fp8") else 12), name
    configs = {c["name"]: c for c in validation(records, rows, command="")["validation"]["configs"]}
    for name, c in configs.items():
        want = QUANT_KEY if name in quant else "timing_s/gen" if "-gen-" in name else None
        assert c.get("judged_on") == want, name


def test_quantized_records_leave_the_dense_fit_unchanged():
    """Adding the quantized records (bf16 baselines included) moves only fp8_decode_layer_s and
    int4_decode_efficiency; a workload without quantization is predicted the same whatever their
    values."""
    without = fit(load_records(DENSE)).to_dict()
    with_quant = fit(load_records(DENSE + [QUANT])).to_dict()
    prior = Calibration()
    for k, v in with_quant.items():
        if k in QUANT_COEFS:
            assert v != getattr(prior, k) and without[k] == getattr(prior, k)
        else:
            assert v == pytest.approx(without[k], rel=1e-12), k
    calib = shipped_calibration()
    other = replace(calib, fp8_decode_layer_s=1.0, int4_decode_efficiency=1e-6)
    for rec in load_records(DENSE + [COST / "varlen_gsm8k.json"])[:3]:
        run = parse_record(rec)
        a = stage_breakdown(run.shape, run.gpu, run.plan, run.workload, calib)
        assert a == stage_breakdown(run.shape, run.gpu, run.plan, run.workload, other)


def test_quantized_terms_charged_only_when_quantized():
    """fp8 adds fp8_decode_layer_s per layer per decode step, int4 its kernel's FLOPs at
    int4_decode_efficiency (and its prefill's dequantized copies); none adds neither."""
    rec = load_records([QUANT])[0]
    run = parse_record(rec)
    calib = shipped_calibration()
    for mode in ("none", "fp8", "int4"):
        w = replace(run.workload, rollout_quantization=mode)
        gen = stage_breakdown(run.shape, run.gpu, run.plan, w, calib)["gen"]
        assert ("quant_overhead" in gen) is (mode == "fp8")
        assert ("quant_compute" in gen) is (mode == "int4")
        assert ("quant_dequant" in gen) is (mode == "int4")
    w = replace(run.workload, rollout_quantization="fp8")
    one = stage_breakdown(run.shape, run.gpu, run.plan, w,
                          replace(calib, fp8_decode_layer_s=1e-5))["gen"]["quant_overhead"]
    steps = one / 1e-5 / run.shape.num_layers
    assert run.workload.response_len - 2 <= steps <= run.workload.response_len + 2


def test_int4_kernel_only_up_to_its_rows_wider_gemms_dequantize():
    """int4: the kernel's FLOPs over decode row-steps of buckets of at most int4_kernel_max_rows
    rows; the prefill's sub-batches and every wider decode step pay a bf16 copy of each quantized
    matrix (4 bytes per weight) instead."""
    from hybridflow.cost.timing import (DEVICE_COPY_EFF, INT4_DEQUANT_BYTES_PER_WEIGHT,
                                        stage_terms)

    rec = next(r for r in load_records([QUANT]) if r["config"]["rollout_quantization"] == "int4")
    run = parse_record(rec)
    calib = shipped_calibration()
    quantized = run.shape.num_layers * run.shape.layer_matmul_params
    copy_s = quantized * INT4_DEQUANT_BYTES_PER_WEIGHT / (run.gpu.hbm_gbps * 1e9 * DEVICE_COPY_EFF)
    w = replace(run.workload, rollout_quantization="int4")
    rows = w.num_sequences
    narrow = stage_breakdown(run.shape, run.gpu, run.plan, w, calib)["gen"]
    assert narrow["quant_dequant"] == pytest.approx(copy_s)  # one prefill sub-batch
    kernel = stage_terms(run.shape, run.gpu, run.plan, w, calib)["gen"].x["inv_int4_decode_eff"]
    peak = run.gpu.bf16_tflops * 1e12
    assert kernel == pytest.approx(rows * w.response_len * 2 * quantized / peak, rel=0.02)
    wide = replace(w, int4_kernel_max_rows=rows // 2)  # every decode step of this call is wider
    t = stage_terms(run.shape, run.gpu, run.plan, wide, calib)["gen"]
    assert t.x.get("inv_int4_decode_eff", 0.0) == 0.0
    steps = stage_breakdown(run.shape, run.gpu, run.plan, wide, calib)["gen"]["quant_dequant"] \
        / copy_s - 1
    assert w.response_len - 2 <= steps <= w.response_len + 2


def test_int4_kernel_rows_come_from_the_config():
    from hybridflow.config import load_config
    from hybridflow.cost.from_config import workload_fields

    cfg = load_config(["experiment=demo", "rollout.quantization=int4",
                       "rollout.kernel_options.int4_kernel_max_rows=64"])
    assert workload_fields(cfg, decode_kernels="triton")["int4_kernel_max_rows"] == 64


GEN_HEAVY = dict(model="qwen2_1_5b", gpu="H200", num_gpus=1, prompts_per_step=16,
                 samples_per_prompt=4, prompt_len=128, response_len=2048, micro_batch_tokens=8192)


def test_estimator_keeps_bf16_with_the_shipped_fit():
    """Generation dominates this step; with the H200 fit neither fp8 nor int4 is predicted faster,
    so none is recommended, and the reason names what each costs."""
    r = estimate_cost(**GEN_HEAVY)
    assert max(r.stage_seconds, key=r.stage_seconds.get) == "gen"
    q = r.quantization
    assert q["recommended"] is None
    assert q["options"]["fp8"]["step_s"] > q["options"]["none"]["step_s"] == r.step_seconds
    assert q["options"]["int4"]["step_s"] > q["options"]["fp8"]["step_s"]
    assert "fp8:" in q["reason"] and "int4:" in q["reason"] and "_scaled_mm" in q["reason"]
    assert "rollout.quantization (none given): keep none" in str(r)


def test_estimator_recommends_fp8_when_it_is_predicted_faster():
    """With a calibration where fp8 costs only its bytes (no added latency), the halved weight
    reads make generation faster and fp8 is recommended; asked for fp8 with the shipped fit, the
    estimator recommends going back to bf16."""
    cheap = replace(shipped_calibration(), fp8_decode_layer_s=0.0)
    q = estimate_cost(calibration=cheap, **GEN_HEAVY).quantization
    assert q["recommended"] == "fp8"
    assert q["options"]["fp8"]["gen_s"] < q["options"]["none"]["gen_s"]
    assert q["reason"].startswith("recommend rollout.quantization=fp8")
    back = estimate_cost(rollout_quantization="fp8", **GEN_HEAVY).quantization
    assert back["recommended"] == "none"


def test_estimator_does_not_consider_quantization_when_training_dominates():
    r = estimate_cost(**(GEN_HEAVY | {"response_len": 128, "prompts_per_step": 128}))
    assert r.quantization["recommended"] is None and not r.quantization["options"]
    assert "not considered" in r.quantization["reason"]


def test_estimator_considers_quantization_when_nothing_fits():
    """Nothing fits (a 7B actor on one 24 GiB card): the quantized modes are tried with
    actor.offload_params too; they do not fit either (the update phase is the peak), so none is
    recommended and the reason says so."""
    r = estimate_cost(**(GEN_HEAVY | {"model": "qwen2_7b", "gpu_memory_gib": 24}))
    assert not r.fits
    q = r.quantization
    assert q["recommended"] is None
    assert q["options"]["fp8"]["offload_params"] and not q["options"]["fp8"]["fits"]
    assert "fp8 does not fit either" in q["reason"]
