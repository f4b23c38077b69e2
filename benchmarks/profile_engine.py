"""Where a forward-only pass of the actor Engine spends its time, at any TP (torchrun).

Runs `Engine.compute_logprobs` on a random batch shaped like the RL benchmark (64 sequences of
128 + 256 tokens, micro-batch 8) a few times, then once under torch.profiler; rank 0 prints the
median wall time and the top CPU and CUDA ops.

  torchrun --nproc_per_node 2 benchmarks/profile_engine.py --tp 2 [--sp]
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2_0_5b")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--sp", action="store_true")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-profile", dest="profile", action="store_false")
    args = ap.parse_args()
    import yaml

    from hybridflow.config import ModelConfig, ParallelConfig
    from hybridflow.data.batch import RolloutBatch
    from hybridflow.engine import Engine
    from hybridflow.parallel import groups

    groups.init_distributed()
    ctx = groups.init_model_parallel(tp=args.tp, pp=1, seed=1)
    with open(os.path.join(os.path.dirname(__file__), "..", "hybridflow", "conf", "model", f"{args.model}.yaml")) as f:
        cfg = ModelConfig(**yaml.safe_load(f))
    par = ParallelConfig(tensor_parallel_size=args.tp, sequence_parallel=args.sp)
    eng = Engine(role="ref", model_cfg=cfg, ctx=ctx, parallel=par, precision="bf16")
    b, p, r = args.batch, 128, 256
    g = torch.Generator().manual_seed(0)
    batch = RolloutBatch(prompt_ids=torch.randint(0, min(1000, cfg.vocab_size), (b, p), generator=g),
                         prompt_mask=torch.ones(b, p, dtype=torch.long),
                         response_ids=torch.randint(0, min(1000, cfg.vocab_size), (b, r), generator=g),
                         response_mask=torch.ones(b, r, dtype=torch.long),
                         group_ids=torch.arange(b), indices=torch.arange(b))
    times = []
    for _ in range(args.repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        eng.compute_logprobs(batch, micro_batch_size=args.micro)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if torch.distributed.get_rank() == 0:
        print(f"{args.model} TP={args.tp} SP={args.sp} micro={args.micro}: compute_logprobs median "
              f"{statistics.median(times[1:]):.3f} s (times {[round(t, 3) for t in times]})")
    if not args.profile:
        groups.destroy()
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        eng.compute_logprobs(batch, micro_batch_size=args.micro)
        torch.cuda.synchronize()
    if torch.distributed.get_rank() == 0:
        avg = prof.key_averages()
        print(avg.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
        print(avg.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
    groups.destroy()


if __name__ == "__main__":
    main()
