"""Typed configuration schemas for every config group.

Hydra YAML under `hybridflow/conf/` only sets values over these dataclasses: an unknown key is an
error, not a silently ignored typo. `load_config(overrides)` composes `conf/ppo.yaml` with
command-line overrides, merges it onto the schema and returns a `Config`. The cross-field rules live
in `hybridflow.config_checks.validate`; the `null` (auto) defaults of the speed options are decided
for the machine at start-up by `hybridflow.config_auto.resolve_auto`.
conf/ is read as the package `hybridflow.conf` (`CONF_PACKAGE`), never by a path beside the source,
so an installed package runs from any directory.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from hybridflow.model_config import ModelConfig  # the model group's schema, with its derived counts

CONF_PACKAGE = "hybridflow.conf"
QUACK_CHOICES = ("torch", "quack", "auto")  # parallel.mlp_kernels
SWIGLU_BACKWARD_CHOICES = ("triton", "compiled")  # parallel.swiglu_backward


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = True  # only takes effect when DP > 1
    # full activation recompute, per decoder layer (NeMo-RL's name; Megatron's
    # recompute_granularity=full, uniform, 1 layer; verl's enable_gradient_checkpointing): the
    # training passes keep each layer's input only and recompute the layer in backward, ~1/3 more
    # compute for the activation memory of one layer (the cost model's `recompute` layouts)
    activation_checkpointing: bool = False
    # LM head + log-prob pass in chunks of this many positions per micro-batch (verl's fused
    # linear-for-PPO, Liger's fused linear cross-entropy): the (positions x vocab) logits and
    # their gradient are never held whole; backward makes each chunk's logits again (one more
    # LM-head GEMM). 0: the whole logits of a micro-batch at once
    lm_head_chunk_tokens: int = 0
    # on CUDA, the training passes' RoPE and SwiGLU as fused kernels (the RoPE on
    # hybridflow/kernels/rope_train.py, one kernel each way; Megatron's compiled
    # bias_activation_fusion SwiGLU, which keeps only fc1's output for backward);
    # hybridflow/models/fused.py. CPU runs are unchanged either way
    fused_elementwise: bool = True
    # with fused_elementwise on CUDA, the fused SwiGLU's backward: "triton" (one read of fc1's
    # output and the gradient, both halves of the input gradient written from it;
    # hybridflow/kernels/swiglu_train.py) or "compiled" (Megatron's torch.compile'd swiglu_back,
    # whose kernel reads the gate and the gradient once per half). Same formula, fp32, one rounding
    swiglu_backward: str = "compiled"
    # with fused_elementwise on CUDA, the RoPE kernel reads q where the QKV projection put it, in
    # its KV groups (a view), instead of the copy Megatron's reshape to (S, B, heads, head_dim)
    # makes in every layer's forward under GQA (hybridflow/models/fused.py use_rope_from_qkv);
    # layers with a q / k norm or an output gate, and query groups split over TP, keep the copy
    rope_from_qkv: bool = False
    # the gated MLP's SwiGLU inside its GEMMs on CUDA (hybridflow/models/quack_mlp.py,
    # quack-kernels, installed with flash-attn-4): fc1's epilogue forward, the epilogue of fc2's
    # input-gradient GEMM backward. quack: an error where it cannot run; auto: quack on sm_90+
    # where it imports; torch: Megatron's MLP (fc1, the SwiGLU's own kernels, fc2)
    mlp_kernels: str = "torch"
    # the decoder layers' weight gradients added into DDP's fp32 main_grad by their backward GEMM
    # (Megatron's gradient_accumulation_fusion, without apex: models/linear.py accumulate_wgrad)
    # instead of a bf16 gradient that DDP's hook then adds in a second pass; trainable roles, the
    # local layer spec (not transformer-engine's). With LoRA at TP = 1 (no adapter dropout) it
    # also makes each adapted linear one autograd node that adds its factors' gradients so
    # (models/lora.py fused_linear)
    gradient_accumulation_fusion: bool = True
    # on CUDA, each decoder layer's training forward and backward replayed as one CUDA graph
    # (models/graphs.py, as torch.cuda.make_graphed_callables), captured once at the shape of the
    # first update's most common micro-batch; packed micro-batches (algo.pack_sequences, varlen
    # attention) are padded to the token budget with a fixed count of documents and captured at
    # that shape (again if a pass's rows outgrow it); micro-batches of another shape, with
    # left-padded prompts (an attention mask), packed for flex_attention or packed into less than
    # train_graphs_min_fill of the budget run the eager layers
    # (`<role>/graphed_micro_batch_frac` says the share that replayed). Without TE a layer is ~75
    # kernel launches forward and backward, ~50 us of host time each: small micro-batches are
    # bound by the host, and one graph replay per layer removes that. Each layer's backward graph
    # adds its weight gradients into DDP's main_grad; the graphs' pool keeps one micro-batch's
    # activations reserved and their static inputs and outputs allocated for the run. PP = 1, no
    # activation recompute; CPU runs are unchanged. null: on for a dense model's LoRA update on a
    # GPU at TP = 1 (every trained role with adapters and without dropout; its many small launches
    # bind it to the host), off for full-parameter training (on the GSM8K recipe the padding costs
    # what the host saves)
    train_cuda_graphs: Optional[bool] = None
    # with train_cuda_graphs: a packed micro-batch holding fewer real tokens than this share of the
    # token budget runs the eager layers unpadded instead of being padded to the captured shape (a
    # GSM8K update's last micro-batch holds 4,396 of 20,480 tokens, 90% of the pass's padding,
    # which costs more GPU time than one micro-batch's eager launches); 0: every one padded
    train_graphs_min_fill: float = 0.5
    # MoE models (model.moe): experts split over this many ranks (Megatron's expert model
    # parallelism; EP ranks come out of the DP x TP ranks of a stage: EP x ETP divides DP x TP and
    # EP divides model.moe.num_experts). Tokens travel to their experts' ranks by all-to-all
    expert_parallel_size: int = 1
    # TP inside each expert (Megatron's expert_tensor_parallel_size); null: the attention's TP
    expert_tensor_parallel_size: Optional[int] = None


@dataclass
class DecodeKernelOptions:
    """rollout.kernel_options: the decode kernels' trade-offs that depend on the GPU and the batch
    (rollout.decode_kernels=triton; compile_* with rollout.compile_decode). Checked by
    hybridflow.config_checks.validate_rollout_options; measurements behind the defaults:
    docs/perf_log.md."""
    # programmatic dependent launch of our Triton kernels (sm_90+; elsewhere launched plainly):
    # each kernel's programs start while the previous kernel finishes, then wait in-kernel for its
    # writes; the results are the plain launch's
    pdl: bool = True
    # the decode GEMMs whose weights the kernel before them hints into L2 (sm_90+), a subset of
    # [qkv, proj, fc1, fc2]: the hint shortens the GEMM's first HBM reads but costs the hinting
    # kernel time; worth it for the small QKV / projection weights
    prefetch_weights: list[str] = field(default_factory=lambda: ["qkv", "proj"])
    # ... only at decode batches (graph buckets) of at least this many rows: with fewer rows the
    # GEMMs already read weights at bandwidth and the hints cost more than they save
    prefetch_min_rows: int = 256
    # fc1 + SwiGLU as one Triton GEMM (hybridflow/kernels/gemm.py) at decode batches of at least
    # this many rows; below, cuBLAS's fc1 + the SwiGLU kernel (the tiles were tuned at 256 rows)
    swiglu_gemm_min_rows: int = 256
    # rollout.quantization=fp8: decode GEMMs of at most this many rows run weight-only (the E4M3
    # codes widened to bf16 in a Triton GEMM, hybridflow/kernels/quant.py; no per-token
    # activation quantization) instead of torch._scaled_mm; 0: always _scaled_mm
    fp8_weight_only_max_rows: int = 0
    # rollout.quantization=int4: GEMMs of at most this many rows (decode) run the tiled Triton
    # kernel that dequantizes the codes in registers; more rows (prefill) dequantize the weight
    # once into a temporary of the model dtype and run cuBLAS on it (the tiled kernel would
    # dequantize it again for every 64 rows; the temporary moves over twice bf16's bytes)
    int4_kernel_max_rows: int = 256
    # rollout.decode_kernels=triton, temperature > 0 without top-k / top-p: the draw and its
    # log-prob by the inverse CDF in two Triton passes (hybridflow/kernels/sample.py: each
    # vocabulary chunk's mass, then one uniform per row from a counter-based Philox stream on
    # the device, keyed by each generate call's seed, and a scan of the chunk that holds it)
    # instead of PyTorch's exponential race + log_softmax passes (timings: docs/performance.md);
    # other sampling settings keep the PyTorch sampler. false: the PyTorch sampler (the
    # generator's torch.Generator stream) everywhere
    fused_sampler: bool = True
    # rollout.decode_kernels=triton: each row's attention reads only its own cache columns (from
    # its first prompt token to the current one; none for a finished row still in the batch, or
    # in the multi-turn step for a row not fed that step)
    # instead of every column of the step's window (left padding, unwritten window columns and
    # finished rows read and masked out; bit-equal outputs for the unfinished rows). Faster on the
    # GSM8K step, most with rollout.partial, whose carried rows no longer widen every row's reads
    # (docs/perf_log.md; benchmarks/results/gsm8k_step_ab_h100.json,
    # generate_long_tail_own_columns_h100.json)
    own_columns_only: bool = True
    # torch.compile backend and mode of rollout.compile_decode (CPU tests: aot_eager)
    compile_backend: str = "inductor"
    compile_mode: Optional[str] = None
    # each prefill sub-batch's width rounded up to a multiple of this many columns (more left
    # padding, masked out; the same distribution of samples, the shapes' own rounding aside): the
    # prefill's attention and GEMMs meet a few shapes, where each new prompt width otherwise
    # builds a new cuDNN attention plan and loads new kernels mid-step (~50 ms on the GSM8K
    # step). 1: each sub-batch at its own widest prompt. null (auto): 64 on a GPU, 1 on CPU
    prefill_width_multiple: Optional[int] = None


@dataclass
class PartialRolloutConfig:
    """rollout.partial: partial rollouts against the long tail of response lengths
    (hybridflow/rollout/partial.py). Each step decodes at most `max_decode_steps` new tokens per
    row, trains on data.prompts_per_step complete groups (oldest first) and carries the unfinished
    rows (tokens and rollout log-probs kept) into the next step's generation. Off: the step as without it."""
    enable: bool = False
    # new tokens a row may decode per step (below rollout.max_new_tokens); a row still running at
    # the cap continues next step from prompt + its partial response
    max_decode_steps: int = 512
    # groups kept in flight beyond data.prompts_per_step (over all DP ranks; a multiple of DP):
    # the slack that lets a step find prompts_per_step complete groups without uncapped decode
    # (per prompt batch: a dynamic-sampling round of k batches keeps k x extra_prompts)
    extra_prompts: int = 0
    # steps a group may wait: a group drawn at step s still incomplete at step s + max_staleness
    # is finished then without the cap
    max_staleness: int = 1


