"""Static KV cache for in-place generation.

One preallocated pair of tensors per generation call shape, laid out for attention without copies:
k, v: (num_layers, rows, groups_local, length, head_dim), where `groups_local` is this rank's share
of the query groups (GQA) under TP_g. Column j of a row holds the key/value of that row's j-th slot:
the left-padded prompt fills columns 0..P-1, generated token s (s >= 1) is written at column P+s-1.
A batch bucket of b rows uses the views k[:, :b] (contiguous), so one cache serves every bucket and
CUDA graphs captured on those views stay valid until the cache is reallocated.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, *, num_layers: int, rows: int, groups: int, length: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (num_layers, rows, groups, length, head_dim)
        # zeros, not empty: warm-up/capture steps read the cache before any prefill wrote it
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    @property
    def length(self) -> int:
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def fits(self, *, rows: int, length: int) -> bool:
        return rows <= self.rows and length <= self.length

    def layer(self, index: int, stop: int, start: int = 0):
        """(k, v) views (stop - start, groups, length, head_dim) of one layer's rows start..stop-1."""
        return self.k[index, start:stop], self.v[index, start:stop]

    def gather_rows(self, index: torch.Tensor, *, columns: int) -> None:
        """Rows 0..len(index)-1 := rows `index` (n,), over the first `columns` columns of every
        layer. Source and destination rows may overlap, so each layer goes through a temporary
        (one layer at a time: bounds it)."""
        n = index.shape[0]
        for kv in (self.k, self.v):  # (L, rows, G, T, hd)
            for layer in kv:
                layer[:n, :, :columns].copy_(layer[:, :, :columns].index_select(0, index))
