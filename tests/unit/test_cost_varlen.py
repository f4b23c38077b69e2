"""The cost model on variable-length work (hybridflow.cost.lengths, cost.varlen): length
distributions, the decode schedule (buckets, compaction, KV windows, poll lag) and the packed passes
by hand on tiny inputs, the fixed-length limit, the long-tail benchmark's measured row-steps, the
fit of the new coefficients on synthetic records, and the CLI."""
import contextlib
import io
import json
import math
import os
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from hybridflow.cost import Calibration
from hybridflow.cost.calibrate import fit, parse_record, predict, predict_vs_measured
from hybridflow.cost.lengths import fit_stats, from_metrics, from_quantiles, load_lengths, quantile_points
from hybridflow.cost.timing import stage_terms
from hybridflow.cost.varlen import (FA4_MASKED_SHARE, VARLEN_MASKED_SHARE, decode_schedule,
                                   pass_work, row_lengths)
from hybridflow.cost.workload import Workload

ROOT = Path(__file__).resolve().parents[2]


# --- lengths ------------------------------------------------------------------------------------

def test_quantile_points_and_quantiles_by_hand():
    assert quantile_points([5, 1, 3, 2, 4], k=5) == (1, 2, 3, 4, 5)
    assert quantile_points(range(1, 101), k=4) == (13, 38, 63, 88)    # (i + 0.5) / 4 of 100
    # {0.5: 100, 1.0: 300}: 0 -> 100 (nearest given), linear from the median to the top
    assert from_quantiles({0.5: 100, 1.0: 300}, k=4) == (100, 100, 150, 250)
    with pytest.raises(ValueError, match="must not decrease"):
        from_quantiles({0.5: 300, 0.9: 100})


def test_lognormal_fit_matches_mean_and_share_at_cap():
    pts = fit_stats(mean=300, cap=1024, clip_ratio=0.02, shortest=20, rows=512, k=1000)
    assert statistics.fmean(pts) == pytest.approx(300, rel=0.01)
    assert sum(p == 1024 for p in pts) / len(pts) == pytest.approx(0.02, abs=0.002)
    assert min(pts) >= 20 and pts == tuple(sorted(pts))
    # no row at the cap: the longest row is the 1 - 1/(2 rows) quantile
    pts = fit_stats(mean=200, cap=1024, clip_ratio=0.0, longest=700, rows=100, k=1000)
    assert pts[int(0.995 * 1000)] == pytest.approx(700, rel=0.03) and sum(pts) / 1000 > 190


def test_lengths_from_trainer_metrics(tmp_path):
    steps = [{"step": i, "response_length/mean": 250.0 + i, "response_length/max": 1024.0,
              "response_length/min": 30.0, "response_length/clip_ratio": 0.01,
              "prompt_length/mean": 100.0, "prompt_length/max": 150.0 + i,
              "dynamic_sampling/rounds": 1.0 + (i % 2), "dynamic_sampling/batches": 2.0 + (i % 2)}
             for i in range(1, 6)]
    out = from_metrics(steps, cap=1024)
    # medians over the steps, the longest prompt of any; dynamic sampling's means
    assert statistics.fmean(out["response_lengths"]) == pytest.approx(253, rel=0.01)
    assert max(out["response_lengths"]) == 1024
    assert out["prompt_len"] == 100 and out["prompt_len_max"] == 155
    assert out["gen_rounds"] == 1.6 and out["gen_prompt_factor"] == 2.6
    assert "spec_tail_tokens_per_step" not in out
    # the speculative tail's rate where it ran (steps without tail steps left out)
    tail = [dict(s, **{"rollout/spec_row_steps": float(i > 1), "rollout/spec_tokens_per_row_step":
                       1.5 + i / 2 if i > 1 else 0.0}) for i, s in enumerate(steps, 1)]
    assert from_metrics(tail, cap=1024)["spec_tail_tokens_per_step"] == 3.25  # of 2.5 3 3.5 4
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in steps))
    assert load_lengths(path, cap=1024) == out
    (tmp_path / "q.json").write_text(json.dumps({"response_length_quantiles": {"0.5": 200, "1": 2000}}))
    with pytest.raises(ValueError, match="longer than the cap of 1024"):
        load_lengths(tmp_path / "q.json", cap=1024)


def test_lengths_from_the_runs_rollout_lengths(tmp_path):
    """The trainer's rollout_lengths.jsonl beside its metrics.jsonl: the steps' exact lengths,
    pooled, replace the fitted shape; the rest (prompts, rounds) still comes from metrics.jsonl."""
    steps = [{"step": i, "response_length/mean": 300.0, "response_length/max": 1024.0,
              "response_length/min": 20.0, "response_length/clip_ratio": 0.01,
              "prompt_length/mean": 100.0, "prompt_length/max": 150.0} for i in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    fitted = load_lengths(tmp_path / "metrics.jsonl", cap=1024)
    rows = [[20 + 2 * j for j in range(250)] + [1024] * 6, [30 + j for j in range(250)] + [1024] * 6]
    (tmp_path / "rollout_lengths.jsonl").write_text(
        "".join(json.dumps({"step": i, "response_lengths": r}) + "\n" for i, r in enumerate(rows)))
    exact = quantile_points(rows[0] + rows[1])
    from_metrics_file = load_lengths(tmp_path / "metrics.jsonl", cap=1024)
    assert from_metrics_file == dict(fitted, response_lengths=exact) and exact != fitted[
        "response_lengths"]
    assert load_lengths(tmp_path / "rollout_lengths.jsonl", cap=1024) == from_metrics_file
    # a run committed under a prefix pairs its own two files, not another run's beside them
    runs = tmp_path / "runs"
    runs.mkdir()
    for name in ("metrics.jsonl", "rollout_lengths.jsonl"):
        (runs / f"dapo_{name}").write_text((tmp_path / name).read_text())
    (runs / "rollout_lengths.jsonl").write_text(json.dumps({"step": 1, "response_lengths": [5]}))
    assert load_lengths(runs / "dapo_metrics.jsonl", cap=1024) == from_metrics_file
    assert load_lengths(runs / "dapo_rollout_lengths.jsonl", cap=1024) == from_metrics_file
    # without a metrics.jsonl beside it: the lengths alone
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "rollout_lengths.jsonl").write_text((tmp_path / "rollout_lengths.jsonl").read_text())
    assert load_lengths(alone / "rollout_lengths.jsonl", cap=1024) == {"response_lengths": exact}
    with pytest.raises(ValueError, match="longer than the cap of 512"):
        load_lengths(alone / "rollout_lengths.jsonl", cap=512)
    (alone / "rollout_lengths.jsonl").write_text(json.dumps({"step": 1, "response_lengths": []}))
    with pytest.raises(ValueError, match="no step with response_lengths"):
        load_lengths(alone / "rollout_lengths.jsonl", cap=1024)


