"""Top CUDA kernels of one actor forward+backward (torch.profiler), to see where the time goes.

  python benchmarks/profile_train.py [--model qwen2_0_5b] [--backend sdpa]
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2_0_5b")
    ap.add_argument("--backend", default="sdpa")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    args = ap.parse_args()
    import yaml
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from hybridflow.config import ModelConfig
    from hybridflow.models.build import build_model
    from hybridflow.parallel import groups

    groups.init_distributed()
    ctx = groups.init_model_parallel(tp=1, pp=1, seed=1)
    with open(os.path.join(os.path.dirname(__file__), "..", "hybridflow", "conf", "model", f"{args.model}.yaml")) as f:
        cfg = ModelConfig(**yaml.safe_load(f), )
    cfg.attention_backend = args.backend
    model = build_model(cfg, role="actor", ctx=ctx, precision="bf16").cuda()
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device="cuda")
    pos = torch.arange(args.seq, device="cuda").expand(args.batch, args.seq)

    def step():
        logits = model(ids, pos, None)
        loss = vocab_parallel_cross_entropy(logits.float().transpose(0, 1).contiguous(),
                                            ids.t().contiguous()).mean()
        loss.backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70))
    groups.destroy()


if __name__ == "__main__":
    main()
