"""Unit tests of the analytic cost model (hybridflow.cost): counts by hand, search, CLI, calibration."""
import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

from dataclasses import replace

import pytest

from hybridflow.cost import (Calibration, estimate_cost, estimate_memory, estimate_step_time, load_shape,
                             load_calibration, shipped_calibration)
from hybridflow.cost.calibrate import fit, main as calibrate_main, parse_record, predict, predict_vs_measured
from hybridflow.cost.flops import forward_flops_per_token, train_flops_per_token
from hybridflow.cost.memory import COMPONENTS, GIB, memory_for
from hybridflow.config import load_config
from hybridflow.config_checks import validate
from hybridflow.cost import get_gpu
from hybridflow.cost.search import candidate_plans
from hybridflow.cost.shapes import known_models
from hybridflow.cost.timing import stage_breakdown, stage_terms
from hybridflow.models.hf_config import read_hf_config

ROOT = Path(__file__).resolve().parents[2]


# --- model shapes -------------------------------------------------------------------------------

def test_tiny_param_count_by_hand():
    # conf/model/tiny.yaml: L=2, h=64, ffn=128, 4 heads of 16, 2 KV groups, V=64, QKV bias, untied.
    qkv = 64 * (64 + 2 * 32) + (64 + 2 * 32)      # weight + bias
    out_proj = 64 * 64
    mlp = 3 * 64 * 128                              # gate, up, down
    norms = 2 * 64
    layer = qkv + out_proj + mlp + norms            # 37,120
    total = 2 * layer + 64 + 2 * 64 * 64            # + final norm + embedding + output layer
    assert load_shape("tiny").num_params == total == 82_496


@pytest.mark.parametrize("name, expected", [
    ("qwen2_0_5b", 494_032_768),    # Qwen2-0.5B, tied embeddings: the published 494M
    ("qwen2_7b", 7_615_616_512),    # Qwen2-7B: 7.6B
    ("llama3_8b", 8_030_261_248),   # Llama-3-8B: 8.03B
    ("qwen3_0_6b", 596_049_920),    # Qwen3-0.6B, tied: 0.6B, 0.44B without the embedding
    ("qwen3_1_7b", 1_720_574_976),  # Qwen3-1.7B, tied: 1.7B
    ("qwen3_8b", 8_190_735_360),    # Qwen3-8B, untied: 8.2B
])
def test_real_model_param_counts(name, expected):
    assert load_shape(name).num_params == expected


def test_hf_config_json(tmp_path):
    cfg = {"model_type": "qwen2", "num_hidden_layers": 24, "hidden_size": 896, "intermediate_size": 4864,
           "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
           "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_shape(str(tmp_path)).num_params == 494_032_768              # a directory
    assert load_shape(tmp_path / "config.json") == load_shape(str(tmp_path))  # or the file
    llama = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "head_dim": 128,
             "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
             "vocab_size": 128256, "tie_word_embeddings": False}
    (tmp_path / "llama.json").write_text(json.dumps(llama))
    assert load_shape(tmp_path / "llama.json").num_params == 8_030_261_248
    r = estimate_cost(model=str(tmp_path), gpu="H100", num_gpus=2, prompts_per_step=8, steps=3)
    assert r.fits and r.steps == 3


def test_qwen3_shapes_match_their_config_json():
    """conf/model/qwen3_*.yaml hold what the trainer reads from Qwen3's config.json (the published
    values, copied here); the q/k norms count as parameters (2 x head_dim per layer) and their
    inputs as stored activations, not as matmul FLOPs; widths follow head_dim (0.6B: 16 heads of
    128 on a hidden size of 1024)."""
    import dataclasses

    from hybridflow.cost.flops import activation_bytes_per_token_layer, forward_flops_per_token

    common = {"model_type": "qwen3", "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6,
              "max_position_embeddings": 40960, "rope_theta": 1000000.0, "attention_bias": False,
              "use_sliding_window": False, "sliding_window": None, "max_window_layers": 28}
    published = {"qwen3_0_6b": (28, 1024, 3072, 16, 8, True), "qwen3_1_7b": (28, 2048, 6144, 16, 8, True),
                 "qwen3_8b": (36, 4096, 12288, 32, 8, False)}
    for name, (layers, h, f, heads, kv, tied) in published.items():
        c = {**common, "name": name, "num_hidden_layers": layers, "hidden_size": h,
             "intermediate_size": f, "num_attention_heads": heads, "num_key_value_heads": kv,
             "tie_word_embeddings": tied}
        assert dataclasses.replace(load_shape(c), hf_architecture=None) == load_shape(name), name
    s = load_shape("qwen3_0_6b")
    assert s.qk_layernorm and s.q_dim == 2048 != s.hidden_size and s.kv_dim == 1024
    plain = dataclasses.replace(s, qk_layernorm=False)
    assert s.layer_params - plain.layer_params == 2 * 128
    assert activation_bytes_per_token_layer(s) - activation_bytes_per_token_layer(plain) == 2 * (2048 + 1024)
    assert forward_flops_per_token(s, 1024) == forward_flops_per_token(plain, 1024)


def test_unknown_names_raise_value_error():
    with pytest.raises(ValueError, match="qwen2_7b"):
        load_shape("gpt5")
    with pytest.raises(ValueError, match="H200"):
        estimate_cost(model="tiny", gpu="TPUv9")


# --- FLOPs --------------------------------------------------------------------------------------

def test_flops_per_token_is_6n_plus_causal_attention():
    # N = matmul weights per token: layers' QKV, out, gate/up/down + the LM head (no bias, norm, lookup).
    L, h, f, q, kv, V = 28, 3584, 18944, 28 * 128, 4 * 128, 152064    # qwen2_7b
    n = L * (h * (q + 2 * kv) + q * h + 3 * h * f) + V * h
    s = 1536
    shape = load_shape("qwen2_7b")
    assert shape.num_dense_params == n
    assert forward_flops_per_token(shape, s) == 2 * n + 2 * L * s * q        # causal: mean context s/2
    assert train_flops_per_token(shape, s) == 6 * n + 6 * L * s * q
    assert train_flops_per_token(shape, s, recompute=True) == 8 * n + 8 * L * s * q
    # the LM head (V x h) at a share of the tokens only (the engine's response positions)
    assert forward_flops_per_token(shape, s, head_fraction=0.25) == \
        pytest.approx(2 * (n - 0.75 * V * h) + 2 * L * s * q)
    assert train_flops_per_token(shape, s, head_fraction=0.0) == 6 * (n - V * h) + 6 * L * s * q
    assert forward_flops_per_token(shape, s, "critic", head_fraction=0.25) == \
        forward_flops_per_token(shape, s, "critic")  # its head is h x 1


# --- memory -------------------------------------------------------------------------------------

TINY_WORK = dict(algorithm="grpo", prompts_per_step=2, samples_per_prompt=2, prompt_len=16,
                 response_len=16, micro_batch_tokens=64)


