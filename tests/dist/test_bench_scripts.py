"""CPU smoke runs of the benchmark scripts that GPU runs rely on: bench_generate.py times
transformers after a warm-up as the median of >= 3 calls, the scale-out driver
benchmarks/scaleout_8b.sh runs PP=2 end to end on 2 gloo ranks with the tiny model, and the A/B and
vs-TRL drivers run both sides with the tiny model."""
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")


def test_bench_generate_warms_up_and_takes_median(tmp_path):
    out = tmp_path / "g.json"
    subprocess.run([sys.executable, "benchmarks/bench_generate.py", "--model", "hybridflow/conf/model/tiny.yaml",
                    "--device", "cpu", "--batches", "4", "--prompt-len", "8", "--new-tokens", "8",
                    "--kv-window", "64", "--out", str(out)], check=True, cwd=ROOT, env=ENV,
                   capture_output=True)
    r = json.loads(out.read_text())
    res = r["results"]["4"]
    assert r["kv_window"] == 64
    assert len(res["hf_all_s"]) == 3 and res["hf_warmup_calls"] == 1
    assert res["hf_s"] == statistics.median(res["hf_all_s"])
    assert "median" in r["timing"]["transformers"] and "median" in r["timing"]["ours"]
    bad = subprocess.run([sys.executable, "benchmarks/bench_generate.py", "--hf-reps", "1"],
                         cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert bad.returncode != 0 and "--hf-reps=1" in bad.stderr
    # --no-hf (an A/B of our options): ours and the floor fractions, no transformers timing
    subprocess.run([sys.executable, "benchmarks/bench_generate.py", "--model", "hybridflow/conf/model/tiny.yaml",
                    "--device", "cpu", "--batches", "4", "--prompt-len", "8", "--new-tokens", "8",
                    "--skip-checks", "--no-hf", "--out", str(out)], check=True, cwd=ROOT, env=ENV,
                   capture_output=True)
    r = json.loads(out.read_text())
    res = r["results"]["4"]
    assert r["no_hf"] and "hf_s" not in res and res["floor_with_kv_fraction"] > 0
    # the decode options as the run used them: DecodeOptions' defaults unless a flag set one
    from hybridflow.rollout.options import DecodeOptions

    default = json.loads(json.dumps(dataclasses.asdict(DecodeOptions(kernels="torch"))))
    assert r["decode_options"] == default
    subprocess.run([sys.executable, "benchmarks/bench_generate.py", "--model", "hybridflow/conf/model/tiny.yaml",
                    "--device", "cpu", "--batches", "4", "--prompt-len", "8", "--new-tokens", "8",
                    "--skip-checks", "--no-hf", "--pdl", "off", "--prefetch-weights", "fc1", "qkv",
                    "--prefetch-min-rows", "0", "--swiglu-gemm-min-rows", "0",
                    "--out", str(out)], check=True, cwd=ROOT, env=ENV, capture_output=True)
    opts = json.loads(out.read_text())["decode_options"]
    assert not opts["pdl"] and opts["prefetch_weights"] == ["qkv", "fc1"]
    assert opts["prefetch_min_rows"] == 0 and opts["swiglu_gemm_min_rows"] == 0
    bad = subprocess.run([sys.executable, "benchmarks/bench_generate.py", "--prefetch-weights",
                          "fc3"], cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert bad.returncode != 0 and "--prefetch-weights: invalid choice: 'fc3'" in bad.stderr


def test_bench_long_tail_times_every_variant(tmp_path):
    """The GPU session's generation A/B: compaction and the decode KV window, alone and together,
    each a first call (capture) and the median of >= 3, on the same sampled lengths' distribution."""
    out = tmp_path / "lt.json"
    subprocess.run([sys.executable, "benchmarks/bench_long_tail.py", "--model", "hybridflow/conf/model/tiny.yaml",
                    "--device", "cpu", "--batches", "8", "--prompt-len", "8", "--new-tokens", "80",
                    "--tail-mean", "16", "--kv-window", "64", "--out", str(out)],
                   check=True, cwd=ROOT, env=ENV, capture_output=True)
    res = json.loads(out.read_text())["results"]["8"]
    assert set(res) >= {"on", "off", "window", "on_window", "speedup"}
    for side in ("on", "off", "window", "on_window"):
        assert len(res[side]["s_all"]) == 3 and res[side]["s"] == statistics.median(res[side]["s_all"])
    assert res["on"]["stats"]["compactions"] > 0 and res["on"]["reproducible"]
    assert res["window"]["stats"]["compactions"] == 0


def test_bench_long_tail_speculative_ab(tmp_path):
    """--spec-ab: the tail on one side only, both with compaction and the window; --no-pdl reaches
    every side's kernel options."""
    out = tmp_path / "spec.json"
    subprocess.run([sys.executable, "benchmarks/bench_long_tail.py", "--model",
                    "hybridflow/conf/model/tiny.yaml", "--device", "cpu", "--batches", "8",
                    "--prompt-len", "8", "--new-tokens", "80", "--tail-mean", "16",
                    "--kv-window", "64", "--spec-ab", "4", "--no-pdl", "--out", str(out)],
                   check=True, cwd=ROOT, env=ENV, capture_output=True)
    report = json.loads(out.read_text())
    res = report["results"]["8"]
    assert report["pdl"] is False and set(res) >= {"on", "off", "speedup"}
    assert res["on"]["stats"]["spec_steps"] > 0 and res["off"]["stats"]["spec_steps"] == 0
    assert res["on"]["reproducible"]


def test_bench_multi_turn_synthetic_times_every_variant(tmp_path):
    out = tmp_path / "mt.json"
    subprocess.run([sys.executable, "benchmarks/bench_multi_turn.py", "--synthetic", "--device",
                    "cpu", "--dtype", "float32", "--layers", "1", "--vocab", "1024", "--prompts",
                    "2", "--n", "2", "--max-new", "160", "--reps", "1", "--tool-latency-ms", "5",
                    "--tool-jitter-ms", "20", "--out", str(out)],
                   check=True, cwd=ROOT, env=ENV, capture_output=True)
    r = json.loads(out.read_text())
    for name in ("eager", "graphed", "graphed_windows", "graphed_windows_at_once",
                 "tail_graphed_windows", "tail_graphed_windows_compact",
                 "tail_graphed_windows_compact_at_once"):
        m = r[name]["metrics"]
        assert m["tool_calls/mean"] >= 1 and r[name]["tool_tokens"] > 0, name
        assert r[name]["decode_steps"] > 0 and r["compaction_speedup"] > 0
        assert r[name]["append_calls"] == m["multi_turn/append_calls"] >= 1, name
        assert r[name]["append_wait_steps"] == (0 if name.endswith("_at_once") else 16)
    for name in r["hold_speedup"]:  # held results: never more extend calls than at once
        assert r[name]["append_calls"] <= r[name + "_at_once"]["append_calls"]
    assert r["tail_graphed_windows_compact"]["metrics"]["multi_turn/compactions"] >= 1
    assert set(r["ratios"]) == {"eager", "graphed", "graphed_windows", "graphed_windows_at_once",
                                "graphed_windows_fed", "graphed_windows_fed_ahead"}
    for name in ("graphed_windows", "tail_graphed_windows_compact"):  # results fed, no extend
        for twin, ahead in ((name + "_fed", False), (name + "_fed_ahead", True)):
            m = r[twin]["metrics"]
            assert r[twin]["append_calls"] == 0 and m["multi_turn/fed_tool_tokens"] > 0, twin
            assert r[twin]["lookahead"] == ahead
            assert (m["multi_turn/lookahead_dropped"] > 0) == ahead, twin
        assert r["fed_speedup"][name] > 0 and r["lookahead_speedup"][name] > 0
    assert r["settings"]["rows"] == 4 and r["single_turn"]["wall_s"] > 0
    assert (r["graphed_windows"]["metrics"]["multi_turn/kv_columns_mean"]
            < r["graphed"]["metrics"]["multi_turn/kv_columns_mean"])
    assert r["machine"] and r["command"].split()[1] == "benchmarks/bench_multi_turn.py"


def test_scaleout_driver_pp2_on_cpu(tmp_path):
    env = dict(ENV, OUT_DIR=str(tmp_path), STEPS="2", PYTHON=sys.executable)
    subprocess.run(["bash", "benchmarks/scaleout_8b.sh", "2", "pp2", "model=tiny",
                    "trainer.precision=fp32", "data.synthetic_length=8", "data.max_prompt_length=16",
                    "rollout.max_new_tokens=4", "rollout.n=4", "algo.ppo_mini_batch_size=8",
                    "algo.micro_batch_size_per_gpu=2", "algo.forward_micro_batch_size_per_gpu=2"],
                   check=True, cwd=ROOT, env=env, capture_output=True)
    r = json.loads((tmp_path / "scaleout_8b_h200x2_pp2.json").read_text())
    assert r["layout"] == {"tp": 1, "pp": 2, "dp": 1, "tp_gen": 1}
    w = r["workload"]
    # 4 prompts per GPU, 16-token prompts (8 letters + 8) and 4 forced response tokens
    assert w["prompts_per_step"] == 8 and r["tokens_per_step"] == 8 * 4 * (16 + 4)
    later = r["steps"]["steps"][1]
    assert r["tokens_per_s_per_gpu"] == later["perf/total_num_tokens"] / (later["timing_s/step"] * 2)
    assert r["prediction"]["step_s"] > 0 and "caveat" in r["prediction"]


def test_ab_rl_step_alternates_abba_and_pools_later_steps(tmp_path):
    """The A/B driver on CPU with the tiny model, this tree on both sides and one more flag on B:
    ABBA order over two rounds, each side's step time the median of the later steps of all its
    runs, every run's own median kept, and B vs A computed from the two."""
    out = tmp_path / "ab.json"
    subprocess.run([sys.executable, "benchmarks/ab_rl_step.py", "--sides", "before", "after", "--a-tree", ROOT,
                    "--b-args=--gc-interval 2", "--rounds", "2", "--logdir", str(tmp_path / "logs"),
                    "--out", str(out), "--", "--algos", "grpo", "--steps", "3", "--model", "tiny",
                    "--response", "4", "--prompts", "2", "--samples", "2", "--micro", "2"],
                   check=True, cwd=ROOT, env=ENV, capture_output=True)
    r = json.loads(out.read_text())
    assert r["run_order"] == ["default:before", "default:after", "default:after", "default:before"]
    assert r["sides"]["after"]["args"] == ["--gc-interval", "2"] and r["sides"]["before"]["args"] == []
    w = r["workloads"]["default"]
    for side in ("before", "after"):
        runs = w["runs"][side]
        assert len(runs) == 2 and w["failed_runs"][side] == 0
        later = [s["timing_s/step"] for run in runs for s in run["results"]["grpo"]["steps"][1:]]
        assert w[f"{side}_step_s"] == statistics.median(later) == w["stages"]["step"][side]["median"]
        assert w["stages"]["step"][side]["run_medians"] == [
            run["results"]["grpo"]["median_later_steps"]["timing_s/step"] for run in runs]
    assert w["after_vs_before"] == (w["after_step_s"] - w["before_step_s"]) / w["before_step_s"]
    assert len(list((tmp_path / "logs").glob("*_default_*.log"))) == 4


def test_bench_vs_trl_times_both_sides_and_copies_gsm8k(tmp_path):
    """The vs-TRL driver on CPU with the tiny model: our GRPO step (the speed configuration) and TRL's
    GRPOTrainer step (its fastest configuration: the step's completions from one generate call, one
    update pass, gradient checkpointing off where the memory probe says the update fits) on the same
    forced-length workload, per-stage MFU of ours, and the GSM8K numbers copied from the committed
    results file; --sides trl runs TRL alone."""
    out = tmp_path / "v.json"
    subprocess.run([sys.executable, "benchmarks/bench_vs_trl.py", "--workloads", "w1_0_5b", "--model-yaml",
                    "hybridflow/conf/model/tiny.yaml", "--device", "cpu", "--prompt-len", "16", "--response", "8",
                    "--prompts", "2", "--samples", "2", "--steps", "3", "--trl-steps", "3", "--out", str(out),
                    "--workdir", str(tmp_path / "work")], check=True, cwd=ROOT, env=ENV, capture_output=True)
    r = json.loads(out.read_text())
    assert r["peak_tflops"] == 790.0 and r["machine"]["gpu"] == "cpu" and r["versions"]["trl"]
    w = r["workloads"]["w1_0_5b"]
    assert w["ours_step_s"] > 0 and w["trl_step_s"] > 0
    assert len(w["trl_step_s_all"]) == 3 and w["trl_step_s"] == statistics.median(w["trl_step_s_all"][1:])
    assert w["ratio"] == w["trl_step_s"] / w["ours_step_s"]
    assert w["trl_completion_lengths"] == [[8, 8]] * 3  # forced: every completion 8 tokens
    assert w["ours_tokens"] == {"prompt_len": 16, "response_len": 8}
    # the same micro-batch on both sides: all 4 sequences in one pass; TRL generates them in one call
    trl, ours = w["config"]["trl"], w["config"]["ours"]
    assert ours["micro_batch"] == trl["per_device_train_batch_size"] == trl["generation_batch_size"] == 4
    assert (trl["gradient_accumulation_steps"], trl["steps_per_generation"]) == (1, 1)
    assert trl["grad_ckpt_mode"] == "auto" and trl["memory_probe"]["fits"] and not trl["gradient_checkpointing"]
    # ours: bench_rl_step --speed, with the options a CPU cannot run turned back
    assert ours["configuration"] == "speed" and "rollout.free_cache_engine=false" in ours["overrides"]
    assert ours["options"] == ["trainer.precision=fp32", "rollout.decode_kernels=torch",
                               "rollout.compile_decode=false"]
    assert set(w["ours_mfu"]) == {"gen", "ref", "update_actor", "step"}  # old_log_prob skipped
    for stage, mfu in w["ours_mfu"].items():
        assert math.isfinite(mfu) and mfu > 0
        assert mfu == w["ours_flops"][stage] / (w["ours_stages_s"][stage] * 790e12)
    g = r["workloads"]["gsm8k"]
    ours = json.load(open(os.path.join(ROOT, "benchmarks/results/gsm8k_h200.json")))
    trl = ours["trl"]
    assert g["ours_step_s"] == ours["ours_step_s"] and g["trl_step_s"] == trl["step_s_median"]
    assert g["ratio"] == trl["step_s_median"] / ours["ours_step_s"] and "ours_mfu" not in g
    # TRL alone, gradient checkpointing forced on (the configuration of the earlier results)
    subprocess.run([sys.executable, "benchmarks/bench_vs_trl.py", "--sides", "trl", "--workloads", "w1_0_5b",
                    "--model-yaml", "hybridflow/conf/model/tiny.yaml", "--device", "cpu", "--prompt-len", "16",
                    "--response", "8", "--prompts", "2", "--samples", "2", "--trl-steps", "3",
                    "--trl-grad-ckpt", "on", "--out", str(out)], check=True, cwd=ROOT, env=ENV, capture_output=True)
    w = json.loads(out.read_text())["workloads"]["w1_0_5b"]
    assert "ours_step_s" not in w and "ratio" not in w and w["trl_step_s"] > 0
    assert w["config"]["trl"]["gradient_checkpointing"] and w["config"]["trl"]["memory_probe"] is None
    bad = subprocess.run([sys.executable, "benchmarks/bench_vs_trl.py", "--trl-steps", "2", "--device", "cpu"],
                         cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert bad.returncode != 0 and "--trl-steps 2" in bad.stderr


def test_profile_decode_sums_kernel_time_by_kind(tmp_path):
    """The decode profile the next GPU session reads: per case, time per step by kind adds up to
    the total, the kinds are the script's, and the floor fraction is floor / measured; the wall
    time per step beside it, (--prefill) a one-token call's profile and (--timeline) a traced
    call's idle time by generator phase."""
    out = tmp_path / "p.json"
    subprocess.run([sys.executable, "benchmarks/profile_decode.py", "--models", "hybridflow/conf/model/tiny.yaml",
                    "--device", "cpu", "--batches", "2", "--prompt-len", "8", "--steps", "4",
                    "--prefill", "--timeline", "--out", str(out)], check=True, cwd=ROOT, env=ENV,
                   capture_output=True)
    report = json.loads(out.read_text())
    (case,) = report["cases"]
    # --timeline: the generator's phase labels in the trace (on CPU no kernels: all of it is idle)
    (tl,) = report["timeline"]
    assert set(tl["phase_us"]) == {"generate.setup", "generate.prefill", "generate.decode", "generate.finish"}
    assert tl["busy_us"] == 0 and math.isclose(tl["idle_us"], tl["window_us"], rel_tol=1e-9)
    # a difference of two medians: finite (its sign is noise's on a busy 2-core CPU)
    assert math.isfinite(case["wall_us_per_step"]) and math.isfinite(case["wall_call_rest_us"])
    (pre,) = report["prefill"]
    assert (pre["model"], pre["batch"], pre["prompt_tokens"]) == ("tiny", 2, 16)
    assert pre["wall_us"] > 0 and math.isclose(sum(pre["us_by_kind"].values()), pre["us"],
                                                rel_tol=1e-9)
    assert (case["model"], case["batch"], case["compiled"], case["kernels"]) == ("tiny", 2, False, "torch")
    by_kind = case["us_per_step_by_kind"]
    assert math.isclose(sum(by_kind.values()), case["us_per_step"], rel_tol=1e-9)
    # the kinds of the kernels each decode step launches (by call count: CPU op times are noisy)
    assert set(by_kind) == set(case["kernels_per_step_by_kind"])
    assert {"gemm", "attention"} <= set(by_kind) <= {"attention", "gemm", "norm", "kv_write",
                                                     "sampling", "elementwise", "other"}
    assert case["floor_fraction"] == case["floor_us_per_step"] / case["us_per_step"]
    assert case["top"] and all(t["kind"] in by_kind for t in case["top"])


def test_profile_decode_times_the_speculative_tail(tmp_path):
    """--spec-rows: every case runs the speculative tail once at most that many rows run (here from
    the first stop poll), and reports its time per tail step (the extra tokens of the longer call
    took fewer steps than tokens) and, traced, the tail's steps and its phase."""
    out = tmp_path / "p.json"
    subprocess.run([sys.executable, "benchmarks/profile_decode.py", "--models",
                    "hybridflow/conf/model/tiny.yaml", "--device", "cpu", "--batches", "2",
                    "--prompt-len", "8", "--steps", "32", "--spec-rows", "2", "--timeline",
                    "--out", str(out)], check=True, cwd=ROOT, env=ENV, capture_output=True)
    report = json.loads(out.read_text())
    assert report["decode_options"]["spec_rows"] == 2
    (case,) = report["cases"]
    short, long = case["tail_steps"]
    assert 0 < short < long <= 64 - 16
    assert math.isclose(case["us_per_tail_step"], case["us_per_step"] * 32 / (long - short))
    (tl,) = report["timeline"]
    # the tail takes over after the first poll (16 decode steps + the prefill's token): 15 a row
    assert tl["tail_steps"] == short and tl["tail_tokens"] == 2 * (32 - 17)
    assert "generate.spec_tail" in tl["phase_us"]


def test_bench_decode_gemm_times_every_way_and_sums_a_step(tmp_path):
    """The decode-GEMM comparison on CPU (tiny shapes; "autotune" is dynamo's aot_eager there): every
    GEMM timed every way with its outputs equal to the first way's, the floors from the shape, and
    one step's GEMM time = the layers' GEMMs x layers + the LM head (fc2_acc, in place, outside it)."""
    out = tmp_path / "g.json"
    subprocess.run([sys.executable, "benchmarks/bench_decode_gemm.py", "--device", "cpu", "--models", "tiny",
                    "--rows", "4", "--ways", "cublas", "autotune", "--gemms", "qkv", "fc2", "fc2_acc",
                    "lm_head", "--out", str(out)], check=True, cwd=ROOT, env=ENV, capture_output=True)
    (case,) = json.loads(out.read_text())["cases"]
    assert (case["model"], case["rows"]) == ("tiny", 4)
    g = case["gemms"]
    assert set(g) == {"qkv", "fc2", "fc2_acc", "lm_head"}
    assert g["lm_head"]["gflop"] == 2 * 4 * 64 * 512 / 1e9
    for name, res in g.items():
        assert res["best"] in ("cublas", "autotune") and all(res[w]["us"] > 0 for w in ("cublas", "autotune"))
        if name != "fc2_acc":
            assert res["autotune"]["rel_err"] < 1e-6
    for way in ("cublas", "autotune"):
        assert math.isclose(case[f"{way}_step_us"], 2 * (g["qkv"][way]["us"] + g["fc2"][way]["us"])
                            + g["lm_head"][way]["us"], rel_tol=1e-9)


def test_small_cards_runs_each_cap_in_its_own_process(tmp_path):
    out = tmp_path / "s.json"
    subprocess.run([sys.executable, "benchmarks/small_cards.py", "--model", "tiny", "--prompts", "2",
                    "--samples", "2", "--response", "4", "--steps", "2", "--caps", "24,48",
                    "--out", str(out)], check=True, cwd=ROOT, env=ENV, capture_output=True)
    r = json.loads(out.read_text())["tiny"]
    assert set(r) == {"24", "48"}
    assert "parallel.activation_checkpointing=true" in r["24"]["options"]
    for cap, res in r.items():
        assert res["step_s"] > 0 and "actor.lora.rank=16" in res["options"]
        assert f"trainer.gpu_memory_limit_gib={cap}" in res["overrides"]
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import argparse

    import small_cards

    args = argparse.Namespace(model="qwen2_7b", prompts=8, samples=8, response=256)
    peak = small_cards.predicted_peak(args, 24, small_cards.OPTIONS[24], {})
    assert 14 < peak < 24  # the bf16 7B weights (14.2 GiB) and what the rest needs under the cap


@pytest.mark.slow
def test_small_cards_offload_params_ab(tmp_path):
    out = tmp_path / "ab.json"
    subprocess.run([sys.executable, "benchmarks/small_cards.py", "--model", "tiny", "--prompts", "2",
                    "--samples", "2", "--response", "4", "--steps", "2", "--caps", "24",
                    "--offload-params-ab", "--out", str(out)], check=True, cwd=ROOT, env=ENV,
                   capture_output=True)
    r = json.loads(out.read_text())["tiny"]
    assert set(r) == {"24_offload_params_off", "24_offload_params_on"}
    for on, res in (("false", r["24_offload_params_off"]), ("true", r["24_offload_params_on"])):
        assert res["step_s"] > 0 and f"actor.offload_params={on}" in res["options"]
        assert "rollout.quantization=fp8" in res["options"]


def test_small_cards_offload_params_prediction():
    """The 7B A/B's prediction: the fp8 codes beside the bf16 matrices overflow 24 GiB; with the
    matrices on the host the run fits."""
    import argparse

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import small_cards

    args = argparse.Namespace(model="qwen2_7b", prompts=4, samples=8, response=256)
    off, on = (small_cards.predicted(args, 24, small_cards.AB_OPTIONS
                                     + (f"actor.offload_params={v}",), {})
               for v in ("false", "true"))
    assert off.peak_phase == "gen" and not off.fits and on.fits
    assert off.phases_gib["gen"]["actor_weights"] - on.phases_gib["gen"]["actor_weights"] > 12


def test_lora_checkpoint_sizes_both_formats(tmp_path):
    out = tmp_path / "l.json"
    subprocess.run([sys.executable, "benchmarks/lora_checkpoint.py", "--model", "small", "--rank",
                    "2", "--targets", "q_proj,v_proj", "--out", str(out)], check=True, cwd=ROOT,
                   env=ENV, capture_output=True)
    r = json.loads(out.read_text())
    assert r["adapters_restored_exactly"] and r["workload"]["adapter_params"] > 0
    assert r["adapter_only"]["role_dir_bytes"] < r["full"]["role_dir_bytes"]
    assert r["size_ratio_full_over_adapter_only"] > 1 and r["adapter_only"]["load_s"] > 0


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "emulated_graphs"])
def test_router_replay_records_and_replays(tmp_path, graphs):
    """emulated_graphs: the GPU's decode path (buckets, compaction ladder, two KV windows, the
    warm-ups before each capture), eagerly on CPU."""
    out = tmp_path / "r.json"
    extra = ["--new-tokens", "60", "--emulate-graphs"] if graphs else ["--new-tokens", "8"]
    subprocess.run([sys.executable, "benchmarks/router_replay.py", "--model", "tiny",
                    "--set", "model.moe.num_experts=4", "--set", "model.moe.top_k=2",
                    "--set", "model.moe.moe_ffn_hidden_size=32", "--prompts", "4",
                    "--prompt-len", "8", *extra, "--out", str(out)], check=True,
                   cwd=ROOT, env=ENV, capture_output=True)
    r = json.loads(out.read_text())
    assert r["decode_options"]["emulated_graphs"] == graphs
    assert r["records_well_formed"] and r["tokens_equal_with_recording"]
    L, k = r["workload"]["num_layers"], r["workload"]["top_k"]
    assert r["record_bytes_per_token"] == L * k * 2  # int16
    assert r["replay"]["router_mismatch_frac"] == 0.0  # fp32 generation, same weights
    assert "router_mismatch_frac" not in r["no_replay"]


def test_bench_packed_pass_times_every_variant(tmp_path):
    # the packed (flex; varlen skipped on CPU), padded-budget and equal-length passes through the real Engine (tiny model, CPU):
    # packed micro-batches compute the real tokens, padded ones more, equal rows the same count
    out = tmp_path / "pp.json"
    subprocess.run([sys.executable, "benchmarks/bench_packed_pass.py", "--device", "cpu", "--model", "tiny",
                    "--rows", "16", "--prompt-len", "8", "--mean", "12", "--min", "2", "--cap", "32",
                    "--forward-budget", "256", "--budget", "128", "--iters", "1", "--timeline",
                    "--out", str(out)],
                   check=True, cwd=ROOT, env=ENV, capture_output=True)
    report = json.loads(out.read_text())
    assert report["optimizer_helpers"] == "foreach"  # parallel/multi_tensor.py, as the trainer
    res = report["results"]
    assert set(res) == {"packed", "packed_varlen", "budget", "equal"}
    # --timeline: the traced packed passes' host time by the engine's stage (no kernels on CPU)
    stages = res["packed"].pop("update_timeline")["by_stage"]["phase_us"]
    assert {"engine.micro_batches", "engine.schedule", "engine.forward", "engine.loss",
            "engine.optimizer"} <= set(stages)
    assert "engine.optimizer" not in res["packed"].pop("ref_timeline")["by_stage"]["phase_us"]
    # torch's varlen_attn is CUDA only: the variant says why it did not run
    assert res.pop("packed_varlen") == {"skipped": "algo.packed_attention=varlen cannot run here: "
                                        "varlen_attn runs on CUDA only (device cpu); set "
                                        "algo.packed_attention=auto or flex"}
    assert res["packed"]["packed_attention"] == "flex"
    p, b = res["packed"], res["budget"]
    assert p["ref_tokens_computed"] == p["update_tokens_computed"] == p["real_tokens"]
    assert b["ref_tokens_computed"] > b["real_tokens"] and b["update_tokens_computed"] > b["real_tokens"]
    for r in res.values():
        assert len(r["ref_s"]) == 1 and r["ref_median_s"] > 0 and r["update_median_s"] > 0
        assert r["predicted_s"]["ref"] > 0 and r["predicted_s"]["update_actor"] > 0


def test_bench_lora_update_times_both_sides(tmp_path):
    # the full and the LoRA update through the real Engine (tiny model, CPU): LoRA's linears on the
    # fused path, only the adapters trained, per-layer op counts of each phase
    out = tmp_path / "lora.json"
    subprocess.run([sys.executable, "benchmarks/bench_lora_update.py", "--device", "cpu", "--model",
                    "tiny", "--rows", "8", "--prompt-len", "8", "--mean", "12", "--min", "2", "--cap",
                    "32", "--budget", "64", "--rank", "4", "--alpha", "8", "--iters", "1", "--profile",
                    "--out", str(out)], check=True, cwd=ROOT, env=ENV, capture_output=True)
    rec = json.loads(out.read_text())
    res = rec["results"]
    full, lora = res["full"], res["lora"]
    assert lora["adapter_path"] == "fused" and full["micro_batches"] == lora["micro_batches"] > 1
    assert lora["trainable_tensors"] == rec["layers"] * 7 * 2
    assert lora["trainable_params"] < full["trainable_params"]
    assert res["lora_over_full"] == lora["update_median_s"] / full["update_median_s"]
    assert lora["merge_median_s"] > 0 and lora["restore_median_s"] > 0
    assert "merge_median_s" not in full
    for r in (full, lora):
        assert r["update_median_s"] > 0 and r["fwd_bwd_median_s"] > 0
        assert r["profile"]["forward"]["aten_ops"] > 0 and r["profile"]["backward"]["aten_ops"] > 0
        assert r["profile"]["optimizer"]["aten_ops"] > 0


def test_bench_sampler_times_every_way(tmp_path):
    """The sampler comparison on CPU (the fused way's PyTorch twin, no graphs): every way and tiling
    timed at each batch, the fused log-probs equal to log_softmax, the read floor from the shape."""
    out = tmp_path / "s.json"
    subprocess.run([sys.executable, "benchmarks/bench_sampler.py", "--device", "cpu", "--vocab", "1000",
                    "--batches", "2", "4", "--reps", "2", "--chunks", "1024", "--blocks", "256", "512",
                    "--warps", "4", "--out", str(out)], check=True, cwd=ROOT, env=ENV, capture_output=True)
    report = json.loads(out.read_text())
    assert report["command"].startswith("python") and report["versions"]["torch"]
    assert [c["rows"] for c in report["cases"]] == [2, 4]
    for case in report["cases"]:
        assert set(case["eager_us"]) == {"torch", "torch_no_lp", "fused", "fused_no_lp", "fused_pdl"}
        assert all(v > 0 for v in case["eager_us"].values()) and case["graph_us"] == {}
        assert set(case["tiling_graph_us"]) == {"chunk1024_block256_warps4", "chunk1024_block512_warps4"}
        assert case["fused_lp_err"] < 1e-5 and case["speedup"] > 0
        assert math.isclose(case["read_floor_us"], case["rows"] * 1000 * 4 / 4.3e12 * 1e6)


@pytest.mark.slow
def test_bench_prefill_widths_per_multiple(tmp_path):
    """Each multiple in its own process: every width called once per pass, one prefill per call
    (equal-length rows share nothing: random prompts), a cost per new width reported."""
    out = tmp_path / "pw.json"
    subprocess.run([sys.executable, "benchmarks/bench_prefill_widths.py", "--model", "tiny",
                    "--device", "cpu", "--prompts", "4", "--n", "2", "--widths", "9", "11", "13",
                    "--warm-width", "16", "--shortest", "3", "--new-tokens", "2", "--passes", "2",
                    "--multiples", "1", "8", "--out", str(out)],
                   check=True, cwd=ROOT, env=ENV, capture_output=True)
    report = json.loads(out.read_text())
    assert [r["prefill_width_multiple"] for r in report["runs"]] == [1, 8]
    assert report["compile_caches"] == "fresh per process"
    for r in report["runs"]:
        assert [len(p) for p in r["calls_s"]] == [3, 3] and r["prefills"] == 1
        assert r["new_width_cost_s"] == r["new_width_median_s"] - r["seen_width_median_s"]
        # the warm call at 16 (alignment 16), then 9 (1, new), 11 (1), 13 (1)
        assert [(c["width"], c["alignment"], c["class_new"]) for c in r["first_pass"]] == [
            (9, 1, True), (11, 1, False), (13, 1, False)]


def test_bench_layer_kernels_checks_the_trainer_kernels_against_fp32(tmp_path):
    """The per-layer kernel A/B on CPU: Megatron's MLP (over our linears, weight gradients into
    main_grad) timed and equal to the fp32 reference at fp32 (which reads fc1's rows as
    [gate; up], as quack's side must); quack's sides, the RoPE and the SwiGLU backward need a GPU
    and say why."""
    out = tmp_path / "layer.json"
    subprocess.run([sys.executable, "benchmarks/bench_layer_kernels.py", "--device", "cpu",
                    "--model", "tiny", "--tokens", "32", "48", "--iters", "1", "--warmup", "1",
                    "--out", str(out)], check=True, cwd=ROOT, env=ENV, capture_output=True)
    r = json.loads(out.read_text())["results"]
    assert set(r) == {f"{k}/tiny/{n}" for k in ("mlp", "rope", "swiglu") for n in (32, 48)}
    for key in ("rope/tiny/32", "rope/tiny/48", "swiglu/tiny/32", "swiglu/tiny/48"):  # CUDA only
        assert r.pop(key) == {side: {"skipped": "not a CUDA device"} for side in ("compiled",
                                                                                  "triton")}
    skipped = {"skipped": "not a CUDA device"}
    for key, row in r.items():
        for side in ("trainer", "trainer_swiglu_triton"):  # off CUDA: Megatron's own SwiGLU
            ours = row[side]
            assert ours["forward_s"] > 0 and ours["forward_backward_s"] > 0
            assert max(ours["rel_err"].values()) < 1e-5, (key, side, ours["rel_err"])
        assert row["quack"] == row["quack_tuned"] == skipped, row


def test_bench_packed_pass_keeps_a_repeated_variant_beside_the_first(tmp_path):
    """An A/B/A order (`packed,packed_nextfit,packed`): the repeat is recorded as `packed#2`, and
    the balanced default and next-fit deal the same rows (the same real tokens computed); a quack
    variant off a GPU is recorded as skipped with the reason; the SwiGLU / RoPE kernel suffixes
    build and run (off CUDA on Megatron's own SwiGLU and RoPE)."""
    out = tmp_path / "aba.json"
    subprocess.run([sys.executable, "benchmarks/bench_packed_pass.py", "--device", "cpu",
                    "--model", "tiny", "--rows", "16", "--prompt-len", "8", "--mean", "12",
                    "--min", "2", "--cap", "32", "--forward-budget", "256", "--budget", "128",
                    "--iters", "1", "--variants",
                    "packed,packed_nextfit,packed,packed_quack,packed_swiglu_ropeqkv",
                    "--out", str(out)], check=True, cwd=ROOT, env=ENV, capture_output=True)
    res = json.loads(out.read_text())["results"]
    # quack's MLP needs a GPU: that variant says why it did not run
    assert res.pop("packed_quack") == {"skipped": "parallel.mlp_kernels=quack cannot run here: "
                                                  "not a CUDA device"}
    both = res.pop("packed_swiglu_ropeqkv")
    assert both["update_micro_batches"] == res["packed"]["update_micro_batches"]
    assert set(res) == {"packed", "packed_nextfit", "packed#2"}
    assert res["packed"]["update_micro_batches"] == res["packed#2"]["update_micro_batches"]
    assert {r["real_tokens"] for r in res.values()} == {res["packed"]["update_tokens_computed"]}
