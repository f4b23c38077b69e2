"""The training passes' per-layer kernels as the trainer runs them against alternatives, one GPU.

The gated MLP. Megatron's MLP over our linears (`parallel.fused_elementwise`): fc1 as one GEMM,
Megatron's compiled SwiGLU kernel, fc2 as one GEMM. `QuackMLP` (`parallel.mlp_kernels=quack`,
models/quack_mlp.py; quack-kernels comes with flash-attn-4): the SwiGLU in fc1's GEMM epilogue
forward, its derivative in the epilogue of fc2's input-gradient GEMM backward. The same module and
weights run both forwards; both add their weight gradients into fp32 `main_grad` as under DDP
(`parallel.gradient_accumulation_fusion`).

The SwiGLU's backward alone (`swiglu`): Megatron's compiled swiglu_back (`compiled`) against
kernels/swiglu_train.py (`triton`, parallel.swiglu_backward=triton) on fc1's output and the gradient
as the MLP's backward gets them, --calls back to back per timed run, with the HBM bytes each call
must move (read the gradient and fc1's output once, write the input gradient) over its time; and
the MLP row's `trainer_swiglu_triton` side: Megatron's MLP with that backward installed.

The RoPE of q and k (split from a QKV projection as Megatron splits them): kernels/rope_train.py
(`triton`, the trainer's where it takes the head size) against Megatron's formula compiled
(`compiled`, models/fused.py's fallback for the head sizes the kernel does not take); and for q
taken from the projection's view, Megatron's reshape copy then the kernel (`triton_copy`) against
the kernel reading the view itself (`triton_from_qkv`, parallel.rope_from_qkv).

Per kernel, shape and token count: forward-only (the ref pass) and forward + backward (the update)
seconds (median of --iters after --warmup), and each side's error against an fp32 reference of the
same inputs and weights (output, input gradient, weight gradients; relative to the reference's
largest magnitude): for the MLP, the check that quack reads the [gate; up] halves as Megatron does.
The MLP's `quack_tuned` side runs QuackMLP's GEMMs autotuned at the one shape timed (the trainer
keeps quack's heuristic tiles: the autotuner caches per token count): the bound tuning could reach.
Where quack cannot run (no GPU, not importable: `quack_mlp.quack_unsupported`) its sides are
recorded as skipped with the reason (the RoPE rows without CUDA too).

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

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_packed_pass import timed  # noqa: E402
from benchmarks.run_record import command, machine, versions, write_json  # noqa: E402


def _timed(fn, iters: int, warmup: int, cuda: bool) -> float:
    return statistics.median(timed(fn, iters, cuda, warmup=warmup))


def _reference(x, w1, w2, dout):
    """fp32 SwiGLU MLP: out, dx, dw1, dw2 (fc1's rows are [gate; up], as Megatron stores them)."""
    x, w1, w2 = (t.detach().float().requires_grad_() for t in (x, w1, w2))
    gate, up = F.linear(x, w1).chunk(2, dim=-1)
    out = F.linear(F.silu(gate) * up, w2)
    out.backward(dout.float())
    return out.detach(), x.grad, w1.grad, w2.grad


def _rel_err(got, ref) -> float:
    return float((got.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _mlp_row(mlp, shape, tokens: int, iters: int, warmup: int, cuda: bool, skipped) -> dict:
    """One layer's gated MLP `mlp` as Megatron's (the trainer's), as QuackMLP and as QuackMLP with
    its GEMMs autotuned at this shape, on the same weights: forward, forward + backward, errors."""
    from megatron.core.transformer.mlp import MLP

    from hybridflow.models.quack_mlp import QuackMLP, _GatedMLP

    w1, w2 = mlp.linear_fc1.weight, mlp.linear_fc2.weight
    g = torch.Generator(device=w1.device).manual_seed(tokens)
    x = torch.randn(tokens, 1, shape.hidden_size, generator=g, device=w1.device,
                    dtype=w1.dtype).requires_grad_()
    dout = torch.randn(x.shape, generator=g, device=w1.device, dtype=w1.dtype) * 1e-2
    ref = _reference(x, w1, w2, dout)
    row = {}

    def tuned_mlp(h):  # QuackMLP's GEMMs autotuned at this one shape: a bound
        out = _GatedMLP.apply(h.reshape(-1, h.shape[-1]), w1, w2, True, True)
        return out.view(*h.shape[:-1], out.shape[-1]), None

    from hybridflow.models.fused import use_fused_swiglu

    for side, cls in (("trainer", MLP), ("trainer_swiglu_triton", MLP), ("quack", QuackMLP),
                      ("quack_tuned", QuackMLP)):
        use_fused_swiglu(side == "trainer_swiglu_triton" and cuda)
        if side.startswith("quack") and skipped:
            row[side] = {"skipped": skipped}
            continue
        mlp.__class__ = cls  # the same module and weights, the other forward
        run = tuned_mlp if side == "quack_tuned" else mlp

        def fwd():
            with torch.no_grad():
                run(x)

        def fwd_bwd():
            x.grad = None
            run(x)[0].backward(dout)

        for w in (w1, w2):
            w.main_grad.zero_()
        fwd_bwd()  # from zeroed main_grads: one step's weight gradients
        err = {"out": _rel_err(run(x)[0].detach(), ref[0]), "dx": _rel_err(x.grad, ref[1]),
               "dw1": _rel_err(w1.main_grad, ref[2]), "dw2": _rel_err(w2.main_grad, ref[3])}
        row[side] = {"forward_s": _timed(fwd, iters, warmup, cuda),
                     "forward_backward_s": _timed(fwd_bwd, iters, warmup, cuda), "rel_err": err}
    mlp.__class__ = MLP
    use_fused_swiglu(False)
    return row


def _swiglu_row(shape, tokens: int, iters: int, warmup: int, calls: int, cuda: bool) -> dict:
    """The SwiGLU's backward on fc1's output (tokens, 2F) and its output gradient (tokens, F) in
    bf16: Megatron's compiled swiglu_back against the Triton kernel; seconds per call (median of
    `iters` runs of `calls` calls), the bytes a call must move over that time, and the error
    against fp64 autograd relative to its largest magnitude."""
    from megatron.core.fusions.fused_bias_swiglu import swiglu_back

    from hybridflow.kernels.swiglu_train import swiglu_backward

    if not cuda:
        return {"compiled": {"skipped": "not a CUDA device"},
                "triton": {"skipped": "not a CUDA device"}}
    f = shape.ffn_hidden_size
    g = torch.Generator(device="cuda").manual_seed(tokens)
    z = (3 * torch.randn(tokens, 2 * f, device="cuda", generator=g)).bfloat16()
    grad = torch.randn(tokens, f, device="cuda", generator=g).bfloat16()
    zz = z.double().requires_grad_()
    gate, up = zz.chunk(2, dim=-1)
    (F.silu(gate) * up).backward(grad.double())
    moved = 5 * tokens * f * z.element_size()  # read grad, gate, up; write both halves
    row = {}
    for side, fn in (("compiled", lambda: swiglu_back(grad, z)),
                     ("triton", lambda: swiglu_backward(grad, z, impl="triton"))):
        def run():
            for _ in range(calls):
                fn()

        s = _timed(run, iters, warmup, cuda) / calls
        row[side] = {"call_s": s, "gb_per_s": moved / s / 1e9,
                     "rel_err": {"dz": _rel_err(fn(), zz.grad.float())}}
    return row


def _rope_row(shape, tokens: int, iters: int, warmup: int, cuda: bool) -> dict:
    """One layer's RoPE of q and k (split from a QKV projection as Megatron splits them) by the
    compiled formula (compiled) and by the Triton kernel (triton): forward, forward + backward,
    errors against the fp32 formula."""
    from hybridflow.kernels.rope_train import heads, rope, rope_twin
    from hybridflow.models.fused import _compiled_rope

    if not cuda:
        return {"compiled": {"skipped": "not a CUDA device"},
                "triton": {"skipped": "not a CUDA device"}}
    G, D = shape.num_query_groups, shape.hidden_size // shape.num_attention_heads
    hpg = shape.num_attention_heads // G
    g = torch.Generator(device="cuda").manual_seed(tokens)
    qkv = torch.randn(tokens, 1, G, (hpg + 2) * D, device="cuda", generator=g,
                      dtype=torch.bfloat16)
    q, k, _ = torch.split(qkv, [hpg * D, D, D], dim=3)
    grouped = q.unflatten(3, (hpg, D)).detach().clone().requires_grad_()  # (parallel.rope_from_qkv)
    q = q.reshape(tokens, 1, G * hpg, D)  # a copy where G > 1, as in Megatron
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, device="cuda", dtype=torch.float32) / D))
    freqs = torch.outer(torch.arange(tokens, device="cuda", dtype=torch.float32), inv)
    freqs = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
    cos32, sin32 = torch.cos(freqs), torch.sin(freqs)
    cos, sin = cos32.bfloat16(), sin32.bfloat16()
    xs = [t.detach().clone().requires_grad_() for t in (q, k)]
    grads = [torch.randn(t.shape, device="cuda", generator=g, dtype=torch.bfloat16) for t in xs]
    refs = [rope_twin(t.detach().float(), cos32, sin32) for t in xs]
    sides = {"compiled": (xs, lambda x: _compiled_rope()(x, cos, sin)),
             "triton": (xs, lambda x: rope(x, cos, sin, impl="triton")),
             # q from the QKV projection's view: the reshape copy and the kernel, or the kernel
             # reading the view (parallel.rope_from_qkv); k as above
             "triton_copy": ([grouped, xs[1]], lambda x: rope(heads(x), cos, sin, impl="triton")),
             "triton_from_qkv": ([grouped, xs[1]], lambda x: rope(x, cos, sin, impl="triton"))}
    row = {}
    for side, (inputs, fn) in sides.items():
        def fwd():
            with torch.no_grad():
                for x in inputs:
                    fn(x)

        def fwd_bwd():
            for x, gr in zip(inputs, grads):
                x.grad = None
                fn(x).backward(gr)

        err = {f"out_{n}": _rel_err(fn(x).detach(), ref) for n, x, ref in zip("qk", inputs, refs)}
        row[side] = {"forward_s": _timed(fwd, iters, warmup, cuda),
                     "forward_backward_s": _timed(fwd_bwd, iters, warmup, cuda), "rel_err": err}
    return row


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
    ap.add_argument("--kernels", nargs="+", choices=("mlp", "rope", "swiglu"),
                    default=["mlp", "rope", "swiglu"])
    ap.add_argument("--calls", type=int, default=20,
                    help="swiglu: back-to-back calls per timed run")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)

    from hybridflow.cost.shapes import load_shape
    from hybridflow.models.build import build_model
    from hybridflow.models.linear import LeanColumnParallelLinear, LeanRowParallelLinear
    from hybridflow.models.quack_mlp import quack_unsupported
    from hybridflow.parallel import groups

    cuda = a.device == "cuda"
    groups.init_distributed()
    ctx = groups.init_model_parallel(tp=1, pp=1, seed=1)
    precision = "bf16" if cuda else "fp32"
    skipped = quack_unsupported(ctx.device)  # None where QuackMLP runs quack's GEMMs
    results = {}
    head = {"benchmark": "the training passes' per-layer kernels at one micro-batch of packed "
                         "tokens: the gated MLP, Megatron's (fc1, its compiled SwiGLU, fc2) "
                         "against QuackMLP (parallel.mlp_kernels=quack: the SwiGLU in the GEMM "
                         "epilogues) and Megatron's with the Triton SwiGLU backward, wgrads into "
                         "fp32 main_grad; the SwiGLU backward alone, compiled against Triton; the "
                         "RoPE of q and k, the compiled formula against the Triton kernel",
            "machine": machine(), "versions": versions("megatron-core", "quack-kernels"),
            "command": command(), "iters": a.iters, "warmup": a.warmup}
    for name in a.model:
        shape = dataclasses.replace(load_shape(name), num_layers=1, attention_backend="sdpa")
        model = build_model(shape, role="actor", ctx=ctx, precision=precision,
                            fused_elementwise=True)
        mlp = model.decoder.layers[0].mlp
        for linear in (mlp.linear_fc1, mlp.linear_fc2):
            if type(linear) in (LeanColumnParallelLinear, LeanRowParallelLinear):
                linear.fuse_wgrad = True  # as the Engine sets it under DDP
            linear.weight.main_grad = torch.zeros_like(linear.weight, dtype=torch.float32)
        for tokens in a.tokens:
            if "mlp" in a.kernels:
                row = _mlp_row(mlp, shape, tokens, a.iters, a.warmup, cuda, skipped)
                results[f"mlp/{name}/{tokens}"] = row
                print(f"mlp {name:20s} {tokens:6d}  {_line(row)}", flush=True)
            if "rope" in a.kernels:
                row = _rope_row(shape, tokens, a.iters, a.warmup, cuda)
                results[f"rope/{name}/{tokens}"] = row
                print(f"rope {name:19s} {tokens:6d}  {_line(row)}", flush=True)
            if "swiglu" in a.kernels:
                row = _swiglu_row(shape, tokens, a.iters, a.warmup, a.calls, cuda)
                results[f"swiglu/{name}/{tokens}"] = row
                print(f"swiglu {name:17s} {tokens:6d}  " + "  ".join(
                    f"{k} {v['call_s'] * 1e6:.1f} us {v['gb_per_s']:.0f} GB/s "
                    f"err {v['rel_err']['dz']:.1e}" if "skipped" not in v else f"{k} skipped"
                    for k, v in row.items()), flush=True)
            write_json(a.out, {**head, "results": results})  # a run cut short keeps its rows
        del model, mlp
    return 0


if __name__ == "__main__":
    sys.exit(main())