def test_memory_components_by_hand_tiny():
    p = 82_496
    m = estimate_memory(model="tiny", gpu="H200", num_gpus=1, layout={"tp": 1}, **TINY_WORK,
                        calibration=Calibration())          # memory_scale 1: the hand counts
    up = {k: v * GIB for k, v in m.phases_gib["update_actor"].items()}
    assert up["actor_weights"] == pytest.approx(2 * p)
    assert up["actor_grads"] == pytest.approx(4 * p)          # fp32 main grads
    assert up["actor_optimizer"] == pytest.approx(12 * p)     # fp32 master + Adam m, v
    assert up["reference"] == pytest.approx(2 * p)
    assert up["critic"] == up["kv_cache"] == up["reshard_buffer"] == 0
    # 2 sequences of 32 tokens per micro-batch; per token per layer 2 bytes x (4h + 2q + 2kv + 3f)
    # = 2 x (256 + 128 + 64 + 384) = 1664 bytes, 2 layers; bf16 logits + their grad: 4 bytes x V
    # at the 16 response positions of each 32-token sequence (the engine scores only those).
    assert up["activations"] == pytest.approx(64 * (2 * 1664))
    assert up["logits"] == pytest.approx(32 * 64 * 4)
    # as measured before (the calibration records): fp32 logits + log-softmax at every position
    whole = estimate_memory(model="tiny", gpu="H200", num_gpus=1, layout={"tp": 1}, **TINY_WORK,
                            calibration=Calibration(), response_logits_only=False, bf16_logits=False)
    assert whole.phases_gib["update_actor"]["activations"] * GIB == pytest.approx(64 * 2 * 1664)
    assert whole.phases_gib["update_actor"]["logits"] * GIB == pytest.approx(64 * 64 * 8)
    # parallel.lm_head_chunk_tokens=5: one chunk of 5 positions' logits held, in every LM pass;
    # the update also holds the output weight's gradient summed over the chunks (fp32) and one
    # chunk's bf16 product (V x h x 6 bytes), and pays one more LM-head GEMM (2 x V x h per position)
    kw = dict(model="tiny", gpu="H200", num_gpus=1, layout={"tp": 1}, **TINY_WORK,
              calibration=Calibration())
    chunked = estimate_memory(**kw, lm_head_chunk_tokens=5)
    assert chunked.phases_gib["ref"]["logits"] * GIB == pytest.approx(5 * 64 * 4)
    assert chunked.phases_gib["update_actor"]["logits"] * GIB == pytest.approx(5 * 64 * 4
                                                                                + 64 * 64 * 6)
    t0, t1 = estimate_step_time(**kw), estimate_step_time(**kw, lm_head_chunk_tokens=5)
    assert t1["update_actor"] > t0["update_actor"] and t1["ref"] == t0["ref"]
    with pytest.raises(ValueError, match="lm_head_chunk_tokens must be 0"):
        estimate_memory(**kw, lm_head_chunk_tokens=-2)
    gen = {k: v * GIB for k, v in m.phases_gib["gen"].items()}
    # all 4 sequences in one wave; K and V: 2 x 2 layers x 2 groups x 16 dims x 2 bytes per token,
    # 16 + 16 columns rounded up to the generator's 64
    assert (m.gen_batch, m.gen_waves) == (4, 1)
    assert gen["kv_cache"] == pytest.approx(4 * 64 * 256)


def test_memory_sharding_tiny():
    from hybridflow.cost.memory import replicated_params

    p = 82_496
    m = estimate_memory(model="tiny", gpu="H200", num_gpus=4, algorithm="ppo",
                        layout={"tp": 2, "dp": 2, "tp_gen": 1, "offload_ref": True}, **{
                            k: v for k, v in TINY_WORK.items() if k != "algorithm"},
                        calibration=Calibration())
    gen = {k: v * GIB for k, v in m.phases_gib["gen"].items()}
    assert gen["actor_weights"] == pytest.approx(2 * p / 2)
    assert gen["actor_optimizer"] == pytest.approx(12 * p / 4)        # distributed optimizer over DP
    # TP2 -> TP1: the whole gen shard but the norms (aliased), as parallel.reshard allocates it
    norms = replicated_params(load_shape("tiny"))
    assert gen["reshard_buffer"] == pytest.approx(2 * (p - norms))
    # offloaded: present for its pass, and prefetched behind generation
    # (trainer.offload_ref_prefetch)
    assert m.phases_gib["ref"]["reference"] * GIB == pytest.approx(p)
    assert gen["reference"] == pytest.approx(p)
    assert m.phases_gib["update_actor"]["reference"] == 0
    critic = load_shape("tiny").num_critic_params
    assert gen["critic"] == pytest.approx(critic * (2 + 4 + 12 / 2) / 2)
    late = estimate_memory(model="tiny", gpu="H200", num_gpus=4, algorithm="ppo",
                           layout={"tp": 2, "dp": 2, "tp_gen": 1, "offload_ref": True},
                           offload_ref_prefetch=False, calibration=Calibration(),
                           **{k: v for k, v in TINY_WORK.items() if k != "algorithm"})
    assert late.phases_gib["gen"]["reference"] == 0
    assert late.phases_gib["ref"]["reference"] * GIB == pytest.approx(p)
    # the copy: hidden behind generation when prefetched, paid in the ref stage otherwise
    kw = dict(model="qwen2_1_5b", gpu="H200", num_gpus=1, calibration=Calibration(), **TINY_WORK)
    t = {f: estimate_step_time(layout={"tp": 1, "offload_ref": True}, offload_ref_prefetch=f, **kw)
         for f in (True, False)}
    resident = estimate_step_time(layout={"tp": 1}, **kw)
    assert t[True]["ref"] == pytest.approx(resident["ref"])
    assert t[False]["ref"] > t[True]["ref"]


# --- search and report --------------------------------------------------------------------------

def test_qwen2_7b_fits_on_8xh200():
    r = estimate_cost(model="qwen2_7b", gpu="H200", num_gpus=8, algorithm="ppo", epochs=1,
                      dataset_size=7473, prompts_per_step=128)
    lay = r.layout
    assert r.fits and r.overflow is None
    assert lay["tp"] * lay["pp"] * lay["dp"] == 8 and lay["tp"] % lay["tp_gen"] == 0
    assert r.peak_memory_gib <= r.memory_capacity_gib
    assert r.steps == math.ceil(7473 / 128)
    assert r.cost == pytest.approx(r.gpu_hours * 3.50)
    assert r.gpu_hours == pytest.approx(r.steps * r.step_seconds * 8 / 3600)
    assert set(r.stage_seconds) == {"reshard", "gen", "old_log_prob", "ref", "values",
                                    "update_critic", "update_actor", "other"}
    c = shipped_calibration()   # per step, and per generated row of a DP rank (1024 / dp)
    assert r.stage_seconds["other"] == pytest.approx(
        c.step_overhead_s + c.row_overhead_s * math.ceil(128 * 8 / lay["dp"]))
    assert r.runners_up and all(x["step_seconds"] >= r.step_seconds for x in r.runners_up if x["fits"])
    assert json.loads(r.to_json())["layout"] == lay
    assert "seconds per step" in str(r)


def test_wont_fit_names_the_component():
    r = estimate_cost(model="llama3_8b", gpu="A100-40GB", num_gpus=1, algorithm="ppo")
    assert not r.fits
    assert r.overflow["component"] in COMPONENTS
    assert r.overflow["peak_gib"] > r.overflow["capacity_gib"]
    assert any(s.startswith("more GPUs") for s in r.suggestions)
    assert "WON'T FIT" in str(r)


