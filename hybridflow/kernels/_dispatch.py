"""Which implementation a kernel call takes (the Triton kernel or its PyTorch twin), and how a
Triton kernel is launched (programmatic dependent launch where the device has it)."""

from __future__ import annotations

import dataclasses
import functools
import os

import torch

try:
    import triton  # noqa: F401
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU-only installs: the PyTorch twins serve
    HAVE_TRITON = False

# Programmatic dependent launch (Hopper and newer; CUDA's "PDL"), a launch option of every kernel
# here (`pdl=`, from rollout.kernel_options.pdl): the kernel is launched with the attribute that
# lets the GPU start its programs while the kernel before it in the stream still runs; each
# kernel's first act is griddepcontrol.wait (all of the previous kernel's writes visible), then it
# lets its own successor start (griddepcontrol.launch_dependents). What it saves is the gap
# between two kernels (launch and the programs' start-up overlap the predecessor's last
# programs); the results are those of the plain launch. Captured into CUDA graphs as programmatic
# edges.


def interpreting() -> bool:
    """Whether Triton kernels run through its CPU interpreter (TRITON_INTERPRET=1, the tests')."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(t: torch.Tensor, impl: str) -> bool:
    """impl "auto": Triton for CUDA tensors when triton is installed, else the twin; "triton"
    forces the kernel (on CPU tensors only under TRITON_INTERPRET=1); "torch" the twin."""
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl={impl!r} is not one of auto/triton/torch")
    if impl == "triton" and not HAVE_TRITON:
        raise ValueError("impl='triton' needs the triton package")
    return impl == "triton" or (impl == "auto" and HAVE_TRITON and t.is_cuda)


def prefetch_args(t: torch.Tensor, weight: torch.Tensor | None) -> tuple:
    """(pointer, bytes, PREFETCH) for a kernel that hints `weight` (the next GEMM's, read after it)
    into L2: on sm_90+ for a contiguous tensor whose address and size are multiples of 16 bytes
    (cp.async.bulk's terms); otherwise (t, 0, False): no hint, the kernel unchanged."""
    if (weight is None or not (HAVE_TRITON and t.is_cuda and weight.is_cuda)
            or not weight.is_contiguous() or not _sm90(t.device.index) or weight.data_ptr() % 16
            or weight.nbytes % 16):
        return t, 0, False
    return weight, weight.nbytes, True


@functools.lru_cache(maxsize=None)
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


@functools.lru_cache(maxsize=None)
def _pdl_device(index: int) -> bool:
    """Device `index` is sm_90+ and this Triton's CUDA backend has the launch_pdl option."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    has_option = "launch_pdl" in {f.name for f in dataclasses.fields(CUDAOptions)}
    return has_option and _sm90(index)


def launch_opts(t: torch.Tensor, pdl: bool) -> dict:
    """Keyword arguments of a Triton launch whose tensors live with `t`: {"PDL": True,
    "launch_pdl": True} when `pdl` is asked for and `t` is on an sm_90+ GPU, else {} (the
    kernels' PDL defaults to False; the CPU interpreter never sees the option)."""
    if pdl and HAVE_TRITON and t.is_cuda and _pdl_device(t.device.index):
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

    @triton.jit
    def prefetch_l2(ptr, nbytes, part, parts):
        """Hint bytes [ptr, ptr + nbytes) into L2 (sm_90's cp.async.bulk.prefetch.L2, one
        instruction from the program's thread 0): this program's share `part` of `parts` equal
        16-byte-aligned slices. A hint: nothing waits on it, no result changes. The decode step's
        kernels hint the weights of the cuBLAS / Triton GEMM that follows them, whose K loop
        otherwise waits on HBM latency at decode's few rows."""
        chunk = ((nbytes + parts - 1) // parts + 15) // 16 * 16
        lo = part * chunk
        size = tl.minimum(chunk, nbytes - lo)
        tl.inline_asm_elementwise(
            "{ .reg .pred %pa, %pb; .reg .b32 %t; mov.u32 %t, %tid.x; setp.eq.u32 %pa, %t, 0; "
            "setp.gt.s32 %pb, $2, 0; and.pred %pa, %pa, %pb; "
            "@%pa cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [ptr.to(tl.pointer_type(tl.int8)) + lo, size.to(tl.int32)], dtype=tl.int32,
            is_pure=False, pack=1)
