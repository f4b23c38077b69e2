"""The GEMMs of one LoRA-adapted decoder layer's backward, timed one by one on the GPU, beside the
full-parameter weight gradients they replace: which way of computing the adapters' gradients (the
factor gradients reduce over every token of a micro-batch: skinny outputs, a long K) is fastest.

Per adapted linear of Qwen2.5-Coder-0.5B (qkv: 3 targeted parts, fc1: 2, o and fc2: 1), N tokens
(one packed micro-batch), rank r, bf16 inputs, fp32 main_grad:
  a_per_part   one mixed-dtype GEMM per A factor (gh's column slice^T @ x, fp32 out, beta = 1)
  a_stacked    one mixed-dtype GEMM for the stacked A factors into an fp32 temporary, added per part
  a_bf16       one bf16 GEMM for the stacked A factors, added per part (autograd + DDP's hook)
  a_splitk{c}  the stacked GEMM as c batched GEMMs over token chunks (fp32 out) and a sum
  b_per_part / b_stacked / b_splitk{c}   the same for the B factors (grad^T @ h)
  base_wgrad   the frozen weight's gradient a full-parameter update computes (reference)
Seconds per call are medians of --reps after a warm-up (CUDA events).

  python benchmarks/probe_lora_gemms.py --out /tmp/lora_gemms.json        # one H200, ~20 s
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.run_record import command, machine, versions, write_json  # noqa: E402

# name: (in, out, targeted parts as (rows, ) in output order)
LINEARS = {"qkv": (896, 1152, (896, 128, 128)), "o": (896, 896, (896,)),
           "fc1": (896, 9728, (4864, 4864)), "fc2": (4864, 896, (896,))}


def timed(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def mixed(out, a, b):
    """out (fp32) += a @ b (bf16)."""
    torch.addmm(out, a, b, out_dtype=torch.float32, out=out)


def splitk(a_t, b, c):
    """a_t (M, N)^T-view product summed over c token chunks: (M, K) fp32."""
    n = a_t.shape[1] // c * c
    left = a_t[:, :n].reshape(a_t.shape[0], c, -1).transpose(0, 1)        # (c, M, N/c)
    right = b[:n].reshape(c, -1, b.shape[1])                              # (c, N/c, K)
    return torch.bmm(left, right, out_dtype=torch.float32).sum(0)


def probe(name: str, tokens: int, rank: int, reps: int, chunks: tuple) -> dict:
    d_in, d_out, parts = LINEARS[name]
    k = len(parts)
    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(tokens, d_in, device=dev, dtype=bf)
    grad = torch.randn(tokens, d_out, device=dev, dtype=bf)
    gh = torch.randn(tokens, k * rank, device=dev, dtype=bf)
    h = torch.randn(tokens, k * rank, device=dev, dtype=bf)
    a_main = [torch.zeros(rank, d_in, device=dev) for _ in parts]
    b_main = [torch.zeros(rows, rank, device=dev) for rows in parts]
    w_main = torch.zeros(d_out, d_in, device=dev)
    offs = [sum(parts[:j]) for j in range(k)]

    def a_per_part():
        for j in range(k):
            mixed(a_main[j], gh[:, j * rank:(j + 1) * rank].t(), x)

    def a_stacked():
        tmp = torch.mm(gh.t(), x, out_dtype=torch.float32)
        for j in range(k):
            a_main[j].add_(tmp[j * rank:(j + 1) * rank])

    def a_bf16():
        tmp = gh.t().mm(x)
        for j in range(k):
            a_main[j].add_(tmp[j * rank:(j + 1) * rank])

    def b_per_part():
        for j in range(k):
            mixed(b_main[j], grad[:, offs[j]:offs[j] + parts[j]].t(), h[:, j * rank:(j + 1) * rank])

    def b_stacked():
        tmp = torch.mm(grad.t(), h, out_dtype=torch.float32)
        for j in range(k):
            b_main[j].add_(tmp[offs[j]:offs[j] + parts[j], j * rank:(j + 1) * rank])

    def base_wgrad():
        mixed(w_main, grad.t(), x)

    fns = {"a_per_part": a_per_part, "a_stacked": a_stacked, "a_bf16": a_bf16,
           "b_per_part": b_per_part, "b_stacked": b_stacked, "base_wgrad": base_wgrad}
    for c in chunks:
        fns[f"a_splitk{c}"] = lambda c=c: [a_main[j].add_(t) for j, t in
                                           enumerate(splitk(gh.t(), x, c).split(rank))]
        fns[f"b_splitk{c}"] = lambda c=c: splitk(grad.t(), h, c)
    out = {}
    for n, f in fns.items():
        try:
            out[n] = timed(f, reps)
        except (RuntimeError, TypeError) as e:  # a variant this torch lacks (out_dtype)
            print(f"{name} {n}: {e}", file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=18851, help="one micro-batch (GSM8K: 207k / 11)")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--chunks", default="4,8,16")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    chunks = tuple(int(c) for c in args.chunks.split(","))
    results = {n: probe(n, args.tokens, args.rank, args.reps, chunks) for n in LINEARS}
    for n, r in results.items():
        print(n, "  ".join(f"{k} {v * 1e6:.0f}us" for k, v in r.items()))
    write_json(args.out, {"benchmark": "LoRA factor-gradient GEMMs, one layer's linears",
                          "tokens": args.tokens, "rank": args.rank, "machine": machine(),
                          "versions": versions(), "command": command(), "seconds": results})


if __name__ == "__main__":
    main()
