"""Tile sweep of the decode layer's fc1 + SwiGLU Triton GEMM (kernels/gemm.swiglu_linear) against what
the layer runs without it: cuBLAS's fc1 (F.linear) + the SwiGLU kernel (kernels.layer_ops.silu_mul).

Per model x rows M (decode batches; a prefill sub-batch of tokens): a grid of tile configs, each
timed as a CUDA graph of 20 back-to-back calls (median of 5 replays, per call;
bench_decode_gemm.graph_us), the best five listed beside cuBLAS's time, and the largest difference
of the best config's output from cuBLAS's (bf16, relative to its largest value). JSON after every
case. The best configs are what kernels/gemm.CONFIGS should hold for that GPU; `--configs`
restricts the grid (a quick re-check). Its rows threshold is rollout.kernel_options.
swiglu_gemm_min_rows (an A/B of the whole call: bench_generate.py --swiglu-gemm-min-rows).

    python benchmarks/bench_triton_gemm.py --rows 256 16384 --out benchmarks/results/triton_gemm_h200.json
    python benchmarks/bench_triton_gemm.py --rows 256 --configs 64,64,64,4,3
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_decode_gemm import graph_us  # noqa: E402  (CUDA graph of 20 calls, median of 5)
from bench_generate import machine  # noqa: E402
from gsm8k_hf_eval import write_json  # noqa: E402  (temp file + os.replace)
from hybridflow.kernels import layer_ops as kern  # noqa: E402
from hybridflow.kernels.gemm import Config, swiglu_linear  # noqa: E402

# name: (hidden, ffn)
MODELS = {"qwen2_0_5b": (896, 4864), "qwen2_1_5b": (1536, 8960), "qwen2_7b": (3584, 18944)}


def grid(M: int):
    """Tiles for decode's few rows (narrow tiles: enough programs) and for the prefill's many."""
    if M <= 512:
        tiles = [(32, 64), (64, 32), (64, 64), (64, 128), (128, 32), (128, 64), (128, 128),
                 (256, 64)]
        ws = [(4, 3), (4, 4), (8, 4)]
    else:
        tiles = [(128, 64), (128, 128), (256, 64), (128, 256)]
        ws = [(4, 3), (8, 3), (8, 4)]
    for (bm, bn), bk, (w, s) in itertools.product(tiles, [64, 128], ws):
        if bm <= max(16, M) * 2:
            yield Config(bm, bn, bk, w, s)


def case(model: str, M: int, configs) -> dict:
    D, ffn = MODELS[model]
    g = torch.Generator(device="cpu").manual_seed(0)
    h = torch.randn(M, D, generator=g).to("cuda", torch.bfloat16)
    fc1 = (torch.randn(2 * ffn, D, generator=g) * 0.03).to("cuda", torch.bfloat16)
    cublas = lambda: kern.silu_mul(F.linear(h, fc1), impl="triton")  # noqa: E731
    today = graph_us(cublas)
    rows = []
    for c in configs or grid(M):
        try:
            rows.append((graph_us(lambda: swiglu_linear(h, fc1, cfg=c, impl="triton")), c))
        except Exception as e:  # noqa: BLE001  (out of shared memory / registers: skip it)
            print(f"  skip {tuple(c)}: {type(e).__name__}: {str(e)[:80]}", flush=True)
    rows.sort(key=lambda r: r[0])
    best_us, best = rows[0]
    ref, out = cublas().float(), swiglu_linear(h, fc1, cfg=best, impl="triton").float()
    err = float((out - ref).abs().max() / ref.abs().max())
    flop = 2 * M * D * 2 * ffn
    res = {"gemm": "fc1", "model": model, "rows": M, "today_us": today, "triton_best_us": best_us,
           "best": best._asdict(), "speedup": today / best_us, "triton_tflops": flop / best_us / 1e6,
           "rel_err_vs_today": err, "tried": len(rows),
           "top5": [{"us": t, **c._asdict()} for t, c in rows[:5]]}
    print(f"fc1 {model} M={M}: cuBLAS + silu_mul {today:.2f} us, Triton {best_us:.2f} us "
          f"{tuple(best)} = {res['speedup']:.2f}x, {res['triton_tflops']:.0f} TFLOP/s, "
          f"rel err {err:.1e}", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["qwen2_0_5b"], choices=sorted(MODELS))
    ap.add_argument("--rows", type=int, nargs="+", default=[256])
    ap.add_argument("--configs", nargs="*", default=None,
                    help="block_m,block_n,block_k,warps,stages[,group_m] each (default: the grid)")
    ap.add_argument("--out", default="benchmarks/results/triton_gemm_h200.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_triton_gemm needs a CUDA device")
    configs = [Config(*map(int, c.split(","))) for c in args.configs] if args.configs else None
    report = {"benchmark": "fc1 + SwiGLU: Triton GEMM (kernels/gemm.py) vs cuBLAS + silu_mul",
              "machine": machine(torch.device("cuda")),
              "command": " ".join([sys.executable] + sys.argv), "cases": []}
    for model, M in itertools.product(args.models, args.rows):
        report["cases"].append(case(model, M, configs))
        write_json(args.out, report)


if __name__ == "__main__":
    main()
