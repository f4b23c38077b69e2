"""Public entry points: `estimate_cost` (search + report) and, for one fixed layout,
`estimate_memory`, `estimate_step_time` and `estimate_options` (what the trainer's probe run puts
beside its measurement)."""
from __future__ import annotations

import math
from dataclasses import replace

from hybridflow.cost.efficiency import Calibration, load_calibration, shipped_calibration
from hybridflow.cost.gpus import get_gpu
from hybridflow.cost.memory import MemoryEstimate, memory_for
from hybridflow.cost.report import CostReport
from hybridflow.cost.search import (Evaluation, evaluate, graphs_compatible, partial_choice,
                                    quantization_choice, reason, runners_up, search, suggest)
from hybridflow.cost.shapes import load_shape
from hybridflow.cost.timing import actor_model_flops, step_seconds
from hybridflow.cost.workload import Plan, Workload, make_plan


def _fixed(model, gpu, num_gpus, layout, calibration, workload: dict):
    shape, gpu_, calib = load_shape(model), get_gpu(gpu), load_calibration(calibration)
    return shape, gpu_, make_plan(layout, num_gpus, shape), Workload(**workload), calib


def estimate_memory(*, model, gpu, num_gpus: int, layout: dict | Plan, calibration=None,
                    **workload) -> MemoryEstimate:
    """Peak memory per GPU by phase and component for one layout; `workload`: Workload's fields."""
    return memory_for(*_fixed(model, gpu, num_gpus, layout, calibration, workload))


def estimate_step_time(*, model, gpu, num_gpus: int, layout: dict | Plan, calibration=None,
                       **workload) -> dict[str, float]:
    """Seconds per stage (`timing_s/<stage>` names) and "step" for one layout."""
    return step_seconds(*_fixed(model, gpu, num_gpus, layout, calibration, workload))


def estimate_options(*, model, gpu, num_gpus: int, layout: dict | Plan, calibration=None,
                     **workload) -> list[str]:
    """What the estimator would change for one layout: its rollout.quantization and
    rollout.partial recommendations (one line each, empty when it keeps the workload's)."""
    shape, gpu_, plan, work, calib = _fixed(model, gpu, num_gpus, layout, calibration, workload)
    best = evaluate(shape, gpu_, plan, work, calib)
    choices = (quantization_choice(shape, gpu_, num_gpus, work, calib, best, plan=plan),
               partial_choice(shape, gpu_, num_gpus, work, calib, best, plan=plan))
    return [c["reason"] for c in choices if c["recommended"]]


def _num_steps(steps, epochs, dataset_size, prompts_per_step) -> tuple[int, str | None]:
    if steps is not None and (epochs is not None or dataset_size is not None):
        raise ValueError("pass either steps or (epochs, dataset_size), not both")
    if steps is not None:
        if int(steps) < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        return int(steps), None
    if (epochs is None) != (dataset_size is None):
        raise ValueError("epochs and dataset_size go together")
    if epochs is None:
        return 1, "steps not given: totals are for one step"
    return math.ceil(epochs * dataset_size / prompts_per_step), None