@dataclass
class SpeculativeConfig:
    """rollout.speculative: the long tail of generation decoded by speculative sampling with
    n-gram drafts (prompt lookup; hybridflow/rollout/speculative.py). Once at most `max_rows` rows
    of a generate call are still running, each step feeds every row its last token and up to
    `draft_tokens` tokens copied from where the row's last n tokens (n = ngram_max..ngram_min) last
    occurred in its prompt or response, and keeps the leading drafts that pass the rejection test
    plus one token drawn after them: the samples have the distribution of plain decoding
    (temperature, top_k and top_p included; greedy output unchanged), only their random draws differ.
    The tail's few rows leave a step's latency-bound weight reads and launches nearly idle, so a
    step that checks several tokens costs about what one token's step costs. Single-turn only.
    enable null (auto): on where it applies and pays, a GPU run's single-turn, unquantized rollout
    decoded by CUDA-graph replays whose generator is kept across steps (hybridflow.config_auto);
    true: on wherever it runs (refused with multi-turn and quantized rollouts); false: off.
    fused_advance: a tail step's bookkeeping after the acceptance (stop check, output writes,
    cache marks, counters) as one Triton kernel (kernels/next_token.advance_tail) instead of ~50
    small PyTorch kernels, where the tail runs the decode kernels; with sampling and no top-k /
    top-p the acceptance before it as well (next_token.accept_advance_tail: the kept drafts and
    the exponential race over the vocabulary in one more launch, instead of ~40 kernels; the same
    random draws). Same results (tokens equal up to rounding at a tie), a cheaper tail step
    (docs/perf_log.md); false: the PyTorch ops, for A/B runs."""
    enable: Optional[bool] = None
    max_rows: int = 16
    draft_tokens: int = 4
    ngram_max: int = 3
    ngram_min: int = 1
    fused_advance: bool = True


