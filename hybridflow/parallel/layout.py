"""Training and generation layouts of the actor on the same ranks: pure rank arithmetic, no groups.

Training layout: Megatron `parallel_state` with TP_t x PP_t x DP_t, rank order tp-cp-ep-dp-pp (CP = EP
= 1 here), so `rank = tp + TP_t * (dp + DP_t * pp)`: TP ranks are consecutive, PP is the slowest axis.

Generation layout: TP_g x 1 x DP_g on the same `world` ranks, TP_g dividing TP_t, every rank holding all
layers of its TP_g shard. With m = TP_t / TP_g (the micro-DP size):
- micro-DP group: inside one training TP group, the ranks with TP ranks k*m .. k*m+m-1 (same dp, pp).
  Their training shards, concatenated per parameter rule, are gen TP shard k, so a rank's gen TP rank
  is `tp_t // m` and its place in the micro-DP group is `tp_t % m`.
- PP gather group (PP_t > 1 only): the ranks with the same (tp_t, dp) over all pipeline stages, i.e.
  Megatron's pipeline group; after the micro-DP gather each of them holds gen shard `tp_t // m` of its
  own stage's layers, and gathering over this group gives every one of them all layers.
- gen TP group: the ranks that hold gen shards 0..TP_g-1 of one replica: same (pp, dp, tp_t % m).
  Gen DP rank: `(pp * DP_t + dp) * m + tp_t % m`, so DP_g = PP_t * DP_t * m = world / TP_g.
All rank lists are sorted ascending, which is also the order of ranks inside a `dist.new_group`; the
orders are chosen so that a group rank equals the coordinate the group gathers over (tp_t % m in a
micro-DP group, pp in a PP gather group, gen tp in a gen TP group).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainCoord:
    tp: int
    pp: int
    dp: int


@dataclass(frozen=True)
class GenCoord:
    tp: int
    dp: int


@dataclass(frozen=True)
class Layout:
    """The two layouts of one actor. Arguments: world size, TP_t, PP_t and TP_g."""

    world_size: int
    tp_t: int
    pp_t: int
    tp_g: int

    def __post_init__(self):
        for key in ("world_size", "tp_t", "pp_t", "tp_g"):
            if getattr(self, key) < 1:
                raise ValueError(f"layout: {key}={getattr(self, key)} must be >= 1")
        if self.world_size % (self.tp_t * self.pp_t):
            raise ValueError(f"layout: world size {self.world_size} is not divisible by "
                             f"TP_t={self.tp_t} x PP_t={self.pp_t}")
        if self.tp_t % self.tp_g:
            raise ValueError(f"layout: rollout TP_g={self.tp_g} must divide training TP_t={self.tp_t}")

    @property
    def dp_t(self) -> int:
        return self.world_size // (self.tp_t * self.pp_t)

    @property
    def micro_dp(self) -> int:
        """m = TP_t / TP_g: how many training shards make one gen shard."""
        return self.tp_t // self.tp_g

    @property
    def dp_g(self) -> int:
        return self.world_size // self.tp_g

    @property
    def needs_reshard(self) -> bool:
        """False when generation can use the training parameters as they are."""
        return self.tp_g != self.tp_t or self.pp_t > 1

    @property
    def replicas_per_model_parallel_group(self) -> int:
        """Gen replicas inside one training model-parallel group (the TP_t x PP_t ranks of a DP
        replica): PP_t * m."""
        return self.pp_t * self.micro_dp

    # ----- coordinates -----
    def train_coord(self, rank: int) -> TrainCoord:
        self._check_rank(rank)
        return TrainCoord(tp=rank % self.tp_t, pp=rank // (self.tp_t * self.dp_t),
                          dp=(rank // self.tp_t) % self.dp_t)

    def train_rank(self, *, tp: int, pp: int, dp: int) -> int:
        if not (0 <= tp < self.tp_t and 0 <= pp < self.pp_t and 0 <= dp < self.dp_t):
            raise ValueError(f"train coordinate tp={tp} pp={pp} dp={dp} is outside {self}")
        return tp + self.tp_t * (dp + self.dp_t * pp)

    def gen_coord(self, rank: int) -> GenCoord:
        c = self.train_coord(rank)
        m = self.micro_dp
        return GenCoord(tp=c.tp // m, dp=(c.pp * self.dp_t + c.dp) * m + c.tp % m)

    def replica_in_model_parallel_group(self, rank: int) -> int:
        """Index (0 .. PP_t * m - 1) of the rank's gen replica among those of its training
        model-parallel group, ordered by (pp, tp_t % m) as the gen DP ranks of that group are."""
        c = self.train_coord(rank)
        return c.pp * self.micro_dp + c.tp % self.micro_dp

    def gen_rank(self, *, tp: int, dp: int) -> int:
        if not (0 <= tp < self.tp_g and 0 <= dp < self.dp_g):
            raise ValueError(f"gen coordinate tp={tp} dp={dp} is outside {self}")
        m = self.micro_dp
        stage_dp, j = divmod(dp, m)
        pp, dp_t = divmod(stage_dp, self.dp_t)
        return self.train_rank(tp=tp * m + j, pp=pp, dp=dp_t)

    # ----- rank lists (each a partition of all ranks) -----
    def micro_dp_groups(self) -> list[list[int]]:
        """One list per (pp, dp, k): the training TP ranks k*m .. k*m+m-1 that make gen shard k."""
        m = self.micro_dp
        return [[self.train_rank(tp=k * m + j, pp=pp, dp=dp) for j in range(m)]
                for pp in range(self.pp_t) for dp in range(self.dp_t) for k in range(self.tp_g)]

    def pp_gather_groups(self) -> list[list[int]]:
        """One list per (tp, dp): the ranks over all stages (empty when PP_t == 1)."""
        if self.pp_t == 1:
            return []
        return [[self.train_rank(tp=tp, pp=pp, dp=dp) for pp in range(self.pp_t)]
                for dp in range(self.dp_t) for tp in range(self.tp_t)]

    def gen_tp_groups(self) -> list[list[int]]:
        """One list per gen replica: the ranks holding gen shards 0..TP_g-1 (in gen TP order)."""
        groups = [[self.gen_rank(tp=k, dp=d) for k in range(self.tp_g)] for d in range(self.dp_g)]
        assert all(g == sorted(g) for g in groups)
        return groups

    # ----- shards -----
    def train_shards_of_gen_shard(self, gen_tp: int) -> list[int]:
        """Training TP ranks whose shards, concatenated in this order, make gen TP shard `gen_tp`."""
        if not 0 <= gen_tp < self.tp_g:
            raise ValueError(f"gen TP rank {gen_tp} is outside TP_g={self.tp_g}")
        m = self.micro_dp
        return list(range(gen_tp * m, gen_tp * m + m))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
