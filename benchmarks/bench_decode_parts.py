"""A decode layer's non-GEMM parts, ours against inductor's, at the speed issue's decode shapes (GPU).

Per shape (rows, hidden, ffn of Qwen2-0.5B / 1.5B at batch 64 / 256), each part is captured 20
times back to back in one CUDA graph and replayed (median of 7 replays, after warm-up), as a
decode step runs them:
- residual sum + RMSNorm: kernels.layer_ops.add_rms_norm against torch.compile of (x + y,
  F.rms_norm) (the compiled decode's `triton_red_fused__fused_rms_norm_add` kernel), and the
  norm alone;
- SwiGLU: kernels.layer_ops.silu_mul against torch.compile of F.silu(gate) * up;
- the attention output's projection with the residual: x.addmm_(a, W^T) in place against the
  compiled x + F.linear(a, W) (an out-of-place addmm: a copy of x, then the GEMM).

  python benchmarks/bench_decode_parts.py --out benchmarks/results/decode_parts_h200.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_fused_linear import timed  # noqa: E402
from bench_generate import machine  # noqa: E402
from gsm8k_hf_eval import write_json  # noqa: E402
from hybridflow.kernels import layer_ops as kern  # noqa: E402

SHAPES = {"0.5b_64": (64, 896, 4864), "0.5b_256": (256, 896, 4864),
          "1.5b_64": (64, 1536, 8960), "1.5b_256": (256, 1536, 8960)}
CALLS, REPLAYS = 20, 7


def graph_us(fn) -> float:
    """Microseconds per call of fn, captured CALLS times in one graph, median over REPLAYS."""
    return timed(fn, reps=CALLS, replays=REPLAYS)


def _add_norm(x, y, w):
    h = x + y
    return h, F.rms_norm(h, (h.shape[-1],), w, 1e-6)


def _norm(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, 1e-6)


def _swiglu(z):
    gate, up = z.chunk(2, dim=-1)
    return F.silu(gate) * up


def _proj_add(x, a, w):
    return x + F.linear(a, w)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_decode_parts needs a GPU")
    kw = dict(dynamic=True)
    compiled = {f.__name__: torch.compile(f, **kw) for f in (_add_norm, _norm, _swiglu, _proj_add)}
    dt, dev = torch.bfloat16, "cuda"
    report = {"machine": machine(torch.device(dev)),
              "command": " ".join([sys.executable] + sys.argv),
              "timing": f"{CALLS} calls per CUDA graph, median of {REPLAYS} replays, us per call",
              "shapes": {}}
    for name in args.shapes:
        N, D, Fh = SHAPES[name]
        x, y = torch.randn(N, D, device=dev, dtype=dt), torch.randn(N, D, device=dev, dtype=dt)
        w = torch.rand(D, device=dev, dtype=dt) + 0.5
        z = torch.randn(N, 2 * Fh, device=dev, dtype=dt)
        a = torch.randn(N, D, device=dev, dtype=dt)
        wp = torch.randn(D, D, device=dev, dtype=dt) / D ** 0.5
        res = {
            "add_rms_norm": {
                "ours": graph_us(lambda: kern.add_rms_norm(x, y, w, 1e-6, impl="triton")),
                "inductor": graph_us(lambda: compiled["_add_norm"](x, y, w))},
            "rms_norm": {
                "ours": graph_us(lambda: kern.add_rms_norm(x, None, w, 1e-6, impl="triton")),
                "inductor": graph_us(lambda: compiled["_norm"](x, w))},
            "silu_mul": {
                "ours": graph_us(lambda: kern.silu_mul(z, impl="triton")),
                "inductor": graph_us(lambda: compiled["_swiglu"](z))},
            "proj_residual": {
                "in_place_addmm": graph_us(lambda: x.addmm_(a, wp.t())),
                "inductor": graph_us(lambda: compiled["_proj_add"](x, a, wp)),
                "gemm_alone": graph_us(lambda: F.linear(a, wp))},
        }
        report["shapes"][name] = {"rows": N, "hidden": D, "ffn": Fh, "us": res}
        print(name, {k: {kk: round(vv, 2) for kk, vv in v.items()} for k, v in res.items()},
              flush=True)
        write_json(args.out, report)


if __name__ == "__main__":
    main()
