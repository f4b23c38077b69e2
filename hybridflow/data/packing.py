"""Sequence packing: one micro-batch's rows as ONE row of their real tokens, built on the host.

Row j of a micro-batch (prompt left-padded, response right-padded; masks are contiguous) becomes its
p_j real prompt tokens followed by its r_j real response tokens, at offset off_j of the packed row;
the rows follow each other in micro-batch order, and the packed length S is padded at the end to a
multiple of `multiple` (TP under sequence parallel). Each row is its own "document" (id j), the tail
padding one more (id b); attention stays within a document and is causal
(hybridflow.models.attention: `cu_seqlens` / `max_seqlen` for the varlen kernel, the document ids
for flex_attention's block mask). Megatron applies RoPE by absolute position
0..S-1, and RoPE scores depend only on relative positions, so a row at an offset attends exactly as
it does alone (the same reason left padding works).

The loss side keeps the padded micro-batch: per-token results over the packed row, (1, S), are
gathered into (b, R) by `PackedRows.unpack` (or, when the LM head ran only at the `scored`
positions, scattered by `PackedRows.unpack_scored`). Response token k of row j sits at packed
position off_j + p_j + k and is predicted by the output at the position before (`own_position`:
the reward model reads each token's own state). Log-prob targets are the packed ids shifted by one:
a row's last position predicts the next row's first token, which is never gathered. Entries past a
row's response are 0 (masked by response_mask, as the padded path's are). Recorded expert ids
(actor.router_replay) are packed like the ids: they follow their tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from hybridflow.data.batch import RolloutBatch


@dataclass
class PackedRows:
    input_ids: torch.Tensor  # (1, S) int64, rows' real tokens back to back, then 0s
    position_ids: torch.Tensor  # (1, S) int64, 0 at each row's first token
    targets: torch.Tensor  # (1, S) int64, the next packed token (0 at the end)
    document_ids: torch.Tensor  # (S,) int64, row j -> j, tail padding -> b
    # (n + 1,) int32, where each non-empty document starts, then S (FlashAttention's cu_seqlens)
    cu_seqlens: torch.Tensor
    max_seqlen: int  # the longest document, known on the host
    gather: torch.Tensor  # (b, R) int64, packed position of each (row, response token)'s result
    valid: torch.Tensor  # (b, R) bool, k < r_j
    scored: torch.Tensor  # (n,) int64, gather[valid]: the positions whose results are kept
    # (n,) int64, where each scored result goes in the flattened (b, R): valid's True entries,
    # found on the host (a mask scatter's backward would find them on the device: a sync)
    slots: torch.Tensor
    # (S, L, k) int16, the rows' recorded expert ids (RolloutBatch.experts) following their tokens,
    # -1 on the tail; None when the micro-batch has none
    experts: Optional[torch.Tensor] = None
    # fit to a PackedShape (`fit_packed`): the static shape the update's CUDA graphs replay
    fitted: bool = False

    def to(self, device) -> "PackedRows":
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device)
                                            for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), torch.Tensor)})

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """(1, S) per packed position -> (b, R) per response token; differentiable."""
        out = values[0][self.gather]
        return torch.where(self.valid, out, torch.zeros((), dtype=out.dtype, device=out.device))

    def unpack_scored(self, values: torch.Tensor) -> torch.Tensor:
        """(1, n) per `scored` position (in its order: row-major over `valid`) -> (b, R), 0 past
        each row's response; differentiable."""
        b, r = self.valid.shape
        return values.new_zeros(b * r).index_copy(0, self.slots, values[0]).view(b, r)


