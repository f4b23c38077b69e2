"""The cost model's view of a trainer config: the `Workload` fields and the `Plan` that a `Config`
describes (used by the probe's prediction and by the automatic token budgets)."""
from __future__ import annotations

from hybridflow.config import Config, micro_batching
from hybridflow.cost.gpus import GPU, get_gpu
from hybridflow.cost.workload import Plan
from hybridflow.parallel.layout import Layout

_ALGO = {"gae": "ppo", "grpo": "grpo", "grpo_no_std": "grpo", "rloo": "rloo"}


def plan_for(cfg: Config, world_size: int) -> Plan:
    p = cfg.parallel
    layout = Layout(world_size=world_size, tp_t=p.tensor_parallel_size, pp_t=p.pipeline_parallel_size,
                    tp_g=cfg.rollout.tensor_parallel_size or p.tensor_parallel_size)
    return Plan(layout, offload_ref=cfg.trainer.offload_ref, recompute=p.activation_checkpointing,
                ep=p.expert_parallel_size)


def micro_batch_tokens(cfg: Config, *, forward: bool) -> int:
    """Tokens of one micro-batch: the budget (algo.use_dynamic_bsz) or rows x the longest row."""
    mb = micro_batching(cfg.algo, forward=forward)
    return mb["max_tokens"] or mb["micro_batch_size"] * (cfg.data.max_prompt_length
                                                         + cfg.rollout.max_new_tokens)


def packed_kernel(option: str, *, gpu: GPU, head_dim: int, fp32: bool = False,
                  fa4_installed: bool = True) -> str:
    """algo.packed_attention (auto | varlen | flex | fa4) -> the kernel a run on `gpu` takes: the
    trainer's rule (models/packed_choice.choose) asked of the GPU table's compute capability, a
    torch with varlen_attn and its kernels, and flash-attn-4 installed or not (`fa4_installed`:
    the gpu extra installs it). varlen where it cannot run: flex (the trainer refuses it; its cost
    is the fallback's); fa4 where it cannot run: the trainer's ValueError, naming the GPU."""
    import torch

    from hybridflow.models.packed_choice import FlashMachine, choose

    machine = FlashMachine("cuda", lambda: gpu.compute_capability, lambda: None,
                           lambda: None if fa4_installed
                           else "flash-attn-4 is not installed there (--no-fa4)")
    dtype = torch.float32 if fp32 else torch.bfloat16
    try:
        return choose(option, machine, dtype=dtype, head_dim=head_dim, where=f"on {gpu.name}")[0]
    except ValueError:
        if option != "varlen":
            raise
        return "flex"


def packed_attention_on_gpu(cfg: Config, *, gpu: str | GPU = "H200",
                            fa4_installed: bool = True) -> str:
    """algo.packed_attention as a run of `cfg` on `gpu` resolves it (`packed_kernel`)."""
    return packed_kernel(cfg.algo.packed_attention, gpu=get_gpu(gpu), head_dim=cfg.model.head_dim,
                         fp32=cfg.trainer.precision == "fp32", fa4_installed=fa4_installed)


def fused_cdf_draw(cfg: Config, *, decode_kernels: str) -> bool:
    """Whether decode steps draw by the fused sampler's inverse CDF (rollout/sampling.sample:
    kernel_options.fused_sampler, the Triton decode layers, temperature > 0, no top-k / top-p);
    else the PyTorch sampler."""
    from hybridflow.rollout.sampling import fused_draw_applies

    r = cfg.rollout
    return bool(r.kernel_options.fused_sampler) and fused_draw_applies(
        kernels=decode_kernels, temperature=r.temperature, top_k=r.top_k, top_p=r.top_p)


def fused_tail_accept(cfg: Config, *, decode_kernels: str) -> bool:
    """Whether the speculative tail's acceptance and bookkeeping run as two Triton kernels
    (rollout/speculative.tail_step): rollout.speculative.fused_advance where the tail runs the
    decode kernels (`fused_verify_applies`: the Triton decode, unquantized weights and cache,
    dense layers, TP_g = 1), sampling without top-k / top-p."""
    from hybridflow.rollout.speculative import unfiltered

    r = cfg.rollout
    tp_g = r.tensor_parallel_size or cfg.parallel.tensor_parallel_size
    verify_fused = (decode_kernels == "triton" and r.quantization == "none"
                    and r.kv_cache_dtype != "fp8" and tp_g == 1 and not cfg.model.moe.enabled)
    return (bool(r.speculative.fused_advance) and verify_fused
            and unfiltered(r.temperature, r.top_k, r.top_p, cfg.model.vocab_size))


