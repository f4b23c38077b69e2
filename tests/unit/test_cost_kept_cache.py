"""A kept generator's KV cache (rollout.free_cache_engine=false) in the cost model: sized by the
run's largest generation call, as the generator allocates it.

- A real CPU Generator kept across two calls of different sizes (dynamic sampling's rounds: 2
  prompt batches, then 1) holds the cache of the larger call's graph bucket; the model's
  `kv_cache` component is that many bytes (the mean call would say fewer).
- The DAPO GSM8K record (rounds of up to 3 prompt batches, rollout.max_batch_size=1536) against
  the peak measured in benchmarks/results/gsm8k_dapo_h200.json.
- A trainer config under dynamic sampling hands its batches_per_round to the model."""

import json
import math
from pathlib import Path

import pytest

from hybridflow.cost.efficiency import Calibration
from tests.unit.test_rollout import CFG, PROMPTS, make, opts, rc

ROOT = Path(__file__).resolve().parents[2]
GIB = 2 ** 30


def _kv_cache_bytes(**work) -> float:
    from hybridflow.cost.gpus import get_gpu
    from hybridflow.cost.memory import memory_for
    from hybridflow.cost.workload import Workload, make_plan

    m = memory_for(CFG, get_gpu("H200"), make_plan({"tp": 1}, 1, CFG), Workload(**work),
                   Calibration())
    return m.phases_gib["update_actor"]["kv_cache"] * GIB


def test_kept_cache_is_the_largest_calls():
    gen = make()
    cfg = rc(n=3, max_batch_size=16)
    options = opts(cfg, emulate_graphs=True)     # graph buckets as on a GPU
    gen.generate(PROMPTS, cfg=cfg, options=options, eos_id=-1, pad_id=0, seed=0)  # 12 rows
    gen.generate(PROMPTS[:2], cfg=cfg, options=options, eos_id=-1, pad_id=0, seed=1)  # 6 rows
    measured = gen._cache.nbytes / 2             # fp32 on CPU; the model counts bf16
    assert gen._cache.rows == 16                 # the 12-row call's bucket
    # 2 prompts a batch; rounds of up to 2 batches (12 rows), 1.25 batches per call on average
    work = dict(prompts_per_step=2, samples_per_prompt=3, prompt_len=4,
                prompt_len_max=max(map(len, PROMPTS)), response_len=9, max_new_tokens=9,
                gen_max_batch_size=16, gen_rounds=2.0, gen_prompt_factor=2.5,
                keep_generator=True)
    assert _kv_cache_bytes(**work, gen_batches_per_round=2) == measured
    assert _kv_cache_bytes(**work) == measured / 2   # the mean call: 8 rows, bucket 8
    gen.release()


def test_dapo_peak_against_the_measured_run():
    from hybridflow.cost.calibrate import load_records, parse_record
    from hybridflow.cost.efficiency import shipped_calibration
    from hybridflow.cost.memory import memory_for

    rec = next(r for r in load_records([ROOT / "benchmarks/results/cost/varlen_gsm8k.json"])
               if r["name"] == "gsm8k-dapo-then")
    run = parse_record(rec)
    calib = shipped_calibration()
    m = memory_for(run.shape, run.gpu, run.plan, run.workload, calib)
    measured = json.loads((ROOT / "benchmarks/results/gsm8k_dapo_h200.json").read_text())
    peak = measured["peak_memory_gb"]                # GiB (bytes / 2**30)
    assert m.peak_gib == pytest.approx(peak, rel=0.05)
    # the kept cache holds a round of 3 batches of 64 x 8 rows: 1,536, the max_batch_size
    kv_seq = m.components_gib["kv_cache"] / 1536
    mean_call = math.ceil(512 * run.workload.gen_prompt_factor / run.workload.gen_rounds)
    assert mean_call == 1024
    from dataclasses import replace

    mean = memory_for(run.shape, run.gpu, run.plan, replace(run.workload, gen_batches_per_round=1),
                      calib)
    assert mean.components_gib["kv_cache"] == pytest.approx(kv_seq * mean_call)
    assert mean.peak_gib < 0.9 * peak                # what the mean call predicted (-14.6%)


def test_config_hands_batches_per_round_over():
    from hybridflow.config import load_config
    from hybridflow.cost.from_config import workload_fields

    dapo = load_config(["experiment=gsm8k_qwen_coder_0_5b", "algo=dapo"])
    grpo = load_config(["experiment=gsm8k_qwen_coder_0_5b"])
    assert workload_fields(dapo, decode_kernels="torch")["gen_batches_per_round"] == \
        dapo.algo.dynamic_sampling.batches_per_round == 3
    assert workload_fields(grpo, decode_kernels="torch")["gen_batches_per_round"] == 1
