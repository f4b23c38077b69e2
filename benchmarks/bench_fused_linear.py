"""Tile sweep of benchmarks/fused_linear_triton.fused_linear (an experiment; it lost to cuBLAS) at
the decode shapes, against what a decode layer runs today (rollout.compile_decode: inductor's norm /
SwiGLU / residual kernels around cuBLAS GEMMs).

For each model shape x batch (rows M): the four GEMMs of a TP = 1 decode layer (QKV with its RMSNorm
and bias; the output projection + residual; fc1 with its RMSNorm and SwiGLU; fc2 + residual), each
over a grid of tile configs; per GEMM the best config's time beside cuBLAS's bare F.linear, and the
layer's GEMM work both ways: today's two compiled parts (decoder._qkv, decoder._attn_out_split)
against the four fused kernels with the best configs, and the largest relative difference of their
outputs (bf16). Times: CUDA graphs of 20 back-to-back calls, median of 5 replays, per call.
`--prefill` adds the prefill's attention: SDPA with K/V repeated per head against `enable_gqa`.

    python benchmarks/bench_fused_linear.py --out benchmarks/results/fused_linear_h200.json
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_generate import machine  # noqa: E402
from gsm8k_hf_eval import write_json  # noqa: E402  (temp file + os.replace)
import fused_linear_triton as lin  # noqa: E402
from hybridflow.rollout import decoder  # noqa: E402

# (name, hidden, heads, groups, head_dim, ffn)
MODELS = {"qwen2_0_5b": (896, 14, 2, 64, 4864), "qwen2_1_5b": (1536, 12, 2, 128, 8960)}


def timed(fn, reps: int = 20, replays: int = 5) -> float:
    """us per call: CUDA graph of `reps` calls, median over `replays` replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
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


def grid(kind: str, M: int):
    """A small grid around what the first sweeps showed: wide N tiles with split-K for the
    column-parallel GEMMs (an A tile is as large as a W tile at decode's rows), narrower ones for
    the residual GEMMs."""
    bns = {"swiglu": [128, 256], "norm": [64, 128], "res": [32, 64, 128]}[kind]
    splits = {"swiglu": [2, 4], "norm": [2, 4, 8], "res": [2, 4, 8]}[kind]
    for bn, (bk, st), sp in itertools.product(bns, [(64, 4), (128, 3)], splits):
        for wp in ([4, 8] if kind == "swiglu" else [4]):
            yield lin.Config(64, bn, bk, sp, wp, st)


def sweep(kind: str, M: int, call) -> dict:
    rows = []
    for c in grid(kind, M):
        try:
            rows.append((timed(lambda: call(c)), c))
        except Exception as e:  # noqa: BLE001  (out of shared memory etc.: skip the config)
            print(f"  skip {c}: {type(e).__name__}: {str(e)[:80]}", flush=True)
    rows.sort(key=lambda r: r[0])
    return {"best_us": rows[0][0], "best": rows[0][1]._asdict(),
            "top5": [{"us": t, **c._asdict()} for t, c in rows[:5]], "tried": len(rows)}


