"""parallel.norm_kernels=quack: the training passes' RMSNorms as quack-kernels' (CuTe DSL, installed
with flash-attn-4): one kernel forward and one backward per norm, the weight gradient reduced per SM
inside the backward kernel. torch's RMSNorm (models/build.py TorchRMSNorm, the default) computes
the weight gradient in a reduction kernel of its own that runs at about a third of the memory
bandwidth on the GSM8K update (docs/perf_log.md).

`QuackRMSNorm` is TorchRMSNorm with this forward on CUDA tensors outside a CUDA-graph capture;
elsewhere (CPU, captured layers) torch's forward runs unchanged. Where quack can run is
`quack_mlp.quack_unsupported`'s rule, shared with the MLP option.
"""

from __future__ import annotations

import functools

import torch

from hybridflow.models.build import TorchRMSNorm
from hybridflow.models.quack_mlp import resolve_quack


@functools.cache
def _rmsnorm():
    from quack.rmsnorm import rmsnorm

    return rmsnorm


def resolve_norm_kernels(option: str, device: torch.device) -> bool:
    """Whether the RMSNorms run on quack (parallel.norm_kernels; quack_mlp.resolve_quack)."""
    return resolve_quack("parallel.norm_kernels", option, device)


class QuackRMSNorm(TorchRMSNorm):
    """TorchRMSNorm; its forward on quack's kernel where it applies (module doc)."""

    @classmethod
    def adopt(cls, model: torch.nn.Module) -> int:
        """Every TorchRMSNorm of `model` becomes a QuackRMSNorm in place (same parameters and
        attributes); returns how many."""
        norms = [m for m in model.modules() if type(m) is TorchRMSNorm]
        for m in norms:
            m.__class__ = cls
        return len(norms)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (not x.is_cuda or torch.cuda.is_current_stream_capturing() or self.weight is None
                or x.dtype != self.weight.dtype):
            return super().forward(x)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps  # as torch's
        return _rmsnorm()(x, self.weight, eps=eps)
