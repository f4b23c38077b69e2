"""Which kernel runs the packed micro-batches' attention (algo.packed_attention): the one rule,
asked of a live process by models/attention.choose_packed_attention and of a GPU of its table by the
cost model (cost/from_config.packed_kernel). torch only: the cost model imports it without
Megatron.

auto: FlashAttention-4 where it runs (CUDA, bf16 / fp16, head_dim a multiple of 8 up to 256,
compute capability 9.0+, flash-attn-4 importable), else torch's varlen_attn (FlashAttention-2: the
same at 8.0+, a torch that ships it with FlashAttention kernels), else flex. varlen or fa4 by name
where it cannot run: a ValueError naming the key and the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

PACKED_KERNELS = ("varlen", "flex", "fa4")


@dataclass(frozen=True)
class FlashMachine:
    """What the choice reads of a machine, each asked only when the checks before it pass (a CPU or
    fp32 run never queries CUDA): the device type, its compute capability, why torch's varlen_attn
    cannot run there for want of the op or its kernels (None: it can) and why flash-attn-4 does not
    import (None: it does)."""
    device_type: str
    capability: Callable[[], tuple]
    varlen_missing: Callable[[], Optional[str]]
    fa4_missing: Callable[[], Optional[str]]


def flash_limits(m: FlashMachine, dtype: torch.dtype, head_dim: int, *, op: str, kernel: str,
                 min_cap: tuple[int, int]) -> Optional[str]:
    """What the FlashAttention kernels need, checked in this order (the first three before any
    CUDA query): CUDA, bf16 / fp16, head_dim a multiple of 8 up to 256, compute capability."""
    if m.device_type != "cuda":
        return f"{op} runs on CUDA only (device {m.device_type})"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"{op} takes bf16 or fp16 (the model computes in {dtype})"
    if head_dim % 8 or head_dim > 256:
        return f"{kernel} takes head_dim a multiple of 8 up to 256 (got {head_dim})"
    cap = tuple(m.capability())
    if cap < min_cap:
        return (f"{kernel} needs compute capability {min_cap[0]}.{min_cap[1]}+ "
                f"(got {cap[0]}.{cap[1]})")
    return None


def varlen_why(m: FlashMachine, dtype: torch.dtype, head_dim: int) -> Optional[str]:
    """Why torch's varlen_attn cannot run the packed passes on `m`; None where it can."""
    why = flash_limits(m, dtype, head_dim, op="varlen_attn", kernel="FlashAttention-2",
                       min_cap=(8, 0))
    return m.varlen_missing() if why is None else why


def fa4_why(m: FlashMachine, dtype: torch.dtype, head_dim: int) -> Optional[str]:
    """Why FlashAttention-4 cannot run the packed passes on `m`; None where it can."""
    why = flash_limits(m, dtype, head_dim, op="FlashAttention-4", kernel="FlashAttention-4",
                       min_cap=(9, 0))
    return m.fa4_missing() if why is None else why


def choose(option: str, m: FlashMachine, *, dtype: torch.dtype, head_dim: int,
           where: str = "here") -> tuple[str, str]:
    """algo.packed_attention (auto | varlen | flex | fa4) on `m` -> (kernel, the line that says
    why); the ValueErrors say "cannot run <where>"."""
    if option not in ("auto", *PACKED_KERNELS):
        raise ValueError(f"algo.packed_attention={option!r} is not one of "
                         f"['auto', 'flex', 'varlen', 'fa4']")
    if option == "flex":
        return "flex", "packed attention: flex_attention document mask (algo.packed_attention=flex)"
    fa4 = None if option == "varlen" else fa4_why(m, dtype, head_dim)  # (varlen: not imported)
    if option == "fa4" and fa4 is not None:
        raise ValueError(f"algo.packed_attention=fa4 cannot run {where}: {fa4}; set "
                         "algo.packed_attention=auto, varlen or flex")
    if fa4 is None and option != "varlen":
        return "fa4", ("packed attention: FlashAttention-4 varlen (flash_attn.cute; "
                       f"algo.packed_attention={option})")
    why = varlen_why(m, dtype, head_dim)
    if why is None:
        note = "" if option == "varlen" else f"; {fa4}"
        return "varlen", (f"packed attention: torch varlen_attn (FlashAttention-2 varlen; "
                          f"algo.packed_attention={option}{note})")
    if option == "varlen":
        raise ValueError(f"algo.packed_attention=varlen cannot run {where}: {why}; set "
                         "algo.packed_attention=auto or flex")
    return "flex", (f"packed attention: flex_attention document mask (algo.packed_attention=auto "
                    f"falls back: {why})")
