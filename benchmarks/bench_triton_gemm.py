"""The decode layer's GEMMs as Triton GEMMs with their neighbours in the epilogue (kernels/gemm.py)
against what the layer runs without them, per tile config:

- fc1: swiglu_linear vs cuBLAS's fc1 (F.linear) + the SwiGLU kernel (kernels.layer_ops.silu_mul);
- qkv: linear with the bias vs F.linear with it;
- proj: linear accumulated into the residual in place vs addmm_ (cuBLAS, beta = 1);
- fc2: linear with split-K (the reduction in the kernel) vs F.linear (cuBLAS: split-K + its
  reduce kernel).

Per model x rows M (decode batches; a prefill sub-batch of tokens for fc1): a grid of tile configs,
each timed as a CUDA graph of 20 back-to-back calls (median of 5 replays, per call;
bench_fused_linear.timed), the best five listed beside today's time, and the largest difference of
the best config's output from today's (bf16, relative to its largest value). JSON after every case.
`--configs` restricts the grid (a quick re-check). Measured first as bench_swiglu_gemm.py (fc1
only): benchmarks/results/swiglu_gemm_h200.json.

    python benchmarks/bench_triton_gemm.py --gemms fc1 qkv proj --rows 256 --out benchmarks/results/triton_gemm_h200.json
    python benchmarks/bench_triton_gemm.py --gemms fc1 --rows 256 16384 --configs 64,64,64,4,3
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
from bench_fused_linear import timed  # noqa: E402  (CUDA graph of 20 calls, median of 5)
from bench_generate import machine  # noqa: E402
from gsm8k_hf_eval import write_json  # noqa: E402  (temp file + os.replace)
from hybridflow.kernels import layer_ops as kern  # noqa: E402
from hybridflow.kernels.gemm import Config, linear, swiglu_linear  # noqa: E402

# name: (hidden, heads, groups, head_dim, ffn)
MODELS = {"qwen2_0_5b": (896, 14, 2, 64, 4864), "qwen2_1_5b": (1536, 12, 2, 128, 8960),
          "qwen2_7b": (3584, 28, 4, 128, 18944)}


def grid(M: int, gemm: str = "fc1"):
    """Tiles for decode's few rows (narrow tiles: enough programs) and for the prefill's many;
    fc2 (K = the FFN width over few output tiles) with split-K."""
    if gemm == "fc2":
        tiles = [(32, 64), (64, 32), (64, 64), (64, 128), (128, 64)]
        for (bm, bn), bk, (w, s), sp in itertools.product(tiles, [64, 128], [(4, 3), (4, 4)],
                                                          [2, 4, 8]):
            yield Config(bm, bn, bk, w, s, 8, sp)
        return
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


def calls(gemm: str, model: str, M: int):
    """(today's call, the Triton call of a config, the Triton output's check, flop) for one GEMM."""
    D, H, G, hd, ffn = MODELS[model]
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(dev, dt)  # noqa: E731
    if gemm == "fc1":
        h, fc1 = rnd(M, D), rnd(2 * ffn, D, scale=0.03)
        return (lambda: kern.silu_mul(F.linear(h, fc1), impl="triton"),
                lambda c: swiglu_linear(h, fc1, cfg=c, impl="triton"), 2 * M * D * 2 * ffn)
    if gemm == "qkv":
        n = (H + 2 * G) * hd
        h, w, b = rnd(M, D), rnd(n, D, scale=0.03), rnd(n)
        return (lambda: F.linear(h, w, b), lambda c: linear(h, w, b, cfg=c, impl="triton"),
                2 * M * D * n)
    if gemm == "fc2":
        act, fc2 = rnd(M, ffn), rnd(D, ffn, scale=0.01)
        return (lambda: F.linear(act, fc2), lambda c: linear(act, fc2, cfg=c, impl="triton"),
                2 * M * ffn * D)
    a, w, x = rnd(M, H * hd), rnd(D, H * hd, scale=0.03), rnd(M, D)
    # in place, as the decode step runs them: the residual drifts over the timed calls, harmless
    return (lambda: x.addmm_(a, w.t()), lambda c: linear(a, w, out=x, cfg=c, impl="triton"),
            2 * M * H * hd * D)


def case(gemm: str, model: str, M: int, configs) -> dict:
    today_fn, triton_fn, flop = calls(gemm, model, M)
    today = timed(today_fn)
    rows = []
    for c in configs or grid(M, gemm):
        try:
            rows.append((timed(lambda: triton_fn(c)), c))
        except Exception as e:  # noqa: BLE001  (out of shared memory / registers: skip it)
            print(f"  skip {tuple(c)}: {type(e).__name__}: {str(e)[:80]}", flush=True)
    rows.sort(key=lambda r: r[0])
    best_us, best = rows[0]
    today_fn2, triton_fn2, _ = calls(gemm, model, M)  # fresh operands (proj accumulated in place)
    ref, out = today_fn2().float().clone(), None
    today_fn2, triton_fn2, _ = calls(gemm, model, M)
    out = triton_fn2(best).float()
    err = float((out - ref).abs().max() / ref.abs().max())
    res = {"gemm": gemm, "model": model, "rows": M, "today_us": today, "triton_best_us": best_us,
           "best": best._asdict(), "speedup": today / best_us, "triton_tflops": flop / best_us / 1e6,
           "rel_err_vs_today": err, "tried": len(rows),
           "top5": [{"us": t, **c._asdict()} for t, c in rows[:5]]}
    print(f"{gemm:4s} {model} M={M}: today {today:.2f} us, Triton {best_us:.2f} us {tuple(best)} = "
          f"{res['speedup']:.2f}x, {res['triton_tflops']:.0f} TFLOP/s, rel err {err:.1e}", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gemms", nargs="+", default=["fc1", "qkv", "proj", "fc2"],
                    choices=["fc1", "qkv", "proj", "fc2"])
    ap.add_argument("--models", nargs="+", default=["qwen2_0_5b"], choices=sorted(MODELS))
    ap.add_argument("--rows", type=int, nargs="+", default=[256])
    ap.add_argument("--configs", nargs="*", default=None,
                    help="block_m,block_n,block_k,warps,stages[,group_m[,split]] each (default: the "
                         "grid)")
    ap.add_argument("--out", default="benchmarks/results/triton_gemm_h200.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_triton_gemm needs a CUDA device")
    configs = [Config(*map(int, c.split(","))) for c in args.configs] if args.configs else None
    report = {"benchmark": "decode GEMMs: Triton with epilogues (kernels/gemm.py) vs cuBLAS + kernels",
              "machine": machine(torch.device("cuda")),
              "command": " ".join([sys.executable] + sys.argv), "cases": []}
    for gemm, model, M in itertools.product(args.gemms, args.models, args.rows):
        report["cases"].append(case(gemm, model, M, configs))
        write_json(args.out, report)


if __name__ == "__main__":
    main()
