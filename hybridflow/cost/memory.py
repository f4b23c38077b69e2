"""Peak memory per GPU, by component and by phase of the RL step.

Resident through the whole step (DESIGN.md: actor and critic state stays on the GPU):
- actor weights: bf16, 2 bytes/param over TP x PP;
- actor grads: Megatron's DDP grad buffer in fp32 (bf16 training accumulates and reduces grads in
  fp32), 4 bytes/param over TP x PP, not sharded over DP;
- actor optimizer: fp32 master copy + Adam m and v, 12 bytes/param over TP x PP, and over DP too (the
  distributed optimizer is on whenever DP > 1);
- critic (PPO only): the same three for the critic (value head instead of LM head);
- reference: bf16 weights in the training layout, unless offloaded (then present in its own phase,
  and in generation's too when prefetched behind it: `offload_ref_prefetch`, the trainer's default).
- LoRA (`Workload.lora_rank`, all-linear targets): the actor's grads and optimizer cover only the
  adapters (`lora_params`), the adapters' bf16 weights join the actor's, and there is no reference
  copy (the reference is the actor with adapters off). Merging adapters for generation works in
  blocks of 1024 rows (tens of MB, not counted).
- `Workload.offload_optimizer`: the optimizer's 12 bytes/param live on the host; they return only
  for the optimizer step, after the update's activations are gone (component `actor_optimizer` in
  the `optimizer_step` phase: weights + grads + optimizer state).
- `Workload.offload_grads`: the actor's gradient buffers exist only in its update (and optimizer
  step) phases.
- `Workload.critic_lora_rank` (PPO): the critic's bf16 weights plus its adapters', grads and
  optimizer state for the adapters and the value head only.
- `Workload.offload_params`: the actor's weights (LoRA: the frozen base; the adapters stay) are
  absent from the `values` and `update_critic` phases, from `ref` when the reference is a model
  of its own, and from `gen` where the generator holds its
  own copy (`gen_owns_weights`): with a reshard the whole training shard leaves (the gen buffer,
  component `reshard_buffer`, holds the full TP_g shard), with a quantized rollout the decoder's
  matrices leave (embedding, norms and LM head stay: the generator reads them in place; the
  matrices go to the host first and are quantized one at a time from there, so the bf16 matrices
  and the codes are never on the device together). Not for MoE generation. The quantized
  generator's codes are component `rollout_weights` (every rollout with `rollout_quantization`;
  without offload_params the bf16 matrices stay beside them). With a reshard, the gather holds
  the training shard and the gen buffer at once before the training shard leaves (not counted:
  no KV cache yet).
Per phase, on top:
- gen: the reshard buffer (what `parallel.reshard.Resharder` allocates: the whole gen TP_g shard of
  the actor, the rank's own training slice copied in, but for the replicated norms, which it
  aliases at PP_t = 1; zero when TP_g = TP and PP = 1), the KV cache of one generation wave, prefill
  scratch (one layer of the wave's prompts) and last-position logits. Sequences that do not fit run
  in several waves;
- old_log_prob / ref / values: one layer's activations for a micro-batch, and its logits (component
  `logits`: at the response positions only, `Workload.head_fraction`, or one chunk of them with
  `lm_head_chunk_tokens`; bf16, or fp32 with `bf16_logits` false);
- with `keep_generator` (rollout.free_cache_engine=false, no reshard) the KV cache is the one
  kept from the run's largest generation call (under dynamic sampling a round of
  `gen_batches_per_round` prompt batches, at most rollout.max_batch_size rows, rounded up to its
  graph bucket), in gen and through every later phase;
- update_actor / update_critic: stored activations (`flops.activation_bytes_per_token_layer`, the
  unfused SwiGLU's two extra tensors without `fused_elementwise`; with
  full recompute only each layer's bf16 input plus one layer's working set), 1F1B keeping
  min(PP, micro-batches) micro-batches in flight on the first stage, plus the logits and their grad
  (component `logits`); with `lm_head_chunk_tokens` one chunk of them plus the chunked backward's
  output-weight gradient: its fp32 sum over the chunks and one chunk's bf16 product
  (`HEAD_GRAD_BYTES` per weight entry, held across the chunks: over a GiB with a 150k vocabulary
  at 1.5B).
- with `train_cuda_graphs` (parallel.train_cuda_graphs) the graphs' static tensors stay allocated
  through every phase (component `graph_pool`): per layer one micro-batch's input, output and
  their gradients (and, with `graph_weight_grads_held`, the layers' bf16 weight gradients). The
  peak is set in the update phase of the first step, when the capture holds one micro-batch's
  activations as live tensors, as an eager update does; after it, the replayed activations live in
  the graphs' private pool (reserved memory, not counted as allocated: perf/max_memory_allocated_gb is the
  run's maximum, from the start). That pool stays reserved through generation and the other passes:
  `reserved_peak_gib` adds each trained role's update activations to every phase but its own
  (`reserved_phases_gib` per phase), `fits` (hence the automatic token budgets) takes the larger
  of it and the allocated peak, and generation's batch is what the memory holds beside the graphs'
  tensors and pools.
MoE (`ModelConfig.moe`): the experts' weights, grads (and the reference's weights) are split over
EP x expert TP x PP (`Plan.expert_shard`), the rest over TP x PP; the optimizer's 12 bytes/param
over every rank either way (the distributed optimizer shards the experts over the expert-DP ranks:
EP x expert TP x PP x expert DP = the world, as TP x PP x DP is). Generation runs in place with every
expert at TP_g = TP (`parallel.reshard.generation_params` all-gathers the other EP ranks' experts,
and slices whole experts at expert TP 1): component `reshard_buffer` holds the experts this rank
does not train, for the gen phase. The stored activations of an MoE layer count its dispatched
rows (`flops.activation_bytes_per_token_layer`); the all-to-all's send / receive buffers are one
layer's dispatched rows (top_k x hidden per token, both ways), inside the one layer's working set
already counted, so not added.
Not modelled: Megatron's vocab padding, optimizer-step temporaries, allocator fragmentation (folded
into `Calibration.memory_headroom_gib` and `memory_scale`; `activation_memory_scale` scales the
activation component alone: what grows with the micro-batch beyond the counted tensors).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from hybridflow.cost.efficiency import Calibration
from hybridflow.cost.flops import BYTES_PER_PARAM, activation_bytes_per_token_layer, kv_bytes_per_token
from hybridflow.cost.gpus import GPU
from hybridflow.cost.workload import Plan, Workload
from hybridflow.model_config import ModelConfig
from hybridflow.parallel.layout import Layout

GIB = 2 ** 30
FORWARD_STAGES = ("old_log_prob", "ref", "values")  # the step's forward-only passes
LOGIT_BYTES = 8        # per vocab entry per token: fp32 logits + fp32 log-softmax (or its grad)
LOGIT_BYTES_BF16 = 4   # the same kept in bf16 (the engine's bf16 output, Workload.bf16_logits)
HEAD_GRAD_BYTES = 6    # per output-weight entry, chunked LM-head backward: fp32 sum + bf16 product
COMPONENTS = ("actor_weights", "actor_grads", "actor_optimizer", "critic", "reference",
              "reshard_buffer", "rollout_weights", "kv_cache", "activations", "logits",
              "graph_pool")


@dataclass
class MemoryEstimate:
    phases_gib: dict[str, dict[str, float]]   # phase -> component -> GiB per GPU (scaled)
    peak_phase: str
    peak_gib: float
    capacity_gib: float                       # usable: memory_gib - headroom
    gen_batch: int                            # sequences per generation wave per gen replica
    gen_waves: int
    # what the caching allocator holds at the worst phase, when more than is allocated: with
    # train_cuda_graphs each trained role's graphs keep one update micro-batch's activations in
    # their private pool from the capture on, through every other phase (reserved there, not
    # allocated: the records' peaks, and `peak_gib`, do not show it)
    reserved_peak_gib: float = 0.0
    # per phase: what it allocates plus the pools the other trained roles' graphs hold there
    # (equal to phases_gib's sums without train_cuda_graphs)
    reserved_phases_gib: dict[str, float] = field(default_factory=dict)

    @property
    def components_gib(self) -> dict[str, float]:
        return self.phases_gib[self.peak_phase]

    @property
    def fits(self) -> bool:
        return max(self.peak_gib, self.reserved_peak_gib) <= self.capacity_gib

    @property
    def largest_component(self) -> str:
        c = self.components_gib
        return max(c, key=c.get)

    def to_dict(self) -> dict:
        return {**asdict(self), "components_gib": self.components_gib, "fits": self.fits}


def phases_to_run(workload: Workload) -> list[str]:
    phases = ["gen"] + ([] if workload.skip_old_log_prob else ["old_log_prob"])
    phases += ["ref"] if workload.use_reference else []
    phases += ["values", "update_critic"] if workload.has_critic else []
    phases += ["update_actor"]
    return phases + (["optimizer_step"] if workload.offload_optimizer else [])


def lora_params(shape: ModelConfig, rank: int) -> int:
    """Adapter parameters of all-linear LoRA at `rank`: r x (in + out) per adapted matrix (q, k,
    v, o, gate, up, down) per layer."""
    h, f = shape.hidden_size, shape.ffn_hidden_size
    q = shape.num_attention_heads * shape.head_dim
    kv = shape.num_query_groups * shape.head_dim
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + f) + (f + h)
    return rank * per_layer * shape.num_layers


def _reference_used(plan: Plan, workload: Workload) -> bool:
    """A reference copy exists (a KL term, and not the LoRA actor with its adapters off)."""
    return workload.use_reference and not workload.lora_rank


def expert_params(shape: ModelConfig) -> int:
    """The routed experts' weights of every layer (0 for a dense model)."""
    m = shape.moe
    return shape.num_layers * 3 * shape.hidden_size * m.num_experts * m.moe_ffn_hidden_size \
        if m.enabled else 0


