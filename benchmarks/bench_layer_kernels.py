"""The training passes' per-layer kernels as the trainer runs them against quack-kernels', one GPU.

The gated MLP. The trainer's (Megatron's MLP over our linears, `parallel.fused_elementwise`): fc1
as one GEMM, Megatron's compiled SwiGLU kernel, fc2 as one GEMM, each weight gradient accumulated
into its fp32 `main_grad` by the wgrad GEMM (`parallel.gradient_accumulation_fusion`).
quack-kernels (flash-attn-4's dependency, installed with it; `parallel.mlp_kernel=quack`) fuses
the SwiGLU into fc1's epilogue in the forward and its derivative into the epilogue of fc2's
input-gradient GEMM in the backward (`quack.mlp.mlp_func`, `concat_layout=True`: fc1's weight as
Megatron stores it, [gate; up]), and keeps fc1's output instead of the SwiGLU's (fc2's weight
gradient recomputes it inside that epilogue). Its weight gradients come back in `.grad` (bf16) and
are added into `main_grad`, as Megatron's DDP hook does for a layer without the fusion; the timing
includes that add.

The RMSNorm. The trainer's: torch's `nn.RMSNorm` (models/build.py TorchRMSNorm); quack's:
`quack.rmsnorm.rmsnorm` (one kernel each way, the weight gradient reduced per SM in the backward).

Per kernel, shape and token count: forward-only (the ref pass) and forward + backward (the update)
seconds (median of --iters after --warmup), and each side's error against an fp32 reference of the
same inputs and weights (output, input gradient, weight gradients; relative to the reference's
largest magnitude): for the MLP, the check that quack reads the [gate; up] halves as Megatron does.
The MLP's `quack` is what `parallel.mlp_kernel=quack` runs (`tuned=False`: quack's heuristic tile
configurations; its autotuner keys on the operands' shapes, and packed micro-batches change the
token count every time); `quack_tuned` is autotuned for each fixed shape here, the bound of what
tuning could add. Without a GPU (or without quack) the quack sides are recorded as skipped.

  python benchmarks/bench_layer_kernels.py --out benchmarks/results/layer_kernels_h100.json
  python benchmarks/bench_layer_kernels.py --device cpu --model tiny --tokens 64 --iters 1 \\
      --out /tmp/layer.json  # CPU smoke: the trainer's sides only
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.run_record import command, machine, versions, write_json  # noqa: E402


def _timed(fn, iters: int, warmup: int, cuda: bool) -> float:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _reference(x, w1, w2, dout):
    """fp32 SwiGLU MLP: out, dx, dw1, dw2 (fc1's rows are [gate; up], as Megatron stores them)."""
    x, w1, w2 = (t.detach().float().requires_grad_() for t in (x, w1, w2))
    gate, up = F.linear(x, w1).chunk(2, dim=-1)
    out = F.linear(F.silu(gate) * up, w2)
    out.backward(dout.float())
    return out.detach(), x.grad, w1.grad, w2.grad


def _rel_err(got, ref) -> float:
    return float((got.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _quack(module: str, name: str):
    try:
        return getattr(__import__(module, fromlist=[name]), name), None
    except Exception as e:  # noqa: BLE001 - any import failure means: not here
        return None, f"quack-kernels not importable: {type(e).__name__}: {e}"


def _rmsnorm_rows(hidden: int, tokens: int, device, dtype, iters: int, warmup: int,
                  cuda: bool, quack_rmsnorm, skipped) -> dict:
    """torch's RMSNorm (the trainer's) against quack's: forward, forward + backward, errors."""
    g = torch.Generator(device=device).manual_seed(tokens + hidden)
    x = torch.randn(tokens, hidden, generator=g, device=device, dtype=dtype).requires_grad_()
    dout = torch.randn(x.shape, generator=g, device=device, dtype=dtype)
    norm = torch.nn.RMSNorm(hidden, eps=1e-6, device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(hidden, generator=g, device=device))
    x32, w32 = (t.detach().float().requires_grad_() for t in (x, norm.weight))
    ref = F.rms_norm(x32, (hidden,), w32, eps=1e-6)
    ref.backward(dout.float())
    sides = {"trainer": lambda: norm(x)}
    if quack_rmsnorm is not None:
        sides["quack"] = lambda: quack_rmsnorm(x, norm.weight, eps=1e-6)
    row = {} if quack_rmsnorm is not None else {"quack": {"skipped": skipped}}
    for side, fn in sides.items():
        def fwd():
            with torch.no_grad():
                fn()

        def fwd_bwd():
            x.grad = norm.weight.grad = None
            fn().backward(dout)

        fwd_bwd()
        err = {"out": _rel_err(fn().detach(), ref.detach()), "dx": _rel_err(x.grad, x32.grad),
               "dw": _rel_err(norm.weight.grad, w32.grad)}
        row[side] = {"forward_s": _timed(fwd, iters, warmup, cuda),
                     "forward_backward_s": _timed(fwd_bwd, iters, warmup, cuda), "rel_err": err}
    return dict(sorted(row.items(), key=lambda kv: kv[0] != "trainer"))


def _line(row: dict) -> str:
    return "  ".join(f"{k} fwd {v['forward_s'] * 1e3:.2f} ms fwd+bwd "
                     f"{v['forward_backward_s'] * 1e3:.2f} ms "
                     f"err {max(v['rel_err'].values()):.1e}"
                     if "skipped" not in v else f"{k} skipped" for k, v in row.items())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", nargs="+", default=["qwen2_5_coder_0_5b", "qwen2_1_5b"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[20480, 40960],
                    help="rows of one packed micro-batch (the recipe's update and ref budgets)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)

    from hybridflow.cost.shapes import load_shape
    from hybridflow.models.build import build_model
    from hybridflow.models.linear import LeanColumnParallelLinear, LeanRowParallelLinear
    from hybridflow.parallel import groups

    cuda = a.device == "cuda"
    groups.init_distributed()
    ctx = groups.init_model_parallel(tp=1, pp=1, seed=1)
    precision = "bf16" if cuda else "fp32"
    mlp_func, skipped = _quack("quack.mlp", "mlp_func") if cuda else (None, "needs a CUDA GPU")
    quack_rmsnorm = _quack("quack.rmsnorm", "rmsnorm")[0] if cuda else None
    results = {}
    for name in a.model:
        shape = dataclasses.replace(load_shape(name), num_layers=1, attention_backend="sdpa")
        model = build_model(shape, role="actor", ctx=ctx, precision=precision,
                            fused_elementwise=True)
        mlp = model.decoder.layers[0].mlp
        w1, w2 = mlp.linear_fc1.weight, mlp.linear_fc2.weight
        for linear in (mlp.linear_fc1, mlp.linear_fc2):
            if type(linear) in (LeanColumnParallelLinear, LeanRowParallelLinear):
                linear.fuse_wgrad = True  # as the Engine sets it under DDP
            linear.weight.main_grad = torch.zeros_like(linear.weight, dtype=torch.float32)
        for tokens in a.tokens:
            g = torch.Generator(device=ctx.device).manual_seed(tokens)
            x = torch.randn(tokens, 1, shape.hidden_size, generator=g, device=ctx.device,
                            dtype=w1.dtype).requires_grad_()
            dout = torch.randn(x.shape, generator=g, device=ctx.device, dtype=w1.dtype) * 1e-2
            ref = _reference(x, w1, w2, dout)

            def ours_fwd():
                with torch.no_grad():
                    mlp(x)

            def ours_fwd_bwd():
                x.grad = None
                mlp(x)[0].backward(dout)

            def errors(out):  # after one fwd+bwd from zeroed main_grads
                return {"out": _rel_err(out, ref[0]), "dx": _rel_err(x.grad, ref[1]),
                        "dw1": _rel_err(w1.main_grad, ref[2]),
                        "dw2": _rel_err(w2.main_grad, ref[3])}

            for w in (w1, w2):
                w.main_grad.zero_()
            ours_fwd_bwd()
            err = errors(mlp(x)[0].detach())
            row = {"trainer": {"forward_s": _timed(ours_fwd, a.iters, a.warmup, cuda),
                               "forward_backward_s": _timed(ours_fwd_bwd, a.iters, a.warmup, cuda),
                               "rel_err": err}}
            for side, tuned in (("quack", False), ("quack_tuned", True)):
                if mlp_func is None:
                    row[side] = {"skipped": skipped}
                    continue

                def quack():  # under no_grad mlp_func keeps nothing for backward
                    return mlp_func(x.view(tokens, -1), w1, w2, "swiglu", concat_layout=True,
                                    tuned=tuned)

                def quack_fwd():
                    with torch.no_grad():
                        quack()

                def quack_fwd_bwd():
                    x.grad = None
                    quack().backward(dout.view(tokens, -1))
                    for w in (w1, w2):  # what DDP's hook does with a .grad
                        w.main_grad.add_(w.grad)
                        w.grad = None

                for w in (w1, w2):
                    w.main_grad.zero_()
                quack_fwd_bwd()
                err = errors(quack().detach().view(ref[0].shape))
                row[side] = {
                    "forward_s": _timed(quack_fwd, a.iters, a.warmup, cuda),
                    "forward_backward_s": _timed(quack_fwd_bwd, a.iters, a.warmup, cuda),
                    "rel_err": err}
            results[f"mlp/{name}/{tokens}"] = row
            print(f"mlp {name:20s} {tokens:6d}  {_line(row)}", flush=True)
            row = _rmsnorm_rows(shape.hidden_size, tokens, ctx.device, w1.dtype, a.iters,
                                a.warmup, cuda, quack_rmsnorm, skipped)
            results[f"rmsnorm/{shape.hidden_size}/{tokens}"] = row
            print(f"rmsnorm {shape.hidden_size:16d} {tokens:6d}  {_line(row)}", flush=True)
        del model, mlp
    write_json(a.out, {
        "benchmark": "the training passes' per-layer kernels at one micro-batch of packed "
                     "tokens: the gated MLP, the trainer's (fc1, Megatron's compiled SwiGLU, fc2, "
                     "wgrad into fp32 main_grad) against quack.mlp.mlp_func (the SwiGLU in the "
                     "GEMM epilogues); the RMSNorm, torch's against quack.rmsnorm.rmsnorm",
        "machine": machine(), "versions": versions("megatron-core", "quack-kernels"),
        "command": command(), "iters": a.iters, "warmup": a.warmup, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
