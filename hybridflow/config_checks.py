"""Cross-field validation of a composed `Config`, before anything is built. Each check raises
ValueError naming the key, the value and what was expected: parallel sizes against the world size
and the model shape, rollout (decode options included), data and reward options, batch sizes (global
mini-batch vs per-GPU micro-batches, or token budgets), and the algorithm recipes.
"""

from __future__ import annotations

from typing import Optional

from hybridflow.config import QUACK_CHOICES, SWIGLU_BACKWARD_CHOICES, Config
from hybridflow.model_config import ModelConfig

KERNELS = ("auto", "triton", "torch")  # rollout.decode_kernels
# the decode step's GEMMs whose weight the kernel before it can hint into L2: qkv by the first
# norm, proj by the fused RoPE + attention kernel, fc1 by the second norm, fc2 by fc1's Triton GEMM
PREFETCHABLE = ("qkv", "proj", "fc1", "fc2")
QUANTIZATION = ("none", "fp8", "int4")  # rollout.quantization
KV_CACHE_DTYPES = ("auto", "fp8")  # rollout.kv_cache_dtype
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def _one_of(key: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is not one of {sorted(allowed)}")


def _positive(key: str, value) -> None:
    if value is None or value <= 0:
        raise ValueError(f"{key}={value!r} must be a positive number")


def _int_at_least(key: str, value, lo: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{key}={value!r} must be an integer >= {lo} ({what})")


def validate_moe(cfg: ModelConfig, *, tp: int, ep: int = 1, etp: int | None = None,
                 prefix: str = "model") -> None:
    """model.moe against itself and the expert layout (EP, expert TP)."""
    m, k = cfg.moe, f"{prefix}.moe"
    if m.num_experts < 0:
        raise ValueError(f"{k}.num_experts={m.num_experts} must be >= 0 (0: a dense MLP)")
    if not m.enabled:
        if ep != 1:
            raise ValueError(f"parallel.expert_parallel_size={ep} needs a mixture-of-experts model "
                             f"({k}.num_experts > 0); {prefix} is dense")
        return
    if not 1 <= m.top_k <= m.num_experts:
        raise ValueError(f"{k}.top_k={m.top_k} must be in [1, {k}.num_experts={m.num_experts}]")
    _positive(f"{k}.moe_ffn_hidden_size", m.moe_ffn_hidden_size)
    for key in ("aux_loss_coeff", "z_loss_coeff", "shared_expert_ffn_hidden_size"):
        if getattr(m, key) < 0:
            raise ValueError(f"{k}.{key}={getattr(m, key)} must be >= 0")
    _one_of(f"{k}.router_dtype", m.router_dtype, {"fp32", "fp64"})
    _one_of(f"{k}.token_dispatcher", m.token_dispatcher, {"alltoall", "allgather"})
    if m.num_experts % ep:
        raise ValueError(f"parallel.expert_parallel_size={ep} must divide {k}.num_experts="
                         f"{m.num_experts}")
    etp = etp or tp
    if m.moe_ffn_hidden_size % etp:
        raise ValueError(f"the expert TP size {etp} (parallel.expert_tensor_parallel_size, null: "
                         f"TP) must divide {k}.moe_ffn_hidden_size={m.moe_ffn_hidden_size}")


def check_one_model_source(cfg: ModelConfig, prefix: str = "model") -> None:
    if cfg.hf_path is not None and cfg.gguf_path is not None:
        raise ValueError(f"{prefix}.hf_path={cfg.hf_path} and {prefix}.gguf_path={cfg.gguf_path} "
                         f"are both set: the weights come from one of them; set the other to null "
                         f"({prefix}.gguf_path=null or {prefix}.hf_path=null)")


def validate_model(cfg: ModelConfig, *, tp: int, pp: int, prefix: str = "model") -> None:
    check_one_model_source(cfg, prefix)
    for k in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
              "num_query_groups", "vocab_size"):
        _positive(f"{prefix}.{k}", getattr(cfg, k))
    _one_of(f"{prefix}.attention_backend", cfg.attention_backend, {"auto", "sdpa", "te", "local"})
    if cfg.num_attention_heads % cfg.num_query_groups:
        raise ValueError(
            f"{prefix}.num_query_groups={cfg.num_query_groups} must divide "
            f"{prefix}.num_attention_heads={cfg.num_attention_heads}")
    if cfg.kv_channels is None and cfg.hidden_size % cfg.num_attention_heads:
        raise ValueError(f"{prefix}.hidden_size={cfg.hidden_size} is not divisible by "
                         f"{prefix}.num_attention_heads={cfg.num_attention_heads}; set kv_channels")
    for k in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):
        if getattr(cfg, k) % tp:
            raise ValueError(f"parallel.tensor_parallel_size={tp} must divide {prefix}.{k}="
                             f"{getattr(cfg, k)}")
    if cfg.num_layers % pp:
        raise ValueError(f"parallel.pipeline_parallel_size={pp} must divide "
                         f"{prefix}.num_layers={cfg.num_layers}")