def workload_fields(cfg: Config, *, decode_kernels: str, lengths: dict | None = None,
                    gpu: str | GPU = "H200", fa4_installed: bool = True) -> dict:
    """`Workload` keyword arguments for one step of `cfg` (a config whose auto options are
    resolved). `lengths`: prompt_len / response_len / response_len_max, or response_lengths (a
    distribution, cost.lengths) and prompt_len / prompt_len_max, as measured; default the config's
    maxima (every response runs to rollout.max_new_tokens). `gpu`, `fa4_installed`: the machine
    the kernels are chosen on (`packed_attention_on_gpu`)."""
    from hybridflow.algo.on_policy import skip_old_log_prob

    a, p, r, d = cfg.algo, cfg.parallel, cfg.rollout, cfg.data
    seqs = d.prompts_per_step * r.n
    lengths = lengths or dict(prompt_len=d.max_prompt_length, response_len=r.max_new_tokens)
    return dict(algorithm=_ALGO.get(a.adv_estimator, "reinforce_plus_plus"),
                prompts_per_step=d.prompts_per_step, samples_per_prompt=r.n, **lengths,
                ppo_epochs=a.ppo_epochs, mini_batches=max(1, seqs // a.ppo_mini_batch_size),
                micro_batch_tokens=micro_batch_tokens(cfg, forward=False),
                forward_micro_batch_tokens=micro_batch_tokens(cfg, forward=True),
                use_reference=a.use_kl_loss or a.use_kl_in_reward,
                skip_old_log_prob=skip_old_log_prob(cfg, step=cfg.trainer.critic_warmup)[0],
                keep_generator=not r.free_cache_engine, rollout_quantization=r.quantization,
                int4_kernel_max_rows=r.kernel_options.int4_kernel_max_rows,
                own_columns_only=bool(r.kernel_options.own_columns_only)
                and decode_kernels == "triton",
                cdf_sampler=fused_cdf_draw(cfg, decode_kernels=decode_kernels),
                kv_cache_dtype=r.kv_cache_dtype,
                lm_head_chunk_tokens=p.lm_head_chunk_tokens, decode_kernels=decode_kernels,
                reward_in_pass=bool(cfg.reward.score_in_pass),
                fused_elementwise=p.fused_elementwise, train_cuda_graphs=bool(p.train_cuda_graphs),
                graph_min_fill=p.train_graphs_min_fill,
                gradient_accumulation_fusion=p.gradient_accumulation_fusion,
                offload_ref_prefetch=cfg.trainer.offload_ref_prefetch, dtype="bf16",
                lora_rank=cfg.actor.lora.rank, offload_optimizer=cfg.actor.offload_optimizer,
                offload_grads=cfg.actor.offload_grads, offload_params=cfg.actor.offload_params,
                critic_lora_rank=cfg.critic.lora.rank if cfg.use_critic else 0,
                # how generation and the passes treat variable lengths (cost.varlen)
                max_new_tokens=r.max_new_tokens, gen_max_batch_size=r.max_batch_size,
                compact_finished_rows=bool(r.compact_finished_rows),
                decode_kv_window=int(r.decode_kv_window or 0), dynamic_bsz=bool(a.use_dynamic_bsz),
                pack_sequences=bool(a.use_dynamic_bsz and a.pack_sequences),
                balanced_micro_batches=bool(a.use_dynamic_bsz and a.pack_sequences
                                            and a.balance_micro_batches),
                packed_attention=packed_attention_on_gpu(cfg, gpu=gpu,
                                                         fa4_installed=fa4_installed),
                gen_batches_per_round=(a.dynamic_sampling.batches_per_round
                                       if a.dynamic_sampling.enable else 1),
                partial_decode_steps=r.partial.max_decode_steps if r.partial.enable else 0,
                partial_extra_prompts=r.partial.extra_prompts if r.partial.enable else 0,
                multi_turn=bool(r.multi_turn.enable),
                spec_rows=r.speculative.max_rows if r.speculative.enable is True else 0,
                spec_draft_tokens=r.speculative.draft_tokens,
                spec_fused_accept=fused_tail_accept(cfg, decode_kernels=decode_kernels))
