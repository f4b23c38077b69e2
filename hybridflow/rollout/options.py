"""The decode variants of generation as one frozen, hashable object: `DecodeOptions`.

Built from the config in one place (`DecodeOptions.from_config(cfg.rollout)`), handed to
`Generator.generate` and from there, explicitly, to `decoder.forward` / `decoder.decode_step` and to
the kernels' launch arguments (`pdl=`, `prefetch=`). It is part of the key of the generator's
captured decode steps, so calls with different options never replay each other's CUDA graphs, and
a benchmark A/B is two options objects in one process (benchmarks/bench_generate.py flags), not
module globals flipped with setattr.

What stays configurable is a real trade-off or depends on the hardware (PDL on sm_90+, which
weights to hint into L2 and from which batch size, from which batch size fc1 runs as a Triton
GEMM, the compile backend). Variants that lost were deleted; docs/perf_log.md ("Generation /
decode kernels") says what was measured and names the git tags that keep their code.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from hybridflow.config import DecodeKernelOptions, RolloutConfig
from hybridflow.config_checks import KERNELS, PREFETCHABLE

_K = DecodeKernelOptions()  # the rollout.kernel_options defaults, mirrored below



@dataclass(frozen=True)
class DecodeOptions:
    """How generation decodes. The first group mirrors `rollout.*` keys, the second
    `rollout.kernel_options.*`; the third is not in the config (fixed for runs; tests set smaller
    values to reach the polls, compaction and prefill sub-batches with a few tiny rows)."""
    # rollout.decode_kernels: "triton" (each decode layer as Triton kernels + cuBLAS; the prefill's
    # RoPE + K/V writes, SwiGLU and norms too), "torch" (PyTorch ops: the reference the kernels are
    # tested against) or "auto" (triton where it applies; `resolved` decides per device)
    kernels: str = "auto"
    cuda_graphs: bool = True  # rollout.cuda_graphs: the decode step as CUDA-graph replays on GPU
    compile: bool = False  # rollout.compile_decode: the torch path's layer parts via torch.compile
    kv_window: int = 0  # rollout.decode_kv_window: attention windows of this many columns; 0: none
    compact_finished_rows: bool = False  # rollout.compact_finished_rows (compaction.py)

    # rollout.kernel_options.*: see DecodeKernelOptions in hybridflow/config.py for each
    pdl: bool = _K.pdl
    prefetch_weights: tuple = tuple(_K.prefetch_weights)  # sorted into PREFETCHABLE's order
    prefetch_min_rows: int = _K.prefetch_min_rows
    swiglu_gemm_min_rows: int = _K.swiglu_gemm_min_rows
    fp8_weight_only_max_rows: int = _K.fp8_weight_only_max_rows
    int4_kernel_max_rows: int = _K.int4_kernel_max_rows
    fused_sampler: bool = _K.fused_sampler
    own_columns_only: bool = _K.own_columns_only
    compile_backend: str = _K.compile_backend
    compile_mode: Optional[str] = _K.compile_mode
    prefill_width_multiple: int = 1  # rollout.kernel_options.prefill_width_multiple (null: 1)

    # rollout.speculative (rollout/speculative.py): the tail from this many running rows on by
    # speculative sampling with n-gram drafts (0: off), drafts per row and step, the n-gram sizes
    spec_rows: int = 0
    spec_draft_tokens: int = 4
    spec_ngram: tuple = (3, 1)
    spec_fused_advance: bool = True  # rollout.speculative.fused_advance

    check_every: int = 16  # decode steps between stop polls (and compaction decisions)
    prefill_tokens: int = 16384  # prompt tokens per prefill sub-batch (bounds activation memory)
    # equal prompts side by side share one prefill, as a prompt's n copies do (off: the tests'
    # per-row reference)
    share_prefill: bool = True
    # smallest compaction target under CUDA graphs: below it a step costs about the same (weight
    # reads and launches), so a graph of fewer rows would be capture time for nothing
    min_graphed_bucket: int = 16
    # off a GPU (tests): run the graphed path's host side as a GPU would (chunks padded to their
    # buckets, every ladder bucket's step made up front, each step's warm-up calls on its buffers
    # as GraphedStep makes them), then call the step eagerly where a GPU replays its graph; CPU
    # ops raise on an index out of range, where a GPU's kernel asserts on the device
    emulate_graphs: bool = False

    def __post_init__(self):
        order = {n: i for i, n in enumerate(PREFETCHABLE)}
        names = tuple(sorted(set(self.prefetch_weights), key=lambda n: order.get(n, len(order))))
        object.__setattr__(self, "prefetch_weights", names)  # one key per set, whatever its order

    @classmethod
    def from_config(cls, r: RolloutConfig) -> "DecodeOptions":
        """The options of `rollout` (a RolloutConfig). The null (auto) values of
        compile_decode / decode_kv_window / compact_finished_rows / speculative.enable, when not
        resolved for the machine before (hybridflow.config_auto), count as off."""
        k = r.kernel_options
        return cls(kernels=r.decode_kernels, cuda_graphs=bool(r.cuda_graphs),
                   compile=bool(r.compile_decode), kv_window=int(r.decode_kv_window or 0),
                   compact_finished_rows=bool(r.compact_finished_rows), pdl=bool(k.pdl),
                   prefetch_weights=tuple(k.prefetch_weights),
                   prefetch_min_rows=k.prefetch_min_rows,
                   swiglu_gemm_min_rows=k.swiglu_gemm_min_rows,
                   fp8_weight_only_max_rows=k.fp8_weight_only_max_rows,
                   int4_kernel_max_rows=k.int4_kernel_max_rows,
                   fused_sampler=bool(k.fused_sampler),
                   own_columns_only=bool(k.own_columns_only),
                   compile_backend=k.compile_backend, compile_mode=k.compile_mode,
                   prefill_width_multiple=k.prefill_width_multiple or 1,
                   spec_rows=r.speculative.max_rows if r.speculative.enable is True else 0,
                   spec_draft_tokens=r.speculative.draft_tokens,
                   spec_ngram=(r.speculative.ngram_max, r.speculative.ngram_min),
                   spec_fused_advance=bool(r.speculative.fused_advance))

    def replace(self, **changes) -> "DecodeOptions":
        return dataclasses.replace(self, **changes)

    def resolved(self, device: torch.device, head_dim: int) -> "DecodeOptions":
        """These options as generation on `device` runs them: kernels "auto" decided (triton on a
        CUDA device with triton and a power-of-two head_dim >= 16, else torch)."""
        return self.replace(kernels=resolve_decode_kernels(self.kernels, device, head_dim))


def resolve_decode_kernels(value: str, device: torch.device, head_dim: int) -> str:
    """rollout.decode_kernels as generation runs it: "auto" is "triton" on a CUDA device with
    triton and a power-of-two head_dim >= 16, else "torch"; "triton" and "torch" are taken as
    given (triton's requirements checked by the generator)."""
    if value not in KERNELS:
        raise ValueError(f"rollout.decode_kernels={value!r}: expected 'auto', 'torch' or 'triton'")
    if value != "auto":
        return value
    from hybridflow.kernels import layer_ops as kern

    usable = kern.HAVE_TRITON and device.type == "cuda" and kern.head_dim_supported(head_dim)
    return "triton" if usable else "torch"