def estimate_cost(*, model, gpu: str = "H200", num_gpus: int = 8, prompts_per_step: int = 128,
                  samples_per_prompt: int = 8, prompt_len: int = 512, response_len: int = 1024,
                  response_len_max: int | None = None,
                  algorithm: str = "grpo", steps: int | None = None, epochs: float | None = None,
                  dataset_size: int | None = None, price_per_gpu_hour: float | None = None,
                  layout: dict | None = None, ppo_epochs: int = 1, mini_batches: int = 1,
                  micro_batch_tokens: int = 8192, forward_micro_batch_tokens: int | None = None,
                  dtype: str = "bf16", use_reference: bool = True,
                  skip_old_log_prob: bool = False, keep_generator: bool = False,
                  lm_head_chunk_tokens: int = 0, decode_kernels: str = "triton",
                  rollout_quantization: str = "none", kv_cache_dtype: str = "auto",
                  fused_elementwise: bool = True, train_cuda_graphs: bool = False,
                  gradient_accumulation_fusion: bool = True, offload_ref_prefetch: bool = True,
                  lora_rank: int = 0, offload_optimizer: bool = False, offload_grads: bool = False,
                  offload_params: bool = False, critic_lora_rank: int = 0,
                  moe_grouped_gemm: bool = False,
                  gpu_memory_gib: float | None = None, calibration=None,
                  **varlen) -> CostReport:
    """Memory, seconds per stage, GPU-hours and money of an RL run, and the layout to run it in.

    `layout` forces one layout (dict of tp, pp, dp, tp_gen, offload_ref, recompute, ep, etp); otherwise every
    buildable layout is searched. Nothing fitting is an answer: `fits=False`, `overflow` names the
    component, `suggestions` say what would fit (more or bigger GPUs, smaller micro-batches, and on
    these GPUs the fp8 KV cache / LoRA / optimizer offload / parameter offload / recompute).
    `gpu_memory_gib`: the card's memory instead of the named GPU's (a 24 GiB card, or
    trainer.gpu_memory_limit_gib on a bigger one).
    `varlen`: Workload's variable-length fields (response_lengths, prompt_len_max, max_new_tokens,
    gen_max_batch_size, compact_finished_rows, decode_kv_window, dynamic_bsz, pack_sequences,
    balanced_micro_batches, packed_attention, gen_rounds, gen_prompt_factor,
    gen_batches_per_round, response_logits_only, bf16_logits, graph_min_fill,
    int4_kernel_max_rows, own_columns_only, partial_decode_steps, partial_extra_prompts,
    multi_turn, spec_rows, spec_draft_tokens, spec_tail_tokens_per_step, spec_draft_accept,
    spec_fused_accept), cdf_sampler and reward_in_pass."""
    allowed = {"response_lengths", "prompt_len_max", "max_new_tokens", "gen_max_batch_size",
               "compact_finished_rows", "decode_kv_window", "dynamic_bsz", "pack_sequences",
               "balanced_micro_batches",
               "packed_attention", "gen_rounds", "gen_prompt_factor", "gen_batches_per_round",
               "response_logits_only", "bf16_logits", "graph_min_fill", "int4_kernel_max_rows",
               "own_columns_only", "partial_decode_steps", "partial_extra_prompts", "multi_turn",
               "spec_rows", "spec_draft_tokens", "spec_tail_tokens_per_step",
               "spec_draft_accept", "spec_fused_accept", "cdf_sampler", "reward_in_pass"}
    if set(varlen) - allowed:
        raise TypeError(f"estimate_cost: unknown arguments {sorted(set(varlen) - allowed)}")
    shape, gpu_, calib = load_shape(model), get_gpu(gpu), load_calibration(calibration)
    if gpu_memory_gib is not None:
        if gpu_memory_gib <= calib.memory_headroom_gib:
            raise ValueError(f"gpu_memory_gib={gpu_memory_gib} must exceed the calibration's "
                             f"headroom of {calib.memory_headroom_gib} GiB")
        gpu_ = replace(gpu_, name=f"{gpu_.name}@{gpu_memory_gib:g}GiB", memory_gib=gpu_memory_gib)
    if num_gpus < 1:
        raise ValueError(f"num_gpus must be >= 1, got {num_gpus}")
    work = Workload(algorithm=algorithm, prompts_per_step=prompts_per_step,
                    samples_per_prompt=samples_per_prompt, prompt_len=prompt_len,
                    response_len=response_len, response_len_max=response_len_max,
                    ppo_epochs=ppo_epochs, mini_batches=mini_batches,
                    micro_batch_tokens=micro_batch_tokens,
                    forward_micro_batch_tokens=forward_micro_batch_tokens,
                    use_reference=use_reference, dtype=dtype,
                    skip_old_log_prob=skip_old_log_prob, keep_generator=keep_generator,
                    lm_head_chunk_tokens=lm_head_chunk_tokens, decode_kernels=decode_kernels,
                    rollout_quantization=rollout_quantization, kv_cache_dtype=kv_cache_dtype,
                    fused_elementwise=fused_elementwise, train_cuda_graphs=train_cuda_graphs,
                    gradient_accumulation_fusion=gradient_accumulation_fusion,
                    offload_ref_prefetch=offload_ref_prefetch, lora_rank=lora_rank,
                    offload_optimizer=offload_optimizer, offload_grads=offload_grads,
                    offload_params=offload_params, critic_lora_rank=critic_lora_rank,
                    moe_grouped_gemm=moe_grouped_gemm, **varlen)
    num_steps, steps_note = _num_steps(steps, epochs, dataset_size, prompts_per_step)
    if layout is not None:
        plan = make_plan(layout, num_gpus, shape)
        if not graphs_compatible(plan, work):
            raise ValueError("train_cuda_graphs needs pp=1 and no recompute (parallel."
                             "train_cuda_graphs with parallel.pipeline_parallel_size > 1 or "
                             "parallel.activation_checkpointing=true is refused by the trainer)")
        ranked = [evaluate(shape, gpu_, plan, work, calib)]
    else:
        ranked = search(shape, gpu_, num_gpus, work, calib)
        if not ranked:
            raise ValueError(f"no layout of {num_gpus} GPUs suits {shape.name}: TP must divide "
                             f"{shape.num_attention_heads} heads, {shape.num_query_groups} KV groups "
                             f"and FFN width {shape.ffn_hidden_size}, PP {shape.num_layers} layers")
    return _report(shape, gpu_, num_gpus, work, calib, ranked, num_steps, price_per_gpu_hour,
                   notes=[steps_note] if steps_note else [], forced=layout is not None)


