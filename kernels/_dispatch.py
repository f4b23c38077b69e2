"""Which implementation a kernel call takes: the Triton kernel or its PyTorch twin."""

from __future__ import annotations

import torch

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # CPU-only installs: the PyTorch twins serve
    HAVE_TRITON = False


def use_triton(t: torch.Tensor, impl: str) -> bool:
    """impl "auto": Triton for CUDA tensors when triton is installed, else the twin; "triton"
    forces the kernel (on CPU tensors only under TRITON_INTERPRET=1); "torch" the twin."""
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl={impl!r} is not one of auto/triton/torch")
    if impl == "triton" and not HAVE_TRITON:
        raise ValueError("impl='triton' needs the triton package")
    return impl == "triton" or (impl == "auto" and HAVE_TRITON and t.is_cuda)