# --- generation ---------------------------------------------------------------------------------

def test_decode_schedule_by_hand_poll_lag_and_window():
    # 4 rows of 2, 2, 3, 9 tokens, prompts of 4, cap 64, one bucket of 4. The live count is polled
    # every 16 steps and read one poll late (the first poll has nothing to read): the poll at step
    # 32 reads step 16's count (0 live) and ends the chunk: tokens 0..32, all 4 rows each
    w = Workload(prompts_per_step=1, samples_per_prompt=4, prompt_len=4, response_lengths=(2, 2, 3, 9),
                 max_new_tokens=64, gen_max_batch_size=4)
    d = decode_schedule(w, 4, 4)
    assert (d.steps, d.row_steps, d.compactions) == (33, 132, 0)
    assert d.row_columns == 4 * sum(4 + t + 0.5 for t in range(33))            # the written columns
    # KV window 8: token t attends over the multiple of 8 holding P + t + 1 = 5..37 columns
    d = decode_schedule(replace(w, decode_kv_window=8), 4, 4)
    assert d.row_columns == 4 * (4 * 8 + 8 * 16 + 8 * 24 + 8 * 32 + 5 * 40)
    # without a cap (forced lengths) the chunk ends with its longest row
    assert decode_schedule(replace(w, max_new_tokens=None), 4, 4).steps == 9


def test_own_columns_by_hand():
    # rollout.kernel_options.own_columns_only: the same steps, but token t reads only the rows
    # still live at it (lengths 2, 2, 3, 9: 4 rows at t < 2, 2 at t = 2, 1 up to t = 8, then none),
    # each over its own prompt_len + t + 0.5 columns (the mean prompt; padding to the longest
    # prompt, the window's unwritten columns and finished rows not read)
    w = Workload(prompts_per_step=1, samples_per_prompt=4, prompt_len=4, prompt_len_max=6,
                 response_lengths=(2, 2, 3, 9), max_new_tokens=64, gen_max_batch_size=4,
                 decode_kv_window=8, own_columns_only=True)
    d = decode_schedule(w, 4, 4)
    live = [4, 4, 2] + [1] * 6
    assert d.row_columns == sum(n * (4 + t + 0.5) for t, n in enumerate(live))
    off = decode_schedule(replace(w, own_columns_only=False), 4, 4)
    assert (d.steps, d.row_steps) == (off.steps, off.row_steps) and off.row_columns > d.row_columns


def test_partial_rollouts_by_hand():
    # rollout.partial at 4 tokens per call: responses of 2, 2, 3, 9 split into segments of
    # (2), (2), (3), (4, 4, 1), the last row's re-prefilled at prompt + 4 and prompt + 8 tokens;
    # one call holds all 6 segments (the steady state), decodes at most 4 steps and reads, per
    # token t, the live segments' own prompts + t
    from hybridflow.cost.varlen import partial_segments

    seg, start = partial_segments(np.array([2, 2, 3, 9]), 4)
    assert seg.tolist() == [2, 2, 3, 4, 4, 1] and start.tolist() == [0, 0, 0, 0, 4, 8]
    w = Workload(prompts_per_step=1, samples_per_prompt=4, prompt_len=4,
                 response_lengths=(2, 2, 3, 9), max_new_tokens=64, gen_max_batch_size=8,
                 own_columns_only=True, partial_decode_steps=4)
    d = decode_schedule(w, 4, 4)
    assert d.carried_prefill_tokens == (4 + 4) + (4 + 8)
    assert d.steps == 4 and d.row_steps == 8 * 4          # bucket 8 (6 rows), capped at 4 steps
    prompts = [4, 4, 4, 4, 8, 12]
    live = {0: range(6), 1: range(5), 2: [2, 3, 4], 3: [3, 4]}
    assert d.row_columns == sum(prompts[i] + t + 0.5 for t, rows in live.items() for i in rows)


def test_compaction_by_hand():
    # 64 rows: 60 end at 2 tokens, 4 run to 100 (cap 256). Bucket 64; the ladder under it is 16, 32
    # (>= 16 rows under CUDA graphs). The poll at step 32 reads step 16's count (4 live): 16 rows
    # from step 33 on. The poll at 128 reads step 112's count (0: 100 <= 112 + 1) and ends it.
    w = Workload(prompts_per_step=8, samples_per_prompt=8, prompt_len=10,
                 response_lengths=(2,) * 60 + (100,) * 4, max_new_tokens=256, gen_max_batch_size=64,
                 compact_finished_rows=True)
    d = decode_schedule(w, 64, 64)
    assert (d.steps, d.compactions) == (129, 1)
    assert d.row_steps == 64 * 33 + 16 * (129 - 33)
    assert d.moved_bytes == 2 * 16 * (10 + 32)          # the kept rows' K/V columns, read + write
    off = decode_schedule(replace(w, compact_finished_rows=False), 64, 64)
    assert off.row_steps == 64 * 129 and off.steps == d.steps


def test_compaction_matches_the_long_tail_benchmark():
    # benchmarks/results/generate_long_tail_h200.json: 512 rows, prompts of 128, lengths geometric
    # (a stop id drawn with p = 506 / 151,936 per step, cut at 1,024) ran 208,864 decode
    # row-steps in 4 compactions with compaction on, 523,776 (512 x 1,023) with it off
    rec = json.loads((ROOT / "benchmarks/results/generate_long_tail_h200.json").read_text())["results"]["512"]
    p = 506 / 151936
    pts = tuple(min(1024, max(1, math.ceil(math.log(1 - (i + 0.5) / 512) / math.log(1 - p))))
                for i in range(512))
    assert statistics.fmean(pts) == pytest.approx(rec["on"]["lengths"]["mean"], rel=0.05)
    w = Workload(prompts_per_step=64, samples_per_prompt=8, prompt_len=128, max_new_tokens=1024,
                 gen_max_batch_size=512, compact_finished_rows=True, response_lengths=pts)
    d = decode_schedule(w, 512, 512)
    assert d.row_steps == pytest.approx(rec["on"]["stats"]["decode_row_steps"], rel=0.05)
    assert d.compactions == rec["on"]["stats"]["compactions"]
    off = decode_schedule(replace(w, compact_finished_rows=False), 512, 512)
    assert off.row_steps == 512 * 1024 == rec["off"]["stats"]["decode_row_steps"] + 512  # + token 0


