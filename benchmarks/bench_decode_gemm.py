"""The decode step's GEMMs (rows = the generation batch) three ways: cuBLAS as the decode layer calls
it today, cuBLASLt (torch.backends.cuda.preferred_blas_library), and inductor's max-autotune
(torch.compile mode "max-autotune-no-cudagraphs": its Triton GEMM templates, persistent/TMA ones
on Hopper included, and decompose-K, benchmarked against cuBLAS at each exact shape; the fastest
wins). Issue "Speed": generation at batch 256 >= 25% of the weight+KV read floor, where the decode
GEMMs are 808 of 1,434 us per step at Qwen2-0.5B (benchmarks/results/decode_profile_h200_fused_layer.json).

Per model x rows: the layer's QKV projection (+ bias), the attention output projection accumulated
into the residual (addmm), fc1, fc2, and the LM head; per GEMM and way: us per call (CUDA graph of
20 back-to-back calls, median of 5 replays), the compute floor at --peak-tflops and the weight-read
floor at --copy-bw, and the largest relative difference from cuBLAS's output. The inductor log
(which template won, at what time) goes to stderr. JSON after every GEMM. Back-to-back calls keep a
layer GEMM's weights (2-17 MB) in L2, so these times are ~1 us below the same kernels' inside a
decode step (profile_decode.py); the comparison between ways holds. Measured (H200, 2026-12-02):
cuBLAS the fastest everywhere within noise (benchmarks/results/decode_gemm_h200.json).

    python benchmarks/bench_decode_gemm.py --models qwen2_0_5b qwen2_1_5b --rows 256 64 \
        --out benchmarks/results/decode_gemm_h200.json
    python benchmarks/bench_decode_gemm.py --device cpu --models tiny --rows 4 --out /tmp/g.json  # smoke
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_generate import COPY_BW, machine  # noqa: E402
from gsm8k_hf_eval import write_json  # noqa: E402  (temp file + os.replace)

# name: (hidden, heads, groups, head_dim, ffn, vocab, layers)
MODELS = {"qwen2_0_5b": (896, 14, 2, 64, 4864, 151936, 24),
          "qwen2_1_5b": (1536, 12, 2, 128, 8960, 151936, 28), "tiny": (64, 4, 2, 16, 128, 512, 2)}
WAYS = ("cublas", "cublaslt", "autotune")


def graph_us(fn, reps: int = 20, replays: int = 5, generator=None) -> float:
    """us per call on CUDA: a CUDA graph of `reps` calls (after 3 warm-up calls on a side stream),
    median over `replays` replays; `generator` (a CUDA torch.Generator the calls draw from, or
    None) registered with the graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    if generator is not None:
        g.register_generator_state(generator)
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(times)


def gemms(model: str, rows: int, device, dtype):
    """name -> (fn, its args, multiply-adds): the calls of decoder._decode_step_fused."""
    D, H, G, hd, F_, V, _ = MODELS[model]
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, scale=0.02):
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype)

    qkv_out = (H + 2 * G) * hd
    x = rnd(rows, D, scale=1.0)
    return {
        "qkv": (lambda h, w, b: F.linear(h, w, b), (x, rnd(qkv_out, D), rnd(qkv_out)), rows * D * qkv_out),
        "proj": (lambda r, a, w: torch.addmm(r, a, w.t()), (x, rnd(rows, H * hd, scale=1.0), rnd(D, H * hd)),
                 rows * H * hd * D),
        "fc1": (lambda h, w: F.linear(h, w), (x, rnd(2 * F_, D)), rows * D * 2 * F_),
        "fc2": (lambda a, w: F.linear(a, w), (rnd(rows, F_, scale=1.0), rnd(D, F_)), rows * F_ * D),
        # fc2 accumulated in place into the residual (cuBLAS's beta = 1, as the proj): does cuBLAS
        # then keep its split-K, and its separate reduce kernel?
        "fc2_acc": (lambda a, w, r: r.addmm_(a, w.t()), (rnd(rows, F_, scale=1.0), rnd(D, F_), x.clone()),
                    rows * F_ * D),
        "lm_head": (lambda h, w: F.linear(h, w), (x, rnd(V, D)), rows * D * V),
    }