def params_per_gpu(shape: ModelConfig, plan: Plan) -> float:
    """The actor's parameters on one GPU of the training layout: the experts over EP x expert TP x
    PP, the rest over TP x PP."""
    e = expert_params(shape)
    return (shape.num_params - e) / (plan.layout.tp_t * plan.layout.pp_t) + e / plan.expert_shard


def critic_trained_params(shape: ModelConfig, workload: Workload) -> int:
    """The critic's trained parameters: all of them, or with critic LoRA its adapters and its
    value head (hidden + bias)."""
    if workload.critic_lora_rank:
        return lora_params(shape, workload.critic_lora_rank) + shape.hidden_size + 1
    return shape.num_critic_params


def _critic_bytes(shape: ModelConfig, plan: Plan, workload: Workload) -> float:
    """Weights (bf16, adapters included), fp32 grads and the optimizer's 12 bytes per trained
    parameter (over DP too) of the critic on one GPU."""
    if not workload.has_critic:
        return 0.0
    lay = plan.layout
    shard = lay.tp_t * lay.pp_t
    trained = critic_trained_params(shape, workload)
    weights = shape.num_critic_params + (trained if workload.critic_lora_rank else 0)
    return (BYTES_PER_PARAM * weights + 4 * trained + 12 * trained / lay.dp_t) / shard