@dataclass
class MultiTurnConfig:
    """rollout.multi_turn (verl's names; append_* are ours): generation that calls tools between
    assistant turns (hybridflow/rollout/multi_turn.py). Off: one response per prompt. Its decode
    step runs the single-turn step's layers (rollout.decode_kernels: the Triton kernels or PyTorch
    ops) and sampler, a CUDA-graph replay on a GPU with KV windows and compaction
    (rollout.cuda_graphs, decode_kv_window, compact_finished_rows); not compiled or quantized
    layers."""
    enable: bool = False
    # model turns per trajectory; a tool call in the last one ends it (its result is not appended)
    max_assistant_turns: int = 5
    # tokens of one tool result appended to the context (longer results are cut)
    max_tool_response_length: int = 256
    # verl's tool config YAML (tools: - class_name, config, tool_schema); required when enabled
    tool_config_path: Optional[str] = None
    # "hermes": <tool_call>{json}</tool_call> calls, results as the chat template's tool messages;
    # "code": fenced ```python blocks run by the first tool, output appended as ```output blocks
    # (check which one the model writes: benchmarks/tool_format_probe.py, docs/recipes.md)
    format: str = "hermes"
    # threads running tool calls (rows' calls run concurrently while other rows decode)
    tool_workers: int = 8
    # results that are in are held and appended together, one eager `extend` (a full forward
    # pass) for many rows instead of one per result as they trickle in: a held result is
    # appended at the latest this many decode steps after it came in, as soon as
    # append_batch_rows rows are held, when no row could decode otherwise, and at the end.
    # 0: each result at the poll it came in (the rows resume sooner, in more calls)
    append_wait_steps: int = 16
    # append the held results as soon as this many rows hold one (1: at once)
    append_batch_rows: int = 64
    # how a tool result enters its row's cache: "prefill", an eager `extend` over its tokens (held
    # and batched as above); "decode", fed one token per decode step through the decode step
    # itself (forced tokens, inside its CUDA graph: no forward pass of its own, as every slot is
    # computed each step anyway; the row samples again after the result's last token). decode is
    # the default: faster per decode step and in the rollout's wall time than held and prefilled,
    # with the same greedy rollouts (tests; benchmarks/results/multi_turn_fed_h200.json)
    append: str = "decode"
    # launch each decode step before reading the previous one's tokens, so that the host's work
    # between steps (recording tokens, looking for calls, tools, compaction) overlaps the device's
    # step instead of leaving it idle; a row that stopped or called a tool at step k has been fed
    # once more at step k + 1: that token is dropped and, after a call, taken back in the cache
    # at the next step. true needs append=decode; null: on with append=decode
    lookahead: Optional[bool] = None

    @property
    def lookahead_on(self) -> bool:
        """`lookahead` resolved: null is on exactly with append=decode."""
        return self.append == "decode" if self.lookahead is None else bool(self.lookahead)


