"""Static KV cache for in-place generation.

One preallocated pair of tensors per generation call shape, laid out for attention without copies:
k, v: (num_layers, rows, groups_local, length, head_dim), where `groups_local` is this rank's share
of the query groups (GQA) under TP_g. Column j of a row holds the key/value of that row's j-th slot:
the left-padded prompt fills columns 0..P-1, generated token s (s >= 1) is written at column P+s-1.
A batch bucket of b rows uses the views k[:, :b] (contiguous), so one cache serves every bucket and
CUDA graphs captured on those views stay valid until the cache is reallocated.

With rollout.kv_cache_dtype=fp8 each side is a kernels/kv_fp8.Fp8KV: E4M3 codes in that layout
plus one fp32 scale per (layer, row, group, column) (the format and its readers and writers are
described there).
"""

from __future__ import annotations

import torch

from hybridflow.kernels.kv_fp8 import KV_FP8, Fp8KV, as_indexable


def kv_cache_nbytes(*, num_layers: int, rows: int, groups: int, length: int, head_dim: int,
                    dtype: torch.dtype, fp8: bool = False) -> int:
    """Bytes of a KVCache of this shape: K and V, each (num_layers, rows, groups, length,
    head_dim) in `dtype`, or fp8 codes with one fp32 scale per (layer, row, group, column)."""
    n = num_layers * rows * groups * length * head_dim
    per_k = n + 4 * (n // head_dim) if fp8 else n * dtype.itemsize
    return 2 * per_k


class KVCache:
    def __init__(self, *, num_layers: int, rows: int, groups: int, length: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, fp8: bool = False):
        shape = (num_layers, rows, groups, length, head_dim)
        # zeros, not empty: warm-up/capture steps read the cache before any prefill wrote it
        if fp8:
            self.k, self.v = (Fp8KV(torch.zeros(shape, dtype=KV_FP8, device=device),
                                    torch.ones(shape[:-1], dtype=torch.float32, device=device))
                              for _ in range(2))
        else:
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def fp8(self) -> bool:
        return isinstance(self.k, Fp8KV)

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    @property
    def length(self) -> int:
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def _tensors(self) -> tuple:
        return tuple(t for kv in (self.k, self.v)
                     for t in (kv.tensors() if isinstance(kv, Fp8KV) else (kv,)))

    def fits(self, *, rows: int, length: int) -> bool:
        return rows <= self.rows and length <= self.length

    def layer(self, index: int, stop: int, start: int = 0):
        """(k, v) views (stop - start, groups, length, head_dim) of one layer's rows start..stop-1."""
        return self.k[index, start:stop], self.v[index, start:stop]

    def gather_rows(self, index: torch.Tensor, *, columns: int) -> None:
        """Rows 0..len(index)-1 := rows `index` (n,), over the first `columns` columns of every
        layer (codes and scales of an fp8 cache). Source and destination rows may overlap, so each
        layer goes through a temporary (one layer at a time: bounds it)."""
        n = index.shape[0]
        for t in self._tensors():  # (L, rows, G, T[, hd])
            for layer in as_indexable(t):
                layer[:n, :, :columns].copy_(layer[:, :, :columns].index_select(0, index))