def gen_owns_weights(plan: Plan, workload: Workload, shape: ModelConfig) -> bool:
    """The generator decodes from its own copy of the decoder's matrices (gathered into the gen
    layout, or quantized), not from the training weights in place (dense models)."""
    return not shape.moe.enabled and (plan.layout.needs_reshard
                                      or workload.rollout_quantization != "none")


def offloaded_params_bytes(shape: ModelConfig, plan: Plan, workload: Workload, phase: str) -> float:
    """actor.offload_params: the actor's weight bytes per GPU absent from `phase` (0 without it)."""
    if not workload.offload_params:
        return 0.0
    local = BYTES_PER_PARAM * params_per_gpu(shape, plan)
    if phase in ("values", "update_critic") or (phase == "ref" and _reference_used(plan, workload)):
        return local  # (a LoRA actor's reference pass reads its base)
    if phase == "gen" and gen_owns_weights(plan, workload, shape):
        if plan.layout.needs_reshard:
            return local
        lay = plan.layout
        return BYTES_PER_PARAM * shape.num_layers * shape.layer_matmul_params / (lay.tp_t * lay.pp_t)
    return 0.0


def rollout_weights_bytes(shape: ModelConfig, plan: Plan, workload: Workload) -> float:
    """The quantized generator's codes and scales of the decoder's matrices (its TP_g shard)."""
    if workload.rollout_quantization == "none":
        return 0.0
    from hybridflow.cost.flops import ROLLOUT_BYTES_PER_WEIGHT

    return (ROLLOUT_BYTES_PER_WEIGHT[workload.rollout_quantization] * shape.num_layers
            * shape.layer_matmul_params / plan.layout.tp_g)


