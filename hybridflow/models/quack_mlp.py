"""parallel.mlp_kernels=quack: the gated MLP's SwiGLU inside its GEMMs (quack-kernels).

Megatron's MLP runs fc1 on cuBLAS, then the SwiGLU as its own kernels (forward: read fc1's
(tokens, 2F) output, write (tokens, F); backward: read it again with the incoming gradient, write
its (tokens, 2F) gradient), then fc2. quack-kernels (Tri Dao's CuTe-DSL kernels, a dependency of
flash-attn-4) computes the SwiGLU in the epilogue of fc1's GEMM (`gemm_gated`: the pre-activation
kept for backward, the post-activation written once) and its derivative in the epilogue of the
GEMM that makes fc2's input gradient (`gemm_dgated`: d(post) = dout W2, then dpre =
dswiglu(d(post), pre), writing the post-activation again for fc2's weight gradient). The
element-wise passes over the MLP's widest activations are gone from both directions.

fc1's weight keeps Megatron's row order [gate; up] (checkpoints, the reshard and the decode
kernels read it so); quack reads such a weight as its `concat_layout`, which makes the
pre-activation and its gradient interleaved (gate and up of one unit side by side), and the two
GEMMs that take the gradient back to fc1 (its input and weight gradients) read that layout the
same way. Weight gradients go into DDP's fp32 `main_grad` where the linears fuse them
(parallel.gradient_accumulation_fusion, models/linear.py): fc2's by the same cuBLAS GEMM as the
lean linears, fc1's by quack's in-place GEMM (it writes the rows back in [gate; up] order).

`QuackMLP` is Megatron's MLP with this forward where it applies (CUDA sm_90+, quack importable,
SwiGLU without bias, TP = 1, no LoRA adapter on fc1 / fc2, not inside a CUDA-graph capture);
elsewhere, and on CPU, Megatron's forward runs unchanged.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP

from hybridflow.config import QUACK_CHOICES
from hybridflow.models.linear import (LeanColumnParallelLinear, LeanRowParallelLinear,
                                      accumulate_wgrad)


@functools.cache
def _quack() -> tuple:
    """(quack's gemm interface module, None), or (None, why it cannot be used)."""
    if importlib.util.find_spec("quack") is None:
        return None, "quack-kernels is not installed (it comes with flash-attn-4)"
    try:
        import cutlass
        from quack import gemm_interface
    except Exception as e:  # installed but broken (its CUDA libraries)
        return None, f"quack-kernels does not import: {type(e).__name__}: {e}"
    where = os.path.abspath(cutlass.__file__)
    if not any(f"{os.sep}{d}{os.sep}" in where for d in ("site-packages", "dist-packages")):
        # quack fingerprints an epilogue's code for its compile cache and walks into every
        # function not under such a folder: the DSL's own then fail at one of their ContextVars
        return None, (f"the CUTLASS DSL is imported from {os.path.dirname(where)}, outside a "
                      "site-packages folder, where quack-kernels cannot key its kernels (install "
                      "with pip, or unzip into a folder named site-packages)")
    return gemm_interface, None


def quack_unsupported(device: torch.device) -> Optional[str]:
    """Why quack's gated GEMMs cannot run on `device`; None where they can."""
    if device.type != "cuda":
        return "not a CUDA device"
    major, _ = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"compute capability {major}.x (quack's GEMMs need 9.0+)"
    return _quack()[1]


def resolve_mlp_kernels(option: str, device: torch.device) -> bool:
    """Whether the MLPs run on quack (parallel.mlp_kernels: torch / quack / auto): `quack`
    insists (an error saying why it cannot), `auto` takes it where it runs, `torch` never."""
    if option not in QUACK_CHOICES:
        raise ValueError(f"parallel.mlp_kernels={option!r}: expected one of {QUACK_CHOICES}")
    if option == "torch":
        return False
    why = quack_unsupported(device)
    if why is not None and option == "quack":
        raise ValueError(f"parallel.mlp_kernels=quack cannot run here: {why}")
    return why is None


def _wgrad(weight_main_grad, grad, x, weight_dtype, gi=None, concat=False, tuned=False):
    """The weight gradient grad^T x: added into `weight_main_grad` (returns None) or returned."""
    if concat:
        if weight_main_grad is not None:
            gi.gemm_add_inplace(grad.t(), x, weight_main_grad, dynamic_scheduler=True,
                                tuned=tuned, concat_layout=("C", "out"))
            return None
        return gi.gemm(grad.t(), x, out_dtype=weight_dtype, dynamic_scheduler=True,
                       tuned=tuned, concat_layout=("out",))
    if weight_main_grad is not None:
        accumulate_wgrad(weight_main_grad, grad, x)
        return None
    return grad.t().mm(x).to(weight_dtype)


class _GatedMLP(torch.autograd.Function):
    """out = fc2(swiglu(fc1(x))) for x (N, H), fc1 (2F, H) in [gate; up] rows, fc2 (H, F).
    `tuned`: quack's GEMMs autotuned, which its autotuner caches per operand shape (a tuning per
    new token count: the trainer keeps False, quack's heuristic tiles; benchmarks at one fixed
    shape use True for the bound tuning could reach)."""

    @staticmethod
    def forward(ctx, x, w1, w2, fuse_wgrad: bool, tuned: bool = False):
        gi = _quack()[0]
        need_grad = any(ctx.needs_input_grad[:3])  # (grad mode is off inside forward)
        ctx.tuned = tuned
        pre, post = gi.gemm_gated(x, w1.t(), activation="swiglu", store_preact=need_grad,
                                  tuned=tuned, concat_layout=("B",))
        out = F.linear(post, w2)
        if need_grad:
            ctx.save_for_backward(x, pre, w1, w2)
            # the buffers themselves (see models/linear.py _LinearWgradIntoMainGrad)
            ctx.main_grads = tuple(getattr(w, "main_grad", None) if fuse_wgrad else None
                                   for w in (w1, w2))
        return out

    @staticmethod
    def backward(ctx, dout):
        gi = _quack()[0]
        x, pre, w1, w2 = ctx.saved_tensors
        dout = dout.contiguous()
        # d(post) = dout W2 with the SwiGLU's derivative in the epilogue; post made again
        dpre, post = gi.gemm_dgated(dout, w2, pre, activation="swiglu", dynamic_scheduler=True,
                                    tuned=ctx.tuned)
        mg1, mg2 = ctx.main_grads
        dw2 = _wgrad(mg2, dout, post, w2.dtype) if ctx.needs_input_grad[2] else None
        dx = None
        if ctx.needs_input_grad[0]:
            dx = gi.gemm(dpre, w1, dynamic_scheduler=True, tuned=ctx.tuned, concat_layout=("B",))
        dw1 = _wgrad(mg1, dpre, x, w1.dtype, gi, concat=True, tuned=ctx.tuned) \
            if ctx.needs_input_grad[1] else None
        return dx, dw1, dw2, None, None


class QuackMLP(MLP):
    """Megatron's MLP; its forward on quack's gated GEMMs where they apply (module doc)."""

    @classmethod
    def adopt(cls, model: torch.nn.Module) -> int:
        """Every dense `MLP` of `model` becomes a QuackMLP in place (same parameters and
        attributes, Megatron's construction kept); returns how many."""
        mlps = [m for m in model.modules() if type(m) is MLP]
        for m in mlps:
            m.__class__ = cls
        return len(mlps)

    def _quack_applies(self, x: torch.Tensor) -> bool:
        c = self.config
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        return (x.is_cuda and not torch.cuda.is_current_stream_capturing()
                and c.gated_linear_unit and self.activation_func is F.silu
                and not c.add_bias_linear and getattr(c, "glu_linear_offset", 0.0) == 0.0
                and getattr(c, "activation_func_clamp_value", None) is None
                and type(fc1) is LeanColumnParallelLinear and type(fc2) is LeanRowParallelLinear
                and fc1._tp == 1 and fc2._tp == 1 and not fc1.sequence_parallel
                and fc1._modules.get("lora") is None and fc2._modules.get("lora") is None
                and x.shape[-1] % 8 == 0 and fc2.weight.shape[1] % 8 == 0
                and x.dtype in (torch.bfloat16, torch.float16) and x.dtype == fc1.weight.dtype)

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if per_token_scale is not None or not self._quack_applies(hidden_states):
            return super().forward(hidden_states, per_token_scale=per_token_scale, **kwargs)
        shape = hidden_states.shape
        fuse = self.linear_fc1.fuse_wgrad
        out = _GatedMLP.apply(hidden_states.reshape(-1, shape[-1]), self.linear_fc1.weight,
                              self.linear_fc2.weight, fuse)
        return out.view(*shape[:-1], out.shape[-1]), None
