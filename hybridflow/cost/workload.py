"""What one RL step does (`Workload`) and where it runs (`Plan`: the trainer's parallel `Layout` plus
the cost model's memory options): validated inputs of the cost model."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from hybridflow.config import ParallelConfig
from hybridflow.config_checks import validate_model, validate_moe
from hybridflow.model_config import ModelConfig
from hybridflow.parallel.layout import Layout

ALGORITHMS = ("ppo", "grpo", "rloo", "reinforce_plus_plus")
DTYPES = ("bf16", "fp16")


@dataclass(frozen=True)
class Workload:
    algorithm: str = "grpo"
    prompts_per_step: int = 128
    samples_per_prompt: int = 8
    prompt_len: int = 512
    response_len: int = 1024      # the mean response length (every response, by default)
    # the longest response of a step (decode runs until it ends: every step pays the per-step
    # weight read and launches); None: every response runs to response_len (forced lengths)
    response_len_max: int | None = None
    ppo_epochs: int = 1
    mini_batches: int = 1         # optimizer steps per PPO epoch
    micro_batch_tokens: int = 8192  # tokens per micro-batch in the update phases
    # tokens per micro-batch of the forward-only passes (old_log_prob, ref, values); None: as above
    # (the trainer's algo.forward_micro_batch_size_per_gpu)
    forward_micro_batch_tokens: int | None = None
    use_reference: bool = True
    dtype: str = "bf16"
    # the trainer leaves out the old_log_prob pass (one epoch of one mini-batch: the update's own
    # forward is the old policy, hybridflow.algo.on_policy; algo.skip_redundant_old_log_prob)
    skip_old_log_prob: bool = False
    # the generator prefills each prompt once and copies its K/V to the prompt's n sample rows
    # (hybridflow.rollout.generator); records measured before it did say false: every sample row
    # was prefilled
    prefill_once_per_prompt: bool = True
    # rollout.free_cache_engine=false: the generator's KV cache (and graphs) stay allocated through
    # the training phases where generation reads the training weights in place (no reshard)
    keep_generator: bool = False
    # the training-side passes compute logits only at the positions that predict response tokens
    # (hybridflow.engine, LeanOutputLinear.select); records measured before they did say false
    response_logits_only: bool = True
    # the logits stay bf16 into the log-prob kernels (no fp32 upcast of tokens x vocab); records
    # measured before say false
    bf16_logits: bool = True
    # parallel.lm_head_chunk_tokens: the LM head + log-prob pass this many positions at a time
    # (logits of one chunk held, one more LM-head GEMM in the update's backward); 0: whole
    lm_head_chunk_tokens: int = 0
    # reward.score_in_pass: the rule reward (the per-row part of "other") scored on the host while
    # the step's first forward-only pass runs on the device: hidden where such a pass runs (the
    # pass's device time covers it; a rule slower than the pass would show in that pass)
    reward_in_pass: bool = False
    # rollout.decode_kernels: "triton" (the fused decode kernels, what the trainer's default "auto"
    # runs on a GPU; the records that measured them also ran rollout.compile_decode) has its own
    # fitted per-layer decode cost; records of the PyTorch decode say "torch"
    decode_kernels: str = "triton"
    # rollout.quantization: the bytes per layer weight the decode step reads
    # (flops.ROLLOUT_BYTES_PER_WEIGHT); the records measured so far say "none"
    rollout_quantization: str = "none"
    # rollout.kernel_options.int4_kernel_max_rows: int4 GEMMs of more rows (prefill, decode buckets
    # above it) dequantize the weight to bf16 and run cuBLAS instead of the weight-only kernel
    int4_kernel_max_rows: int = 256
    # rollout.kernel_options.own_columns_only (triton decode): a decode row's attention reads its
    # own columns only (no left padding, no window columns past its token, nothing once it
    # finished); records measured before say false
    own_columns_only: bool = False
    # triton decode: each step's draw by the fused sampler's inverse CDF (kernels/sample.py;
    # temperature > 0, no top-k / top-p) instead of the exponential race every calibration record
    # drew by, which the fitted decode terms hold: timing.py charges the difference
    # (`sampler_delta`); records measured before say false
    cdf_sampler: bool = False
    # rollout.kv_cache_dtype: "fp8" caches (and moves) 1 + 4 / head_dim bytes per K/V value
    # instead of 2 (flops.kv_bytes_per_token); its decode reads cost bf16's (timing._gen)
    kv_cache_dtype: str = "auto"
    # parallel.fused_elementwise (the trainer's default): the training passes' RoPE and SwiGLU as
    # fused kernels (own fitted MFUs; the unfused SwiGLU also keeps two more ffn-wide tensors per
    # token and layer); records measured before it existed say false
    fused_elementwise: bool = True
    # parallel.train_cuda_graphs: the update passes replay each layer's forward and backward as
    # CUDA graphs (one launch per layer pass: its own fitted per-layer cost, the micro-batch's
    # eager LM head and loss folded in; forward-only passes stay eager); their static inputs,
    # outputs and gradients stay allocated for the run
    train_cuda_graphs: bool = False
    # records of train_cuda_graphs measured before the graphs added the weight gradients into
    # DDP's main_grad themselves say true: those graphs also held the layers' weight gradients
    # (bf16) as static outputs for the run
    graph_weight_grads_held: bool = False
    # parallel.train_graphs_min_fill: under train_cuda_graphs, packed micro-batches of fewer real
    # tokens than this share of the budget run the eager layers, unpadded; records of the graphs
    # measured before it existed say 0 (every packed micro-batch padded to the budget)
    graph_min_fill: float = ParallelConfig.train_graphs_min_fill
    # parallel.gradient_accumulation_fusion (the trainer's default): the decoder layers' weight
    # gradients go into DDP's main_grad inside their backward GEMM, not through a bf16 gradient and
    # a second pass per micro-batch (timing.GRAD_ACCUM_*); records measured before say false
    gradient_accumulation_fusion: bool = True
    # trainer.offload_ref_prefetch (the default), for layouts with offload_ref: the reference's
    # weights are copied back behind generation, so they sit on the GPU through generation too
    # (memory) and their PCIe copy is hidden (timing); false: copied in the ref stage
    offload_ref_prefetch: bool = True
    # actor.lora.rank (all-linear targets): only the adapters have grads and optimizer state, and
    # the reference is the actor with its adapters off (no copy); 0: full-parameter training
    lora_rank: int = 0
    # actor.offload_optimizer: the fp32 master weights and Adam state live in host memory, on the
    # GPU only during the optimizer step (after the update's activations are freed)
    offload_optimizer: bool = False
    # actor.offload_grads: the actor's gradient buffers exist only in the update phase
    offload_grads: bool = False
    # actor.offload_params: the actor's training weights (LoRA: its frozen base) leave the GPU in
    # the critic's phases and, when the generator holds its own copy of the decoder's matrices
    # (rollout_quantization != none, or a reshard), in generation (cost/memory.py)
    offload_params: bool = False
    # critic.lora.rank (PPO, all-linear targets): the critic's grads and optimizer state cover its
    # adapters and value head only
    critic_lora_rank: int = 0
    # MoE experts' training GEMMs: false, megatron-core's SequentialMLP (no transformer-engine: one
    # expert's GEMMs after another, a fixed cost per local expert per layer pass,
    # `Calibration.expert_pass_s`); true, TE's grouped GEMM (one kernel for all local experts: no
    # per-expert cost). The MoE record measured so far (H200, an image without TE) says false
    moe_grouped_gemm: bool = False
    # --- variable lengths (hybridflow.cost.varlen; None / off: every row prompt_len + response_len)
    # the step's response lengths as a distribution: K representative lengths, each 1/K of the rows
    # (hybridflow.cost.lengths); when set, response_len and response_len_max are their mean and max
    response_lengths: tuple[int, ...] | None = None
    # the longest prompt (generation left-pads a chunk's prompts to it); None: prompt_len
    prompt_len_max: int | None = None
    # rollout.max_new_tokens: the cap. A step whose longest row ends before it stops at the next
    # stop poll; None: rows end at their length exactly
    max_new_tokens: int | None = None
    # rollout.max_batch_size: rows per generation chunk; None: as many as the memory holds
    gen_max_batch_size: int | None = None
    # rollout.compact_finished_rows: live rows move to smaller graph buckets as rows finish
    compact_finished_rows: bool = False
    # rollout.decode_kv_window: a decode step attends over the multiple of it holding every
    # written column (0: the written columns; the records before it existed were fitted so)
    decode_kv_window: int = 0
    # algo.use_dynamic_bsz: micro-batches by token budget (micro_batch_tokens /
    # forward_micro_batch_tokens), rows grouped by length (hybridflow.data.microbatch)
    dynamic_bsz: bool = False
    # algo.pack_sequences: each token-budget micro-batch as one packed row of real tokens
    pack_sequences: bool = False
    # algo.balance_micro_batches: packed micro-batches dealt evenly (data.microbatch)
    balanced_micro_batches: bool = False
    # algo.packed_attention as a GPU run resolves it (from_config.packed_kernel): "flex", a
    # flex_attention document mask (every packed record's kernel but the varlen family's);
    # "varlen", FlashAttention-2 varlen over the documents; "fa4", FlashAttention-4's (the
    # update's graphed micro-batches still varlen's). Each its share of masked attention's cost
    # (cost.varlen.MASKED_SHARE)
    packed_attention: str = "flex"
    # dynamic sampling (algo.dynamic_sampling): generation calls per step, each paying the long
    # tail, and prompts generated per trained prompt (its metrics dynamic_sampling/rounds, /batches)
    gen_rounds: float = 1.0
    gen_prompt_factor: float = 1.0
    # algo.dynamic_sampling.batches_per_round: prompt batches of the largest generation call of
    # the run (the first round draws all of them, adaptive rounds at most that); a kept generator's
    # KV cache is sized by that call (1: every call generates one step's prompts)
    gen_batches_per_round: int = 1
    # rollout.partial.max_decode_steps when rollout.partial.enable (0: off): each call decodes at
    # most this many tokens per row; a longer response runs over several steps, each re-prefilling
    # the row's prompt + response so far (costed in the steady state: one step's call holds every
    # segment of a step's worth of rows, cost.varlen)
    partial_decode_steps: int = 0
    # rollout.partial.extra_prompts (over all DP ranks): groups kept in flight beyond the step's;
    # the first step generates all of them, the run's largest call (a kept KV cache's rows)
    partial_extra_prompts: int = 0
    # rollout.speculative when enabled (0: off): a generate call's tail from this many running
    # rows on decodes by speculative steps of spec_draft_tokens drafts, each a decode step of the
    # tail's rows x (1 + drafts) tokens, the tail's rows gaining spec_tail_tokens_per_step
    # tokens per step (a measured property of the model and data: a run's
    # rollout/spec_tokens_per_row_step, or benchmarks/spec_tail_study.py's). None: from
    # spec_draft_accept, each draft kept with that probability once the ones before it were,
    # (1 - a^(k + 1)) / (1 - a) tokens with k drafts; 0.645 gives the 2.5 tokens per row-step the
    # GSM8K recipe's tail made with 4 drafts on an H100 (benchmarks/results/gsm8k_spec_ab_h100.json)
    spec_rows: int = 0
    spec_draft_tokens: int = 4
    spec_tail_tokens_per_step: Optional[float] = None
    spec_draft_accept: float = 0.645
    # rollout.speculative.fused_advance on the Triton decode with sampling and no top-k / top-p:
    # a tail step's acceptance and bookkeeping as two kernels (next_token.accept_advance_tail)
    # instead of ~90 small PyTorch ones, SPEC_FUSED_ACCEPT_S less per tail step than the
    # records measured (timing.py); records measured before say false
    spec_fused_accept: bool = False
    # rollout.multi_turn.enable: generation with tool turns, costed as single-turn generation of
    # the same lengths (tool waits, appended results and the multi-turn step's own costs are not
    # modelled); the options its config refuses (quantized rollouts, partial rollouts, the fp8 KV
    # cache) are never suggested for it
    multi_turn: bool = False

    def __post_init__(self):
        if self.response_lengths is not None:
            lengths = tuple(sorted(int(v) for v in self.response_lengths))
            if not lengths or lengths[0] < 1:
                raise ValueError(f"response_lengths: expected positive lengths, got "
                                 f"{self.response_lengths!r}")
            object.__setattr__(self, "response_lengths", lengths)
            object.__setattr__(self, "response_len", max(1, round(sum(lengths) / len(lengths))))
            object.__setattr__(self, "response_len_max", max(lengths[-1], self.response_len))
        if self.prompt_len_max is not None and self.prompt_len_max < self.prompt_len:
            raise ValueError(f"prompt_len_max={self.prompt_len_max} is below the mean "
                             f"prompt_len={self.prompt_len}")
        for f in ("max_new_tokens", "gen_max_batch_size"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, int) or v <= 0):
                raise ValueError(f"{f} must be a positive integer or None, got {v!r}")
        if self.max_new_tokens is not None and self.longest_response > self.max_new_tokens:
            raise ValueError(f"the longest response ({self.longest_response}) exceeds "
                             f"max_new_tokens={self.max_new_tokens}")
        if not isinstance(self.decode_kv_window, int) or self.decode_kv_window < 0:
            raise ValueError(f"decode_kv_window must be 0 (off) or a positive integer, got "
                             f"{self.decode_kv_window!r}")
        if self.packed_attention not in ("flex", "varlen", "fa4"):
            raise ValueError(f"packed_attention {self.packed_attention!r}: expected 'flex', "
                             f"'varlen' or 'fa4'")
        if self.balanced_micro_batches and not self.pack_sequences:
            raise ValueError("balanced_micro_batches needs pack_sequences "
                             "(algo.balance_micro_batches deals packed micro-batches)")
        if self.pack_sequences and not self.dynamic_bsz:
            raise ValueError("pack_sequences needs dynamic_bsz (algo.pack_sequences needs "
                             "algo.use_dynamic_bsz)")
        if not isinstance(self.gen_batches_per_round, int) or self.gen_batches_per_round < 1:
            raise ValueError(f"gen_batches_per_round must be a positive integer, got "
                             f"{self.gen_batches_per_round!r}")
        if not self.gen_rounds >= 1 or not self.gen_prompt_factor >= 1:
            raise ValueError(f"gen_rounds ({self.gen_rounds}) and gen_prompt_factor "
                             f"({self.gen_prompt_factor}) must be >= 1")
        if not 0.0 <= self.spec_draft_accept <= 1.0:
            raise ValueError(f"spec_draft_accept={self.spec_draft_accept!r}: expected a "
                             f"probability in [0, 1]")
        if self.spec_tail_tokens_per_step is not None and not self.spec_tail_tokens_per_step >= 1:
            raise ValueError(f"spec_tail_tokens_per_step={self.spec_tail_tokens_per_step!r}: a "
                             f"running row gains at least 1 token per tail step")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm {self.algorithm!r}: expected one of {ALGORITHMS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: expected one of {DTYPES}")
        if self.skip_old_log_prob and (self.ppo_epochs, self.mini_batches) != (1, 1):
            raise ValueError(f"skip_old_log_prob needs ppo_epochs=1 and mini_batches=1 (got "
                             f"{self.ppo_epochs}, {self.mini_batches}): later updates need pi_old")
        for f in ("prompts_per_step", "samples_per_prompt", "prompt_len", "response_len",
                  "ppo_epochs", "mini_batches", "micro_batch_tokens", "forward_micro_batch_tokens",
                  "response_len_max"):
            v = getattr(self, f)
            if f in ("forward_micro_batch_tokens", "response_len_max") and v is None:  # defaults
                continue
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{f} must be a positive integer, got {v!r}")
        if self.rollout_quantization not in ("none", "fp8", "int4"):
            raise ValueError(f"rollout_quantization {self.rollout_quantization!r}: expected "
                             f"'none', 'fp8' or 'int4'")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r}: expected 'auto' or 'fp8'")
        if self.decode_kernels not in ("torch", "triton"):
            raise ValueError(f"decode_kernels {self.decode_kernels!r}: expected 'torch' or 'triton'")
        if not isinstance(self.lm_head_chunk_tokens, int) or self.lm_head_chunk_tokens < 0:
            raise ValueError(f"lm_head_chunk_tokens must be 0 (off) or a positive integer, got "
                             f"{self.lm_head_chunk_tokens!r}")
        if self.response_len_max is not None and self.response_len_max < self.response_len:
            raise ValueError(f"response_len_max={self.response_len_max} is below the mean "
                             f"response_len={self.response_len}")

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
    def longest_response(self) -> int:
        """Decode steps of a generation wave: until its longest response ends."""
        return self.response_len_max or self.response_len

    @property
    def varlen(self) -> bool:
        """Whether the step's passes are costed row by row (hybridflow.cost.varlen)."""
        return (self.response_lengths is not None or self.dynamic_bsz or self.gen_rounds != 1
                or self.gen_prompt_factor != 1 or self.compact_finished_rows
                or self.decode_kv_window > 0 or self.prompt_len_max is not None
                or self.partial_decode_steps > 0 or self.spec_rows > 0)

    @property
    def spec_tokens_per_step(self) -> float:
        """Tokens a running row of the speculative tail gains per step (see spec_draft_accept)."""
        if self.spec_tail_tokens_per_step is not None:
            return self.spec_tail_tokens_per_step
        a, k = self.spec_draft_accept, self.spec_draft_tokens
        return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)

    @property
    def head_fraction(self) -> float:
        """The share of a sequence's tokens whose LM head the training-side passes compute."""
        return self.response_len / self.seq_len if self.response_logits_only else 1.0

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
class Plan:
    """Where the step runs: the actor's training and generation layout (the trainer's own `Layout`:
    world size, TP_t, PP_t, TP_g; DP derived), plus two memory options of the cost model."""
    layout: Layout
    offload_ref: bool = False   # reference weights live on the host, copied in for the ref pass
    recompute: bool = False     # full activation recompute in the update phases
    #                             (the trainer's parallel.activation_checkpointing)
    ep: int = 1                 # MoE expert parallel size (parallel.expert_parallel_size)
    # MoE expert TP size (parallel.expert_tensor_parallel_size): None, TP; 1, whole experts
    etp: int | None = None

    @property
    def expert_tp(self) -> int:
        return self.etp or self.layout.tp_t

    @property
    def expert_shard(self) -> int:
        """Ranks one layer's experts are split over: EP x expert TP x PP."""
        return self.ep * self.expert_tp * self.layout.pp_t

    def to_dict(self) -> dict:
        lay = self.layout
        return {"tp": lay.tp_t, "pp": lay.pp_t, "dp": lay.dp_t, "tp_gen": lay.tp_g,
                "offload_ref": self.offload_ref, "recompute": self.recompute,
                **({"ep": self.ep} if self.ep > 1 else {}),
                **({"etp": self.etp} if self.etp is not None else {})}

    def short(self) -> str:
        lay = self.layout
        s = f"tp={lay.tp_t} pp={lay.pp_t} dp={lay.dp_t} tp_gen={lay.tp_g}"
        s += f" ep={self.ep}" if self.ep > 1 else ""
        s += f" etp={self.etp}" if self.etp is not None else ""
        return s + (" offload_ref" if self.offload_ref else "") + (" recompute" if self.recompute else "")