def _resident(shape: ModelConfig, plan: Plan, workload: Workload) -> dict[str, float]:
    lay = plan.layout
    shard = lay.tp_t * lay.pp_t
    local = params_per_gpu(shape, plan)
    trained = lora_params(shape, workload.lora_rank) / shard if workload.lora_rank else local
    weights = local + (trained if workload.lora_rank else 0)
    ref = (_reference_bytes(shape, plan) if _reference_used(plan, workload)
           and not plan.offload_ref else 0.0)
    critic = _critic_bytes(shape, plan, workload)
    everything = (lora_params(shape, workload.lora_rank) if workload.lora_rank else shape.num_params)
    optimizer = 0.0 if workload.offload_optimizer else 12 * everything / lay.world_size
    return {"actor_weights": BYTES_PER_PARAM * weights, "actor_grads": 4 * trained,
            "actor_optimizer": optimizer, "critic": critic, "reference": ref}


def _reference_bytes(shape: ModelConfig, plan: Plan) -> float:
    """The reference's bf16 weights in the training layout."""
    return BYTES_PER_PARAM * params_per_gpu(shape, plan)


def _prefetched_reference(shape: ModelConfig, plan: Plan, workload: Workload) -> float:
    """The offloaded reference's weights in generation, where the trainer prefetches them."""
    if not (_reference_used(plan, workload) and plan.offload_ref and workload.offload_ref_prefetch):
        return 0.0
    return _reference_bytes(shape, plan)


def replicated_params(shape: ModelConfig) -> int:
    """Parameters every TP rank holds whole (the norms: two per layer, the QK norms, the final
    one): a dense model's generation reads them in place at PP_t = 1 (`param_rules.REPLICATED`)."""
    qk = 2 * shape.head_dim if shape.qk_layernorm else 0
    return shape.num_layers * (2 * shape.hidden_size + qk) + shape.hidden_size


def reshard_buffer_bytes(shape: ModelConfig, layout: Layout, plan: Plan | None = None) -> float:
    """Bytes a GPU allocates for generation's weights. Dense: the Resharder's buffers hold the whole
    gen TP_g shard (the rank's own training slice is copied in, not aliased), but for the
    replicated norms, which at PP_t = 1 are the training parameters themselves (at PP_t > 1 the
    other stages' norms are gathered too); zero when TP_g = TP and PP = 1 (everything aliased).
    MoE (in place, TP_g = TP): the experts it does not train (other EP ranks', and the other
    expert-TP slices at expert TP 1), all-gathered for generation."""
    if shape.moe.enabled:
        return reshard_received_bytes(shape, layout, plan)
    if not layout.needs_reshard:
        return 0.0     # generation reads the training weights in place
    norms = replicated_params(shape)
    own_norms = 0 if layout.pp_t == 1 else norms
    return BYTES_PER_PARAM * ((shape.num_params - norms) / layout.tp_g + own_norms)


def reshard_received_bytes(shape: ModelConfig, layout: Layout, plan: Plan | None = None) -> float:
    """Bytes a GPU receives to build its generation weights: the gen TP_g shard minus the training
    shard it holds; MoE, the experts it does not train (slices at expert TP 1 are views)."""
    if shape.moe.enabled:
        e = expert_params(shape)
        shard = plan.expert_shard if plan is not None else layout.tp_t * layout.pp_t
        return max(0.0, BYTES_PER_PARAM * e * (1 / layout.tp_g - 1 / shard))
    if not layout.needs_reshard:
        return 0.0
    return BYTES_PER_PARAM * shape.num_params * (1 / layout.tp_g - 1 / (layout.tp_t * layout.pp_t))


