"""parallel.norm_kernels=quack: the training passes' RMSNorms as quack-kernels' (CuTe DSL, installed
with flash-attn-4): one kernel forward and one backward per norm, the weight gradient reduced per SM
inside the backward kernel. torch's RMSNorm (models/build.py TorchRMSNorm, the default) computes
the weight gradient in a reduction kernel of its own that runs at about a third of the memory
bandwidth on the GSM8K update (docs/perf_log.md).

`QuackRMSNorm` (models/build.py) is TorchRMSNorm with this forward (`quack_rmsnorm`) on CUDA
tensors outside a CUDA-graph capture; elsewhere (CPU, captured layers) torch's forward runs
unchanged. Where quack can run is `quack_mlp.quack_unsupported`'s rule, shared with the MLP option.
"""

from __future__ import annotations

import functools

import torch

from hybridflow.models.quack_mlp import resolve_quack


@functools.cache
def _rmsnorm():
    from quack.rmsnorm import rmsnorm

    return rmsnorm


def resolve_norm_kernels(option: str, device: torch.device) -> bool:
    """Whether the RMSNorms run on quack (parallel.norm_kernels; quack_mlp.resolve_quack)."""
    return resolve_quack("parallel.norm_kernels", option, device)


def quack_rmsnorm(norm: torch.nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """`norm`'s RMSNorm of `x` on quack's kernel where it applies (CUDA, outside a capture, the
    weight in x's dtype), else torch's."""
    if (not x.is_cuda or torch.cuda.is_current_stream_capturing() or norm.weight is None
            or x.dtype != norm.weight.dtype):
        return torch.nn.RMSNorm.forward(norm, x)
    eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps  # as torch's
    return _rmsnorm()(x, norm.weight, eps=eps)