@dataclass
class RolloutConfig:
    tensor_parallel_size: Optional[int] = None  # TP_g; None: same as training TP
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_k: int = 0  # 0 disables
    top_p: float = 1.0
    n: int = 1  # samples per prompt
    max_batch_size: int = 256  # sequences per generate call on a rank; larger batches are chunked
    stop_token_ids: list = field(default_factory=list)  # besides the tokenizer's EOS
    cuda_graphs: bool = True  # capture the decode step on GPU (single- and multi-turn)
    # move the unfinished rows to a smaller batch bucket as rows stop, so a long tail of response
    # lengths does not hold the whole batch (rollout/compaction.py; multi-turn: the rows still
    # decoding or waiting for a tool, at the same thresholds). Greedy output is unchanged;
    # sampled output stays seeded-reproducible but draws a different (equally valid) sample.
    # null (auto): on with CUDA-graph decoding on a GPU, off on CPU
    compact_finished_rows: Optional[bool] = None
    # verl's name: free the generator's KV cache, captured decode graphs and static buffers after
    # each generation. false keeps them across steps (no re-capture per step; costs their memory
    # during training) where generation uses the training weights in place (TP_g == TP, PP == 1);
    # with resharding the gathered weights move every step and the generator is rebuilt anyway.
    # null (auto): false on a GPU where generation runs in place, else true; true also where the
    # automatic token budgets would give the update less than half the tokens per micro-batch with
    # the generator kept (a tight memory cap)
    free_cache_engine: Optional[bool] = None
    # decode attends over the first multiple of this many cache columns that holds every written
    # slot (a CUDA graph per window), not the whole prompt + max_new_tokens cache: early steps of a
    # long budget read a fraction of the KV cache. 0: the whole cache. A multiple of 64. Each window
    # is a graph per batch bucket: pair with free_cache_engine=false (captured once). Multi-turn
    # too (a graph per window and chunk size; a step's window holds every row's next column).
    # null (auto): on a GPU with cuda_graphs, about an eighth of the cache (at least 64 columns)
    # when the generator is kept across steps; 0 when it is freed after generation (every window's
    # graph would be captured again each step, slower than reading the whole cache: Qwen2-7B under
    # a 24 GiB cap, docs/performance.md) and on CPU
    decode_kv_window: Optional[int] = None
    # run each layer's pure parts of the decode step (norm + QKV + RoPE; out-projection + MLP) through
    # torch.compile (dynamic batch size; the KV writes and attention stay eager between them; all
    # captured in the CUDA graphs as before): fuses the RMSNorm, RoPE, SwiGLU and residual
    # element-wise kernels, which bound decode at small batches (a ~0.5B model's step is ~550
    # kernel launches). TP_g = 1 only; the first step pays the compile. With decode_kernels=triton
    # the layers run its kernels instead (faster per op) and this compiles the sampler only.
    # null (auto): on with CUDA-graph decoding on a GPU at TP_g = 1, off on CPU
    compile_decode: Optional[bool] = None
    # "triton": each decode layer as Triton kernels + cuBLAS (hybridflow/kernels/): the residual
    # sum + RMSNorm one kernel, RoPE + both KV-cache writes + split-KV ("flash-decoding") attention
    # over the query groups one kernel, fc1 + SwiGLU one GEMM at large batches, the projection and
    # fc2 accumulated into the residual in place; the prefill's RoPE + KV writes, norms and SwiGLU
    # too. Needs CUDA and triton; power-of-two head_dim. "torch": PyTorch ops (with compile_decode:
    # inductor's), the reference the kernels are tested against. "auto": triton where it applies,
    # else torch (CPU runs: torch). Finer knobs: kernel_options; measurements: docs/perf_log.md
    decode_kernels: str = "auto"
    kernel_options: DecodeKernelOptions = field(default_factory=DecodeKernelOptions)
    return_logprobs: bool = False
    ignore_eos: bool = False  # always generate max_new_tokens (benchmarks)
    # multi-turn rollouts with tools; max_new_tokens then bounds a trajectory's whole response
    # (every model turn and tool result together)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    # partial rollouts: capped decode per step, unfinished rows carried to the next step
    partial: PartialRolloutConfig = field(default_factory=PartialRolloutConfig)
    # the long tail by speculative sampling with n-gram drafts (exact samples, fewer steps)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    # generate with a quantized copy of the policy's matmul weights (hybridflow/rollout/quantize.py):
    # "fp8" (E4M3, per-output-channel scales, per-token activation scales, torch._scaled_mm),
    # "int4" (weight-only, a scale and offset per 128 columns, a Triton GEMM) or "none". Quantized
    # once per step from the training weights; the LM head stays unquantized. The log-probs are
    # the quantized model's: it turns on rollout.return_logprobs and, unless set,
    # algo.tis_imp_ratio_cap=2.0 (truncated importance sampling; one line says so). Neither mode
    # generates faster than bf16 on Hopper at 0.5-1.5B; int4 lost val accuracy on the GSM8K recipe
    quantization: str = "none"
    # the KV cache's storage: "auto" (the weights' dtype) or "fp8" (E4M3 codes with one fp32 scale
    # per token and KV head, kernels/kv_fp8.py: 1 + 4 / head_dim bytes a value, about half of bf16's
    # K/V reads per decode step and room for about twice the rows). The prefill attends exactly;
    # decode reads the rounded keys and values, so the log-probs are the fp8-cache model's: like
    # `quantization` it turns on rollout.return_logprobs and, unless set, algo.tis_imp_ratio_cap
    kv_cache_dtype: str = "auto"


