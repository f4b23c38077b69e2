"""A decode step's temperature draw and its log-probs at decode batch sizes: PyTorch's sampler
(sampling.sample without a device stream: a (B, V) fp32 tensor of exponentials, the race over the
logits, then the log-probs' fp32 copy, gather and logsumexp) against kernels/sample.sample_rows
(rollout.kernel_options.fused_sampler: the inverse CDF in two Triton passes, each chunk's mass,
then one uniform per row and a scan of the chunk that holds it).

Per batch B (--batches) x --vocab bf16 logits and way (torch / fused, with and without log-probs,
fused with programmatic dependent launch): us per call eager (--reps back-to-back calls between
two CUDA events, launches included) and graphed (a CUDA graph of --reps calls, the torch way's
generator registered with it; median of 5 replays); the log-probs' largest difference from
log_softmax; the floor of reading the logits once at COPY_BW. Then the kernels' tiling (--chunks
x --blocks x --warps: ids per program of pass 1 and per scan of pass 2, ids per tile, warps per
program) graphed, for picking the defaults. JSON after every batch (benchmarks/run_record.py:
machine, versions, command; written atomically).

    python benchmarks/bench_sampler.py --out benchmarks/results/sampler_h200.json
    python benchmarks/bench_sampler.py --device cpu --vocab 1000 --batches 4 --reps 2 \\
        --chunks 1024 --blocks 256 --warps 4 --out /tmp/sampler.json  # CPU smoke (the twin)
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_decode_gemm import graph_us  # noqa: E402
from run_record import command, machine, versions, write_json  # noqa: E402

from hybridflow.kernels import sample as ks  # noqa: E402
from hybridflow.rollout.sampling import sample  # noqa: E402

COPY_BW = 4.3e12  # B/s, device-to-device copy measured on the H200 (bench_generate.COPY_BW)


def eager_us(fn, device, reps: int) -> float:
    fn()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) * 1e6 / reps
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / reps


def ways(logits, temperature: float, generator, state):
    """name -> (zero-argument call, generator to register): the ways a decode step draws."""
    kernels = "triton" if logits.is_cuda else "torch"

    def torch_way(lp):
        return lambda: sample(logits, temperature=temperature, generator=generator,
                              need_logprobs=lp, kernels=kernels)

    def fused_way(lp, pdl=False, **kw):
        return lambda: ks.sample_rows(logits, 1.0 / temperature, state, need_logprobs=lp,
                                      pdl=pdl, **kw)

    return {"torch": (torch_way(True), generator), "torch_no_lp": (torch_way(False), generator),
            "fused": (fused_way(True), None), "fused_no_lp": (fused_way(False), None),
            "fused_pdl": (fused_way(True, pdl=True), None)}, fused_way


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256, 512])
    ap.add_argument("--vocab", type=int, default=151936, help="Qwen2.5's true vocabulary")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--chunks", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--blocks", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="benchmarks/results/sampler_h200.json")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    report = dict(benchmark="decode sampling + log-probs: PyTorch sampler vs kernels/sample.py",
                  command=command(), machine=machine(), versions=versions("triton"),
                  vocab=args.vocab, temperature=args.temperature, dtype=str(dtype),
                  copy_bw_gbs=COPY_BW / 1e9, cases=[])
    for B in args.batches:
        g = torch.Generator(device=device).manual_seed(0)
        # logits of a trained LM's spread: most ids far below the top few
        logits = (torch.randn(B, args.vocab, generator=g, device=device) * 3).to(dtype)
        state = ks.new_rng_state(0, device)
        gen = torch.Generator(device=device).manual_seed(1)
        calls, fused_way = ways(logits, args.temperature, gen, state)
        case = dict(rows=B, read_floor_us=logits.nbytes / COPY_BW * 1e6, eager_us={},
                    graph_us={}, tiling_graph_us={})
        report["cases"].append(case)
        for name, (fn, reg) in calls.items():
            case["eager_us"][name] = eager_us(fn, device, args.reps)
            if device.type == "cuda":
                case["graph_us"][name] = graph_us(fn, args.reps, generator=reg)
        tok, lp = ks.sample_rows(logits, 1.0 / args.temperature, state)
        ref = torch.log_softmax(logits.float() / args.temperature, -1).gather(1, tok[:, None])
        case["fused_lp_err"] = (lp - ref.squeeze(1)).abs().max().item()
        for chunk, block, warps in itertools.product(args.chunks, args.blocks, args.warps):
            if chunk % block == 0:
                fn = fused_way(True, chunk=chunk, block=block, warps=warps)
                key = f"chunk{chunk}_block{block}_warps{warps}"
                case["tiling_graph_us"][key] = (graph_us(fn, args.reps)
                                                if device.type == "cuda"
                                                else eager_us(fn, device, args.reps))
        timed = case["graph_us"] or case["eager_us"]
        case["speedup"] = timed["torch"] / timed["fused"]
        case["speedup_no_lp"] = timed["torch_no_lp"] / timed["fused_no_lp"]
        print(f"B={B}: eager {fmt(case['eager_us'])}; graphed {fmt(case['graph_us'])}; "
              f"floor {case['read_floor_us']:.1f} us; fused x{case['speedup']:.2f} "
              f"(no lp x{case['speedup_no_lp']:.2f}); lp err {case['fused_lp_err']:.1e}; "
              f"tiling {fmt(case['tiling_graph_us'])}", flush=True)
        write_json(args.out, report)
    print(f"wrote {args.out}")


def fmt(d: dict) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in d.items())


if __name__ == "__main__":
    main()