# --- training passes ----------------------------------------------------------------------------

def test_packed_pass_by_hand():
    # rows of 4 + (2, 2, 3, 9) tokens = 6, 6, 7, 13 under a budget of 16 packed tokens, longest
    # first (next fit): [13] [7, 6] [6]; a micro-batch of equal rows runs unpacked
    w = Workload(prompts_per_step=1, samples_per_prompt=4, prompt_len=4, response_lengths=(2, 2, 3, 9),
                 dynamic_bsz=True, pack_sequences=True, micro_batch_tokens=16)
    assert sorted(row_lengths(w, 4)) == [2, 2, 3, 9]
    p = pass_work(w, 4, 16)
    assert (p.micro, p.tokens) == (3, 13 + 13 + 6)
    assert p.masked_attention == 7 ** 2 + 6 ** 2          # the packed micro-batch's rows
    assert p.head_tokens == 9 + (3 + 2) + 2
    assert p.attention == 13 ** 2 + (7 ** 2 + 6 ** 2) + 6 ** 2
    # unpacked token budgets: each micro-batch padded to its longest prompt + response; the one of
    # rows of two lengths needs an attention mask (masked attention), single rows do not
    u = pass_work(replace(w, pack_sequences=False), 4, 16)
    assert (u.micro, u.tokens, u.masked_attention) == (3, 13 + 2 * 7 + 6, 2 * 7 ** 2)
    # fixed micro-batches: every row padded to the step's longest (4 + 9), 2 rows each, all masked
    f = pass_work(replace(w, pack_sequences=False, dynamic_bsz=False), 4, 26)
    assert (f.micro, f.tokens, f.masked_attention, f.attention) == (2, 4 * 13, 4 * 13 ** 2, 4 * 13 ** 2)
    # packed rows on varlen: the packed micro-batch's attention at VARLEN_MASKED_SHARE of flex's
    # extra cost; padded micro-batches keep their mask (varlen runs only packed rows)
    v = pass_work(replace(w, packed_attention="varlen"), 4, 16)
    assert v.masked_attention == pytest.approx(VARLEN_MASKED_SHARE * (7 ** 2 + 6 ** 2))
    assert (v.micro, v.tokens, v.attention) == (p.micro, p.tokens, p.attention)
    uv = pass_work(replace(w, pack_sequences=False, packed_attention="varlen"), 4, 16)
    assert uv.masked_attention == u.masked_attention
    # the update's CUDA graphs pad each packed micro-batch to the budget: [7, 6] computes 16; the
    # single rows run unpacked at their width; attention and the LM head stay the rows'
    g = pass_work(replace(w, packed_attention="varlen"), 4, 16, 1, True)
    assert (g.micro, g.tokens, g.attention, g.head_tokens) == (3, 13 + 16 + 6, v.attention, v.head_tokens)
    assert g.eager_micro == 0   # 13 of 16 tokens: at least graph_min_fill (0.5) of the budget
    # under graph_min_fill of the budget a packed micro-batch runs the eager layers, unpadded
    e = pass_work(replace(w, packed_attention="varlen", graph_min_fill=0.9), 4, 16, 1, True)
    assert (e.tokens, e.eager_micro) == (13 + 13 + 6, 1)
    # fa4: its own share, between none and varlen's; the graphs capture varlen, so a graphed
    # micro-batch counts varlen's share under fa4 too, an eager one fa4's
    assert 0 < FA4_MASKED_SHARE < VARLEN_MASKED_SHARE
    f4 = pass_work(replace(w, packed_attention="fa4"), 4, 16)
    assert f4.masked_attention == pytest.approx(FA4_MASKED_SHARE * (7 ** 2 + 6 ** 2))
    assert (f4.micro, f4.tokens, f4.attention) == (p.micro, p.tokens, p.attention)
    assert pass_work(replace(w, packed_attention="fa4"), 4, 16, 1, True) == g
    assert pass_work(replace(w, packed_attention="fa4", graph_min_fill=0.9), 4, 16, 1,
                     True) == replace(e, masked_attention=f4.masked_attention)
    # balanced (algo.balance_micro_batches): 13, 7, 6, 6 dealt into 2 leaves a 6 without room,
    # into 3: [13] [7] [6, 6], the last of equal rows, unpacked, without a mask
    bw = replace(w, balanced_micro_batches=True)
    b = pass_work(bw, 4, 16)
    assert (b.micro, b.tokens, b.masked_attention) == (3, 13 + 7 + 12, 0)
    assert pass_work(bw, 4, 16, 1, True) == pass_work(w, 4, 16, 1, True)  # graphs: not balanced
    with pytest.raises(ValueError, match="balanced_micro_batches needs pack_sequences"):
        replace(bw, pack_sequences=False)
    with pytest.raises(ValueError, match="packed_attention 'sdpa'"):
        replace(w, packed_attention="sdpa")


def test_packed_attention_from_config():
    from hybridflow.config import load_config
    from hybridflow.cost.from_config import packed_attention_on_gpu

    # auto: fa4 on compute capability 9.0+ with flash-attn-4, else varlen (8.0+), else flex
    for gpu in ("H100", "H200", "B200"):
        assert packed_attention_on_gpu(load_config([]), gpu=gpu) == "fa4", gpu
        assert packed_attention_on_gpu(load_config([]), gpu=gpu, fa4_installed=False) == "varlen"
    for gpu in ("A100-80GB", "L40S"):
        assert packed_attention_on_gpu(load_config([]), gpu=gpu) == "varlen", gpu
    assert packed_attention_on_gpu(load_config(["algo.packed_attention=varlen"]),
                                   gpu="H100") == "varlen"
    assert packed_attention_on_gpu(load_config(["algo.packed_attention=fa4"]), gpu="H100") == "fa4"
    assert packed_attention_on_gpu(load_config(["algo.packed_attention=flex"])) == "flex"
    assert packed_attention_on_gpu(load_config(["trainer.precision=fp32"])) == "flex"
    # fa4 where it cannot run: the trainer refuses it, so does the cost model
    fa4 = load_config(["algo.packed_attention=fa4"])
    with pytest.raises(ValueError, match=r"fa4 cannot run on A100-80GB: FlashAttention-4 needs "
                                         r"compute capability 9.0\+ \(got 8.0\)"):
        packed_attention_on_gpu(fa4, gpu="A100")
    with pytest.raises(ValueError, match="flash-attn-4 is not installed there"):
        packed_attention_on_gpu(fa4, gpu="H100", fa4_installed=False)