def test_forced_layout_and_fixed_layout_api():
    work = dict(algorithm="grpo", prompts_per_step=32, samples_per_prompt=4, prompt_len=256,
                response_len=512)
    r = estimate_cost(model="qwen2_1_5b", gpu="H100", num_gpus=4, layout={"tp": 2, "tp_gen": 1}, **work)
    assert r.layout == {"tp": 2, "pp": 1, "dp": 2, "tp_gen": 1, "offload_ref": False, "recompute": False}
    t = estimate_step_time(model="qwen2_1_5b", gpu="H100", num_gpus=4, layout={"tp": 2, "tp_gen": 1}, **work)
    assert t["step"] == pytest.approx(r.step_seconds) and t["reshard"] > 0
    m = estimate_memory(model="qwen2_1_5b", gpu="H100", num_gpus=4, layout={"tp": 2, "tp_gen": 1}, **work)
    assert m.peak_gib == pytest.approx(r.peak_memory_gib) and m.fits
    with pytest.raises(ValueError, match="num_query_groups"):
        estimate_cost(model="qwen2_1_5b", gpu="H100", num_gpus=3, layout={"tp": 3})


def test_cli_prints_table_and_json():
    cmd = [sys.executable, "-m", "hybridflow.cost", "--model", "qwen2_0_5b", "--gpu", "H100",
           "--num-gpus", "2", "--steps", "10"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "seconds per step" in out and "GPU-hours" in out
    out = subprocess.run(cmd + ["--json"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert json.loads(out)["steps"] == 10



def _one_error(capsys, tool: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith(f"hybridflow {tool}: error: ") and err.count("\n") == 1, err
    return err[len(f"hybridflow {tool}: error: "):-1]


def test_cli_names_a_bad_calibration_file(tmp_path, capsys):
    from hybridflow.cost.__main__ import main as cost_main

    bad = tmp_path / "bad.json"
    for text, what in [
        ("{not json", "not valid JSON (Expecting property name enclosed in double quotes: line 1 "
                      "column 2); expected the calibration JSON python -m hybridflow.cost.calibrate "
                      "writes"),
        ("[1, 2]", "expected a JSON object of calibration values (as python -m "
                   "hybridflow.cost.calibrate writes), got list"),
        ('{"calibration": {"train_mfu": "fast"}}', "train_mfu='fast': expected a number"),
        ('{"train_muf": 0.5}', "unknown keys ['train_muf']; expected some of ["),
    ]:
        bad.write_text(text)
        assert cost_main(["--model", "qwen2_0_5b", "--calibration", str(bad)]) == 2
        assert _one_error(capsys, "cost").startswith(f"{bad}: {what}"), text
    assert cost_main(["--model", "qwen2_0_5b", "--calibration", str(tmp_path / "no.json")]) == 2
    assert _one_error(capsys, "cost") == f"calibration file {tmp_path / 'no.json'} not found"


def test_cli_refuses_a_micro_batch_smaller_than_the_longest_row(capsys):
    """The trainer refuses a token budget that cannot hold the longest row; so does the cost CLI
    (it used to model one sequence per micro-batch)."""
    from hybridflow.cost.__main__ import main as cost_main

    args = ["--model", "qwen2_0_5b", "--num-gpus", "1", "--prompt-len", "512"]
    assert cost_main([*args, "--micro-batch-tokens", "1000"]) == 2
    assert _one_error(capsys, "cost") == (
        "--micro-batch-tokens=1000 (tokens per micro-batch, per GPU) must hold the longest row of a "
        "step, --prompt-len + --response-len = 512 + 1024 = 1536")
    assert cost_main([*args, "--response-len-max", "2048", "--forward-micro-batch-tokens", "2048"]) == 2
    assert _one_error(capsys, "cost") == (
        "--forward-micro-batch-tokens=2048 (tokens per micro-batch, per GPU) must hold the longest "
        "row of a step, --prompt-len + --response-len-max = 512 + 2048 = 2560")
    assert cost_main([*args, "--micro-batch-tokens", "1536"]) == 0
    cfg = load_config(["experiment=demo", "algo.use_dynamic_bsz=true",
                       "algo.max_tokens_per_micro_batch_per_gpu=10"])
    with pytest.raises(ValueError, match=r"^algo.max_tokens_per_micro_batch_per_gpu=10 \(tokens per "
                                         r"micro-batch, per GPU\) must hold the longest row of a "
                                         r"step, data.max_prompt_length \+ rollout.max_new_tokens"):
        validate(cfg, world_size=1)


def test_calibrate_cli_names_a_bad_results_file(tmp_path, capsys):
    (tmp_path / "a.json").write_text('{"records": [')
    (tmp_path / "b.jsonl").write_text('{"name": "x"}\n{oops\n')
    (tmp_path / "c.json").write_text('[3]')
    for name, what in [("a.json", "not valid JSON (Expecting value: line 1 column 14)"),
                       ("b.jsonl", "line 2: not valid JSON (Expecting property name enclosed in "
                                   "double quotes: column 2)"),
                       ("c.json", "record 0: expected a JSON object, got int")]:
        assert calibrate_main([str(tmp_path / name)]) == 2
        assert _one_error(capsys, "calibrate") == f"{tmp_path / name}: {what}", name


# --- calibration --------------------------------------------------------------------------------

TRUTH = Calibration(train_mfu=0.28, forward_mfu=0.45, fused_train_mfu=0.38, fused_forward_mfu=0.6,
                    prefill_efficiency=0.55, decode_bw_efficiency=0.7,
                    decode_layer_overhead_s=2e-4, fused_decode_layer_overhead_s=9e-5,
                    comm_efficiency=0.6, layer_pass_overhead_s=7e-4,
                    tp_collective_s=3e-4, optimizer_step_s=0.05,
                    step_overhead_s=0.04, memory_scale=1.1, activation_memory_scale=1.3)
CONFIGS = [
    ("qwen2_0_5b", 1, {"tp": 1}, "grpo", 16, 4, 128, 256),
    ("qwen2_0_5b", 2, {"tp": 2, "tp_gen": 1}, "ppo", 32, 4, 256, 512),
    ("qwen2_1_5b", 2, {"tp": 2, "tp_gen": 1}, "grpo", 8, 8, 512, 128),
    ("qwen2_1_5b", 2, {"tp": 1, "pp": 2}, "ppo", 64, 2, 64, 1024),
    ("qwen2_0_5b", 2, {"tp": 1, "dp": 2}, "rloo", 128, 4, 256, 64),
    ("qwen2_1_5b", 1, {"tp": 1}, "reinforce_plus_plus", 4, 1, 1024, 384),
]


def synthetic_records(calib=TRUTH):
    out = []
    for i, (model, n, layout, algo, prompts, samples, plen, rlen) in enumerate(CONFIGS):
        rec = {"name": f"{model}-{n}gpu-{algo}", "config": {
            "model": model, "gpu": "H200", "num_gpus": n, "layout": layout, "algorithm": algo,
            "prompts_per_step": prompts, "samples_per_prompt": samples, "prompt_len": plen,
            "response_len": rlen, "fused_elementwise": i % 2 == 1,
            "decode_kernels": "torch" if i < 3 else "triton"}}
        run = parse_record(rec)
        metrics = predict(run, calib)
        other = metrics.pop("timing_s/other")     # the trainer times reward and adv, not "other"
        reward = _reward_s(run, calib)
        rec["metrics"] = metrics | {"timing_s/reward": reward, "timing_s/adv": other - reward}
        out.append(rec)
    return out


def _reward_s(run, calib):
    """The reward's seconds as the model has them: "other"'s per-row part."""
    t = stage_terms(run.shape, run.gpu, run.plan, run.workload, calib)
    return t["other"].breakdown(calib.coefs())["row_overhead"]


def test_fit_recovers_known_factors():
    fitted = fit(synthetic_records())
    for k, v in TRUTH.to_dict().items():
        assert getattr(fitted, k) == pytest.approx(v, rel=1e-6), k


def test_row_overhead_is_fitted_on_the_timed_reward():
    # "other" = a cost per step + the reward per generated row. Here the records of more rows also
    # spent more per step (another workload's bookkeeping, as GSM8K's steps against the fixed-length
    # records'): "other" alone reads that as a per-row cost, the timed reward does not
    recs = synthetic_records()
    for rec in recs:
        run = parse_record(rec)
        rows = stage_terms(run.shape, run.gpu, run.plan, run.workload, TRUTH)["other"].x[
            "row_overhead_s"]
        rec["metrics"]["timing_s/step"] += 1e-4 * rows
        rec["metrics"]["timing_s/adv"] += 1e-4 * rows
    fitted = fit(recs)
    assert fitted.row_overhead_s == pytest.approx(TRUTH.row_overhead_s, rel=1e-6)
    assert fitted.step_overhead_s > TRUTH.step_overhead_s       # the extra, as a cost per step
    for rec in recs:   # without timing_s/reward: row_overhead_s and step_overhead_s on "other"
        del rec["metrics"]["timing_s/reward"]
    joint = fit(recs)
    assert joint.row_overhead_s == pytest.approx(TRUTH.row_overhead_s + 1e-4, rel=1e-6)
    assert joint.step_overhead_s == pytest.approx(TRUTH.step_overhead_s, rel=1e-6)


def test_memory_fit_falls_back_to_one_scale_when_it_cannot_separate():
    # one record: a common ratio of measured to predicted peak, activations unscaled
    rec = synthetic_records()[:1]
    fitted = fit(rec)
    assert fitted.activation_memory_scale == 1.0
    run = parse_record(rec[0])
    assert predict(run, fitted)["perf/max_memory_allocated_gb"] == pytest.approx(
        rec[0]["metrics"]["perf/max_memory_allocated_gb"], rel=1e-9)


def test_fit_separates_launch_and_tp_terms_from_flops():
    # Only the shared per-layer cost and the TP collectives differ from the FLOP-only model: the fit
    # must put them there, not into the MFUs (each stage group alone could not separate them).
    fitted = fit(synthetic_records(replace(TRUTH, layer_pass_overhead_s=2e-3, tp_collective_s=1e-3)))
    assert fitted.layer_pass_overhead_s == pytest.approx(2e-3, rel=1e-6)
    assert fitted.tp_collective_s == pytest.approx(1e-3, rel=1e-6)
    assert fitted.train_mfu == pytest.approx(TRUTH.train_mfu, rel=1e-6)


def test_unmeasured_factor_keeps_its_prior():
    # Without a TP > 1 record nothing depends on tp_collective_s: it keeps the prior, the rest is fit.
    recs = [r for r in synthetic_records() if r["config"]["layout"].get("tp", 1) == 1]
    prior = Calibration(tp_collective_s=1.23e-4)
    fitted = fit(recs, prior)
    assert fitted.tp_collective_s == prior.tp_collective_s
    assert fitted.layer_pass_overhead_s == pytest.approx(TRUTH.layer_pass_overhead_s, rel=1e-6)
    assert fitted.step_overhead_s == pytest.approx(TRUTH.step_overhead_s, rel=1e-6)


def test_launch_and_tp_terms_by_hand():
    # tiny: 2 layers, h=64; 4 sequences of 32 tokens, 2 per micro-batch -> 2 micro-batches per pass.
    # Counts and ideal seconds (the terms' x), before coefficients and overlap.
    calib = Calibration(layer_pass_overhead_s=1e-3, tp_collective_s=1e-4, step_overhead_s=0.5)

    def terms(num_gpus, layout):
        run = parse_record({"config": {"model": "tiny", "gpu": "H200", "num_gpus": num_gpus,
                                       "layout": layout, **TINY_WORK, "algorithm": "ppo"}})
        return stage_terms(run.shape, run.gpu, run.plan, run.workload, calib)

    one = terms(1, {"tp": 1})
    assert one["old_log_prob"].x["layer_pass_overhead_s"] == 2 * 2                  # L x micro
    assert one["update_critic"].x["layer_pass_overhead_s"] == 3 * 2 * 2             # fwd+bwd: 3
    assert "tp_collective_s" not in one["update_actor"].x
    assert one["other"].breakdown(calib.coefs()) == {"step_overhead": 0.5,
                                                     "row_overhead": 4 * calib.row_overhead_s}
    # TP=2 + SP: 4 collectives per layer per forward micro-batch, 8 for fwd+bwd; bytes: those of 2 (4)
    # all-reduces of 128 tokens x 64 x 2 bytes per layer, half of it per GPU, at 450 GB/s.
    two = terms(2, {"tp": 2})
    assert two["ref"].x["tp_collective_s"] == 4 * 2 * 2
    assert two["update_actor"].x["tp_collective_s"] == 8 * 2 * 2
    assert two["ref"].x["inv_comm_eff"] == pytest.approx(2 * 2 * 128 * 64 * 2 * 2 * 0.5 / 450e9)
    t = estimate_step_time(model="tiny", gpu="H200", num_gpus=2, layout={"tp": 2}, calibration=calib,
                           **TINY_WORK)
    assert t["other"] == pytest.approx(0.5 + 4 * calib.row_overhead_s) and t["step"] == pytest.approx(sum(v for k, v in t.items() if k != "step"))


def test_stage_and_optimizer_terms_by_hand():
    # 2 PPO epochs x 2 mini-batches = 4 optimizer steps per update; forward micro-batches of 4
    # sequences (2 of 2 in the updates): 1 forward micro-batch of the 4 sequences, 2 x 4 in updates.
    calib = Calibration(optimizer_step_s=0.02, layer_pass_overhead_s=1e-3)
    work = TINY_WORK | {"ppo_epochs": 2, "mini_batches": 2, "forward_micro_batch_tokens": 4 * 32}
    run = parse_record({"config": {"model": "tiny", "gpu": "H200", "num_gpus": 1, "layout": {"tp": 1},
                                   **work, "algorithm": "ppo"}})
    terms = stage_terms(run.shape, run.gpu, run.plan, run.workload, calib)
    assert "optimizer_step_s" not in terms["old_log_prob"].x
    assert terms["update_actor"].x["optimizer_step_s"] == 4
    assert terms["old_log_prob"].x["layer_pass_overhead_s"] == 2 * 1          # L x 1 micro-batch
    assert terms["update_actor"].x["layer_pass_overhead_s"] == 2 * 4 * 1 * 3  # L x 4 x 1 x fwd+bwd
    parts = stage_breakdown(run.shape, run.gpu, run.plan, run.workload, calib)
    adam = 30 * run.shape.num_params / (run.gpu.hbm_gbps * 1e9)                 # bytes / HBM peak
    assert parts["update_actor"]["optimizer"] == pytest.approx(4 * (0.02 + adam))  # serial: no overlap
    # the forward passes' activations follow their own micro-batch: 4 sequences, not 2
    mem = memory_for(run.shape, run.gpu, run.plan, run.workload, Calibration())
    small = replace(run.workload, forward_micro_batch_tokens=None)
    mem2 = memory_for(run.shape, run.gpu, run.plan, small, Calibration())
    for part in ("activations", "logits"):
        assert mem.phases_gib["old_log_prob"][part] == pytest.approx(
            2 * mem2.phases_gib["old_log_prob"][part])


def test_overlap_of_host_and_gpu_parts_by_hand():
    # A pass's host parts (launches) and GPU parts (FLOPs) cost (H^p + G^p)^(1/p), the serial parts
    # add; the breakdown scales the overlapped parts so the labels still sum to the stage.
    calib = Calibration(layer_pass_overhead_s=1e-3, forward_mfu=0.5)
    run = parse_record({"config": {"model": "qwen2_0_5b", "gpu": "H200", "num_gpus": 1,
                                   "layout": {"tp": 1}, **TINY_WORK, "fused_elementwise": False}})
    t = stage_terms(run.shape, run.gpu, run.plan, run.workload, calib)["old_log_prob"]
    coefs = calib.coefs()
    host = t.x["layer_pass_overhead_s"] * 1e-3
    gpu = t.x["inv_forward_mfu"] * 2.0
    assert t.sides(coefs) == pytest.approx({"a": host, "b": gpu, "serial": 0.0})
    p = calib.overlap_p
    assert t.seconds(coefs) == pytest.approx((host ** p + gpu ** p) ** (1 / p))
    assert max(host, gpu) < t.seconds(coefs) < host + gpu
    assert sum(t.breakdown(coefs).values()) == pytest.approx(t.seconds(coefs))
    # decode: its FLOPs overlap its HBM reads; prefill FLOPs and the per-layer cost add
    g = stage_terms(run.shape, run.gpu, run.plan, run.workload, calib)["gen"]
    sides = g.sides(coefs)
    assert sides["a"] > 0 and sides["b"] > 0 and sides["serial"] > 0
    assert g.seconds(coefs) == pytest.approx(
        sides["serial"] + (sides["a"] ** p + sides["b"] ** p) ** (1 / p))


def test_overlap_exponent_is_the_calibrations(tmp_path):
    # p is a field of the calibration (default 2), read by every overlapped stage: another p
    # changes a pass's and decode's seconds as (A^p + B^p)^(1/p) says, the serial parts as they were
    assert Calibration().overlap_p == 2.0
    calib = Calibration(layer_pass_overhead_s=1e-3, forward_mfu=0.5)
    run = parse_record({"config": {"model": "qwen2_0_5b", "gpu": "H200", "num_gpus": 1,
                                   "layout": {"tp": 1}, **TINY_WORK, "fused_elementwise": False}})
    for p in (1.5, 3.0):
        other = replace(calib, overlap_p=p)
        coefs = other.coefs()
        assert coefs["overlap_p"] == p
        terms = stage_terms(run.shape, run.gpu, run.plan, run.workload, other)
        for stage in ("old_log_prob", "gen"):
            sides = terms[stage].sides(coefs)
            assert sides == pytest.approx(terms[stage].sides(calib.coefs()))
            want = sides["serial"] + (sides["a"] ** p + sides["b"] ** p) ** (1 / p)
            assert terms[stage].seconds(coefs) == pytest.approx(want, rel=1e-12)
            assert terms[stage].seconds(coefs) != pytest.approx(
                terms[stage].seconds(calib.coefs()), rel=1e-6)
            assert sum(terms[stage].breakdown(coefs).values()) == pytest.approx(want, rel=1e-12)
        assert predict(run, other)["timing_s/gen"] == pytest.approx(
            terms["gen"].seconds(coefs), rel=1e-12)
    with pytest.raises(ValueError, match="overlap_p"):
        Calibration(overlap_p=0.5)               # would cost two overlapping parts over their sum
    # the fit keeps its base's p (records made at p = 3 give back their factors at p = 3), the
    # writer writes it and the loader reads it back; a calibration JSON without it loads at 2
    truth = replace(TRUTH, overlap_p=3.0)
    base, out = tmp_path / "base.json", tmp_path / "calibration.json"
    (tmp_path / "records.json").write_text(json.dumps(synthetic_records(truth)))
    base.write_text(json.dumps({"calibration": {"overlap_p": 3.0}}))
    assert calibrate_main([str(tmp_path / "records.json"), "--base", str(base),
                           "-o", str(out)]) == 0
    assert json.loads(out.read_text())["calibration"]["overlap_p"] == 3.0
    fitted = load_calibration(out)
    for k, v in truth.to_dict().items():
        assert getattr(fitted, k) == pytest.approx(v, rel=1e-6), k
    assert load_calibration({"train_mfu": 0.3}).overlap_p == 2.0
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"calibration": {k: v for k, v in TRUTH.to_dict().items()
                                               if k != "overlap_p"}}))
    assert load_calibration(old) == TRUTH


def test_leave_one_out_on_synthetic_records_is_exact():
    rows = predict_vs_measured(synthetic_records(), Calibration())
    assert len(rows) >= 6 * 6
    assert {"timing_s/step", "perf/max_memory_allocated_gb"} <= {r["metric"] for r in rows}
    assert max(abs(r["error_pct"]) for r in rows if r["measured"] > 0) < 1e-4   # reshard 0: nan


def test_single_record_is_reproduced_by_the_least_change_fit():
    # One PPO record: 5 pass stages for 6 pass unknowns, 1 gen stage for 3: underdetermined, so the
    # exact fit that moves the priors least (relatively) is taken; every measured stage is matched.
    rec = synthetic_records()[1]
    pred = predict(parse_record(rec), fit([rec]))
    for k, v in rec["metrics"].items():
        if k not in ("timing_s/reward", "timing_s/adv"):    # modelled together as "other"
            assert pred[k] == pytest.approx(v, rel=1e-6), k


def test_calibrate_cli_roundtrip(tmp_path, capsys):
    recs = synthetic_records()
    (tmp_path / "a.json").write_text(json.dumps(recs[:3]))
    (tmp_path / "b.json").write_text(json.dumps({"records": recs[3:]}))
    out, val = tmp_path / "calibration.json", tmp_path / "validation.json"
    assert calibrate_main([str(tmp_path / "a.json"), str(tmp_path / "b.json"), "-o", str(out),
                           "--validation", str(val)]) == 0
    assert "leave-one-out" in capsys.readouterr().out
    summary = json.loads(val.read_text())["validation"]
    assert summary["num_configs"] == summary["num_within_tolerance"] == 6
    c = summary["configs"][0]
    assert c["source"] == str(tmp_path / "a.json") and c["gpu"] == "H200"
    assert abs(c["step_s_error_pct"]) < 1e-4 and c["measured_step_s"] > 0 and "gen" in str(c["stages"])
    assert "--validation" in summary["command"]
    # both outputs are skipped when globbed back in
    # the calibration loads as one
    assert calibrate_main([str(p) for p in sorted(tmp_path.glob("*.json"))]) == 0
    r = estimate_cost(model="qwen2_0_5b", gpu="H200", num_gpus=1, calibration=str(out))
    assert r.calibration == pytest.approx(TRUTH.to_dict(), rel=1e-6)


def test_estimator_defaults_to_the_shipped_h200_fit():
    shipped = shipped_calibration()
    assert shipped != Calibration()                           # a fit, not the priors
    assert shipped == load_calibration(ROOT / "benchmarks" / "results" / "calibration.json")
    r = estimate_cost(model="qwen2_0_5b", gpu="H200", num_gpus=1, steps=1)
    assert "calibration: the shipped H200 fit" in r.notes


# --- one model type, one config.json reader, one layout type with the trainer ---------------------

@pytest.mark.parametrize("name", known_models())
def test_cost_model_reads_the_trainers_model_config(name):
    # load_shape reads conf/model/<name>.yaml itself; Hydra composes it over the schema
    assert load_shape(name) == load_config(["experiment=demo", f"model={name}"]).model


def test_config_json_read_as_the_trainer_reads_it(tmp_path):
    llama = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps(llama))
    assert load_shape(str(tmp_path)) == read_hf_config(str(tmp_path))
    assert not load_shape(str(tmp_path)).add_qkv_bias
    # Llama's attention_bias also biases o_proj, which the trainer cannot build: refused by both
    (tmp_path / "config.json").write_text(json.dumps(llama | {"attention_bias": True}))
    with pytest.raises(ValueError, match="attention_bias"):
        load_shape(str(tmp_path))


