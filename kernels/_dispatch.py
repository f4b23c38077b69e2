"""Which implementation a kernel call takes (the Triton kernel or its PyTorch twin), and how a
Triton kernel is launched (programmatic dependent launch where the device has it)."""

from __future__ import annotations

import dataclasses
import functools

import torch

try:
    import triton  # noqa: F401
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU-only installs: the PyTorch twins serve
    HAVE_TRITON = False

# Programmatic dependent launch (Hopper and newer; CUDA's "PDL"): our Triton kernels are launched
# with the launch attribute that lets the GPU start a kernel's programs while the kernel before it
# in the stream still runs; each kernel's first act is griddepcontrol.wait (all of the previous
# kernel's writes visible), then it lets its own successor start (griddepcontrol.launch_dependents).
# What it saves is the gap between two kernels (launch and the programs' start-up overlap the
# predecessor's last programs), ~200 of them in a decode step; the results are those of the plain
# launch. Captured into CUDA graphs as programmatic edges. A module switch for A/B runs.
PDL = True


def use_triton(t: torch.Tensor, impl: str) -> bool:
    """impl "auto": Triton for CUDA tensors when triton is installed, else the twin; "triton"
    forces the kernel (on CPU tensors only under TRITON_INTERPRET=1); "torch" the twin."""
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl={impl!r} is not one of auto/triton/torch")
    if impl == "triton" and not HAVE_TRITON:
        raise ValueError("impl='triton' needs the triton package")
    return impl == "triton" or (impl == "auto" and HAVE_TRITON and t.is_cuda)


@functools.lru_cache(maxsize=None)
def _pdl_device(index: int) -> bool:
    """Device `index` is sm_90+ and this Triton's CUDA backend has the launch_pdl option."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    has_option = "launch_pdl" in {f.name for f in dataclasses.fields(CUDAOptions)}
    return has_option and torch.cuda.get_device_capability(index)[0] >= 9


def launch_opts(t: torch.Tensor) -> dict:
    """Keyword arguments of a Triton launch whose tensors live with `t`: {"PDL": True,
    "launch_pdl": True} under PDL on an sm_90+ GPU, else {} (the kernels' PDL defaults to False;
    the CPU interpreter never sees the option)."""
    if PDL and HAVE_TRITON and t.is_cuda and _pdl_device(t.device.index):
        return {"PDL": True, "launch_pdl": True}
    return {}


if HAVE_TRITON:

    @triton.jit
    def pdl_enter(PDL: tl.constexpr):
        """A kernel's first statement: under PDL wait for the previous kernel's writes, then let
        the next kernel's programs start (they wait in turn before touching memory)."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