def case(model: str, M: int) -> dict:
    D, H, G, hd, ffn = MODELS[model]
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    mk = lambda *s, scale=0.02: (torch.randn(*s, device=dev) * scale).to(dt)  # noqa: E731
    qkv_rows = G * (H // G + 2) * hd
    x, y = mk(M, D, scale=1.0), mk(M, D, scale=1.0)
    a = mk(M, H * hd, scale=1.0)
    ln1, ln2 = 1 + mk(D), 1 + mk(D)
    qkv_w, qkv_b, proj = mk(qkv_rows, D), mk(qkv_rows), mk(D, H * hd)
    fc1, fc2 = mk(2 * ffn, D), mk(D, ffn)
    act = mk(M, ffn, scale=1.0)
    eps = 1e-6
    calls = {
        "qkv": ("norm", lambda c: lin.fused_linear(x, qkv_w, norm_weight=ln1, eps=eps, bias=qkv_b,
                                                   cfg=c),
                lambda: F.linear(x, qkv_w, qkv_b)),
        "proj": ("res", lambda c: lin.fused_linear(a, proj, residual=x, cfg=c),
                 lambda: F.linear(a, proj)),
        "fc1": ("swiglu", lambda c: lin.fused_linear(x, fc1, norm_weight=ln2, eps=eps, swiglu=True,
                                                     cfg=c),
                lambda: F.linear(x, fc1)),
        "fc2": ("res", lambda c: lin.fused_linear(act, fc2, residual=x, cfg=c),
                lambda: F.linear(act, fc2)),
    }
    out = {"model": model, "rows": M, "gemms": {}}
    best = {}
    for name, (kind, call, cublas) in calls.items():
        r = sweep(kind, M, call)
        r["cublas_linear_us"] = timed(cublas)
        best[name] = lin.Config(**r["best"])
        out["gemms"][name] = r
        print(f"{model} M={M} {name:5s} fused {r['best_us']:7.2f} us  cuBLAS bare "
              f"{r['cublas_linear_us']:7.2f} us  best {r['best']}", flush=True)
    # the decode layer of that session (rollout.compile_decode's inductor parts around cuBLAS);
    # since then decode_kernels=triton runs kernels.decode's norm / SwiGLU kernels instead
    qkv_fn, attn_out = (torch.compile(f, dynamic=True)
                        for f in (decoder._qkv, decoder._attn_out_split))
    shape = (G, H // G + 2, hd)
    today = lambda: (qkv_fn(x, y, ln1, qkv_w, qkv_b, eps, shape),  # noqa: E731
                     attn_out(x, a, proj, ln2, fc1, fc2, eps))

    def fused():
        q = lin.fused_linear(x, qkv_w, norm_weight=ln1, eps=eps, bias=qkv_b, cfg=best["qkv"])
        h = lin.fused_linear(a, proj, residual=x, cfg=best["proj"])
        m = lin.fused_linear(h, fc1, norm_weight=ln2, eps=eps, swiglu=True, cfg=best["fc1"])
        return q, h, m, lin.fused_linear(m, fc2, residual=h, cfg=best["fc2"])

    out["today_layer_us"] = timed(today)
    out["fused_layer_us"] = timed(fused)
    # outputs: today's (x + y is the layer input there; here the fused path gets x itself)
    q_ref = F.linear(F.rms_norm(x, (D,), ln1, eps), qkv_w, qkv_b)
    h_ref, m_ref = decoder._attn_out_split(x, a, proj, ln2, fc1, fc2, eps)
    q, h, _, o = fused()
    rel = lambda u, v: float((u.float() - v.float()).abs().max() / v.float().abs().max())  # noqa
    out["rel_err"] = {"qkv": rel(q, q_ref), "h": rel(h, h_ref), "out": rel(o, h_ref + m_ref)}
    print(f"{model} M={M} layer: today {out['today_layer_us']:.1f} us, fused "
          f"{out['fused_layer_us']:.1f} us; rel err {out['rel_err']}", flush=True)
    return out


def prefill_attention(B: int, S: int, H: int, G: int, hd: int) -> dict:
    dev, dt = torch.device("cuda"), torch.bfloat16
    q = torch.randn(B, H, S, hd, device=dev, dtype=dt)
    cache = torch.randn(2, B, G, S + 64, hd, device=dev, dtype=dt)
    k, v = cache[0, :, :, :S], cache[1, :, :, :S]
    valid = torch.ones(B, S, dtype=torch.bool, device=dev)
    valid[::2, :S // 4] = False
    causal = torch.ones(S, S, dtype=torch.bool, device=dev).tril()
    mask = ((causal & valid[:, None, :]) | torch.eye(S, dtype=torch.bool, device=dev))[:, None]
    hpg = H // G
    rep = lambda: F.scaled_dot_product_attention(  # noqa: E731
        q, k.repeat_interleave(hpg, 1), v.repeat_interleave(hpg, 1), attn_mask=mask)
    gqa = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # noqa
    r = {"B": B, "S": S, "repeat_us": timed(rep, reps=5), "gqa_us": timed(gqa, reps=5),
         "max_diff": float((rep() - gqa()).abs().max())}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for name, be in (("efficient", SDPBackend.EFFICIENT_ATTENTION),
                     ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel(be):
                r[f"gqa_{name}_us"] = timed(gqa, reps=5)
        except Exception as e:  # noqa: BLE001
            r[f"gqa_{name}_us"] = f"{type(e).__name__}: {str(e)[:100]}"
    print("prefill attention", r, flush=True)
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", default=["qwen2_1_5b:64", "qwen2_0_5b:256"],
                   help="model:rows")
    p.add_argument("--prefill", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    res = {"machine": machine(torch.device("cuda")), "command": " ".join(sys.argv), "cases": []}
    for c in args.cases:  # the file is rewritten after each case (a cut-off run keeps its cases)
        model, rows = c.split(":")
        res["cases"].append(case(model, int(rows)))
        write_json(args.out, res)
    if args.prefill:
        res["prefill_attention"] = [prefill_attention(64, 128, 14, 2, 64),
                                    prefill_attention(256, 128, 14, 2, 64)]
        write_json(args.out, res)


if __name__ == "__main__":
    main()