def _report(shape, gpu, num_gpus, work, calib: Calibration, ranked: list[Evaluation], num_steps,
            price, notes, forced) -> CostReport:
    best, mem = ranked[0], ranked[0].memory
    price = gpu.price_per_hour if price is None else float(price)
    gpu_hours = num_steps * best.step * num_gpus / 3600
    stages = {k: v for k, v in best.seconds.items() if k != "step"}
    lengths = ("every response runs to response_len" if work.response_len_max is None else
               f"responses average {work.response_len} tokens and generation decodes until the "
               f"longest ({work.response_len_max}) ends")
    if work.response_lengths is not None:
        q = work.response_lengths
        lengths = (f"response lengths as a distribution (median {q[len(q) // 2]}, 90th percentile "
                   f"{q[int(0.9 * len(q))]}, longest {q[-1]}, mean {work.response_len}), "
                   f"generation and the passes costed row by row")
    notes = notes + [f"{lengths}; reward, advantages and bookkeeping: a fitted constant per step "
                     "and per generated row (stage 'other')",
                     "calibration: " + ("the shipped H200 fit" if calib == shipped_calibration()
                                        else "priors (no fit)" if calib == Calibration() else "given")]
    if work.multi_turn:
        notes.append("multi-turn rollouts costed as single-turn generation of the same lengths: "
                     "tool waits, appended results and the multi-turn step's own costs are not "
                     "modelled, so generation is predicted low (docs/cost_model.md)")
    quant = quantization_choice(shape, gpu, num_gpus, work, calib, best,
                                plan=best.plan if forced else None)
    partial = partial_choice(shape, gpu, num_gpus, work, calib, best,
                             plan=best.plan if forced else None)
    if mem.gen_waves > 1:
        notes.append(f"generation runs in {mem.gen_waves} waves per replica: the KV cache takes the "
                     "memory left free (as vLLM's gpu_memory_utilization), so the gen peak is the capacity")
    return CostReport(
        model=shape.name, num_params=shape.num_params, gpu=gpu.name, num_gpus=num_gpus,
        algorithm=work.algorithm,
        workload={k: getattr(work, k) for k in work.__dataclass_fields__},
        fits=best.fits, layout=best.plan.to_dict(),
        reason=reason(best, best, forced),
        memory_gib=mem.components_gib, peak_memory_gib=mem.peak_gib, peak_phase=mem.peak_phase,
        memory_capacity_gib=mem.capacity_gib,
        memory_by_phase_gib={p: sum(c.values()) for p, c in mem.phases_gib.items()},
        gen_batch=mem.gen_batch, gen_waves=mem.gen_waves, stage_seconds=stages,
        time_breakdown=best.breakdown,
        step_seconds=best.step, steps=num_steps, gpu_hours=gpu_hours, price_per_gpu_hour=price,
        cost=gpu_hours * price, tokens_per_step=work.tokens_per_step,
        throughput=work.tokens_per_step / (best.step * num_gpus),
        mfu_actor=actor_model_flops(shape, work) / (stages["update_actor"] * num_gpus
                                                    * gpu.bf16_tflops * 1e12),
        runners_up=[{"layout": ev.plan.to_dict(), "step_seconds": ev.step,
                     "peak_memory_gib": ev.memory.peak_gib, "fits": ev.fits, "reason": reason(ev, best)}
                    for ev in runners_up(ranked)],
        overflow=None if best.fits else best.overflow(),
        suggestions=[] if best.fits else suggest(shape, gpu, num_gpus, work, calib)
        + ([quant["reason"]] if quant["recommended"] else []),
        quantization=quant, partial=partial,
        calibration=calib.to_dict(), notes=notes)