def test_packed_kernel_follows_the_flash_limits():
    from hybridflow.cost.from_config import packed_kernel
    from hybridflow.cost.gpus import get_gpu

    h100 = get_gpu("H100")
    assert packed_kernel("auto", gpu=h100, head_dim=128) == "fa4"
    assert packed_kernel("auto", gpu=h100, head_dim=256) == "fa4"
    for bad in (dict(head_dim=260), dict(head_dim=12), dict(head_dim=64, fp32=True)):
        assert packed_kernel("auto", gpu=h100, **bad) == "flex", bad
        assert packed_kernel("varlen", gpu=h100, **bad) == "flex", bad
        with pytest.raises(ValueError, match=r"fa4 cannot run on H100: FlashAttention-4 takes "
                                             r"(bf16 or fp16|head_dim a multiple of 8 up to 256)"):
            packed_kernel("fa4", gpu=h100, **bad)
    with pytest.raises(ValueError, match="algo.packed_attention='sdpa' is not one of"):
        packed_kernel("sdpa", gpu=h100, head_dim=64)


def test_fa4_in_the_pass_terms():
    """fa4 charges less masked attention than varlen and more than none; the update's graphed
    micro-batches stay varlen's (the graphs capture varlen)."""
    from hybridflow.cost import get_gpu, load_shape
    from hybridflow.cost.workload import make_plan

    shape = load_shape("qwen2_0_5b")
    plan = make_plan({"tp": 1}, 1, shape)
    w = Workload(prompts_per_step=32, samples_per_prompt=8, prompt_len=100,
                 response_lengths=(40, 100, 200, 300, 600, 1000), max_new_tokens=1024,
                 dynamic_bsz=True, pack_sequences=True, micro_batch_tokens=16384,
                 forward_micro_batch_tokens=32768)

    def masked(**kw):
        t = stage_terms(shape, get_gpu("H100"), plan, replace(w, **kw), Calibration())
        return {k: t[k].x.get("inv_masked_attn_eff", 0.0) for k in ("ref", "update_actor")}

    varlen, fa4 = masked(packed_attention="varlen"), masked(packed_attention="fa4")
    for stage in varlen:
        assert 0 < fa4[stage] < varlen[stage], stage
        assert fa4[stage] == pytest.approx(varlen[stage] * FA4_MASKED_SHARE / VARLEN_MASKED_SHARE)
    graphed = dict(train_cuda_graphs=True, graph_min_fill=0.0)  # every packed one replays
    assert masked(packed_attention="fa4", **graphed)["update_actor"] == \
        pytest.approx(masked(packed_attention="varlen", **graphed)["update_actor"])
    assert masked(packed_attention="fa4", **graphed)["ref"] == pytest.approx(fa4["ref"])


def test_packed_terms_by_hand():
    w = dict(algorithm="grpo", prompts_per_step=1, samples_per_prompt=4, prompt_len=4,
             response_lengths=[2, 2, 3, 9], dynamic_bsz=True, pack_sequences=True,
             micro_batch_tokens=16, forward_micro_batch_tokens=16, fused_elementwise=True)
    run = parse_record({"config": {"model": "tiny", "gpu": "H200", "num_gpus": 1, "layout": {"tp": 1},
                                   **w}})
    t = stage_terms(run.shape, run.gpu, run.plan, run.workload, Calibration())
    s, peak = run.shape, run.gpu.bf16_tflops * 1e12
    flops = (2 * (s.num_dense_params - s.embedding_params) * 32 + 2 * s.embedding_params * 16
             + 2 * s.num_layers * s.q_dim * 290)
    assert t["ref"].x["inv_fused_forward_mfu"] == pytest.approx(flops / peak)
    assert t["update_actor"].x["inv_fused_train_mfu"] == pytest.approx(3 * flops / peak)
    # masked attention's cost: the packed micro-batch's attention FLOPs (2 L q_dim (7^2 + 6^2))
    # once more per kernel: 1 forward, 2 fwd + bwd
    masked = 2 * s.num_layers * s.q_dim * 85 / peak
    assert t["ref"].x["inv_masked_attn_eff"] == pytest.approx(masked)
    assert t["update_actor"].x["inv_masked_attn_eff"] == pytest.approx(2 * masked)
    assert t["ref"].x["layer_pass_overhead_s"] == 2 * 3 and t["other"].x["row_overhead_s"] == 4


def test_equal_lengths_on_the_varlen_path_match_the_fixed_model():
    # every row 128 + 256: compaction has nothing to move, token budgets of whole rows make the
    # fixed micro-batches, so each term equals the fixed-length model's
    base = dict(model="qwen2_0_5b", gpu="H200", num_gpus=1, layout={"tp": 1}, algorithm="grpo",
                prompts_per_step=8, samples_per_prompt=8, prompt_len=128, response_len=256,
                micro_batch_tokens=8 * 384, forward_micro_batch_tokens=16 * 384)
    plain = parse_record({"config": base})
    var = parse_record({"config": base | dict(dynamic_bsz=True, pack_sequences=True,
                                              compact_finished_rows=True, gen_max_batch_size=64)})
    assert var.workload.varlen and not plain.workload.varlen
    a = stage_terms(plain.shape, plain.gpu, plain.plan, plain.workload, Calibration())
    b = stage_terms(var.shape, var.gpu, var.plan, var.workload, Calibration())
    for stage in a:
        assert b[stage].x == pytest.approx(a[stage].x, rel=1e-12), stage
        assert b[stage].const == pytest.approx(a[stage].const, rel=1e-12), stage


# --- calibration --------------------------------------------------------------------------------

TRUTH = Calibration(train_mfu=0.3, forward_mfu=0.45, fused_train_mfu=0.4, fused_forward_mfu=0.55,
                    prefill_efficiency=0.5, decode_bw_efficiency=0.8, torch_kv_efficiency=0.3,
                    decode_layer_overhead_s=8e-5, fused_decode_layer_overhead_s=4e-5,
                    layer_pass_overhead_s=6e-4, optimizer_step_s=0.05, step_overhead_s=0.03,
                    row_overhead_s=2e-4, masked_attention_efficiency=0.03)