@dataclass
class DataConfig:
    train_files: Optional[str] = None  # .jsonl / .parquet in verl's format
    val_files: Optional[str] = None  # held-out prompts, same format; scored every trainer.val_every
    synthetic: Optional[str] = None  # name of a built-in synthetic task (the CPU demo)
    synthetic_size: int = 2000
    synthetic_length: Optional[int] = None  # prompt letters of length-aware tasks (copy); None: default
    tokenizer: Optional[str] = None  # tokenizer.json dir or sentencepiece .model; default: model's
    prompt_key: str = "prompt"
    max_prompt_length: int = 64
    truncation: str = "error"  # error | left | right
    # chat templates' thinking switch (Qwen3's `enable_thinking`), passed to the template when chat
    # prompts are rendered; null: not passed, the template's default (Qwen3: thinking on)
    enable_thinking: Optional[bool] = None
    # a system message put first in chat prompts that have none (e.g. how to call the tools of a
    # multi-turn rollout); null: the prompts as they are
    system_prompt: Optional[str] = None
    prompts_per_step: int = 8
    shuffle: bool = True


@dataclass
class OverlongBufferConfig:
    """DAPO's soft overlong penalty (verl's reward_model.overlong_buffer): the score of a response
    longer than rollout.max_new_tokens - len falls linearly, to -penalty_factor at max_new_tokens."""
    enable: bool = False
    len: int = 0  # tokens before the maximum where the penalty ramps (DAPO: 4096 of 20480)
    penalty_factor: float = 1.0


@dataclass
class RewardConfig:
    fn: Optional[str] = "default"  # registered name, `module:function`, `/path/file.py:function`;
    # null: no rule reward (reward model only)
    model_path: Optional[str] = None  # HF reward-model checkpoint (*ForSequenceClassification)
    model_weight: float = 1.0  # score = rule score + model_weight * reward-model score
    # rule rewards reported on validation beside `fn` (e.g. [gsm8k_strict]); they do not train
    val_fns: list = field(default_factory=list)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    # verl's reward_model.launch_reward_fn_async: score the rule reward (detokenising and `fn`) on a
    # worker thread while the step's reference / old-log-prob / value passes run on the device,
    # waited for before the advantages (with trainer.balance_batch at DP > 1, before the
    # balancing: the scores travel with the rows). Same scores and metrics; timing_s/reward is
    # then the wait. For a rule reward alone: not with reward.model_path (a device pass),
    # dynamic sampling or rollout.partial (each needs the scores before the step goes on); the
    # rule runs off the main thread, so one that installs signal handlers (signal.alarm
    # timeouts) raises there. It pays for rules that wait (a sandbox, a remote judge: the wait
    # releases the GIL); a rule that computes in Python holds the GIL, and the main thread's
    # work between the stages waits for it instead (no gain on the GSM8K step; docs/perf_log.md)
    launch_reward_fn_async: bool = False
    # score the rule reward on the main thread inside the step's first forward-only pass (old
    # log-probs, reference or values): after the pass's last kernel is launched and before its
    # result is copied back, while the device still works through the launched kernels, so a
    # rule that computes (GSM8K's: detokenising and a regex) is hidden without a thread or the
    # GIL. Same scores and metrics (perf/reward_in_pass_s: its host seconds in the pass;
    # where no such pass runs, no reference model and the old log-probs skipped, it is scored
    # before the advantages, timing_s/reward). The same limits as launch_reward_fn_async, and
    # not with it. null (auto): on with a CUDA device wherever those limits allow
    # (hybridflow/config_auto.py), off on CPU (where a pass has finished when its last op returns)
    score_in_pass: Optional[bool] = None


@dataclass
class DynamicSamplingConfig:
    """DAPO's dynamic sampling (verl's algorithm.filter_groups): drop the groups whose scores are all
    equal and generate more until data.prompts_per_step informative groups are found, at most
    max_rounds generation rounds per step (verl's max_num_gen_batches). When the cap is hit the step
    trains anyway, topped up with uninformative groups (verl raises instead; see
    hybridflow/rollout/dynamic_sampling.py)."""
    enable: bool = False
    max_rounds: int = 10
    # prompt batches (data.prompts_per_step each) per generation round: verl's data.gen_batch_size
    # over data.train_batch_size (its DAPO recipe: 3); the informative groups past the step's
    # need are dropped
    batches_per_round: int = 1
    # size each round from the kept fraction seen so far (the previous step's for a first round),
    # from 1 to batches_per_round batches
    adaptive: bool = False
    # with adaptive: size each round in prompts, not whole batches, as the fewest that find the
    # missing informative groups with this probability (e.g. 0.9) under the kept fraction; a round
    # short by a few groups costs a whole second round. The rest of a batch waits for the next
    # round or step. null: whole batches from the kept fraction's point estimate
    round_confidence: Optional[float] = None


