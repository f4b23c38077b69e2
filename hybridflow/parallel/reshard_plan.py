"""The reshard plan: where every generation weight lives in the gathered buffers (pure, no groups).

Computed once from every pipeline stage's (name, shape, dtype) list and the layouts; `reshard.py`
executes it each step. Vocabulary (see `layout.py`): m = TP_t / TP_g, j = this rank's place in its
micro-DP group, a *piece* is one all-gather over the micro-DP group: each of the m ranks contributes
`numel` contiguous elements and the gathered *region* is `m * numel` elements, rank j's contribution at
`j * numel`. The region is laid out so that every gen tensor is a view of it, never a regrouped copy:
- vocab (embedding, output layer) and column (QKV weight/bias): a gen shard is the concatenation of the
  m training shards on dim 0, so one piece per parameter. QKV concatenates cleanly only if each training
  shard holds whole query groups (num_query_groups % TP_t == 0); the plan checks it. The vocab keeps the
  training padding: V_pad(TP_t) / TP_g rows per gen shard (padded logits are masked downstream).
- gated_fc1: a training shard is [gate_j; up_j] and the gen shard [gate_0..gate_m-1; up_0..up_m-1], so
  two pieces, gate halves then up halves, in adjacent regions: the gen tensor spans both.
- row (linear_proj, linear_fc2): the gen shard concatenates on dim 1, which no row-major view of
  rank-major chunks can be; each rank contributes its shard *transposed* (in/TP_t, out), the region is
  W_gen^T (m*in/TP_t, out) row-major and the gen tensor is its `.t()` view (out, m*in/TP_t) with strides
  (1, out): dense, not contiguous; `F.linear`/matmul take it as is (cuBLAS transposed operand).
- replicated (norms): identical on the m ranks: no gather. With PP_t == 1 the gen tensor is the
  training parameter itself (an alias, no copy); so is every tensor when also m == 1.
With PP_t > 1 a bucket has one *slot* per pipeline stage. Decoder-layer parameters are the same list on
every stage ("uniform" buckets): each stage fills its own slot (micro-DP gathers, replicated copies) and
one in-place all-gather over the PP group fills the others; slot s holds layers of stage s (global
indices). Embedding / final norm / output layer live on one stage ("ragged" buckets, one slot): filled
there, then broadcast over the PP group. With tied embeddings the last stage's output_layer.weight is
skipped: a PP=1 tied model has none. Buckets group parameters (never split one) up to `bucket_numel`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridflow.parallel import param_rules as pr
from hybridflow.parallel.layout import Layout

ALIGN_BYTES = 128  # region offsets are aligned for vectorised copies; real shapes need no padding


@dataclass(frozen=True)
class ParamMeta:
    name: str  # local name (this stage's layer indices)
    shape: tuple
    dtype: torch.dtype


@dataclass(frozen=True)
class Piece:
    """One rank's contribution, copied into its place of a region (then gathered if `gathered`)."""

    param: str                 # local training parameter name
    rows: tuple | None         # (start, stop) rows of the training shard; None: all
    transpose: bool            # contribute shard.t() (row-parallel)
    own_shape: tuple           # shape of the contribution as stored in the region
    numel: int
    gathered: bool             # False: replicated (or m == 1), the region is the own copy
    offset: int                # region offset in the slot (elements)


@dataclass(frozen=True)
class GenView:
    name: str                  # gen (global) name
    offset: int                # in the slot (elements)
    stored_shape: tuple        # row-major shape in the buffer
    transposed: bool           # the gen tensor is the stored tensor's .t()

    @property
    def numel(self) -> int:
        return _numel(self.stored_shape)


@dataclass
class Bucket:
    stages: tuple              # the pipeline stage whose data fills slot i
    dtype: torch.dtype
    slot_numel: int = 0
    pieces: list = field(default_factory=list)   # what an owner stage contributes to its slot
    views: list = field(default_factory=list)    # per slot: [GenView]