def _records(calib=TRUTH):
    tail = fit_stats(mean=200, cap=512, clip_ratio=0.02, shortest=10, rows=128, k=64)
    out = []
    for i, (model, kernels, fused, varlen) in enumerate([
            ("qwen2_0_5b", "torch", False, False), ("qwen2_0_5b", "triton", True, False),
            ("qwen2_1_5b", "torch", True, False), ("qwen2_1_5b", "triton", False, False),
            ("qwen2_0_5b", "torch", False, True), ("qwen2_0_5b", "triton", True, True),
            ("qwen2_1_5b", "torch", True, True), ("qwen2_1_5b", "triton", False, True)]):
        cfg = {"model": model, "gpu": "H200", "num_gpus": 1, "layout": {"tp": 1}, "algorithm": "grpo",
               "prompts_per_step": 8 + 8 * (i % 3), "samples_per_prompt": 8, "prompt_len": 64 + 32 * i,
               "response_len": 128 + 64 * (i % 2), "micro_batch_tokens": 4096 + 2048 * (i % 3),
               "decode_kernels": kernels, "fused_elementwise": fused, "skip_old_log_prob": i % 2 == 1}
        if varlen:
            cfg |= {"response_lengths": list(tail), "max_new_tokens": 512, "prompt_len_max": 64 + 32 * i + 40,
                    "gen_max_batch_size": 128, "compact_finished_rows": True, "decode_kv_window": 128,
                    "dynamic_bsz": True, "pack_sequences": True, "forward_micro_batch_tokens": 16384}
        rec = {"name": f"r{i}", "config": cfg}
        run = parse_record(rec)
        m = predict(run, calib)
        other = m.pop("timing_s/other")
        reward = stage_terms(run.shape, run.gpu, run.plan, run.workload, calib)["other"].breakdown(
            calib.coefs())["row_overhead"]        # "other"'s per-row part; the rest is adv's
        rec["metrics"] = m | {"timing_s/reward": reward, "timing_s/adv": other - reward}
        out.append(rec)
    return out


def test_fit_recovers_the_varlen_coefficients():
    fitted = fit(_records())
    for k in ("masked_attention_efficiency", "torch_kv_efficiency", "row_overhead_s", "step_overhead_s",
              "decode_bw_efficiency", "fused_train_mfu", "train_mfu", "layer_pass_overhead_s"):
        assert getattr(fitted, k) == pytest.approx(getattr(TRUTH, k), rel=1e-4), k


def test_families_are_held_out_together():
    recs = _records()
    for r in recs[4:]:
        r["family"] = "packed"
    rows = predict_vs_measured(recs, Calibration())
    # every packed record is predicted by a fit of the 4 fixed-length ones alone, which cannot see
    # masked_attention_efficiency (their rows are all of one length): it keeps its prior, and the packed
    # records' passes come out short
    ref = {r["name"]: r for r in rows if r["metric"] == "timing_s/update_actor"}
    assert all(ref[f"r{i}"]["error_pct"] < -1 for i in range(4, 8))
    assert all(abs(ref[f"r{i}"]["error_pct"]) < 1e-3 for i in range(4))


# --- CLI ----------------------------------------------------------------------------------------

def _cli(*args):
    """`python -m hybridflow.cost ARGS` in this process (its main; a fresh interpreter per call
    spent most of the module's time importing): stdout, stderr and the exit status."""
    from hybridflow.cost.__main__ import main

    out, err, cwd = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if not isinstance(e.code, (int, type(None))):
                    print(e.code, file=sys.stderr)
    finally:
        os.chdir(cwd)
    return subprocess.CompletedProcess(["hybridflow.cost", *args], code or 0, out.getvalue(),
                                       err.getvalue())


def test_cli_with_lengths(tmp_path):
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps({"mean": 300, "max": 1024, "min": 20, "clip_ratio": 0.01,
                                   "prompt_len": 100, "prompt_len_max": 180}))
    common = ["--model", "qwen2_0_5b", "--num-gpus", "1", "--tp", "1", "--prompts-per-step", "16",
              "--samples-per-prompt", "8", "--micro-batch-tokens", "8192", "--max-new-tokens", "1024",
              "--dynamic-bsz", "--pack-sequences", "--compact-finished-rows", "--kv-window", "256",
              "--json"]
    r = _cli(*common, "--lengths", str(lengths))
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    w = rep["workload"]
    assert w["prompt_len"] == 100 and w["prompt_len_max"] == 180 and w["response_len_max"] == 1024
    assert w["response_len"] == pytest.approx(300, abs=3) and len(w["response_lengths"]) == 256
    assert rep["step_seconds"] == pytest.approx(sum(rep["stage_seconds"].values()))
    assert rep["time_breakdown"]["ref"]["masked_attention"] > 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"lengths": {"median": 3}}))
    r = _cli(*common, "--lengths", str(bad))
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert "expected response_lengths, response_length_quantiles" in r.stderr