@dataclass
class AlgoConfig:
    adv_estimator: str = "gae"  # gae (PPO with critic) | grpo | grpo_no_std | rloo | reinforce_plus_plus ...
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std: bool = True
    policy_loss: str = "vanilla"  # vanilla | gspo | gspo_token
    # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm (Dr.GRPO)
    loss_agg_mode: str = "token-mean"
    # the constant of seq-mean-token-sum-norm (verl's loss_scale_factor); None: rollout.max_new_tokens
    loss_scale_factor: Optional[float] = None
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: Optional[float] = 3.0
    # truncated importance sampling: policy loss x min(pi_old / pi_rollout, cap) per token (verl's
    # actor.tis_imp_ratio_cap; e.g. 2.0); needs rollout.return_logprobs. None: off
    tis_imp_ratio_cap: Optional[float] = None
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    cliprange_value: float = 0.5
    entropy_coeff: float = 0.0
    use_kl_in_reward: bool = False
    kl_penalty: str = "k1"
    kl_ctrl: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001
    target_kl: float = 0.1
    kl_horizon: int = 10000
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "k3"
    ppo_epochs: int = 1
    # leave out the old_log_prob pass when it is provably redundant: one epoch of ONE mini-batch per
    # step (ppo_mini_batch_size = prompts_per_step x rollout.n), no KL in the reward, the actor
    # updating; pi_old is then the update's own forward (ratio 1, as verl and TRL do). Decided by
    # hybridflow.algo.on_policy.skip_old_log_prob; metric actor/old_log_prob_skipped
    skip_redundant_old_log_prob: bool = True
    # Batch sizes as verl names them: the mini-batch is GLOBAL (sequences per optimizer step, over
    # all DP ranks); micro-batches are PER GPU (sequences per forward/backward on one rank).
    ppo_mini_batch_size: int = 8
    micro_batch_size_per_gpu: int = 4
    # sequences per forward-only micro-batch on one rank (old/ref log-probs, values); None: the
    # training micro-batch. Larger means fewer kernel launches and TP collectives per pass.
    forward_micro_batch_size_per_gpu: Optional[int] = None
    # Dynamic batch size (verl's use_dynamic_bsz): micro-batches by tokens instead of rows. Rows are
    # grouped by length, each micro-batch padded only to its own longest prompt + response, and its
    # rows x (P + R) kept within the budget (per GPU; verl's ppo_max_token_len_per_gpu); the two
    # micro_batch_size keys above are then unused. Results are the same; less padding is computed.
    # null (auto): on a GPU with parallel.pipeline_parallel_size=1, off on CPU
    use_dynamic_bsz: Optional[bool] = None
    # tokens per training micro-batch (update_actor/critic, SFT); null (auto): on a GPU, the largest
    # that the cost model's memory estimate fits in the GPU's free memory (capped at one micro-batch
    # per mini-batch); 16384 on CPU
    max_tokens_per_micro_batch_per_gpu: Optional[int] = None
    # tokens per forward-only micro-batch (old/ref log-probs, values); null (auto): sized as above
    # for the forward passes on a GPU, the training budget on CPU
    forward_max_tokens_per_micro_batch_per_gpu: Optional[int] = None
    # Sequence packing (needs use_dynamic_bsz and PP=1): each token-budget micro-batch runs as ONE
    # row of its rows' real tokens back to back (no padding computed), attention limited to each
    # row's own tokens, causally (hybridflow/data/packing.py; the kernel: packed_attention below);
    # the budget then counts real tokens. Same results as unpacked; no explicit SDPA mask, so the cuDNN masked-
    # backward bug routed around in models/attention.py does not arise. Needs SDPAttention
    # (model.attention_backend sdpa, or auto without transformer-engine). A micro-batch without
    # padding runs unpacked (equal rows need no mask). null (auto): on wherever use_dynamic_bsz is
    # and the attention is SDPA, else off
    pack_sequences: Optional[bool] = None
    # packed micro-batches dealt evenly into the fewest that hold the rows (verl's balanced dynamic
    # batches; hybridflow/data/microbatch.py) instead of sorted next-fit, whose last micro-batch
    # holds whatever rows are left (a step a few rows past k budgets runs k full ones and one of a
    # few rows); the same rows and results, other micro-batch shapes. Needs pack_sequences; not
    # for an update replayed as CUDA graphs (parallel.train_cuda_graphs), whose packed
    # micro-batches are padded to the budget, so more full ones would compute more padding.
    # null (auto): on wherever pack_sequences is (docs/performance.md: the GSM8K step)
    balance_micro_batches: Optional[bool] = None
    # the packed micro-batches' attention kernel (hybridflow/models/attention.py): "varlen": torch's
    # varlen_attn (FlashAttention-2 over the rows' cu_seqlens, GQA native; CUDA, bf16/fp16, head_dim
    # a multiple of 8 up to 256, compute capability 8.0+, torch 2.10+); "flex": a flex_attention
    # document mask (compiled on CUDA); "fa4": FlashAttention-4's CuTe kernels (flash-attn-4, in
    # the gpu extra; compute capability 9.0+; compiled on first use, seconds once per process; the
    # update's packed CUDA graphs keep varlen); "auto": fa4 where it runs, else varlen where it
    # runs, else flex, chosen once per run and printed by rank 0 with the reason. Each is faster
    # than the next (docs/performance.md: the GSM8K step's passes, flash-attn-4 against varlen on
    # an H100 and varlen against flex on an H200), and the flash kernels agree with flex as
    # closely as flex with itself against an fp32 reference (tests/gpu/test_packing_gpu.py)
    packed_attention: str = "auto"


def micro_batching(a: AlgoConfig, *, forward: bool) -> dict:
    """`micro_batch_size`, `max_tokens` (None: fixed micro-batches) and `pack` (sequence packing)
    for the Engine's passes."""
    rows = a.micro_batch_size_per_gpu
    tokens = a.max_tokens_per_micro_batch_per_gpu
    if forward:
        rows = a.forward_micro_batch_size_per_gpu or rows
        tokens = a.forward_max_tokens_per_micro_batch_per_gpu or tokens
    return {"micro_batch_size": rows, "max_tokens": tokens if a.use_dynamic_bsz else None,
            "pack": bool(a.pack_sequences and a.use_dynamic_bsz)}