def check_model_split(model: ModelConfig, layout: Layout, ep: int = 1, etp: int | None = None) -> None:
    """ValueError unless megatron-core can split `model` by the layout's TP and PP (and, MoE, EP
    and expert TP): the trainer's own checks (`config_checks.validate_model`, `validate_moe`, and
    megatron-core 0.16's rule that EP x expert TP divides the ranks of a pipeline stage, DP x TP);
    `Layout` itself checks world size, TP and TP_g."""
    validate_model(model, tp=layout.tp_t, pp=layout.pp_t)
    validate_moe(model, tp=layout.tp_t, ep=ep, etp=etp)
    ep_etp = ep * (etp or layout.tp_t)
    if (layout.world_size // layout.pp_t) % ep_etp:
        raise ValueError(f"ep={ep} x expert TP {etp or layout.tp_t} = {ep_etp} must divide the "
                         f"{layout.world_size // layout.pp_t} ranks of a pipeline stage (DP x TP)")
    if model.moe.enabled and (layout.pp_t > 1 or layout.tp_g != layout.tp_t):
        raise ValueError(f"a mixture-of-experts model generates in place: pp must be 1 and tp_gen "
                         f"= tp (got pp={layout.pp_t}, tp={layout.tp_t}, tp_gen={layout.tp_g})")
    if model.moe.enabled and etp not in (None, 1, layout.tp_t):
        raise ValueError(f"etp={etp}: expected None (= tp) or 1")


def make_plan(layout: dict | Plan, num_gpus: int, model: ModelConfig) -> Plan:
    """A checked Plan from a dict of tp, pp, dp (default: the rest), tp_gen (default tp),
    offload_ref, recompute, ep (default 1), etp (default None: tp)."""
    if isinstance(layout, Plan):
        plan = layout
    else:
        unknown = set(layout) - {"tp", "pp", "dp", "tp_gen", "offload_ref", "recompute", "ep", "etp"}
        if unknown:
            raise ValueError(f"layout: unknown keys {sorted(unknown)}")
        tp, pp = int(layout.get("tp", 1)), int(layout.get("pp", 1))
        dp = layout.get("dp")
        if dp is not None and int(dp) * tp * pp != num_gpus:
            raise ValueError(f"layout: tp={tp} x pp={pp} x dp={dp} != num_gpus {num_gpus}")
        plan = Plan(Layout(world_size=num_gpus, tp_t=tp, pp_t=pp, tp_g=int(layout.get("tp_gen") or tp)),
                    offload_ref=bool(layout.get("offload_ref", False)),
                    recompute=bool(layout.get("recompute", False)), ep=int(layout.get("ep", 1)),
                    etp=None if layout.get("etp") is None else int(layout["etp"]))
    if plan.layout.world_size != num_gpus:
        raise ValueError(f"layout {plan.short()}: world size {plan.layout.world_size} != num_gpus "
                         f"{num_gpus}")
    check_model_split(model, plan.layout, plan.ep, plan.etp)
    return plan
