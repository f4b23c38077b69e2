"""Actor forward+backward tokens/s: our GPTModel vs Megatron's local spec vs transformers, one GPU.

Same shape (hybridflow/conf/model/<model>.yaml, default Qwen2-0.5B), same batch (8 x 1024 tokens), bf16, random
init, loss = mean token cross-entropy over the full vocabulary; timed region = forward + backward
(no optimizer step), median of N iterations after warm-up. Writes JSON with the machine, versions
and the command. `cpu_s` is the time until the step's Python returns (all kernels queued, before
synchronising): close to `median_s` means the step is launch-bound.

Variants of ours (GPTModel, SDPA attention): `ours_sdpa` = lean TP linears + fused Triton log-prob
loss (-mean vocab_parallel_logprobs, i.e. CE); `_graphs` adds per-layer CUDA graphs
(hybridflow/models/graphs.py); `_compile` torch.compile per layer; ablations `_megatron_ce`
(Megatron's vocab_parallel_cross_entropy on fp32 logits) and `_megatron_linear` (Megatron's
Column/RowParallelLinear). `megatron_local` is Megatron's plain local spec with its CE.

  python benchmarks/bench_train.py --out benchmarks/results/train_fwd_bwd_h200.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import platform
import statistics
import sys
import time
import types

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from run_record import write_json  # noqa: E402


def _time(fn, iters: int, warmup: int) -> tuple[list[float], list[float]]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out, cpu = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        cpu.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out, cpu


def _profile(fn, path: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40,
                                          max_name_column_width=80))


def bench_ours(model_cfg, variant: str, ids, iters, warmup, profile_path=None):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    import hybridflow.models.build as build
    from hybridflow.models.logprob import vocab_parallel_logprobs

    backend = "local" if variant == "megatron_local" else "sdpa"
    cfg = dataclasses.replace(model_cfg, attention_backend=backend)
    lean = build.LeanColumnParallelLinear, build.LeanRowParallelLinear, build.LeanOutputLinear
    if variant.endswith("_megatron_linear"):  # ablation: Megatron's linears in our spec
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

        build.LeanColumnParallelLinear, build.LeanRowParallelLinear = (ColumnParallelLinear,
                                                                       RowParallelLinear)
        build.LeanOutputLinear = types.SimpleNamespace(adopt=lambda layer: layer)
    try:
        model = build.build_model(cfg, role="actor", ctx=ctx, precision="bf16").cuda()
    finally:
        build.LeanColumnParallelLinear, build.LeanRowParallelLinear, build.LeanOutputLinear = lean
    b, s = ids.shape
    pos = torch.arange(s, device="cuda").expand(b, s)
    labels = torch.roll(ids, -1, 1)
    if variant.endswith("_compile"):
        for layer in model.decoder.layers:
            layer.forward = torch.compile(layer.forward)
    if variant.endswith("_graphs"):
        from hybridflow.models.graphs import graph_layers

        model.train()
        graph_layers(model, micro_batch_size=b, seq_len=s)
    megatron_ce = variant == "megatron_local" or variant.endswith("_megatron_ce")
    tp_group = ps.get_tensor_model_parallel_group()

    def step():
        logits = model(ids, pos, None)  # (b, s, V) vocab-parallel (TP=1: all of it)
        if megatron_ce:
            loss = vocab_parallel_cross_entropy(logits.float().transpose(0, 1).contiguous(),
                                                labels.t().contiguous()).mean()
        else:  # CE = -log p(label), fused kernel on bf16 logits
            loss = -vocab_parallel_logprobs(logits, labels, tp_group=tp_group,
                                            true_vocab_size=cfg.vocab_size).mean()
        loss.backward()

    torch.cuda.reset_peak_memory_stats()
    times, cpu = _time(step, iters, warmup)
    mem = torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30
    if profile_path:
        _profile(step, profile_path)
    n_params = sum(p.numel() for p in model.parameters())
    del model
    gc.collect()  # graphed layers hold their graphs in reference cycles
    torch.cuda.empty_cache()
    return times, cpu, mem, n_params


def bench_hf(model_cfg, ids, iters, warmup):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    c = model_cfg
    hf_cfg = Qwen2Config(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                         intermediate_size=c.ffn_hidden_size, num_hidden_layers=c.num_layers,
                         num_attention_heads=c.num_attention_heads,
                         num_key_value_heads=c.num_query_groups, rope_theta=c.rotary_base,
                         rms_norm_eps=c.norm_epsilon, tie_word_embeddings=c.tie_word_embeddings,
                         max_position_embeddings=c.max_position_embeddings,
                         attn_implementation="sdpa", torch_dtype=torch.bfloat16)
    model = Qwen2ForCausalLM(hf_cfg).to(device="cuda", dtype=torch.bfloat16)
    model.train()

    def step():
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()

    torch.cuda.reset_peak_memory_stats()
    times, cpu = _time(step, iters, warmup)
    mem = torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30
    del model
    torch.cuda.empty_cache()
    return times, cpu, mem


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2_0_5b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--variants", default="ours_sdpa,ours_sdpa_graphs,ours_sdpa_compile,"
                                          "megatron_local,hf_sdpa")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile_variant", default=None, help="torch.profiler table of this variant")
    ap.add_argument("--profile_out", default="profile.txt")
    args = ap.parse_args()

    import yaml

    from hybridflow.config import ModelConfig
    from hybridflow.parallel import groups

    groups.init_distributed()
    ctx = groups.init_model_parallel(tp=1, pp=1, seed=1)
    with open(os.path.join(ROOT, "hybridflow", "conf", "model", f"{args.model}.yaml")) as f:
        model_cfg = ModelConfig(**yaml.safe_load(f))
    torch.manual_seed(0)
    ids = torch.randint(0, model_cfg.vocab_size, (args.batch, args.seq), device="cuda")
    tokens = args.batch * args.seq
    results = {}
    for v in args.variants.split(","):
        try:
            if v == "hf_sdpa":
                times, cpu, mem = bench_hf(model_cfg, ids, args.iters, args.warmup)
                n_params = None
            elif v == "megatron_local" or v.startswith("ours_sdpa"):
                prof = args.profile_out if v == args.profile_variant else None
                times, cpu, mem, n_params = bench_ours(model_cfg, v, ids, args.iters, args.warmup,
                                                       profile_path=prof)
            else:
                raise ValueError(f"unknown variant {v!r}")
        except Exception as e:  # a failing variant is reported, not fatal
            import traceback

            traceback.print_exc()
            results[v] = {"error": f"{type(e).__name__}: {e}"}
            continue
        med = statistics.median(times)
        results[v] = {"median_s": med, "tokens_per_s": tokens / med,
                      "cpu_s": statistics.median(cpu), "times_s": times, "peak_memory_gb": mem[0],
                      "peak_reserved_gb": mem[1], "num_params": n_params}
        print(f"{v}: {tokens / med:.0f} tok/s, cpu {statistics.median(cpu) * 1e3:.1f} ms / "
              f"step {med * 1e3:.1f} ms, peak {mem[0]:.1f} GB (reserved {mem[1]:.1f})", flush=True)
    if "hf_sdpa" in results and "tokens_per_s" in results["hf_sdpa"]:
        base = results["hf_sdpa"]["tokens_per_s"]
        for r in results.values():
            if "tokens_per_s" in r:
                r["vs_transformers"] = r["tokens_per_s"] / base
    import megatron.core
    import transformers

    record = {
        "benchmark": "actor forward+backward tokens/s",
        "model": args.model, "batch": args.batch, "seq_len": args.seq, "dtype": "bf16",
        "machine": {"gpu": torch.cuda.get_device_name(), "host": platform.node()},
        "versions": {"torch": torch.__version__, "megatron_core": megatron.core.__version__,
                     "transformers": transformers.__version__, "python": platform.python_version()},
        "command": " ".join(["python"] + sys.argv), "results": results,
    }
    print(f"{'variant':28s} {'tok/s':>10s} {'x HF':>6s} {'peak GB':>8s} {'resv GB':>8s} "
          f"{'cpu ms':>7s}")
    for k, r in results.items():
        if "error" in r:
            print(f"{k:28s} ERROR {r['error'][:80]}")
        else:
            print(f"{k:28s} {r['tokens_per_s']:10.0f} {r.get('vs_transformers', 0):6.2f} "
                  f"{r['peak_memory_gb']:8.1f} {r['peak_reserved_gb']:8.1f} {r['cpu_s'] * 1e3:7.1f}")
    if args.out:
        write_json(args.out, record)
    groups.destroy()


if __name__ == "__main__":
    main()