@dataclass
class OptimConfig:
    lr: float = 1e-5
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    lr_warmup_steps: int = 0
    lr_decay_style: str = "constant"  # constant | linear | cosine


@dataclass
class LoRAConfig:
    """LoRA adapters on a role's decoder linears (hybridflow/models/lora.py), PEFT's names."""
    rank: int = 0  # 0: off (full-parameter training)
    alpha: float = 16.0  # the update is B @ A * alpha / rank
    dropout: float = 0.0  # on the adapters' input, in training passes
    # PEFT module names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj) or
    # [all-linear]; mapped onto Megatron's fused linear_qkv / linear_proj / linear_fc1 / linear_fc2
    target_modules: list = field(default_factory=lambda: ["all-linear"])


@dataclass
class ActorConfig:
    # with lora.rank > 0 only the adapters train (and have grads and optimizer state); the
    # reference policy is the actor with its adapters off (no second model is built) and
    # generation runs on the weights with the adapters merged in (restored exactly after)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    # the optimizer's fp32 master weights and Adam state live in host memory (pinned) and come to
    # the GPU only for the optimizer step, after the update's activations are freed (verl's name);
    # bit-identical results, PCIe copies of 12 bytes per trained parameter each way per update
    offload_optimizer: bool = False
    # the actor's fp32 gradient buffers are released after each optimizer step and allocated again
    # at the next update (their contents are dead in between: every update starts from zero), so
    # generation and the forward-only passes run without them (verl's grad_offload; nothing is
    # copied). Not with parallel.train_cuda_graphs (the graphs hold the buffers' addresses)
    offload_grads: bool = False
    # mixture-of-experts actors (verl's actor.router_replay.mode): R3 (Rollout Routing Replay)
    # records every token's experts per MoE layer in generation and routes the step's actor
    # training passes (old log-probs, the update) by them, the gating weights still computed from
    # the current router over the replayed experts (hybridflow/models/moe.py); disabled:
    # the routers' own choice. Costs layers x tokens x top_k int16 per row, on the device in
    # generation and in the batch (docs/recipes.md)
    router_replay: str = "disabled"
    # the actor's training weights (with LoRA: its frozen base) live in pinned host memory while no
    # pass needs them: through the critic's passes (PPO), the reward computation and, when the
    # generator holds its own copy of the decoder's matrices (rollout.quantization != none, or a
    # generation layout other than training's), through decoding; copied back on a side stream
    # ahead of the next pass that reads them (verl's param_offload). Bit-identical results;
    # docs/recipes.md says when it lowers the peak (a start-up warning when it cannot).
    # Not with parallel.train_cuda_graphs (the graphs hold the weights' addresses)
    offload_params: bool = False


@dataclass
class CriticConfig:
    # with lora.rank > 0 (PPO) only the critic's adapters and its value head train (the value head
    # is new: it trains in full); checkpoints hold those and their optimizer state, not the base
    lora: LoRAConfig = field(default_factory=LoRAConfig)