def test_search_offers_the_layouts_the_trainer_accepts():
    # 8 heads in 4 KV groups would allow TP=4, the FFN width 4098 = 2 x 2049 does not (Megatron
    # splits it over TP): the search must agree with config.validate on every (TP, PP, TP_g).
    shape = load_shape({"name": "odd", "num_layers": 6, "hidden_size": 256, "ffn_hidden_size": 4098,
                        "num_attention_heads": 8, "num_query_groups": 4, "vocab_size": 1000})
    base = load_config(["experiment=demo", "algo.micro_batch_size_per_gpu=1", "algo.forward_micro_batch_size_per_gpu=1"])
    base = replace(base, model=shape)
    accepted = set()
    for tp, pp, tp_g in itertools.product(range(1, 9), repeat=3):
        cfg = replace(base, parallel=replace(base.parallel, tensor_parallel_size=tp,
                                             pipeline_parallel_size=pp),
                      rollout=replace(base.rollout, tensor_parallel_size=tp_g))
        try:
            validate(cfg, world_size=8)
        except ValueError:
            continue
        accepted.add((tp, pp, tp_g))
    plans = candidate_plans(shape, get_gpu("H200"), 8, use_reference=True)
    assert {(p.layout.tp_t, p.layout.pp_t, p.layout.tp_g) for p in plans} == accepted
    assert {tp for tp, _, _ in accepted} == {1, 2}
    with pytest.raises(ValueError, match="ffn_hidden_size"):
        estimate_cost(model=shape, gpu="H200", num_gpus=8, layout={"tp": 4})