def timed(fn, device, reps: int = 20, replays: int = 5) -> float:
    """us per call: on CUDA graph_us's (a graph of `reps` calls, median of `replays`
    replays); on CPU the wall time of `reps` calls, median of `replays`."""
    if device.type == "cuda":
        return graph_us(fn, reps, replays)
    fn()
    t = []
    for _ in range(replays):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        t.append((time.perf_counter() - t0) * 1e6 / reps)
    return statistics.median(t)


def way_fn(way: str, fn, device):
    if way == "autotune":
        backend = "inductor" if device.type == "cuda" else "aot_eager"
        mode = "max-autotune-no-cudagraphs" if device.type == "cuda" else None
        return torch.compile(fn, backend=backend, mode=mode, dynamic=False, fullgraph=True)
    return fn


def run_way(way: str, fn, args, device):
    """(us per call, output) of one GEMM done one way."""
    lib = torch.backends.cuda.preferred_blas_library() if device.type == "cuda" else None
    try:
        if device.type == "cuda":
            torch.backends.cuda.preferred_blas_library("cublaslt" if way == "cublaslt" else "cublas")
        f = way_fn(way, fn, device)
        t0 = time.perf_counter()
        out = f(*args)  # compiles (and autotunes) here
        compile_s = time.perf_counter() - t0
        us = timed(lambda: f(*args), device)
        return us, out, compile_s
    finally:
        if lib is not None:
            torch.backends.cuda.preferred_blas_library(lib)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["qwen2_0_5b", "qwen2_1_5b"], choices=sorted(MODELS))
    ap.add_argument("--rows", type=int, nargs="+", default=[256, 64])
    ap.add_argument("--gemms", nargs="+", default=["qkv", "proj", "fc1", "fc2", "lm_head"],
                    help="among qkv proj fc1 fc2 fc2_acc lm_head (fc2_acc: not in the step sums)")
    ap.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak (H200: 989)")
    ap.add_argument("--out", default="benchmarks/results/decode_gemm_h200.json")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    report = dict(benchmark="decode GEMMs: cuBLAS vs cuBLASLt vs inductor max-autotune",
                  command=" ".join([os.path.basename(sys.executable)] + sys.argv), machine=machine(device),
                  peak_tflops=args.peak_tflops, copy_bw_gbs=COPY_BW / 1e9, cases=[])
    for model in args.models:
        for rows in args.rows:
            case = dict(model=model, rows=rows, gemms={})
            report["cases"].append(case)
            for name, (fn, gargs, macs) in gemms(model, rows, device, dtype).items():
                if name not in args.gemms:
                    continue
                w_bytes = gargs[1].numel() * gargs[1].element_size()
                res = dict(gflop=2 * macs / 1e9, compute_floor_us=2 * macs / (args.peak_tflops * 1e12) * 1e6,
                           weight_read_floor_us=w_bytes / COPY_BW * 1e6)
                ref = None
                for way in args.ways:
                    us, out, compile_s = run_way(way, fn, gargs, device)
                    if ref is None:
                        ref = out.float()
                    err = (float("nan") if name.endswith("_acc") else  # in place: each call adds
                           ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item())
                    res[way] = dict(us=us, tflops=2 * macs / us / 1e6, rel_err=err, first_call_s=compile_s)
                    print(f"{model} rows={rows} {name:8s} {way:9s} {us:8.2f} us "
                          f"({2 * macs / us / 1e6:6.1f} TFLOP/s, floor {res['compute_floor_us']:.2f} us "
                          f"compute / {res['weight_read_floor_us']:.2f} us read) err {err:.1e} "
                          f"first call {compile_s:.1f} s", flush=True)
                res["best"] = min(args.ways, key=lambda w: res[w]["us"])
                case["gemms"][name] = res
                write_json(args.out, report)
            layers = MODELS[model][-1]
            step = {n: g for n, g in case["gemms"].items() if n != "fc2_acc"}
            for way in args.ways:  # one decode step's GEMMs: the layers' and the LM head
                case[f"{way}_step_us"] = sum(g[way]["us"] * (1 if n == "lm_head" else layers)
                                             for n, g in step.items())
            case["best_step_us"] = sum(g[g["best"]]["us"] * (1 if n == "lm_head" else layers)
                                       for n, g in step.items())
            print(model, rows, {k: round(v) for k, v in case.items() if k.endswith("_step_us")}, flush=True)
            write_json(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