@dataclass
class Plan:
    layout: Layout
    aliases: list              # [(gen name, local training name)]: returned as the parameter itself
    buckets: list              # [Bucket]
    names: list                # gen names in the order of a PP=1 model's named_parameters()

    def buffer_numel(self) -> int:
        return sum(len(b.stages) * b.slot_numel for b in self.buckets)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _align(n: int, dtype: torch.dtype) -> int:
    a = max(1, ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
    return -(-n // a) * a


def _pieces(meta: ParamMeta, *, m: int, tp_t: int, num_query_groups: int):
    """(pieces without offsets, gen stored shape, transposed) of one parameter."""
    rule = pr.param_rule(meta.name)
    shape, numel = tuple(meta.shape), _numel(meta.shape)
    if rule == pr.REPLICATED or m == 1:
        return [Piece(meta.name, None, False, shape, numel, False, 0)], shape, False
    if rule == pr.COLUMN and ".linear_qkv." in meta.name:
        if num_query_groups % tp_t or shape[0] % (num_query_groups // tp_t):
            raise ValueError(f"{meta.name}: num_query_groups={num_query_groups} is not divisible by "
                             f"TP_t={tp_t}: a QKV shard must hold whole query groups to concatenate")
    if rule in (pr.VOCAB, pr.COLUMN):
        return ([Piece(meta.name, None, False, shape, numel, True, 0)],
                (shape[0] * m,) + shape[1:], False)
    if rule == pr.GATED_FC1:
        if shape[0] % 2:
            raise ValueError(f"{meta.name}: gated fc1 shard has an odd number of rows {shape[0]}")
        f = shape[0] // 2
        half = (f,) + shape[1:]
        return ([Piece(meta.name, (0, f), False, half, numel // 2, True, 0),
                 Piece(meta.name, (f, 2 * f), False, half, numel // 2, True, 0)],
                (2 * f * m,) + shape[1:], False)
    assert rule == pr.ROW and len(shape) == 2, (meta.name, rule)
    out_dim, in_dim = shape
    piece = Piece(meta.name, None, True, (in_dim, out_dim), numel, True, 0)
    return [piece], (in_dim * m, out_dim), True


def build_plan(stages: list[list[ParamMeta]], *, layout: Layout, num_layers: int,
               num_query_groups: int, tied: bool, bucket_numel: int) -> Plan:
    """Plan for a model whose stage s has parameters `stages[s]` (local names, in
    named_parameters order)."""
    pp, m = layout.pp_t, layout.micro_dp
    if len(stages) != pp:
        raise ValueError(f"reshard plan: got {len(stages)} stage parameter lists for PP_t={pp}")

    def gname(local: str, s: int) -> str:
        return pr.global_name(local, pp_rank=s, num_layers=num_layers, pp_size=pp)

    def keep(meta: ParamMeta) -> bool:  # a tied PP>1 last stage's output copy is no gen weight
        return not (tied and pp > 1 and pr.param_rule(meta.name) == pr.VOCAB
                    and meta.name.endswith("output_layer.weight"))

    def uniform(meta: ParamMeta) -> bool:
        return pp > 1 and pr.layer_index(meta.name) is not None

    layer_lists = [[p for p in st if uniform(p)] for st in stages]
    if any(lst != layer_lists[0] for lst in layer_lists):
        raise ValueError("reshard plan: pipeline stages hold different decoder-layer parameters; "
                         "every stage must have the same number and shapes of layers")

    aliases, buckets = [], []
    open_buckets: dict = {}

    def add(meta: ParamMeta, owner_stages: tuple) -> None:
        if pp == 1 and (m == 1 or pr.param_rule(meta.name) == pr.REPLICATED):
            aliases.append((meta.name, meta.name))
            return
        pieces, stored, transposed = _pieces(meta, m=m, tp_t=layout.tp_t,
                                             num_query_groups=num_query_groups)
        key = (owner_stages, meta.dtype)
        b = open_buckets.get(key)
        if b is None or (b.slot_numel and b.slot_numel + _numel(stored) > bucket_numel):
            b = Bucket(stages=owner_stages, dtype=meta.dtype, views=[[] for _ in owner_stages])
            buckets.append(b)
            open_buckets[key] = b
        start = offset = b.slot_numel
        for piece in pieces:  # adjacent regions: the gen tensor may span several (gated fc1)
            b.pieces.append(Piece(piece.param, piece.rows, piece.transpose, piece.own_shape,
                                  piece.numel, piece.gathered, offset))
            offset += piece.numel * (m if piece.gathered else 1)
        b.slot_numel = _align(offset, meta.dtype)
        for i, s in enumerate(owner_stages):
            b.views[i].append(GenView(gname(meta.name, s), start, stored, transposed))

    names = []
    for s, st in enumerate(stages):
        for meta in st:
            if not keep(meta):
                continue
            names.append(gname(meta.name, s))
            if uniform(meta):
                if s == 0:
                    add(meta, tuple(range(pp)))
            else:
                add(meta, (s,))
    if len(set(names)) != len(names):
        raise ValueError("reshard plan: a non-layer parameter is present on several pipeline stages")
    return Plan(layout=layout, aliases=aliases, buckets=buckets, names=names)