def test_skipped_old_log_prob_pass_is_not_predicted():
    """One epoch of one mini-batch: the trainer leaves the old_log_prob pass out (algo.
    skip_redundant_old_log_prob), so the forecast has no such stage and its step is shorter by
    exactly that stage; the skip is refused where it would not be exact."""
    kw = dict(model="qwen2_0_5b", gpu="H200", num_gpus=1, layout={"tp": 1}, prompts_per_step=8,
              samples_per_prompt=8, prompt_len=128, response_len=256)
    kept = estimate_step_time(**kw)
    skipped = estimate_step_time(**kw, skip_old_log_prob=True)
    assert "old_log_prob" in kept and "old_log_prob" not in skipped
    assert {k: v for k, v in kept.items() if k not in ("old_log_prob", "step")} == \
        {k: v for k, v in skipped.items() if k != "step"}
    assert skipped["step"] == pytest.approx(kept["step"] - kept["old_log_prob"])
    assert "old_log_prob" not in estimate_memory(**kw, skip_old_log_prob=True).phases_gib
    with pytest.raises(ValueError, match="skip_old_log_prob needs ppo_epochs=1 and mini_batches=1"):
        estimate_step_time(**kw, mini_batches=2, skip_old_log_prob=True)


def test_prefill_is_charged_once_per_prompt_on_each_replica():
    """The generator prefills each prompt once for its n samples: the gen stage's prefill FLOPs are
    those of the replica's prompts, n times fewer than one per sample row (the old generator, which
    the calibration records were measured with and say so: prefill_once_per_prompt false)."""
    for dp in (1, 2):
        work = dict(TINY_WORK, prompts_per_step=8, samples_per_prompt=4)
        runs = {once: parse_record({"config": {"model": "qwen2_0_5b", "gpu": "H200", "num_gpus": dp,
                                               "layout": {"tp": 1, "dp": dp}, **work,
                                               "prefill_once_per_prompt": once}})
                for once in (True, False)}
        flops = {once: stage_terms(r.shape, r.gpu, r.plan, r.workload, Calibration())["gen"]
                 .x["inv_prefill_eff"] for once, r in runs.items()}
        r = runs[True]
        one_row = 16 * forward_flops_per_token(r.shape, 16) / (r.gpu.bf16_tflops * 1e12)
        # one row per prompt against one per sample row: 8/dp and 32/dp rows per replica
        assert flops[False] - flops[True] == pytest.approx((32 - 8) // dp * one_row)
        assert flops[True] > 8 // dp * one_row  # the decode FLOPs come on top
    # every calibration record states which generator and training passes it measured, and its file
    # name says it in tokens: the first 17 the old generator, the speed runs' trainer options (kv64;
    # tk with the decode kernels) the current one; fe the fused RoPE / SwiGLU
    # (parallel.fused_elementwise), g the update's per-layer CUDA graphs (parallel.train_cuda_graphs;
    # ig: graphs that add the weight gradients into main_grad, not hold them), wf the weight
    # gradients accumulated in their GEMM (parallel.gradient_accumulation_fusion)
    records = {p.stem: json.loads(p.read_text()) for p in (ROOT / "benchmarks/results/cost").glob("*.json")}
    configs = [(set(name.split("_")), r["config"]) for name, rec in records.items()
               for r in rec.get("records", []) if "family" not in r]   # (varlen_gsm8k: below)
    assert len(configs) == 40
    for tokens, c in configs:
        assert c["prefill_once_per_prompt"] is ("kv64" in tokens)
        assert (c.get("decode_kernels", "torch") == "triton") is ("tk" in tokens)
        assert c["fused_elementwise"] is ("fe" in tokens)
        assert c.get("train_cuda_graphs", False) is ("g" in tokens)
        assert c.get("graph_weight_grads_held", False) is ("g" in tokens and "ig" not in tokens)
        assert c["gradient_accumulation_fusion"] is ("wf" in tokens)


def test_kept_generator_holds_its_kv_cache_through_training():
    """rollout.free_cache_engine=false: every phase after gen carries the gen wave's KV cache, where
    generation uses the training weights in place; with a reshard the generator is rebuilt anyway."""
    base = dict(model="qwen2_0_5b", gpu="H200", **TINY_WORK)
    for layout, kept in (({"tp": 1}, True), ({"tp": 2, "tp_gen": 1}, False)):
        n = 2 if layout["tp"] == 2 else 1
        freed = estimate_memory(num_gpus=n, layout=layout, **base)
        held = estimate_memory(num_gpus=n, layout=layout, keep_generator=True, **base)
        kv = freed.phases_gib["gen"]["kv_cache"]
        assert kv > 0 and held.phases_gib["gen"] == freed.phases_gib["gen"]
        for phase in ("ref", "update_actor"):
            assert held.phases_gib[phase]["kv_cache"] == pytest.approx(kv if kept else 0.0)
            assert freed.phases_gib[phase]["kv_cache"] == 0.0


def test_longest_response_sets_the_decode_steps_and_the_cache():
    """A long tail: mean response_len, decode until response_len_max. Per-step costs (weight read,
    per-layer decode overhead) scale with the longest response, per-row costs (FLOPs, KV read) and
    the training passes stay at the mean; the KV cache holds the longest."""
    kw = dict(model="qwen2_0_5b", gpu="H200", num_gpus=1, layout={"tp": 1}, algorithm="grpo",
              prompts_per_step=8, samples_per_prompt=8, prompt_len=128, response_len=256)
    runs = {m: parse_record({"config": {"model": "qwen2_0_5b", "gpu": "H200", "num_gpus": 1,
                                        "layout": {"tp": 1}, **{k: v for k, v in kw.items()
                                                                if k not in ("model", "gpu", "num_gpus", "layout")},
                                        "response_len_max": m}})
            for m in (None, 1024)}
    terms = {m: stage_terms(r.shape, r.gpu, r.plan, r.workload, Calibration()) for m, r in runs.items()}
    gen = {m: {label: x for label, _, x in t["gen"].parts} for m, t in terms.items()}
    assert gen[1024]["decode_overhead"] == pytest.approx(4 * gen[None]["decode_overhead"])
    assert gen[1024]["decode_compute"] == gen[None]["decode_compute"]
    assert gen[1024]["hbm_read"] > gen[None]["hbm_read"]  # 4x the weight reads, the same KV reads
    assert terms[1024]["update_actor"].parts == terms[None]["update_actor"].parts
    short, tail = (estimate_memory(**kw, calibration=Calibration(), response_len_max=m) for m in (None, 1024))
    assert tail.phases_gib["gen"]["kv_cache"] == pytest.approx(
        short.phases_gib["gen"]["kv_cache"] * (128 + 1024) / (128 + 256))
    t = estimate_step_time(**kw, response_len_max=1024)
    assert t["gen"] > estimate_step_time(**kw)["gen"]
    with pytest.raises(ValueError, match="response_len_max=128 is below the mean response_len=256"):
        estimate_step_time(**kw, response_len_max=128)


def test_layout_overrides_name_the_trainer_keys():
    """The estimate says how to run its layout: each override is a field of the trainer's config."""
    import dataclasses

    from hybridflow.config import Config
    from hybridflow.cost.report import layout_overrides

    layout = {"tp": 2, "pp": 4, "dp": 2, "tp_gen": 1, "offload_ref": True, "recompute": True}
    got = layout_overrides(layout)
    assert got == ("parallel.tensor_parallel_size=2 parallel.pipeline_parallel_size=4 "
                   "rollout.tensor_parallel_size=1 parallel.sequence_parallel=true "
                   "trainer.offload_ref=true "
                   "parallel.activation_checkpointing=true")
    for item in got.split():
        group, key = item.split("=")[0].split(".")
        section = next(f for f in dataclasses.fields(Config) if f.name == group)
        cls = section.default_factory().__class__
        assert key in {f.name for f in dataclasses.fields(cls)}, item
    plain = layout_overrides(dict(layout, offload_ref=False, recompute=False))
    assert "offload_ref" not in plain and "activation_checkpointing" not in plain
    r = estimate_cost(model="tiny", gpu="H200", num_gpus=1)
    assert r.fits and f"trainer overrides (world size 1): {layout_overrides(r.layout)}" in str(r)


def test_fused_elementwise_has_its_own_mfu_and_keeps_less():
    """Workload.fused_elementwise (parallel.fused_elementwise): the forward / update passes' FLOP
    time goes to fused_forward_mfu / fused_train_mfu, the same ideal seconds; the update keeps 2 x
    ffn fewer bf16 elements per token and layer (Megatron's unfused SwiGLU keeps silu(gate) and a
    copy of up); the shipped fit has the fused passes faster."""
    runs = {f: parse_record({"config": {"model": "qwen2_0_5b", "gpu": "H200", "num_gpus": 1,
                                        "layout": {"tp": 1}, **TINY_WORK, "fused_elementwise": f}})
            for f in (False, True)}
    terms = {f: stage_terms(r.shape, r.gpu, r.plan, r.workload, Calibration())
             for f, r in runs.items()}
    for stage, coef in (("ref", "forward_mfu"), ("update_actor", "train_mfu")):
        assert terms[True][stage].x[f"inv_fused_{coef}"] == terms[False][stage].x[f"inv_{coef}"] > 0
        assert f"inv_{coef}" not in terms[True][stage].x
    mem = {f: estimate_memory(model="qwen2_0_5b", gpu="H200", num_gpus=1, layout={"tp": 1},
                              **TINY_WORK, fused_elementwise=f) for f in (False, True)}
    shape, tokens = runs[True].shape, 64  # a micro-batch: 2 sequences of 16 + 16 tokens
    saved = tokens * shape.num_layers * 2 * shape.ffn_hidden_size * 2 / 2**30
    cal = shipped_calibration()  # estimate_memory's scales
    assert (mem[False].phases_gib["update_actor"]["activations"]
            - mem[True].phases_gib["update_actor"]["activations"]) == pytest.approx(
                saved * cal.activation_memory_scale * cal.memory_scale)
    assert cal.fused_train_mfu > cal.train_mfu and cal.fused_forward_mfu > cal.forward_mfu


def test_fused_decode_kernels_have_their_own_per_layer_cost():
    """Workload.decode_kernels="triton" (rollout.decode_kernels) charges the decode steps'
    per-layer cost to fused_decode_layer_overhead_s instead of decode_layer_overhead_s, the same
    count; the shipped fit has it below the torch step's."""
    runs = {k: parse_record({"config": {"model": "qwen2_0_5b", "gpu": "H200", "num_gpus": 1,
                                        "layout": {"tp": 1}, **TINY_WORK, "decode_kernels": k}})
            for k in ("torch", "triton")}
    x = {k: stage_terms(r.shape, r.gpu, r.plan, r.workload, Calibration())["gen"].x
         for k, r in runs.items()}
    assert x["triton"]["fused_decode_layer_overhead_s"] == x["torch"]["decode_layer_overhead_s"] > 0
    assert "decode_layer_overhead_s" not in x["triton"]
    cal = shipped_calibration()
    assert 0 < cal.fused_decode_layer_overhead_s < cal.decode_layer_overhead_s
    with pytest.raises(ValueError, match="decode_kernels 'cuda'"):
        parse_record({"config": {"model": "tiny", "gpu": "H200", "num_gpus": 1, "layout": {"tp": 1},
                                 **TINY_WORK, "decode_kernels": "cuda"}})


def test_train_cuda_graphs_replace_the_update_launch_cost():
    """parallel.train_cuda_graphs: the update's layer passes pay `graphed_layer_pass_s` instead of
    the eager launch cost (forward-only passes stay eager), on the host side of the overlap; the
    graphs' static tensors (per layer a micro-batch's input, output and their gradients; the
    layers' bf16 weight gradients too in records of the first version) are resident in every
    phase."""
    base = dict(model="qwen2_1_5b", gpu="H200", num_gpus=1, layout={"tp": 1}, **TINY_WORK)
    r = {g: parse_record({"config": {"model": "qwen2_1_5b", "gpu": "H200", "num_gpus": 1,
                                     "layout": {"tp": 1}, **TINY_WORK, "train_cuda_graphs": g}})
         for g in (False, True)}
    terms = {g: stage_terms(x.shape, x.gpu, x.plan, x.workload, Calibration()) for g, x in r.items()}
    eager, graphed = terms[False]["update_actor"].x, terms[True]["update_actor"].x
    assert graphed["graphed_layer_pass_s"] == eager["layer_pass_overhead_s"] > 0
    assert "layer_pass_overhead_s" not in graphed and "graphed_layer_pass_s" not in eager
    assert terms[True]["ref"].x == terms[False]["ref"].x
    cal = Calibration(layer_pass_overhead_s=1e-3, graphed_layer_pass_s=1e-5)
    t = {g: estimate_step_time(**base, calibration=cal, train_cuda_graphs=g) for g in (False, True)}
    assert t[True]["update_actor"] < t[False]["update_actor"]
    assert t[True]["ref"] == t[False]["ref"]
    shape = load_shape("qwen2_1_5b")
    mem = {g: estimate_memory(**base, calibration=Calibration(), train_cuda_graphs=g)
           for g in (False, True)}
    held = estimate_memory(**base, calibration=Calibration(), train_cuda_graphs=True,
                           graph_weight_grads_held=True)
    tokens = 2 * 32  # a micro-batch: 64 // 32 sequences of 16 + 16 tokens
    static = 4 * 2 * tokens * shape.hidden_size * shape.num_layers / GIB
    grads = 2 * shape.num_layers * shape.layer_params / GIB
    for phase, comps in mem[True].phases_gib.items():
        assert comps["graph_pool"] == pytest.approx(static)
        assert held.phases_gib[phase]["graph_pool"] == pytest.approx(static + grads)
        assert sum(comps.values()) == pytest.approx(sum(mem[False].phases_gib[phase].values()) + static)
    # the graphs' pool keeps the update's activations through generation and the other passes:
    # reserved there, not allocated; what must fit is the larger of the two
    m = mem[True]
    act = m.phases_gib["update_actor"]["activations"]
    assert m.reserved_peak_gib == pytest.approx(max(
        sum(c.values()) + (act if p != "update_actor" else 0.0) for p, c in m.phases_gib.items()))
    assert m.reserved_peak_gib > sum(m.phases_gib["gen"].values()) and mem[False].reserved_peak_gib == 0
    assert m.fits == (max(m.peak_gib, m.reserved_peak_gib) <= m.capacity_gib)
    # token budgets: the graphs' shape is the budget (packed rows are padded to it)
    budget = estimate_memory(**{**base, "dynamic_bsz": True, "micro_batch_tokens": 4096},
                             calibration=Calibration(), train_cuda_graphs=True)
    per_token = 4 * 2 * shape.hidden_size * shape.num_layers / GIB
    assert budget.phases_gib["update_actor"]["graph_pool"] == pytest.approx(4096 * per_token)


def test_gradient_accumulation_fusion_leaves_the_layer_weights_out_of_the_accumulation():
    """Each update micro-batch pays DDP's accumulation of the bf16 gradients autograd hands out, on
    the GPU side of the overlap: every parameter without parallel.gradient_accumulation_fusion, all
    but the layers' matmul weights with it (their backward GEMM adds into main_grad itself)."""
    from hybridflow.cost.timing import GRAD_ACCUM_BW_EFF, GRAD_ACCUM_BYTES_PER_PARAM, _side

    shape = load_shape("qwen2_1_5b")
    r = {f: parse_record({"config": {"model": "qwen2_1_5b", "gpu": "H200", "num_gpus": 1,
                                     "layout": {"tp": 1}, **TINY_WORK,
                                     "gradient_accumulation_fusion": f}}) for f in (False, True)}
    x = {f: dict((label, v) for label, coef, v in stage_terms(run.shape, run.gpu, run.plan,
                                                              run.workload, Calibration())
                 ["update_actor"].parts if label == "grad_accum") for f, run in r.items()}
    micro = r[True].workload.num_micro_batches(1)
    per_param = GRAD_ACCUM_BYTES_PER_PARAM / (r[True].gpu.hbm_gbps * 1e9 * GRAD_ACCUM_BW_EFF)
    assert x[False]["grad_accum"] == pytest.approx(micro * shape.num_params * per_param)
    assert x[True]["grad_accum"] == pytest.approx(
        micro * (shape.num_params - shape.num_layers * shape.layer_matmul_params) * per_param)
    assert _side("pass", "grad_accum", None) == "b"
    t = {f: estimate_step_time(model="qwen2_1_5b", gpu="H200", num_gpus=1, layout={"tp": 1},
                               **TINY_WORK, gradient_accumulation_fusion=f) for f in (False, True)}
    assert t[True]["update_actor"] < t[False]["update_actor"] and t[True]["ref"] == t[False]["ref"]


def test_train_cuda_graphs_layouts_are_pp1_without_recompute():
    """The trainer refuses train_cuda_graphs with PP > 1 or recompute: the search leaves those
    layouts out, a forced one is an error naming the options."""
    kw = dict(model="qwen2_7b", gpu="H200", num_gpus=4, prompts_per_step=8, samples_per_prompt=8,
              prompt_len=128, response_len=256, train_cuda_graphs=True)
    rep = estimate_cost(**kw)
    layouts = [rep.layout] + [r["layout"] for r in rep.runners_up]
    assert all(lay["pp"] == 1 and not lay["recompute"] for lay in layouts)
    with pytest.raises(ValueError, match="train_cuda_graphs needs pp=1 and no recompute"):
        estimate_cost(**kw, layout={"tp": 2, "pp": 2})