@dataclass
class TrainerConfig:
    total_steps: int = 20
    seed: int = 1
    output_dir: str = "outputs/run"
    precision: str = "auto"  # fp32 | bf16 | auto (bf16 on a GPU, fp32 on CPU)
    critic_warmup: int = 0  # steps that update only the critic
    sft_warmup_steps: int = 0  # supervised steps on reference answers before RL (synthetic tasks)
    sft_lr: Optional[float] = None  # learning rate of the warm-up; None: actor_optim.lr
    save_every: int = 0  # 0: only at the end
    save_final: bool = True  # checkpoint when training ends
    resume: bool = True  # continue from the newest checkpoint in <output_dir>/checkpoints
    resume_allow_vocab_resize: bool = False  # resume with another model.vocab_size (rows kept/zeroed)
    # resume on training data other than the checkpoint's (data.train_files content or row count;
    # hybridflow/run_state.py): the sampler starts its epoch again over the new data
    resume_allow_data_change: bool = False
    # resume a LoRA run's adapter-only checkpoint onto a base model whose fingerprint differs from
    # the one it trained on (hybridflow/checkpoint/base.py); the adapters then act on another base
    resume_allow_base_change: bool = False
    # re-deal the step's rows over the DP ranks by tokens after generation (verl's name; each rank
    # otherwise trains on its own prompts' groups); hybridflow/parallel/balance.py
    balance_batch: bool = False
    # seconds a collective of any process group waits for a peer before the rank ends with a
    # stage/timeout line; longer than anything one rank does while the others wait (loading, saving)
    collective_timeout_s: float = 1800.0
    probe_steps: int = 0  # >0: run N steps, write probe.json (time/cost forecast), stop
    # >0: stop cleanly, with a checkpoint, before a step would end past this many seconds of
    # training (a SLURM or device time limit); `trainer.resume=true` continues from there
    time_budget_s: float = 0.0
    # an optimizer step with an inf/NaN gradient is skipped (weights unchanged), said on stdout and
    # in `<role>/update_skipped`, and its mini-batch is saved under <output_dir>/nonfinite/ for
    # replay; this many steps in a row with every update skipped end the run (0: never)
    max_skipped_steps: int = 3
    price_per_gpu_hour: Optional[float] = None  # for the probe's cost; None: the GPU's default
    # the reference model's weights live in (pinned) host memory between its passes: copied to the
    # GPU once per step and dropped after the ref pass (nothing is copied back)
    offload_ref: bool = False
    # with offload_ref: the copy starts at the top of the step on a side stream and runs behind
    # generation (PCIe beside HBM-bound decoding; Engine.onload(prefetch=True)), so the weights sit
    # on the GPU through generation (whose wave sizing sees them) but not through the update;
    # false: copied at the start of the ref pass, on the GPU only there
    offload_ref_prefetch: bool = True
    # cap this process's GPU memory at N GiB (torch.cuda.set_per_process_memory_fraction of the
    # device's total), e.g. 24 to run as on a 24 GB card; the automatic token budgets are sized for
    # it. null: the whole device. Ignored with a warning line on CPU (nothing to cap there)
    gpu_memory_limit_gib: Optional[float] = None
    # Python GC: N > 0 turns automatic collection off during training and collects every N steps
    # (at the start of the step, timed as timing_s/gc), as Megatron's --manual-gc: automatic
    # collections at random points stall every rank of a collective; 0: Python's default.
    gc_interval: int = 1
    # every collection at a step that is a multiple of this is a full one; the others collect the
    # young generations only (what was made since the last collection: the step's garbage), as
    # torchtitan's: a full scan walks every live object, compiled graphs and caches included (tens
    # of ms per step once decode is compiled). 1: every collection is full
    gc_full_interval: int = 50
    # validation (verl's trainer.test_freq): greedy decoding over data.val_files every N steps
    val_every: int = 0  # 0: never during training
    val_before_train: bool = False  # score the starting model (step 0) first
    # score the model once (greedy over data.val_files) and stop: no training, nothing saved. The
    # model is the config's (model.hf_path / gguf_path) or, with trainer.resume, the newest checkpoint
    # in output_dir; e.g. a peer's HF snapshots scored by the same validation as ours
    val_only: bool = False
    val_max_new_tokens: Optional[int] = None  # None: rollout.max_new_tokens
    # validation generates with rollout.quantization and rollout.kv_cache_dtype too (true) or with
    # the unquantized weights and cache (false: the model's own greedy answers; the val metrics
    # carry val-aux/quantized). With false and rollout.free_cache_engine=false, validation builds
    # its own generator beside the kept quantized one (freed after it; the kept one is freed first
    # when the device lacks room for validation's KV cache)
    val_quantized: bool = False
    val_log_generations: int = 8  # rows appended to <output_dir>/val_generations.jsonl per validation
    progress_bar: bool = True
    tensorboard: bool = True
    # torch.profiler around these steps (1-based, as logged): per rank a trace, a per-stage kernel
    # summary (with each stage's idle device time and the host ops it waited for) and an operator
    # table under profile_dir (default <output_dir>/profile); hybridflow/profiling.py
    profile_steps: list = field(default_factory=list)
    profile_dir: Optional[str] = None
    # the profiled steps record Python stacks: each stage's host waits name the lines that made
    # them (more host time per op, so the profiled step runs slower than the others)
    profile_with_stack: bool = False
    # kernels listed per stage in the profiled steps' summary (by device time), enough to set a
    # step's kernels beside a benchmark's (bench_packed_pass.py --profile lists 80)
    profile_top_kernels: int = 40
    # seconds between reads of this rank's GPU clock, power, temperature and clock-event reasons
    # (NVML, nvidia-ml-py in the gpu extra), logged per step and stage as perf/gpu_* (a card held
    # below its boost clock by its power cap shows there); 0 off; off without CUDA or NVML
    gpu_monitor_interval_s: float = 0.2


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    critic_model: Optional[ModelConfig] = None  # None: same shape as the actor
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    actor_optim: OptimConfig = field(default_factory=OptimConfig)
    critic_optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4))
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    @property
    def use_critic(self) -> bool:
        return self.algo.adv_estimator == "gae"


def load_config(overrides: list[str], *, config_name: str = "ppo") -> Config:
    """Compose conf/<config_name>.yaml with Hydra overrides and type it against `Config`.

    Raises ValueError with a one-line message for unknown keys, bad values or bad override syntax.
    """
    from hydra import compose, initialize_config_module
    from hydra.core.config_store import ConfigStore
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    ConfigStore.instance().store(name="hybridflow_schema", node=Config)  # conf/ppo.yaml's base
    try:
        with initialize_config_module(config_module=CONF_PACKAGE, version_base=None):
            raw = compose(config_name=config_name, overrides=list(overrides))
        schema = OmegaConf.structured(Config)
        merged = OmegaConf.merge(schema, raw)
        cfg = OmegaConf.to_object(merged)
    except (HydraException, OmegaConfBaseException) as e:
        raise ValueError(_one_line(e)) from None
    return cfg


_NOISE = ("object_type", "reference_type", "To append", "Config search path", "provider=")


def _one_line(e: BaseException) -> str:
    """Hydra/OmegaConf errors span several lines and causes; keep the lines that name the problem."""
    lines = []
    while e is not None:
        lines += [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        e = e.__cause__
    keep = [ln for ln in lines if not ln.startswith(_NOISE)]
    return "invalid config: " + " ".join(keep)


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)