def test_cli_with_a_trainer_config(tmp_path):
    steps = [{"step": i, "response_length/mean": 300.0, "response_length/max": 1024.0,
              "response_length/min": 20.0, "response_length/clip_ratio": 0.01,
              "prompt_length/mean": 100.0, "prompt_length/max": 170.0} for i in range(1, 4)]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(s) + "\n" for s in steps))
    r = _cli("--config", "experiment=gsm8k_qwen_coder_0_5b", "--num-gpus", "1", "--lengths",
             str(metrics), "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    w = rep["workload"]
    # the recipe's options as the trainer resolves them
    assert (w["micro_batch_tokens"], w["forward_micro_batch_tokens"]) == (20480, 40960)
    assert w["pack_sequences"] and w["compact_finished_rows"] and w["decode_kv_window"] == 256
    assert w["gen_max_batch_size"] == 512 and w["max_new_tokens"] == 1024 and w["skip_old_log_prob"]
    assert w["prompt_len"] == 100 and w["prompt_len_max"] == 170
    assert set(rep["stage_seconds"]) == {"reshard", "gen", "ref", "update_actor", "other"}
    assert rep["layout"]["tp"] == 1 and rep["fits"]


def test_generation_call_rows_under_dynamic_sampling_and_the_batch_cap():
    # dynamic sampling: 2.5 prompt batches in 1.25 rounds -> 2 x 512 rows per call; the call runs
    # in chunks of rollout.max_batch_size (384): 3 chunks, the memory holds one chunk's cache
    from hybridflow.cost import estimate_memory, get_gpu, load_shape
    from hybridflow.cost.memory import gen_batch_size
    from hybridflow.cost.workload import make_plan

    shape = load_shape("qwen2_0_5b")
    plan = make_plan({"tp": 1}, 1, shape)
    w = Workload(prompts_per_step=64, samples_per_prompt=8, prompt_len=100, prompt_len_max=160,
                 response_lengths=(100, 200, 300, 1000), max_new_tokens=1024, gen_rounds=1.25,
                 gen_prompt_factor=2.5, gen_max_batch_size=384)
    assert gen_batch_size(shape, get_gpu("H200"), plan, w, Calibration()) == (384, 3)
    d = decode_schedule(w, 1024, 384)
    assert d.chunks == 3
    t = stage_terms(shape, get_gpu("H200"), plan, w, Calibration())
    # per call 3 chunks' steps, 1.25 calls per step
    assert t["gen"].x["fused_decode_layer_overhead_s"] == pytest.approx(1.25 * d.steps * 24)
    kv = estimate_memory(model="qwen2_0_5b", gpu="H200", num_gpus=1, layout={"tp": 1},
                         calibration=Calibration(),
                         **{k: getattr(w, k) for k in ("prompts_per_step", "samples_per_prompt",
                                                      "prompt_len", "prompt_len_max",
                                                      "response_lengths", "max_new_tokens",
                                                      "gen_rounds", "gen_prompt_factor",
                                                      "gen_max_batch_size")}).phases_gib["gen"]["kv_cache"]
    # (longest prompt + max_new_tokens, rounded up to the generator's 64) x K/V bytes
    per_row = 1216 * 2 * 24 * 2 * 64 * 2
    assert kv == pytest.approx(384 * per_row / 2 ** 30)


def test_cli_notes_dynamic_sampling_without_its_rounds():
    r = _cli("--config", "experiment=gsm8k_qwen_coder_0_5b", "algo=dapo", "--num-gpus", "1", "--json")
    assert r.returncode == 0, r.stderr
    assert "samples dynamically" in r.stderr and "one prompt batch per step" in r.stderr
    assert "ref" not in json.loads(r.stdout)["stage_seconds"]          # DAPO: no KL reference


def test_cli_config_takes_the_trainers_memory_cap():
    """trainer.gpu_memory_limit_gib in the overrides bounds the card as --gpu-memory-gib does (the
    smaller of the two when both are given): the peak is judged against it."""
    args = ["--config", "experiment=gsm8k_qwen_coder_0_5b", "--num-gpus", "1", "--json"]
    full = json.loads(_cli(*args).stdout)
    capped = _cli(*args[:2], "trainer.gpu_memory_limit_gib=24", *args[2:])
    assert capped.returncode == 0, capped.stderr
    capped = json.loads(capped.stdout)
    both = json.loads(_cli(*args[:2], "trainer.gpu_memory_limit_gib=24", *args[2:],
                           "--gpu-memory-gib", "40").stdout)
    assert capped["gpu"] == both["gpu"] == "H200@24GiB" and full["gpu"] == "H200"
    assert capped["memory_capacity_gib"] < full["memory_capacity_gib"]
    # the recipe's token budgets are its own: a 24 GiB card cannot hold its update
    assert full["fits"] and not capped["fits"] and "won't fit" in capped["reason"]


def test_mirrors_of_the_generator_stay_equal():
    """cost/varlen.py keeps torch-free copies of the generator's bucket ladder, poll period, smallest
    compaction bucket, cache-length rounding and prefill sub-batch size: they must equal the
    originals."""
    from hybridflow.cost import varlen
    from hybridflow.rollout import cuda_graph, generator
    from hybridflow.rollout.options import DecodeOptions

    for cap in (1, 2, 3, 16, 100, 512, 768, 1536):
        assert varlen.bucket_sizes(cap) == cuda_graph.bucket_sizes(cap)
    opts = DecodeOptions()
    assert varlen.CHECK_EVERY == opts.check_every
    assert varlen.MIN_GRAPHED_BUCKET == opts.min_graphed_bucket
    assert varlen.LENGTH_MULTIPLE == generator.LENGTH_MULTIPLE
    assert varlen.PREFILL_TOKENS == opts.prefill_tokens


GSM8K_PROBE = ROOT / "benchmarks/results/gsm8k_graphs_h200/full/metrics.jsonl"


def _gsm8k_report(capsys, *overrides, as_json=True):
    from hybridflow.cost.__main__ import main

    assert main(["--config", "experiment=gsm8k_qwen_coder_0_5b", *overrides, "--num-gpus", "1",
                 "--gpu", "H100", "--lengths", str(GSM8K_PROBE)] + ["--json"] * as_json) == 0
    out = capsys.readouterr().out
    return json.loads(out) if as_json else out


def test_partial_rollouts_first_step_rows_hold_the_kept_cache(capsys):
    # rollout.partial's first step generates every in-flight group: (64 + 32) x 8 rows, the run's
    # largest call, so a kept generator's cache holds 768 rows (512 without it)
    on = _gsm8k_report(capsys, "rollout.partial.enable=true",
                       "rollout.partial.max_decode_steps=512", "rollout.partial.extra_prompts=32", "rollout.max_batch_size=768",
                       "algo.tis_imp_ratio_cap=2.0")
    off = _gsm8k_report(capsys)
    assert on["memory_gib"]["kv_cache"] == pytest.approx(off["memory_gib"]["kv_cache"] * 768 / 512)
    assert "already on" in on["partial"]["reason"] and on["partial"]["recommended"] is None


def test_estimator_suggests_partial_rollouts_for_a_long_tail(capsys):
    """GSM8K's lengths (mean ~300, longest 1,024): every cap's predicted step is listed, at the
    first step's rows (768) and the steady state's (rounded up to 64) as rollout.max_batch_size,
    and the fastest fitting one (>= 3% faster) is suggested with the overrides that run it: the
    steady state's size, which pads the call to no larger graph bucket and holds fewer KV rows;
    dynamic sampling or no long tail: not considered, and the reason says why. With the
    speculative tail on (the recipe's default) the options are listed but none is suggested: that
    pair was measured no faster than the tail alone."""
    tail = _gsm8k_report(capsys)["partial"]  # the recipe: the speculative tail on
    assert tail["recommended"] is None and "speculative tail on" in tail["reason"]
    assert tail["options"]
    r = _gsm8k_report(capsys, "rollout.speculative.enable=false")
    p = r["partial"]
    opts = p["options"]
    assert {k.split("/")[0] for k in opts} == {"256", "384", "512"}
    assert {"512/768", "512/576"} <= set(opts)
    assert opts["512/576"]["step_s"] < opts["512/768"]["step_s"]
    assert opts["512/576"]["peak_gib"] < opts["512/768"]["peak_gib"]
    best = min(opts, key=lambda c: opts[c]["step_s"])
    cap, mbs = best.split("/")
    assert opts[best]["step_s"] < 0.97 * r["step_seconds"] and mbs != "768"
    assert p["recommended"] == (f"rollout.partial.enable=true rollout.partial.max_decode_steps="
                                f"{cap} rollout.partial.extra_prompts=32 "
                                f"rollout.max_batch_size={mbs} algo.tis_imp_ratio_cap=2.0")
    assert "rollout.partial: consider" in _gsm8k_report(capsys, "rollout.speculative.enable=false",
                                                       as_json=False)
    assert "check the val curve" in p["reason"]
    for overrides, why in ((["algo=dapo", "reward.overlong_buffer.len=256"], "dynamic sampling"),
                           (["rollout.max_new_tokens=400"], "no long tail")):
        q = _gsm8k_report(capsys, *overrides)["partial"]
        assert q["recommended"] is None and not q["options"] and why in q["reason"], q


def test_multi_turn_is_never_offered_what_its_config_refuses(capsys):
    """experiment=gsm8k_tools_qwen_coder_0_5b at GSM8K's long-tailed lengths: no partial rollouts
    (refused with multi-turn), no quantized rollout; the assumptions say tool turns are not
    modelled. A step that fits a 24 GiB card with the fp8 KV cache single-turn is offered
    something else with multi-turn."""
    from hybridflow.cost.estimate import estimate_cost
    from hybridflow.cost.__main__ import main

    base = ["--config", "experiment=gsm8k_tools_qwen_coder_0_5b", "--num-gpus", "1",
            "--gpu", "H100", "--lengths", str(GSM8K_PROBE)]
    assert main(base + ["--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["workload"]["multi_turn"] is True
    assert r["partial"]["recommended"] is None and "multi-turn" in r["partial"]["reason"]
    assert r["quantization"]["recommended"] is None and "multi-turn" in r["quantization"]["reason"]
    assert any(n.startswith("multi-turn rollouts costed as single-turn") for n in r["notes"])
    work = dict(model="qwen2_5_coder_0_5b", gpu="H100", num_gpus=1, prompts_per_step=64,
                samples_per_prompt=8, prompt_len=120, response_len=1024, max_new_tokens=1024,
                keep_generator=True, gpu_memory_gib=24)
    fits = {mt: [s for s in estimate_cost(multi_turn=mt, **work).suggestions
                 if s.startswith("fits on")] for mt in (False, True)}
    assert len(fits[False]) == len(fits[True]) == 1, fits
    assert "rollout.kv_cache_dtype=fp8" in fits[False][0]
    assert "kv_cache_dtype" not in fits[True][0], fits


def test_speculative_tail_steps():
    """rollout.speculative in the schedule: plain steps through the first poll whose (one poll
    late) live count is at most spec_rows, then ceil(rest / tokens_per_step) tail steps of
    spec_rows x (1 + drafts) tokens each; off, or with no such poll, the plain schedule."""
    from hybridflow.cost.varlen import decode_schedule

    lengths = [20] * 39 + [200]
    w = Workload(algorithm="grpo", prompts_per_step=40, samples_per_prompt=1, prompt_len=10,
                 response_lengths=lengths, max_new_tokens=256, gen_max_batch_size=64)
    plain = decode_schedule(w, 40, 40)
    spec = decode_schedule(replace(w, spec_rows=4, spec_draft_tokens=4,
                                               spec_tail_tokens_per_step=2.5), 40, 40)
    # polls at 32 (39 rows of 20 tokens were live at 17), 48: one row left -> tail after token 48
    tail = math.ceil((200 - 49) / 2.5)
    assert spec.steps == 49 + tail < plain.steps
    assert spec.row_steps == 49 * 64 + tail * 4 * 5  # the 64-row bucket, then 4 rows x 5 tokens
    assert spec.row_columns < plain.row_columns
    # with compaction: none from the tail's poll on (the generator leaves its loop there), and
    # the tail's static rows are spec_rows (at most the cache's 64), not a compacted bucket's
    wide = decode_schedule(replace(w, compact_finished_rows=True, spec_rows=32,
                                   spec_tail_tokens_per_step=2.5), 40, 40)
    assert decode_schedule(replace(w, compact_finished_rows=True), 40, 40).compactions == 1
    assert wide.compactions == 0 and wide.moved_bytes == 0
    assert wide.row_steps == 49 * 64 + tail * 32 * 5
    # tokens per step from the draft acceptance: (1 - a^(k + 1)) / (1 - a); a given rate wins
    assert replace(w, spec_draft_tokens=4).spec_tokens_per_step == pytest.approx(2.5, abs=0.02)
    more = [replace(w, spec_draft_tokens=k).spec_tokens_per_step for k in (1, 2, 4, 8)]
    assert more == sorted(more) and more[0] == pytest.approx(1.645) and more[-1] < 1 / 0.355
    assert replace(w, spec_draft_accept=1.0, spec_draft_tokens=3).spec_tokens_per_step == 4.0
    assert replace(w, spec_tail_tokens_per_step=1.7).spec_tokens_per_step == 1.7
    for bad in (dict(spec_draft_accept=1.5), dict(spec_tail_tokens_per_step=0.5)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            replace(w, **bad)
    never = replace(w, spec_rows=4, response_lengths=[200] * 40)
    assert decode_schedule(never, 40, 40) == decode_schedule(
        replace(never, spec_rows=0), 40, 40)


def test_sampler_delta():
    """The inverse-CDF draw (Workload.cdf_sampler) against the race that the calibration's decode
    terms hold: per decode step (a_cdf - a_race) + (b_cdf - b_race) x the step's bucket rows,
    negative at more than a few rows and larger in size with more; none on the PyTorch decode
    path or for the race; the speculative tail's steps (a PyTorch draw) left out."""
    from hybridflow.cost import get_gpu, load_shape
    from hybridflow.cost.timing import SAMPLER_CDF_S, SAMPLER_RACE_S, SAMPLER_VOCAB, sampler_delta
    from hybridflow.cost.workload import make_plan

    shape = load_shape("qwen2_5_coder_0_5b")
    assert shape.vocab_size == SAMPLER_VOCAB
    # the fits reproduce bench_sampler's 512-row step: 76.6 against 313.5 us
    assert sampler_delta(shape, 1, 512) == pytest.approx((76.6 - 313.5) * 1e-6, abs=2e-6)
    per_step = [sampler_delta(shape, 1, rows) for rows in (16, 64, 256, 512)]
    assert per_step[0] < 0 and per_step == sorted(per_step, reverse=True)
    (a0, b0), (a1, b1) = SAMPLER_RACE_S, SAMPLER_CDF_S
    assert sampler_delta(replace(shape, vocab_size=SAMPLER_VOCAB // 2), 3, 100) == \
        pytest.approx(3 * (a1 - a0) + 100 * (b1 - b0) / 2)

    plan = make_plan({"tp": 1}, 1, shape)
    w = Workload(prompts_per_step=64, samples_per_prompt=8, prompt_len=100,
                 response_lengths=(40, 100, 200, 300, 600, 1000), max_new_tokens=1024,
                 gen_max_batch_size=512, compact_finished_rows=True, cdf_sampler=True)

    def delta(**kw):
        t = stage_terms(shape, get_gpu("H100"), plan, replace(w, **kw), Calibration())["gen"]
        return sum(x for label, _, x in t.parts if label == "sampler_delta")

    d = decode_schedule(w, 512, 512)
    assert delta() == pytest.approx(sampler_delta(shape, d.steps, d.row_steps)) and delta() < 0
    assert delta(prompts_per_step=16) > delta()   # fewer rows a step: less saved
    assert delta(cdf_sampler=False) == 0 and delta(decode_kernels="torch") == 0
    tail = dict(response_lengths=tuple(range(20, 320, 5)) + (1000,), spec_rows=16,
                spec_tail_tokens_per_step=2.5)   # ~8 rows of 1,000 tokens: a speculative tail
    s = decode_schedule(replace(w, **tail), 512, 512)
    assert s.spec_steps > 0 and s.spec_row_steps == s.spec_steps * 16 * 5
    assert delta(**tail) == pytest.approx(
        sampler_delta(shape, s.steps - s.spec_steps, s.row_steps - s.spec_row_steps))


def test_sampler_from_config():
    from hybridflow.config import load_config
    from hybridflow.cost.from_config import fused_cdf_draw

    assert fused_cdf_draw(load_config([]), decode_kernels="triton")
    assert not fused_cdf_draw(load_config([]), decode_kernels="torch")
    for off in ("rollout.kernel_options.fused_sampler=false", "rollout.top_k=50",
                "rollout.top_p=0.9", "rollout.temperature=0"):
        assert not fused_cdf_draw(load_config([off]), decode_kernels="triton"), off


def test_fused_tail_accept_takes_its_measured_cost_off_each_tail_step():
    """rollout.speculative.fused_advance on the Triton decode with unfiltered sampling charges
    SPEC_FUSED_ACCEPT_S less per tail step than SPEC_TAIL_STEP_S; off, filtered sampling, greedy
    or the PyTorch decode charge the records' full cost."""
    from hybridflow.config import load_config
    from hybridflow.cost.efficiency import Calibration
    from hybridflow.cost.from_config import fused_tail_accept
    from hybridflow.cost.gpus import get_gpu
    from hybridflow.cost.shapes import load_shape
    from hybridflow.cost.timing import SPEC_FUSED_ACCEPT_S, SPEC_TAIL_STEP_S, stage_terms
    from hybridflow.cost.varlen import decode_schedule
    from hybridflow.cost.workload import Workload, make_plan

    assert fused_tail_accept(load_config([]), decode_kernels="triton")
    assert not fused_tail_accept(load_config([]), decode_kernels="torch")
    for off in ("rollout.speculative.fused_advance=false", "rollout.top_k=50",
                "rollout.top_p=0.9", "rollout.temperature=0", "rollout.kv_cache_dtype=fp8",
                "rollout.tensor_parallel_size=2", "model=qwen3_moe_2b",
                "rollout.quantization=fp8"):
        assert not fused_tail_accept(load_config([off]), decode_kernels="triton"), off

    shape = load_shape("qwen2_5_coder_0_5b")
    w = Workload(prompts_per_step=64, samples_per_prompt=8, prompt_len=100,
                 response_lengths=tuple(range(20, 320, 5)) + (1000,), max_new_tokens=1024,
                 gen_max_batch_size=512, compact_finished_rows=True, spec_rows=16,
                 spec_tail_tokens_per_step=2.5)

    def tail_cost(**kw):
        t = stage_terms(shape, get_gpu("H100"), make_plan({"tp": 1}, 1, shape),
                        replace(w, **kw), Calibration())["gen"]
        return sum(x for label, _, x in t.parts if label == "spec_tail_step")

    steps = decode_schedule(w, 512, 512).spec_steps
    assert steps > 0
    assert tail_cost() == pytest.approx(steps * SPEC_TAIL_STEP_S)
    assert tail_cost(spec_fused_accept=True) == pytest.approx(
        steps * (SPEC_TAIL_STEP_S - SPEC_FUSED_ACCEPT_S))


def test_cli_packed_attention_and_sampler(capsys):
    """--packed-attention auto follows the trainer on --gpu (fa4 on compute capability 9.0+, varlen
    with --no-fa4 or before 9.0), with --config too; fa4 where it cannot run is a user error; the
    Triton decode draws by the inverse CDF (a sampler_delta part)."""
    from hybridflow.cost.__main__ import main as cost_main

    def run(*args):
        assert cost_main([*args, "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    flags = ["--model", "qwen2_0_5b", "--num-gpus", "1", "--tp", "1", "--prompts-per-step", "16",
             "--response-len", "300", "--response-len-max", "1024", "--dynamic-bsz",
             "--pack-sequences"]
    for extra, kernel in (([], "fa4"), (["--no-fa4"], "varlen"), (["--gpu", "A100"], "varlen"),
                          (["--packed-attention", "flex"], "flex")):
        rep = run(*flags, "--gpu", "H100", *extra)
        assert rep["workload"]["packed_attention"] == kernel, extra
        assert rep["workload"]["cdf_sampler"] and rep["time_breakdown"]["gen"]["sampler_delta"] < 0
    rep = run(*flags, "--decode-kernels", "torch")
    assert not rep["workload"]["cdf_sampler"]
    assert "sampler_delta" not in rep["time_breakdown"]["gen"]
    assert cost_main([*flags, "--gpu", "A100", "--packed-attention", "fa4"]) == 2
    assert capsys.readouterr().err.strip() == (
        "hybridflow cost: error: algo.packed_attention=fa4 cannot run on A100-80GB: "
        "FlashAttention-4 needs compute capability 9.0+ (got 8.0); set algo.packed_attention=auto, "
        "varlen or flex")
    config = ["--config", "experiment=gsm8k_qwen_coder_0_5b", "--num-gpus", "1", "--gpu", "H100"]
    assert run(*config)["workload"]["packed_attention"] == "fa4"
    assert run(*config, "--no-fa4")["workload"]["packed_attention"] == "varlen"