def pack_rows(mb: RolloutBatch, *, multiple: int = 1, own_position: bool = False) -> PackedRows:
    tokens = mb.token_mask().bool()  # (b, P + R)
    p, r = mb.prompt_mask.sum(1), mb.response_mask.sum(1)  # (b,)
    lengths = p + r
    ids = mb.input_ids()[tokens]  # row-major: row 0's prompt + response, then row 1's, ...
    real = ids.numel()
    s = -(-max(real, 1) // multiple) * multiple
    b, dev = mb.batch_size, ids.device  # a batch on the host (the trainer's) or on the device
    doc = torch.cat([torch.repeat_interleave(torch.arange(b, device=dev), lengths),
                     torch.full((s - real,), b, dtype=torch.long, device=dev)])
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])  # (b + 1,)
    positions = torch.arange(s, device=dev) - offsets[doc]  # the tail counts from 0 as well
    ids = torch.nn.functional.pad(ids, (0, s - real))
    targets = torch.cat([ids[1:], ids.new_zeros(1)])
    k = torch.arange(mb.response_ids.shape[1], device=dev)[None]  # (1, R)
    valid = k < r[:, None]
    gather = offsets[:-1, None] + p[:, None] + k - (0 if own_position else 1)
    # past a row's response (and a prompt-less row's first token): any in-range index, masked
    gather = torch.where(valid, gather, 0).clamp(min=0)
    docs = torch.cat([lengths, lengths.new_tensor([s - real])])
    docs = docs[docs > 0]  # rows without tokens, a tail of none: no document
    cu_seqlens = torch.cat([docs.new_zeros(1), docs.cumsum(0)]).to(torch.int32)
    experts = mb.experts()
    if experts is not None:  # (real, L, k) in the ids' order, then the tail
        experts = experts[tokens]
        experts = torch.cat([experts, experts.new_full((s - real, *experts.shape[1:]), -1)])
    return PackedRows(input_ids=ids[None], position_ids=positions[None], targets=targets[None],
                      document_ids=doc, cu_seqlens=cu_seqlens, max_seqlen=int(docs.max()),
                      gather=gather, valid=valid, scored=gather[valid],
                      slots=valid.flatten().nonzero().squeeze(1),
                      experts=experts)


@dataclass(frozen=True)
class PackedShape:
    """One static shape for packed rows (the update's CUDA graphs, models/graphs.py): `length`
    tokens, exactly `documents` documents in cu_seqlens (zero-length ones at the end), none longer
    than `max_seqlen` (the varlen kernel's grid: documents x max_seqlen / 128 blocks per head, so
    both are kept tight)."""
    length: int
    documents: int
    max_seqlen: int

    def cu_seqlens(self, lengths: list) -> torch.Tensor:
        """(documents + 1,) int32: 0, then the ends of documents of `lengths`, then empty ones."""
        docs = torch.tensor(list(lengths) + [0] * (self.documents - len(lengths)), dtype=torch.long)
        return torch.cat([docs.new_zeros(1), docs.cumsum(0)]).to(torch.int32)

    def placeholder_cu_seqlens(self) -> torch.Tensor:
        """A valid layout of this shape (the whole length as documents of max_seqlen): what a
        capture's static cu_seqlens hold until the first micro-batch's are copied in."""
        return self.cu_seqlens(_pieces(self.length, self.max_seqlen))


def _pieces(tokens: int, longest: int) -> list:
    """`tokens` (a tail, or a whole length) as documents of at most `longest`."""
    whole, rest = divmod(tokens, longest)
    return [longest] * whole + ([rest] if rest else [])


def _row_lengths(packed: PackedRows) -> torch.Tensor:
    """The real rows' lengths (the documents before the tail), on the host."""
    docs = packed.cu_seqlens.diff().cpu()
    s, b = packed.input_ids.shape[1], packed.valid.shape[0]
    real = int((packed.document_ids < b).sum())
    return docs[:-1] if s > real else docs


def row_lengths(mb: RolloutBatch) -> torch.Tensor:
    """The documents `pack_rows` makes of mb's rows, known before packing: each row's token count
    (rows without tokens left out)."""
    lengths = mb.prompt_mask.sum(1) + mb.response_mask.sum(1)
    return lengths[lengths > 0]


