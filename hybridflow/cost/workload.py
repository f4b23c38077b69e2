"""What one RL step does (`Workload`) and where it runs (`Layout`): validated inputs of the cost model."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from hybridflow.cost.shapes import ModelShape

ALGORITHMS = ("ppo", "grpo", "rloo", "reinforce_plus_plus")
DTYPES = ("bf16", "fp16")


@dataclass(frozen=True)
class Workload:
    algorithm: str = "grpo"
    prompts_per_step: int = 128
    samples_per_prompt: int = 8
    prompt_len: int = 512
    response_len: int = 1024      # every response is assumed to run to this length
    ppo_epochs: int = 1
    mini_batches: int = 1         # optimizer steps per PPO epoch
    micro_batch_tokens: int = 8192  # tokens per micro-batch in the update phases
    # tokens per micro-batch of the forward-only passes (old_log_prob, ref, values); None: as above
    # (the trainer's algo.forward_micro_batch_size_per_gpu)
    forward_micro_batch_tokens: int | None = None
    use_reference: bool = True
    dtype: str = "bf16"

    def __post_init__(self):
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm {self.algorithm!r}: expected one of {ALGORITHMS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: expected one of {DTYPES}")
        for f in ("prompts_per_step", "samples_per_prompt", "prompt_len", "response_len",
                  "ppo_epochs", "mini_batches", "micro_batch_tokens", "forward_micro_batch_tokens"):
            v = getattr(self, f)
            if f == "forward_micro_batch_tokens" and v is None:   # None: as micro_batch_tokens
                continue
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{f} must be a positive integer, got {v!r}")

    @property
    def has_critic(self) -> bool:
        return self.algorithm == "ppo"

    @property
    def num_sequences(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len

    @property
    def tokens_per_step(self) -> int:
        return self.num_sequences * self.seq_len

    @property
    def seqs_per_micro_batch(self) -> int:
        return max(1, self.micro_batch_tokens // self.seq_len)

    @property
    def seqs_per_forward_micro_batch(self) -> int:
        return max(1, (self.forward_micro_batch_tokens or self.micro_batch_tokens) // self.seq_len)

    def num_micro_batches(self, dp: int) -> int:
        """Micro-batches per DP rank per mini-batch."""
        per_rank = math.ceil(self.num_sequences / self.mini_batches / dp)
        return math.ceil(per_rank / self.seqs_per_micro_batch)


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    tp_gen: int = 1
    offload_ref: bool = False   # reference weights live on the host, copied in for the ref pass
    recompute: bool = False     # full activation recompute in the update phases

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def dp_gen(self) -> int:
        return self.num_gpus // self.tp_gen

    def to_dict(self) -> dict:
        return asdict(self)

    def short(self) -> str:
        s = f"tp={self.tp} pp={self.pp} dp={self.dp} tp_gen={self.tp_gen}"
        return s + (" offload_ref" if self.offload_ref else "") + (" recompute" if self.recompute else "")

    def check(self, shape: ModelShape, num_gpus: int) -> None:
        """ValueError unless megatron-core can build this layout for `shape` on `num_gpus`."""
        if min(self.tp, self.pp, self.dp, self.tp_gen) < 1:
            raise ValueError(f"layout {self.short()}: sizes must be >= 1")
        if self.num_gpus != num_gpus:
            raise ValueError(f"layout {self.short()}: tp*pp*dp = {self.num_gpus} != num_gpus {num_gpus}")
        if self.tp % self.tp_gen:
            raise ValueError(f"layout {self.short()}: tp_gen must divide tp")
        if shape.num_query_groups % self.tp or shape.num_attention_heads % self.tp:
            raise ValueError(f"layout {self.short()}: tp must divide num_query_groups "
                             f"({shape.num_query_groups}) and num_attention_heads")
        if shape.num_layers % self.pp:
            raise ValueError(f"layout {self.short()}: pp must divide num_layers ({shape.num_layers})")


def make_layout(layout: dict | Layout, num_gpus: int) -> Layout:
    """A Layout from a dict of tp, pp, dp (default: the rest), tp_gen (default tp), offload_ref, recompute."""
    if isinstance(layout, Layout):
        return layout
    unknown = set(layout) - {"tp", "pp", "dp", "tp_gen", "offload_ref", "recompute"}
    if unknown:
        raise ValueError(f"layout: unknown keys {sorted(unknown)}")
    tp, pp = int(layout.get("tp", 1)), int(layout.get("pp", 1))
    dp = int(layout.get("dp") or max(1, num_gpus // (tp * pp)))
    return Layout(tp=tp, pp=pp, dp=dp, tp_gen=int(layout.get("tp_gen") or tp),
                  offload_ref=bool(layout.get("offload_ref", False)),
                  recompute=bool(layout.get("recompute", False)))
