"""Greedy decoding's argmax over the vocabulary in two Triton passes, for the decode step.

`argmax_rows(logits)` = torch.argmax(logits, dim=-1) (the first maximal id on ties) for finite
logits (B, V): pass 1 runs a program per (row, chunk of `chunk` ids) that keeps a per-lane best and
writes the chunk's max and its first id; pass 2 reduces a row's chunks the same way. PyTorch's
reduction gives each row to one block: at batch 256 and a 151,936-id vocabulary that is 54 us of a
1,434 us decode step (benchmarks/results/decode_profile_h200_fused_layer.json) for 78 MB of
logits, ~18 us at the copy bandwidth; the split spreads a row over ~19 programs.
Not yet measured on a GPU: `hybridflow.rollout.sampling.GREEDY_KERNEL` (default False) selects it;
benchmarks/bench_generate.py and profile_decode.py take `--triton-argmax` for the A/B.
"""

from __future__ import annotations

import torch

from ._dispatch import HAVE_TRITON, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _argmax_chunk_kernel(x_ptr, val_ptr, idx_ptr, V, s_x, NCHUNK, CHUNK: tl.constexpr,
                             BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        best_v = tl.full([BLOCK], float("-inf"), tl.float32)
        best_i = tl.full([BLOCK], V, tl.int32)  # V: nothing seen yet in this lane
        for start in range(0, CHUNK, BLOCK):
            cols = c * CHUNK + start + tl.arange(0, BLOCK)
            ok = cols < V
            v = tl.load(x_ptr + row * s_x + cols, mask=ok, other=float("-inf")).to(tl.float32)
            # strictly greater keeps a lane's first id; a lane's first id is taken even at -inf
            better = ok & ((v > best_v) | (best_i == V))
            best_v = tl.where(better, v, best_v)
            best_i = tl.where(better, cols, best_i)
        m = tl.max(best_v, 0)
        first = tl.min(tl.where((best_v == m) & (best_i < V), best_i, V), 0)
        tl.store(val_ptr + row * NCHUNK + c, m)
        tl.store(idx_ptr + row * NCHUNK + c, first)

    @triton.jit
    def _argmax_final_kernel(val_ptr, idx_ptr, out_ptr, V, NCHUNK, N_PAD: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, N_PAD)
        ok = c < NCHUNK
        v = tl.load(val_ptr + row * NCHUNK + c, mask=ok, other=float("-inf"))
        i = tl.load(idx_ptr + row * NCHUNK + c, mask=ok, other=V)
        m = tl.max(v, 0)
        tl.store(out_ptr + row, tl.min(tl.where((v == m) & (i < V), i, V), 0).to(tl.int64))


def argmax_rows(logits: torch.Tensor, *, chunk: int = 8192, block: int = 1024,
                impl: str = "auto") -> torch.Tensor:
    """torch.argmax(logits, dim=-1) for finite logits (B, V), last dimension contiguous -> (B,)
    int64; `chunk` ids per program of pass 1 (a multiple of `block`)."""
    if logits.dim() != 2:
        raise ValueError(f"argmax_rows takes (B, V) logits, got shape {tuple(logits.shape)}")
    if not use_triton(logits, impl):
        return torch.argmax(logits, dim=-1)
    if logits.stride(-1) != 1:
        raise ValueError("argmax_rows needs logits contiguous in the last dimension")
    if chunk % block:
        raise ValueError(f"argmax_rows: chunk {chunk} is not a multiple of block {block}")
    B, V = logits.shape
    nchunk = triton.cdiv(V, chunk)
    val = torch.empty((B, nchunk), dtype=torch.float32, device=logits.device)
    idx = torch.empty((B, nchunk), dtype=torch.int32, device=logits.device)
    out = torch.empty((B,), dtype=torch.long, device=logits.device)
    if B:
        _argmax_chunk_kernel[(B, nchunk)](logits, val, idx, V, logits.stride(0), nchunk, CHUNK=chunk,
                                          BLOCK=block, num_warps=4)
        _argmax_final_kernel[(B,)](val, idx, out, V, nchunk,
                                   N_PAD=max(16, triton.next_power_of_2(nchunk)), num_warps=1)
    return out