def _gen_bytes_per_seq(shape: ModelConfig, layout: Layout, workload: Workload) -> tuple[float, float]:
    """(KV cache, scratch) bytes per sequence of a generation wave. The cache holds the longest
    prompt and rollout.max_new_tokens (the longest response without a cap), rounded up to the
    generator's LENGTH_MULTIPLE."""
    from hybridflow.cost.varlen import LENGTH_MULTIPLE

    prompt = workload.prompt_len_max or workload.prompt_len   # a chunk's prompts, left-padded
    length = prompt + (workload.max_new_tokens or workload.longest_response)
    length = -(-length // LENGTH_MULTIPLE) * LENGTH_MULTIPLE
    kv = length * kv_bytes_per_token(shape, layout.tp_g, fp8=workload.kv_cache_dtype == "fp8")
    scratch = (workload.prompt_len * activation_bytes_per_token_layer(shape)
               + shape.vocab_size * LOGIT_BYTES) / layout.tp_g
    return kv, scratch


def gen_batch_size(shape: ModelConfig, gpu: GPU, plan: Plan, workload: Workload,
                   calib: Calibration, *, largest: bool = False) -> tuple[int, int]:
    """(sequences per wave, waves) for one gen replica: as many as the free memory holds (and
    rollout.max_batch_size allows); a call generates the step's rows, or under dynamic sampling
    its share of the prompt batches of a round (the mean call; `largest`: the run's largest call,
    `Workload.gen_batches_per_round` prompt batches, or with partial rollouts every in-flight
    group's rows)."""
    lay = plan.layout
    w = workload
    per_replica = math.ceil(w.num_sequences * w.gen_prompt_factor / w.gen_rounds / lay.dp_g)
    if largest:
        per_replica = max(per_replica,
                          math.ceil(w.num_sequences * w.gen_batches_per_round / lay.dp_g))
        if w.partial_decode_steps:  # every in-flight group's rows (rollout.partial's first step;
            # a dynamic-sampling round of k prompt batches keeps k batches' slack)
            extra = w.partial_extra_prompts * w.samples_per_prompt
            per_replica = max(per_replica, math.ceil(w.gen_batches_per_round
                                                     * (w.num_sequences + extra) / lay.dp_g))
    resident = _resident(shape, plan, workload)
    if workload.offload_grads:
        resident["actor_grads"] = 0.0
    used = (sum(resident.values()) + reshard_buffer_bytes(shape, lay, plan)
            + rollout_weights_bytes(shape, plan, workload)
            - offloaded_params_bytes(shape, plan, workload, "gen")
            + _prefetched_reference(shape, plan, workload))
    if workload.train_cuda_graphs:  # the update graphs' tensors and pools, from the first step on
        used += _graph_pool(shape, plan, workload) + sum(
            _held_pools(shape, plan, workload, calib).values())
    free = (gpu.memory_gib - calib.memory_headroom_gib) * GIB / calib.memory_scale - used
    kv, scratch = _gen_bytes_per_seq(shape, lay, workload)
    batch = min(per_replica, w.gen_max_batch_size or per_replica,
                max(1, int(free // (kv + scratch * calib.activation_memory_scale))))
    return batch, math.ceil(per_replica / batch)


def _kept_cache_rows(shape: ModelConfig, gpu: GPU, plan: Plan, workload: Workload,
                     calib: Calibration) -> int:
    """Rows of a kept generator's KV cache (rollout.free_cache_engine=false): the run's largest
    generation call (a chunk of it, at most rollout.max_batch_size), rounded up to its CUDA-graph
    bucket as the generator's _ensure_cache allocates it."""
    from hybridflow.cost.varlen import bucket_sizes

    rows, _ = gen_batch_size(shape, gpu, plan, workload, calib, largest=True)
    cap = workload.gen_max_batch_size
    return next(b for b in bucket_sizes(cap) if b >= rows) if cap and rows <= cap else rows


def _activations(shape: ModelConfig, plan: Plan, workload: Workload, phase: str) -> tuple[float, float]:
    """(stored layer activations, logits and their grad) of one phase, bytes."""
    lay = plan.layout
    tp, micro_tokens = lay.tp_t, workload.seqs_per_micro_batch * workload.seq_len
    layer = activation_bytes_per_token_layer(shape, fused_swiglu=workload.fused_elementwise)
    # (MoE under EP: a rank's experts see, on average, top_k of its own tokens' rows, as at EP 1)
    per_entry = LOGIT_BYTES_BF16 if workload.bf16_logits else LOGIT_BYTES
    logits = 0 if phase in ("values", "update_critic") else shape.vocab_size * per_entry / tp

    def head(tokens):  # logits (and their grad) held at once: the scored positions, or one chunk
        scored = tokens * workload.head_fraction
        chunk = workload.lm_head_chunk_tokens
        return (min(scored, chunk) if chunk else scored) * logits

    if phase in FORWARD_STAGES:
        tokens = workload.seqs_per_forward_micro_batch * workload.seq_len
        return tokens * layer / tp, head(tokens)
    in_flight = min(lay.pp_t, workload.num_micro_batches(lay.dp_t))
    layers_kept = shape.num_layers // lay.pp_t * in_flight
    if plan.recompute:
        kept = layers_kept * BYTES_PER_PARAM * shape.hidden_size / tp + layer / tp
    else:
        kept = layers_kept * layer / tp
    head_grad = 0.0
    if workload.lm_head_chunk_tokens and phase == "update_actor":
        head_grad = shape.vocab_size / tp * shape.hidden_size * HEAD_GRAD_BYTES
    return micro_tokens * kept, head(micro_tokens) + head_grad


def _held_pools(shape: ModelConfig, plan: Plan, workload: Workload,
                calib: Calibration) -> dict[str, float]:
    """Update phase -> bytes its CUDA graphs' private pool keeps reserved through every other
    phase (one micro-batch's stored activations, scaled as that phase's are); {} without
    train_cuda_graphs."""
    if not workload.train_cuda_graphs:
        return {}
    return {p: _activations(shape, plan, workload, p)[0] * calib.activation_memory_scale
            for p in ("update_actor", "update_critic") if p in phases_to_run(workload)}


def _graph_pool(shape: ModelConfig, plan: Plan, workload: Workload) -> float:
    """Bytes the training CUDA graphs keep allocated from their capture on: per layer the static
    input, output and their two gradients of one micro-batch (bf16, the sequence split over TP
    under sequence parallelism; a token budget's micro-batch: the budget, the shape packed rows
    are padded to), and with `graph_weight_grads_held` the layers' bf16 weight gradients."""
    lay = plan.layout
    layers = shape.num_layers // lay.pp_t
    tokens = (workload.micro_batch_tokens if workload.dynamic_bsz and workload.micro_batch_tokens
              else workload.seqs_per_micro_batch * workload.seq_len)
    static = 4 * BYTES_PER_PARAM * tokens * shape.hidden_size / lay.tp_t * layers
    grads = BYTES_PER_PARAM * layers * shape.layer_params / lay.tp_t
    return static + (grads if workload.graph_weight_grads_held else 0.0)


def memory_for(shape: ModelConfig, gpu: GPU, plan: Plan, workload: Workload,
               calib: Calibration) -> MemoryEstimate:
    lay = plan.layout
    resident = _resident(shape, plan, workload)
    batch, waves = gen_batch_size(shape, gpu, plan, workload, calib)
    phases = {}
    kv, scratch = _gen_bytes_per_seq(shape, lay, workload)
    kept = workload.keep_generator and not lay.needs_reshard
    # a kept generator's cache only grows: the largest call's rows (its graph bucket), every step
    cache_rows = _kept_cache_rows(shape, gpu, plan, workload, calib) if kept else batch
    kept_kv = cache_rows * kv if kept else 0.0
    for phase in phases_to_run(workload):
        c = dict.fromkeys(COMPONENTS, 0.0) | resident
        if phase == "gen":
            c |= {"reshard_buffer": reshard_buffer_bytes(shape, lay, plan),
                  "rollout_weights": rollout_weights_bytes(shape, plan, workload),
                  "kv_cache": cache_rows * kv, "activations": batch * scratch}
            c["reference"] += _prefetched_reference(shape, plan, workload)
        elif phase == "optimizer_step":  # offloaded state back for the step; activations gone
            trained = lora_params(shape, workload.lora_rank) if workload.lora_rank \
                else shape.num_params
            c |= {"kv_cache": kept_kv, "actor_optimizer": 12 * trained / lay.world_size}
        else:
            act, logits = _activations(shape, plan, workload, phase)
            c |= {"kv_cache": kept_kv, "activations": act, "logits": logits}
        if phase == "ref" and _reference_used(plan, workload):
            c["reference"] = _reference_bytes(shape, plan)
        if workload.offload_grads and phase not in ("update_actor", "optimizer_step"):
            c["actor_grads"] = 0.0
        c["actor_weights"] -= offloaded_params_bytes(shape, plan, workload, phase)
        c["activations"] *= calib.activation_memory_scale
        if workload.train_cuda_graphs:
            c["graph_pool"] = _graph_pool(shape, plan, workload)
        phases[phase] = {k: v * calib.memory_scale / GIB for k, v in c.items()}
    peak_phase = max(phases, key=lambda p: sum(phases[p].values()))
    held = {p: v * calib.memory_scale / GIB
            for p, v in _held_pools(shape, plan, workload, calib).items()}
    by_phase = {p: sum(c.values()) + sum(a for q, a in held.items() if q != p)
                for p, c in phases.items()}
    return MemoryEstimate(phases_gib=phases, peak_phase=peak_phase,
                          peak_gib=sum(phases[peak_phase].values()),
                          capacity_gib=gpu.memory_gib - calib.memory_headroom_gib,
                          gen_batch=batch, gen_waves=waves,
                          reserved_peak_gib=max(by_phase.values()) if held else 0.0,
                          reserved_phases_gib=by_phase)