def validate(cfg: Config, *, world_size: int) -> None:
    """Cross-field checks; raises ValueError naming the offending key."""
    p = cfg.parallel
    _positive("parallel.tensor_parallel_size", p.tensor_parallel_size)
    _positive("parallel.pipeline_parallel_size", p.pipeline_parallel_size)
    mp = p.tensor_parallel_size * p.pipeline_parallel_size
    if world_size % mp:
        raise ValueError(
            f"world size {world_size} is not divisible by parallel.tensor_parallel_size="
            f"{p.tensor_parallel_size} x parallel.pipeline_parallel_size={p.pipeline_parallel_size}")
    if p.sequence_parallel and p.tensor_parallel_size == 1:
        raise ValueError("parallel.sequence_parallel=true needs parallel.tensor_parallel_size > 1")
    if p.lm_head_chunk_tokens < 0:
        raise ValueError(f"parallel.lm_head_chunk_tokens={p.lm_head_chunk_tokens}: expected 0 (off) "
                         "or a positive number of positions")
    _one_of("parallel.mlp_kernels", p.mlp_kernels, set(QUACK_CHOICES))
    _one_of("parallel.swiglu_backward", p.swiglu_backward, set(SWIGLU_BACKWARD_CHOICES))
    if not 0.0 <= p.train_graphs_min_fill <= 1.0:
        raise ValueError(f"parallel.train_graphs_min_fill={p.train_graphs_min_fill}: expected a "
                         "share of the token budget in [0, 1]")
    conflicts = train_graphs_conflicts(cfg) if p.train_cuda_graphs else []
    if conflicts:
        raise ValueError(conflicts[0][1])
    validate_model(cfg.model, tp=p.tensor_parallel_size, pp=p.pipeline_parallel_size)
    _positive("parallel.expert_parallel_size", p.expert_parallel_size)
    if p.expert_tensor_parallel_size is not None:
        _positive("parallel.expert_tensor_parallel_size", p.expert_tensor_parallel_size)
    validate_moe(cfg.model, tp=p.tensor_parallel_size, ep=p.expert_parallel_size,
                 etp=p.expert_tensor_parallel_size)
    ep_etp = p.expert_parallel_size * (p.expert_tensor_parallel_size or p.tensor_parallel_size)
    if (world_size // p.pipeline_parallel_size) % ep_etp:
        raise ValueError(
            f"parallel.expert_parallel_size={p.expert_parallel_size} x the expert TP size "
            f"(parallel.expert_tensor_parallel_size, null: TP) = {ep_etp} must divide the "
            f"{world_size // p.pipeline_parallel_size} ranks of a pipeline stage (DP x TP)")
    if cfg.model.moe.enabled and p.tensor_parallel_size > 1 and not p.sequence_parallel:
        raise ValueError("a mixture-of-experts model (model.moe.num_experts > 0) at "
                         f"parallel.tensor_parallel_size={p.tensor_parallel_size} needs "
                         "parallel.sequence_parallel=true (megatron-core's MoE layer refuses to "
                         "train under TP without it)")
    etp = p.expert_tensor_parallel_size
    if cfg.model.moe.enabled and etp not in (None, 1, p.tensor_parallel_size):
        raise ValueError(f"parallel.expert_tensor_parallel_size={etp}: generation runs every expert "
                         f"at the attention's TP ({p.tensor_parallel_size}); expected null (= TP) "
                         "or 1 (whole experts, sliced for generation)")
    if cfg.model.moe.enabled and ((cfg.rollout.tensor_parallel_size or p.tensor_parallel_size)
                                  != p.tensor_parallel_size or p.pipeline_parallel_size > 1):
        raise ValueError("a mixture-of-experts model (model.moe.num_experts > 0) generates in "
                         "place: rollout.tensor_parallel_size must equal "
                         "parallel.tensor_parallel_size and parallel.pipeline_parallel_size be 1 "
                         "(the train -> generation resharder does not move experts yet)")
    if cfg.critic_model is not None and cfg.critic_model.moe.enabled:
        raise ValueError("critic_model.moe.num_experts > 0: mixture-of-experts critics are not "
                         "implemented (the actor may be one)")
    if cfg.critic_model is not None:
        validate_model(cfg.critic_model, tp=p.tensor_parallel_size, pp=p.pipeline_parallel_size,
                       prefix="critic_model")
    dp = world_size // mp

    r = cfg.rollout
    tp_g = r.tensor_parallel_size or p.tensor_parallel_size
    if p.tensor_parallel_size % tp_g:
        raise ValueError(f"rollout.tensor_parallel_size={tp_g} must divide "
                         f"parallel.tensor_parallel_size={p.tensor_parallel_size}")
    _positive("rollout.max_new_tokens", r.max_new_tokens)
    _positive("rollout.n", r.n)
    if r.decode_kv_window is not None and (r.decode_kv_window < 0 or r.decode_kv_window % 64):
        raise ValueError(f"rollout.decode_kv_window={r.decode_kv_window} must be 0 (attend over the "
                         f"whole KV cache) or a positive multiple of 64")
    if r.temperature < 0:
        raise ValueError(f"rollout.temperature={r.temperature} must be >= 0 (0 means greedy)")
    _validate_quantization(cfg)
    if not 0.0 < r.top_p <= 1.0:
        raise ValueError(f"rollout.top_p={r.top_p} must be in (0, 1]")

    if cfg.reward.fn is None and cfg.reward.model_path is None:
        raise ValueError("reward.fn is null and reward.model_path is not set: nothing would score "
                         "the responses")
    t, d = cfg.trainer, cfg.data
    if t.val_every < 0:
        raise ValueError(f"trainer.val_every={t.val_every} must be >= 0 (0: no validation during "
                         "training)")
    if (t.val_every or t.val_before_train or t.val_only) and d.val_files is None:
        raise ValueError("trainer.val_every / trainer.val_before_train / trainer.val_only need "
                         "data.val_files (a .jsonl/.parquet of held-out prompts)")
    if t.val_max_new_tokens is not None:
        _positive("trainer.val_max_new_tokens", t.val_max_new_tokens)
    if (d.val_files is not None or cfg.reward.val_fns) and cfg.reward.fn is None:
        raise ValueError("validation scores with rule rewards: set reward.fn (data.val_files or "
                         "reward.val_fns is set while reward.fn is null)")
    if (d.train_files is None) == (d.synthetic is None):
        raise ValueError("set exactly one of data.train_files (a .jsonl/.parquet path) and "
                         "data.synthetic (a built-in task name); or pick a complete recipe with "
                         "experiment=<name> (hybridflow/conf/experiment/: demo is the CPU demo, "
                         "gpu_template a GPU starting point)")
    _one_of("data.truncation", d.truncation, {"error", "left", "right"})
    if d.prompts_per_step % dp:
        raise ValueError(f"data.prompts_per_step={d.prompts_per_step} must be divisible by the "
                         f"data-parallel size {dp}")

    a = cfg.algo
    from hybridflow.algo import ADVANTAGE_ESTIMATORS, POLICY_LOSSES  # registries live with them

    _one_of("algo.adv_estimator", a.adv_estimator, set(ADVANTAGE_ESTIMATORS))
    _one_of("algo.policy_loss", a.policy_loss, set(POLICY_LOSSES))
    if a.clip_ratio_c is not None and a.clip_ratio_c <= 1.0:
        raise ValueError(f"algo.clip_ratio_c={a.clip_ratio_c} must be > 1 (dual-clip bound) or null")
    _validate_recipes(cfg)
    _one_of("algo.kl_ctrl", a.kl_ctrl, {"fixed", "adaptive"})
    for key in ("kl_penalty", "kl_loss_type"):
        _one_of(f"algo.{key}", getattr(a, key), {"k1", "k2", "k3", "abs"})
    if a.adv_estimator != "gae" and r.n < 2 and a.adv_estimator != "reinforce_plus_plus":
        raise ValueError(f"algo.adv_estimator={a.adv_estimator} compares samples of one prompt: "
                         f"set rollout.n >= 2 (got {r.n})")
    for key in ("ppo_mini_batch_size", "micro_batch_size_per_gpu", "ppo_epochs"):
        _positive(f"algo.{key}", getattr(a, key))
    _positive("data.prompts_per_step", d.prompts_per_step)
    seqs = d.prompts_per_step * r.n
    if seqs % a.ppo_mini_batch_size:
        raise ValueError(f"algo.ppo_mini_batch_size={a.ppo_mini_batch_size} (global) must divide "
                         f"the sequences per step data.prompts_per_step x rollout.n = {seqs}")
    if a.use_dynamic_bsz and p.expert_parallel_size > 1:
        raise ValueError(f"algo.use_dynamic_bsz=true with parallel.expert_parallel_size="
                         f"{p.expert_parallel_size}: token budgets give DP ranks different numbers "
                         "of micro-batches, and each micro-batch's expert all-to-all spans the DP "
                         "ranks of an EP group; set algo.use_dynamic_bsz=false (or null)")
    if a.pack_sequences and (a.use_dynamic_bsz is False or p.pipeline_parallel_size != 1):
        raise ValueError(f"algo.pack_sequences=true needs algo.use_dynamic_bsz=true (got "
                         f"{a.use_dynamic_bsz}) and parallel.pipeline_parallel_size=1 (got "
                         f"{p.pipeline_parallel_size}): it packs each token-budget micro-batch "
                         f"into one row of one shape per micro-batch")
    if a.balance_micro_batches and (a.pack_sequences is False or a.use_dynamic_bsz is False):
        raise ValueError(f"algo.balance_micro_batches=true deals packed micro-batches: it needs "
                         f"algo.pack_sequences and algo.use_dynamic_bsz true or null (got "
                         f"{a.pack_sequences} and {a.use_dynamic_bsz})")
    if a.pack_sequences and cfg.model.attention_backend in ("te", "local"):
        raise ValueError(f"algo.pack_sequences=true needs model.attention_backend=sdpa or auto "
                         f"(got {cfg.model.attention_backend!r}): its documents run on "
                         f"varlen_attn or flex_attention in SDPAttention")
    _one_of("algo.packed_attention", a.packed_attention, {"auto", "varlen", "flex", "fa4"})
    if a.packed_attention in ("varlen", "fa4") and cfg.trainer.precision == "fp32":
        raise ValueError(f"algo.packed_attention={a.packed_attention} needs trainer.precision=bf16 "
                         "(or auto on a GPU): FlashAttention takes bf16/fp16, not fp32; set "
                         "algo.packed_attention=auto or flex")
    if a.use_dynamic_bsz:  # micro-batches by tokens: the row counts of _validate_micro_batches unused
        _validate_dynamic_bsz(cfg, dp=dp)
    else:
        _validate_micro_batches(cfg, dp=dp)
        if a.use_dynamic_bsz is None and p.pipeline_parallel_size == 1:
            _validate_token_budgets(cfg)  # auto: budgets may run, decided on the machine
    for name in ("actor_optim", "critic_optim"):
        _one_of(f"{name}.lr_decay_style", getattr(cfg, name).lr_decay_style,
                {"constant", "linear", "cosine"})
    _one_of("trainer.precision", cfg.trainer.precision, {"fp32", "bf16", "auto"})
    validate_rollout_options(cfg)
    validate_multi_turn(cfg.rollout)
    validate_partial(cfg, dp=dp)
    validate_speculative(cfg.rollout)
    _positive("trainer.total_steps", cfg.trainer.total_steps)
    _positive("trainer.collective_timeout_s", cfg.trainer.collective_timeout_s)
    if cfg.trainer.time_budget_s < 0:
        raise ValueError(f"trainer.time_budget_s={cfg.trainer.time_budget_s} must be >= 0 "
                         "(0: no limit)")
    if cfg.trainer.max_skipped_steps < 0:
        raise ValueError(f"trainer.max_skipped_steps={cfg.trainer.max_skipped_steps} must be >= 0 "
                         "(0: never stop for skipped updates)")
    if cfg.trainer.gc_interval < 0:
        raise ValueError(f"trainer.gc_interval={cfg.trainer.gc_interval} must be >= 0 "
                         "(0: Python's automatic GC)")
    for step in cfg.trainer.profile_steps:
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(f"trainer.profile_steps={list(cfg.trainer.profile_steps)}: expected "
                             f"step numbers >= 1 (as logged), got {step!r}")
    if cfg.trainer.profile_top_kernels < 1:
        raise ValueError(f"trainer.profile_top_kernels={cfg.trainer.profile_top_kernels} must be "
                         ">= 1 (kernels listed per stage in the profiled steps' summary)")
    if not cfg.trainer.gpu_monitor_interval_s >= 0:
        raise ValueError(f"trainer.gpu_monitor_interval_s={cfg.trainer.gpu_monitor_interval_s} "
                         "must be >= 0 seconds (0: off)")
    if cfg.trainer.gc_full_interval < 1:
        raise ValueError(f"trainer.gc_full_interval={cfg.trainer.gc_full_interval} must be >= 1 "
                         "(1: every collection is a full one)")
    validate_lora(cfg)
    validate_router_replay(cfg)
    limit = cfg.trainer.gpu_memory_limit_gib
    if limit is not None and not limit > 0:
        raise ValueError(f"trainer.gpu_memory_limit_gib={limit} must be a positive number of GiB "
                         "(null: the whole device)")


def train_graphs_conflicts(cfg: Config) -> list[tuple[str, str]]:
    """The settings parallel.train_cuda_graphs cannot run with, as (the setting, the error a run
    that asks for both gets); config_auto leaves the graphs off where any is set."""
    p, a = cfg.parallel, cfg.actor
    found = []
    if p.activation_checkpointing:
        found.append(("parallel.activation_checkpointing=true",
                      "parallel.train_cuda_graphs=true and parallel.activation_checkpointing=true: "
                      "a graphed layer replays its saved activations, it cannot recompute them; "
                      "set one of them to false"))
    for key, lora in (("actor.lora", a.lora), ("critic.lora", cfg.critic.lora)):
        if lora.rank > 0 and lora.dropout > 0:
            found.append((f"{key}.dropout={lora.dropout}",
                          f"parallel.train_cuda_graphs=true and {key}.dropout={lora.dropout}: a "
                          "graphed layer would replay one dropout mask every step; set "
                          f"{key}.dropout=0 or parallel.train_cuda_graphs=false"))
    if p.pipeline_parallel_size > 1:
        found.append((f"parallel.pipeline_parallel_size={p.pipeline_parallel_size}",
                      f"parallel.train_cuda_graphs=true needs parallel.pipeline_parallel_size=1, "
                      f"got {p.pipeline_parallel_size}: 1F1B keeps several micro-batches in "
                      "flight and a layer's graph holds one"))
    if a.offload_grads:
        found.append(("actor.offload_grads=true",
                      "actor.offload_grads=true and parallel.train_cuda_graphs=true: the "
                      "captured graphs hold the gradient buffers' addresses; turn one off"))
    if a.offload_params:
        found.append(("actor.offload_params=true",
                      "actor.offload_params=true and parallel.train_cuda_graphs=true: the "
                      "captured graphs hold the weights' addresses; turn one off"))
    return found


def validate_router_replay(cfg: Config) -> None:
    """actor.router_replay: disabled or R3, the latter for an MoE actor on the single-turn,
    whole-rollout path (the generator records the routing there)."""
    mode = cfg.actor.router_replay
    if mode == "R2":
        raise ValueError("actor.router_replay=R2 (replaying the old-log-prob pass's routing) is not "
                         "implemented; expected disabled or R3 (the rollout's routing)")
    _one_of("actor.router_replay", mode, ("disabled", "R3"))
    if mode == "disabled":
        return
    if not cfg.model.moe.enabled:
        raise ValueError(f"actor.router_replay={mode} needs a mixture-of-experts model "
                         "(model.moe.num_experts > 0); set actor.router_replay=disabled")
    for key, on in (("rollout.multi_turn.enable", cfg.rollout.multi_turn.enable),
                    ("rollout.partial.enable", cfg.rollout.partial.enable),
                    ("parallel.train_cuda_graphs", cfg.parallel.train_cuda_graphs)):
        if on:
            raise ValueError(f"actor.router_replay={mode} with {key}=true is not supported (that "
                             "path does not record or bind the routing yet); set one of them off")


def validate_lora(cfg: Config) -> None:
    _validate_lora_role(cfg.actor.lora, "actor.lora", cfg.model)
    lora = cfg.critic.lora
    _validate_lora_role(lora, "critic.lora", cfg.critic_model or cfg.model)
    if lora.rank > 0 and not cfg.use_critic:
        raise ValueError(f"critic.lora.rank={lora.rank} but algo.adv_estimator="
                         f"{cfg.algo.adv_estimator} trains no critic (only gae does); set "
                         "critic.lora.rank=0")


def _validate_lora_role(lora, key: str, model) -> None:
    if isinstance(lora.rank, bool) or not isinstance(lora.rank, int) or lora.rank < 0:
        raise ValueError(f"{key}.rank={lora.rank!r} must be an integer >= 0 (0: off)")
    if lora.rank == 0:
        return
    from hybridflow.models.lora import resolve_targets

    resolve_targets(lora.target_modules, key=f"{key}.target_modules")
    _positive(f"{key}.alpha", lora.alpha)
    if not 0.0 <= lora.dropout < 1.0:
        raise ValueError(f"{key}.dropout={lora.dropout} must be in [0, 1)")
    if model.attention_backend in ("te", "local"):
        raise ValueError(f"{key}.rank={lora.rank} needs model.attention_backend=sdpa or auto "
                         f"(the lean linears adapters attach to), got "
                         f"{model.attention_backend}")


def _validate_micro_batches(cfg: Config, *, dp: int) -> None:
    """Fixed micro-batches of rows: each size divides the rows it splits."""
    a, d, p = cfg.algo, cfg.data, cfg.parallel
    mbs = a.micro_batch_size_per_gpu
    pp_uneven = p.pipeline_parallel_size > 1 and (d.prompts_per_step // dp) % mbs
    if cfg.trainer.sft_warmup_steps > 0 and pp_uneven:  # PP sends fixed-size micro-batches
        raise ValueError(f"algo.micro_batch_size_per_gpu={mbs} (per GPU) must divide the warm-up "
                         f"batch per DP rank data.prompts_per_step / DP = {d.prompts_per_step} / "
                         f"{dp} when parallel.pipeline_parallel_size > 1")
    seqs = d.prompts_per_step * cfg.rollout.n
    fmbs = a.forward_micro_batch_size_per_gpu
    if fmbs is not None and (fmbs <= 0 or (seqs // dp) % fmbs):
        raise ValueError(f"algo.forward_micro_batch_size_per_gpu={fmbs} (per GPU) must divide the "
                         f"sequences per DP rank data.prompts_per_step x rollout.n / DP = "
                         f"{seqs} / {dp} = {seqs // dp}")
    if a.ppo_mini_batch_size % dp or (a.ppo_mini_batch_size // dp) % mbs:
        raise ValueError(f"algo.micro_batch_size_per_gpu={mbs} (per GPU) must divide the "
                         f"mini-batch per DP rank algo.ppo_mini_batch_size / DP = "
                         f"{a.ppo_mini_batch_size} / {dp} (ppo_mini_batch_size is global)")


def _validate_dynamic_bsz(cfg: Config, *, dp: int) -> None:
    """Token budgets: pipelines are refused; each budget must hold the longest row a step makes."""
    a, p = cfg.algo, cfg.parallel
    if a.ppo_mini_batch_size % dp:
        raise ValueError(f"algo.ppo_mini_batch_size={a.ppo_mini_batch_size} (global) must be "
                         f"divisible by the data-parallel size {dp}")
    if p.pipeline_parallel_size > 1:
        raise ValueError(f"algo.use_dynamic_bsz=true needs parallel.pipeline_parallel_size=1 (got "
                         f"{p.pipeline_parallel_size}): pipeline stages exchange micro-batches of "
                         f"one fixed shape; use algo.micro_batch_size_per_gpu with PP")
    _validate_token_budgets(cfg)


def _validate_token_budgets(cfg: Config) -> None:
    """Each budget that is set must hold the longest row a step makes."""
    p, a = cfg.parallel, cfg.algo
    longest = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    how = f"data.max_prompt_length + rollout.max_new_tokens = {cfg.data.max_prompt_length} + " \
          f"{cfg.rollout.max_new_tokens}"
    tp = p.tensor_parallel_size
    if p.sequence_parallel:  # a micro-batch's length is rounded up to a multiple of TP
        longest = -(-longest // tp) * tp
        how += f" rounded up to a multiple of TP={tp} (sequence parallel)"
    for key in ("max_tokens_per_micro_batch_per_gpu", "forward_max_tokens_per_micro_batch_per_gpu"):
        value = getattr(a, key)
        if value is not None:
            check_token_budget(f"algo.{key}", value, longest=longest, how=how)


def check_token_budget(key: str, value: int, *, longest: int, how: str) -> None:
    """A micro-batch's token budget must hold the longest row of a step (`how` says how that row
    is made): the trainer's algo.*max_tokens* keys and the cost CLI's --*micro-batch-tokens."""
    if value < longest:
        raise ValueError(f"{key}={value} (tokens per micro-batch, per GPU) must hold the longest "
                         f"row of a step, {how} = {longest}")


def deferred_reward_blocker(cfg: Config) -> Optional[str]:
    """Why the rule reward cannot be scored while the step's passes run (reward.score_in_pass,
    reward.launch_reward_fn_async), or None where it can."""
    return ("reward.model_path is set (the reward model is a device pass)"
            if cfg.reward.model_path is not None else
            "reward.fn is null" if cfg.reward.fn is None else
            "algo.dynamic_sampling.enable=true (it filters groups by their scores)"
            if cfg.algo.dynamic_sampling.enable else
            "rollout.partial.enable=true (it scores each group as it completes)"
            if cfg.rollout.partial.enable else None)


def _validate_recipes(cfg: Config) -> None:
    """Loss aggregation, clip ranges, TIS, dynamic sampling and overlong shaping (DAPO, GSPO, Dr.GRPO)."""
    from hybridflow.algo import AGG_MODES

    a, r = cfg.algo, cfg.rollout
    _one_of("algo.loss_agg_mode", a.loss_agg_mode, set(AGG_MODES))
    if a.loss_scale_factor is not None and a.loss_scale_factor <= 0:
        raise ValueError(f"algo.loss_scale_factor={a.loss_scale_factor} must be > 0 (the constant "
                         f"normaliser of seq-mean-token-sum-norm) or null (rollout.max_new_tokens)")
    # a clip range of 0 pins the ratio at 1: no token moves the policy past its first update
    if not 0.0 < a.clip_ratio_low < 1.0:
        raise ValueError(f"algo.clip_ratio_low={a.clip_ratio_low} must be in (0, 1): the ratio's "
                         f"lower bound is 1 - clip_ratio_low")
    if a.clip_ratio_high <= 0:
        raise ValueError(f"algo.clip_ratio_high={a.clip_ratio_high} must be > 0: the ratio's "
                         f"upper bound is 1 + clip_ratio_high")
    if a.cliprange_value <= 0:
        raise ValueError(f"algo.cliprange_value={a.cliprange_value} must be > 0: how far a value "
                         f"may move from the old value in one update")
    if a.tis_imp_ratio_cap is not None:
        if a.tis_imp_ratio_cap <= 0:
            raise ValueError(f"algo.tis_imp_ratio_cap={a.tis_imp_ratio_cap} must be > 0 (e.g. 2.0) "
                             f"or null (TIS off)")
        if not r.return_logprobs:
            raise ValueError("algo.tis_imp_ratio_cap is set: TIS weighs by pi_old / pi_rollout and "
                             "needs the generator's log-probs; set rollout.return_logprobs=true")
    ds = a.dynamic_sampling
    if ds.enable:
        _positive("algo.dynamic_sampling.max_rounds", ds.max_rounds)
        _positive("algo.dynamic_sampling.batches_per_round", ds.batches_per_round)
        if ds.adaptive and ds.batches_per_round < 2:
            raise ValueError(f"algo.dynamic_sampling.adaptive=true sizes each round between 1 and "
                             f"algo.dynamic_sampling.batches_per_round batches: set it >= 2 (got "
                             f"{ds.batches_per_round})")
        q = ds.round_confidence
        if q is not None:
            if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0.5 <= q < 1:
                raise ValueError(f"algo.dynamic_sampling.round_confidence={q!r}: the probability "
                                 f"that a round finds the missing groups, in [0.5, 1) (e.g. 0.9), "
                                 f"or null (whole prompt batches)")
            if not ds.adaptive:
                raise ValueError("algo.dynamic_sampling.round_confidence sizes the adaptive "
                                 "rounds: set algo.dynamic_sampling.adaptive=true, or "
                                 "algo.dynamic_sampling.round_confidence=null (algo=dapo sets "
                                 "it to 0.9)")
        if r.n < 2:
            raise ValueError(f"algo.dynamic_sampling.enable=true keeps prompts whose samples score "
                             f"differently: set rollout.n >= 2 (got {r.n})")
    deferred = [k for k in ("launch_reward_fn_async", "score_in_pass") if getattr(cfg.reward, k)]
    if len(deferred) == 2:
        raise ValueError("reward.launch_reward_fn_async=true and reward.score_in_pass=true: the "
                         "rule is scored on a worker thread or inside a pass, not both; set one")
    if deferred:
        why = deferred_reward_blocker(cfg)
        if why:
            raise ValueError(f"reward.{deferred[0]}=true scores a rule reward while the step's "
                             f"passes run; here {why}: set it false")
    ob = cfg.reward.overlong_buffer
    if ob.enable:
        if not 0 < ob.len < r.max_new_tokens:
            raise ValueError(f"reward.overlong_buffer.len={ob.len} must be in (0, rollout.max_new_tokens="
                             f"{r.max_new_tokens}): the penalty ramps over the last `len` tokens "
                             f"(DAPO: 4096 of 20480)")
        if ob.penalty_factor < 0:
            raise ValueError(f"reward.overlong_buffer.penalty_factor={ob.penalty_factor} must be >= 0")


def validate_multi_turn(r) -> None:
    """rollout.multi_turn: its keys, and the decode options it does not run with (its decode step
    runs the single-turn step's layers, decode_kernels torch or triton, a CUDA-graph replay on
    GPU, with KV windows and compaction; not compile or quantized layers: null (auto) values of
    those resolve to off for it)."""
    m = r.multi_turn
    if not m.enable:
        return
    from hybridflow.tools.formats import FORMATS

    _one_of("rollout.multi_turn.format", m.format, set(FORMATS))
    _positive("rollout.multi_turn.max_assistant_turns", m.max_assistant_turns)
    _positive("rollout.multi_turn.max_tool_response_length", m.max_tool_response_length)
    _positive("rollout.multi_turn.tool_workers", m.tool_workers)
    _one_of("rollout.multi_turn.append", m.append, {"prefill", "decode"})
    if m.lookahead is not None and not isinstance(m.lookahead, bool):
        raise ValueError(f"rollout.multi_turn.lookahead: {m.lookahead!r} is not true, false or null")
    if m.lookahead and m.append != "decode":
        raise ValueError(f"rollout.multi_turn.lookahead=true needs rollout.multi_turn.append=decode "
                         f"(got {m.append!r}): an extend between steps would run behind a step "
                         f"launched before the host saw its rows' calls")
    # results held and appended together (multi_turn.py): decode steps, rows
    _int_at_least("rollout.multi_turn.append_wait_steps", m.append_wait_steps, 0,
                  "decode steps a tool result may be held before it is appended; 0: at once")
    _int_at_least("rollout.multi_turn.append_batch_rows", m.append_batch_rows, 1,
                  "held rows whose results are appended together; 1: at once")
    if r.kv_cache_dtype == "fp8":
        raise ValueError("rollout.kv_cache_dtype=fp8 does not run with rollout.multi_turn.enable="
                         "true yet: on a GPU the multi-turn step's log-probs on the fp8 cache "
                         "disagree between the fused and the PyTorch step beyond bf16 rounding; "
                         "set rollout.kv_cache_dtype=auto")
    if not m.tool_config_path:
        raise ValueError("rollout.multi_turn.enable=true needs rollout.multi_turn.tool_config_path "
                         "(a tool config YAML: tools: - class_name, config, tool_schema)")
    clashes = [(key, value, fix) for key, value, bad, fix in (
        ("rollout.compile_decode", r.compile_decode, r.compile_decode is True, "null or false"),
        # its step's matrices are plain tensors (the quantized layers are the single-turn step's)
        ("rollout.quantization", r.quantization, r.quantization != "none", "none")) if bad]
    if clashes:
        key, value, fix = clashes[0]
        raise ValueError(f"rollout.multi_turn.enable=true decodes on the generator's plain "
                         f"weights (rollout.decode_kernels, CUDA graphs, decode_kv_window and "
                         f"compact_finished_rows apply; compiled and quantized layers do not): "
                         f"{key}={value!r} does not apply to it; set {key} to {fix}")


def validate_partial(cfg: Config, *, dp: int) -> None:
    """rollout.partial: its keys, and what it does not run with."""
    p, r = cfg.rollout.partial, cfg.rollout
    if not p.enable:
        return
    if isinstance(p.max_decode_steps, bool) or not isinstance(p.max_decode_steps, int) or not (
            1 <= p.max_decode_steps < r.max_new_tokens):
        raise ValueError(f"rollout.partial.max_decode_steps={p.max_decode_steps!r} must be an "
                         f"integer in [1, rollout.max_new_tokens={r.max_new_tokens}) (a cap at "
                         f"or above max_new_tokens never carries a row over)")
    _positive("rollout.partial.max_staleness", p.max_staleness)
    if p.extra_prompts < 0 or p.extra_prompts % dp:
        raise ValueError(f"rollout.partial.extra_prompts={p.extra_prompts} must be >= 0 and "
                         f"divisible by the data-parallel size {dp}")
    if not r.return_logprobs:
        raise ValueError("rollout.partial.enable=true needs rollout.return_logprobs=true: carried "
                         "rows keep their tokens' rollout log-probs (the older policy's), which "
                         "algo.tis_imp_ratio_cap and the rollout_corr/* metrics use")
    if r.multi_turn.enable:
        raise ValueError("rollout.partial.enable=true does not run with "
                         "rollout.multi_turn.enable=true yet; turn one of them off")


def validate_speculative(r) -> None:
    """rollout.speculative (`r`: the RolloutConfig): its keys, and what it does not run with."""
    sp = r.speculative
    if sp.enable is False:
        return
    for key, what in (("max_rows", "rows still running when the tail starts"),
                      ("draft_tokens", "tokens drafted per row and step"),
                      ("ngram_min", "the shortest suffix looked up")):
        _int_at_least(f"rollout.speculative.{key}", getattr(sp, key), 1, what)
    if sp.ngram_max < sp.ngram_min:
        raise ValueError(f"rollout.speculative.ngram_max={sp.ngram_max} must be >= "
                         f"rollout.speculative.ngram_min={sp.ngram_min}")
    if sp.enable is None:  # auto: resolved where it applies (config_auto)
        return
    if r.multi_turn.enable:
        raise ValueError("rollout.speculative.enable=true decodes single-turn tails only; it does "
                         "not run with rollout.multi_turn.enable=true: turn one of them off")
    if r.quantization != "none":
        raise ValueError(f"rollout.speculative.enable=true checks drafts on the generator's plain "
                         f"weights; rollout.quantization={r.quantization!r} does not run with it: "
                         f"set rollout.quantization=none or rollout.speculative.enable=false")


def _validate_quantization(cfg: Config) -> None:
    """rollout.quantization and rollout.kv_cache_dtype: known modes, and the combinations that
    cannot run quantized."""
    r = cfg.rollout
    _one_of("rollout.quantization", r.quantization, QUANTIZATION)
    _one_of("rollout.kv_cache_dtype", r.kv_cache_dtype, KV_CACHE_DTYPES)
    if r.quantization == "none":
        return
    if r.compile_decode and r.decode_kernels == "torch":
        raise ValueError(f"rollout.quantization={r.quantization} with rollout.decode_kernels=torch "
                         f"and rollout.compile_decode=true: the compiled decode layers take plain "
                         f"weights; set rollout.compile_decode=false or rollout.decode_kernels=auto")


def validate_rollout_options(cfg) -> None:
    """Check the decode options' config keys (`cfg`: the whole Config, or its RolloutConfig);
    raise ValueError naming the key, the value and what was expected."""
    r = getattr(cfg, "rollout", cfg)
    if r.decode_kernels not in KERNELS:
        raise ValueError(f"rollout.decode_kernels: {r.decode_kernels!r} is not one of "
                         f"{', '.join(KERNELS)}")
    k = r.kernel_options
    for name in k.prefetch_weights:
        if name not in PREFETCHABLE:
            raise ValueError(f"rollout.kernel_options.prefetch_weights: {name!r} is not one of "
                             f"{', '.join(PREFETCHABLE)}")
    for key in ("prefetch_min_rows", "swiglu_gemm_min_rows", "fp8_weight_only_max_rows",
                "int4_kernel_max_rows"):
        value = getattr(k, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"rollout.kernel_options.{key}: {value!r} is not a row count >= 0")
    m = k.prefill_width_multiple
    if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
        raise ValueError(f"rollout.kernel_options.prefill_width_multiple: {m!r} is not null or "
                         f"a column count >= 1")
    for key in ("fused_sampler", "own_columns_only"):
        if not isinstance(getattr(k, key), bool):
            raise ValueError(f"rollout.kernel_options.{key}: {getattr(k, key)!r} is not a bool "
                             f"(true / false)")
    if not isinstance(k.compile_backend, str) or not k.compile_backend:
        raise ValueError(f"rollout.kernel_options.compile_backend: {k.compile_backend!r} is not a "
                         f"torch.compile backend name (e.g. inductor)")
    if k.compile_mode is not None and k.compile_mode not in COMPILE_MODES:
        raise ValueError(f"rollout.kernel_options.compile_mode: {k.compile_mode!r} is not null or "
                         f"one of {', '.join(COMPILE_MODES)}")