def packed_length(rows: torch.Tensor, multiple: int = 1) -> int:
    """The length of the packed row `pack_rows` makes of documents `rows`."""
    return -(-max(int(rows.sum()), 1) // multiple) * multiple


def fits(rows: torch.Tensor, shape: PackedShape) -> bool:
    """Whether a packed row of documents `rows` fits `shape` (`fit_packed` pads it, not None)."""
    tail = shape.length - int(rows.sum())
    if tail < 0 or (rows.numel() and int(rows.max()) > shape.max_seqlen):
        return False
    return rows.numel() + len(_pieces(tail, shape.max_seqlen)) <= shape.documents


def shape_for(packed: list[PackedRows], *, length: int, at_least: Optional[PackedShape] = None,
              headroom: float = 1.25) -> PackedShape:
    """A PackedShape of `length` tokens for `packed` (on the host, none longer): max_seqlen their
    longest row rounded up to 128 (at most `length`), documents the most any of them then takes
    (its rows and its tail's pieces) times `headroom`, rounded up to 8; neither below
    `at_least`'s (a shape grown from the last one)."""
    return shape_for_rows([_row_lengths(p) for p in packed], length=length, at_least=at_least,
                          headroom=headroom)


def shape_for_rows(rows: list[torch.Tensor], *, length: int,
                   at_least: Optional[PackedShape] = None, headroom: float = 1.25) -> PackedShape:
    """`shape_for` from each packed row's documents (`row_lengths`), before packing."""
    longest = max((int(r.max()) for r in rows if r.numel()), default=1)
    m = min(-(-longest // 128) * 128, length)
    if at_least is not None:
        m = max(m, at_least.max_seqlen)
    need = max(r.numel() + len(_pieces(length - int(r.sum()), m)) for r in rows)
    docs = -(-int(need * headroom) // 8) * 8
    if at_least is not None:
        docs = max(docs, at_least.documents)
    return PackedShape(length=length, documents=docs, max_seqlen=m)


def fit_packed(packed: PackedRows, shape: PackedShape) -> Optional[PackedRows]:
    """`packed` (on the host) at `shape`: its tail padded to shape.length tokens as documents of
    at most shape.max_seqlen (ids b, b + 1, ...), cu_seqlens at shape.documents + 1 entries (the
    extra documents empty) and max_seqlen = shape.max_seqlen; the real tokens, their positions
    and every gather index unchanged. None where it does not fit (longer, more documents, or a
    row longer than max_seqlen)."""
    rows = _row_lengths(packed)
    if not fits(rows, shape):
        return None
    real = int(rows.sum())
    pieces = _pieces(shape.length - real, shape.max_seqlen)
    b = packed.valid.shape[0]
    pad = shape.length - packed.input_ids.shape[1]
    dev = packed.position_ids.device
    tail_docs = torch.repeat_interleave(torch.arange(b, b + len(pieces)),
                                        torch.tensor(pieces, dtype=torch.long)).to(dev)
    tail_pos = torch.cat([torch.arange(n) for n in pieces]
                         or [torch.zeros(0, dtype=torch.long)]).to(dev)
    ids = F.pad(packed.input_ids, (0, pad))
    experts = packed.experts
    if experts is not None:
        experts = torch.cat([experts, experts.new_full((pad, *experts.shape[1:]), -1)])
    return dataclasses.replace(
        packed, input_ids=ids,
        position_ids=torch.cat([packed.position_ids[0, :real], tail_pos])[None],
        targets=torch.cat([ids[0, 1:], ids.new_zeros(1)])[None],
        document_ids=torch.cat([packed.document_ids[:real], tail_docs]),
        cu_seqlens=shape.cu_seqlens(rows.tolist() + pieces).to(packed.cu_seqlens.device),
        max_seqlen=shape.max_seqlen, experts=experts, fitted=True)
