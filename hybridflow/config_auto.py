"""The `auto` (null) defaults of the speed options, decided for the machine a run starts on.

A run with no overrides is fast on a GPU and exact and simple on CPU. On a CUDA device:
- `trainer.precision=auto` -> bf16;
- `algo.use_dynamic_bsz` -> on (token-budget micro-batches, rows grouped by length) with
  `parallel.pipeline_parallel_size=1`; `algo.pack_sequences` -> on with it where the attention is
  SDPA (each padded micro-batch as one row of real tokens);
- the token budgets -> the largest micro-batch the cost model's memory estimate fits in the GPU's
  free memory, at most one micro-batch per mini-batch (`size_token_budgets`; the smallest free
  memory over all ranks, so every rank cuts its micro-batches alike);
- `rollout.free_cache_engine` -> false where generation reads the training weights in place
  (TP_g = TP, PP = 1; the generator, its KV cache and captured graphs kept across steps), true where
  a reshard gathers new weights every step, or where keeping them would leave the update less than
  half the token budget it gets without them (a tight memory cap: `size_for_memory`);
  `rollout.compact_finished_rows` -> on and `rollout.decode_kv_window` -> about an eighth of the
  KV cache (a multiple of 64) with CUDA-graph decoding (multi-turn too), 0 for a generator freed
  after generation (its windows' graphs would be captured every step); `rollout.compile_decode`
  -> on with CUDA-graph decoding at TP_g = 1 (not for multi-turn: its step is not compiled);
  `rollout.speculative.enable` -> on with CUDA-graph single-turn decoding whose generator is kept
  (its tail's graphs are captured once) where the tail runs the Triton decode layers (unquantized,
  a plain-dtype cache, TP_g = 1, dense layers without q/k norms);
  `rollout.kernel_options.prefill_width_multiple` -> 64 (a few prefill shapes, not one per prompt
  width);
- `parallel.train_cuda_graphs` -> on for a LoRA update (every trained role with adapters) at
  TP = PP = 1 on a dense model, unless a setting it cannot run with is set
  (`config_checks.train_graphs_conflicts`);
- `reward.score_in_pass` -> on (the rule reward scored while the step's first forward-only pass
  runs on the device) unless the step needs the scores first or has no rule reward
  (`config_checks.deferred_reward_blocker`) or reward.launch_reward_fn_async is set.
With `rollout.quantization` (fp8 / int4) or `rollout.kv_cache_dtype=fp8`, on any device:
`rollout.return_logprobs` -> true and
`algo.tis_imp_ratio_cap` -> 2.0 when unset (one line says so).
On CPU every one of them is off (fp32, fixed micro-batches of `micro_batch_size_per_gpu` rows).
A value the user set is kept. Where a GPU run cannot use an option, one `auto:` line says why.
"""
from __future__ import annotations

import dataclasses
import math

from hybridflow.config import Config
from hybridflow.config_checks import deferred_reward_blocker, train_graphs_conflicts, validate

CPU_TOKEN_BUDGET = 16384  # use_dynamic_bsz=true on CPU with no budget set
# the share of the free memory the automatic budgets may plan for: the memory model leaves out
# allocator fragmentation and optimizer-step temporaries beyond its calibrated headroom
MEMORY_SHARE = 0.85
PREFILL_WIDTH_MULTIPLE = 64  # rollout.kernel_options.prefill_width_multiple on a GPU


def apply_memory_limit(limit_gib, device) -> tuple:
    """trainer.gpu_memory_limit_gib: cap this process's allocations on `device` at `limit_gib`
    (torch.cuda.set_per_process_memory_fraction of the device's total memory, so a 24 GB card can
    be emulated on a bigger one). Returns (the cap in bytes or None, a line to print or None). On
    CPU the option is ignored, with a warning line (there is no device memory to cap; the same
    config then runs on either machine)."""
    if limit_gib is None:
        return None, None
    if device.type != "cuda":
        return None, (f"warning: trainer.gpu_memory_limit_gib={limit_gib} ignored: no GPU "
                      "(the cap applies to CUDA devices only)")
    import torch

    total = torch.cuda.get_device_properties(device).total_memory
    cap = float(limit_gib) * 2 ** 30
    if cap > total:
        raise ValueError(f"trainer.gpu_memory_limit_gib={limit_gib} exceeds this GPU's "
                         f"{total / 2 ** 30:.1f} GiB")
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    return cap, (f"trainer.gpu_memory_limit_gib={limit_gib}: this process may allocate at most "
                 f"{limit_gib:g} of the GPU's {total / 2 ** 30:.1f} GiB")


def _replace(cfg: Config, group: str, **values) -> Config:
    return dataclasses.replace(cfg, **{group: dataclasses.replace(getattr(cfg, group), **values)})


def _attention_is_sdpa(cfg: Config) -> bool:
    backend = cfg.model.attention_backend
    if backend == "auto":
        from hybridflow.models.build import have_te

        return not have_te()
    return backend == "sdpa"


def resolve_auto(cfg: Config, *, device_type: str) -> tuple[Config, list[str]]:
    """`cfg` with every auto option but the token budgets decided for `device_type` ("cuda" or
    "cpu"), and the `auto:` lines that say where a GPU run falls back."""
    gpu = device_type == "cuda"
    notes: list[str] = []
    p, a, r, t = cfg.parallel, cfg.algo, cfg.rollout, cfg.trainer
    if t.precision == "auto":
        cfg = _replace(cfg, "trainer", precision="bf16" if gpu else "fp32")

    dynamic = a.use_dynamic_bsz
    if dynamic is None:  # packing asked for implies token budgets
        dynamic = ((gpu or bool(a.pack_sequences)) and p.pipeline_parallel_size == 1
                   and p.expert_parallel_size == 1)
        if gpu and not dynamic and p.pipeline_parallel_size > 1:
            notes.append("auto: algo.use_dynamic_bsz=false: pipeline stages exchange micro-batches "
                         "of one shape (parallel.pipeline_parallel_size > 1)")
        elif gpu and not dynamic:
            notes.append("auto: algo.use_dynamic_bsz=false: under expert parallelism every DP rank "
                         "must run as many micro-batches (each one's all-to-all spans them)")
    pack = a.pack_sequences
    if pack is None:
        pack = bool(dynamic) and gpu and _attention_is_sdpa(cfg)
        if gpu and dynamic and not pack:
            notes.append("auto: algo.pack_sequences=false: packing needs SDPA attention "
                         f"(model.attention_backend={cfg.model.attention_backend!r} runs another)")
    budgets = {}
    if dynamic and not gpu and a.max_tokens_per_micro_batch_per_gpu is None:
        budgets["max_tokens_per_micro_batch_per_gpu"] = CPU_TOKEN_BUDGET
    balance = pack if a.balance_micro_batches is None else a.balance_micro_batches
    cfg = _replace(cfg, "algo", use_dynamic_bsz=dynamic, pack_sequences=pack,
                   balance_micro_batches=balance, **budgets)

    if p.train_cuda_graphs is None:
        cfg = _replace(cfg, "parallel", train_cuda_graphs=_lora_update_graphs(cfg, gpu, notes))
    if cfg.reward.score_in_pass is None:  # the thread option, when set, is the user's choice
        thread, why = cfg.reward.launch_reward_fn_async, deferred_reward_blocker(cfg)
        cfg = _replace(cfg, "reward", score_in_pass=gpu and not thread and why is None)
        if gpu and not thread and why and cfg.reward.fn is not None:
            notes.append(f"auto: reward.score_in_pass=false: {why}")

    in_place = (r.tensor_parallel_size or p.tensor_parallel_size) == p.tensor_parallel_size \
        and p.pipeline_parallel_size == 1
    # multi-turn replays a graph of its own step (PyTorch ops, KV windows, compaction): compile
    # stays off for it
    windows = gpu and r.cuda_graphs
    compiled = windows and not r.multi_turn.enable
    rollout = {}
    if r.free_cache_engine is None:
        rollout["free_cache_engine"] = not (gpu and in_place)
        if gpu and not in_place:
            notes.append("auto: rollout.free_cache_engine=true: generation runs on resharded weights "
                         "(rollout.tensor_parallel_size or pipeline_parallel_size differs), which "
                         "move every step")
    if r.compact_finished_rows is None:
        rollout["compact_finished_rows"] = windows
    if r.decode_kv_window is None:
        freed = rollout.get("free_cache_engine", r.free_cache_engine)
        rollout["decode_kv_window"] = _auto_window(cfg) if windows and not freed else 0
        if windows and freed:
            notes.append(FREED_WINDOW_NOTE)
    if r.compile_decode is None:
        tp_g = r.tensor_parallel_size or p.tensor_parallel_size
        rollout["compile_decode"] = compiled and tp_g == 1
        if compiled and tp_g > 1:
            notes.append(f"auto: rollout.compile_decode=false: it compiles a generation TP of 1 "
                         f"(rollout.tensor_parallel_size is {tp_g})")
    if r.quantization != "none" or r.kv_cache_dtype != "auto":
        cfg = _quantized_rollout_defaults(cfg, notes)
        if r.compile_decode is None and r.decode_kernels == "torch":
            rollout["compile_decode"] = False  # the compiled torch layers take plain weights
    if gpu and not r.cuda_graphs:
        notes.append("auto: rollout.cuda_graphs=false: decode runs eagerly, so compaction, KV "
                     "windows and compiled decoding stay off")
    if r.kernel_options.prefill_width_multiple is None:
        rollout["kernel_options"] = dataclasses.replace(
            r.kernel_options, prefill_width_multiple=PREFILL_WIDTH_MULTIPLE if gpu else 1)
    if r.speculative.enable is None:
        freed = rollout.get("free_cache_engine", r.free_cache_engine)
        on = compiled and not freed and _speculative_tail_applies(cfg)
        rollout["speculative"] = dataclasses.replace(r.speculative, enable=on)
    return _replace(cfg, "rollout", **rollout), notes


def _speculative_tail_applies(cfg: Config) -> bool:
    """Whether auto turns rollout.speculative's tail on: where it runs the decode step's own
    Triton layers (speculative.fused_verify_applies, decided from the config) as measured: an
    unquantized rollout on a plain-dtype cache, generation TP 1, dense layers without q/k norms,
    Triton decode kernels allowed. Elsewhere its PyTorch fallback runs, and a q/k-norm model's
    fused step adds the norms' PyTorch ops per layer; neither has been measured to pay, so auto
    leaves it off there."""
    r, m = cfg.rollout, cfg.model
    tp_g = r.tensor_parallel_size or cfg.parallel.tensor_parallel_size
    return (r.quantization == "none" and r.kv_cache_dtype == "auto" and tp_g == 1
            and r.decode_kernels != "torch" and not m.qk_layernorm and m.moe.num_experts == 0)


FREED_WINDOW_NOTE = ("auto: rollout.decode_kv_window=0: the generator is freed after generation "
                     "(rollout.free_cache_engine=true), so each KV window's decode graph would be "
                     "captured again every step")


def _auto_window(cfg: Config) -> int:
    """About an eighth of the prompt + response cache, in multiples of 64 columns (at least 64)."""
    cache = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    return max(64, math.ceil(cache / 8 / 64) * 64)


def _lora_update_graphs(cfg: Config, gpu: bool, notes: list) -> bool:
    """parallel.train_cuda_graphs left null: on where every trained role has adapters, on a GPU.
    A LoRA update launches half as many kernels again as a full one (the adapters' small GEMMs),
    and the GPU waits for the host; replayed as graphs, the GSM8K recipe's LoRA update took 1.53
    against 1.73 s and its step 3.91 against 4.26 s, with the same results
    (benchmarks/results/small_cards_h200.json). A full-parameter update is near its kernel time
    already: there the padding to the captured shape costs what the host saves."""
    roles = [("actor.lora", cfg.actor.lora)]
    if cfg.use_critic:
        roles.append(("critic.lora", cfg.critic.lora))
    if not gpu or any(lora.rank == 0 for _, lora in roles):
        return False
    blocked = [setting for setting, _ in train_graphs_conflicts(cfg)]
    # not measured: the layers' TP collectives inside captured graphs, an MoE layer's routing
    if cfg.parallel.tensor_parallel_size > 1:
        blocked.append("parallel.tensor_parallel_size > 1")
    if cfg.model.moe.enabled:
        blocked.append("a mixture-of-experts model")
    if blocked:
        notes.append("auto: parallel.train_cuda_graphs=false: a LoRA update replays its layers as "
                     f"CUDA graphs, but not with {', '.join(blocked)}")
        return False
    return True


def _quantized_rollout_defaults(cfg: Config, notes: list) -> Config:
    """rollout.quantization / kv_cache_dtype: the rollout log-probs on (they are the quantized
    model's: the mismatch metrics read them every step) and truncated importance sampling at cap
    2.0 (verl's FP8 rollout recipe) unless algo.tis_imp_ratio_cap is set; int4 gets a line that it
    lost accuracy where it was measured."""
    r, a = cfg.rollout, cfg.algo
    if not r.return_logprobs:
        cfg = _replace(cfg, "rollout", return_logprobs=True)
    if a.tis_imp_ratio_cap is None:
        cfg = _replace(cfg, "algo", tis_imp_ratio_cap=2.0)
        what = ", ".join(f"rollout.{k}={v}" for k, v in (("quantization", r.quantization),
                                                          ("kv_cache_dtype", r.kv_cache_dtype))
                         if v not in ("none", "auto"))
        notes.append(f"quantized rollout ({what}): truncated importance sampling on, "
                     f"algo.tis_imp_ratio_cap=2.0 (set it to change the cap); "
                     f"rollout.return_logprobs=true")
    if r.quantization == "int4":
        notes.append("rollout.quantization=int4: on the GSM8K recipe its rollouts fell below bf16's "
                     "val accuracy over 60 steps (docs/performance.md, quantized rollouts); watch "
                     "val and the rollout_corr/* mismatch metrics")
    return cfg


def budgets_unset(cfg: Config) -> bool:
    a = cfg.algo
    return bool(a.use_dynamic_bsz) and (a.max_tokens_per_micro_batch_per_gpu is None
                                        or a.forward_max_tokens_per_micro_batch_per_gpu is None)


def size_token_budgets(cfg: Config, *, world_size: int, free_gib: float) -> tuple[Config, str]:
    """`cfg` (auto options resolved, use_dynamic_bsz on) with the unset token budgets sized for a GPU
    with `free_gib` free, and the line that says what was chosen.

    Each budget is a whole number of longest rows (prompt + response maxima): the largest whose
    phases (the update's for the training budget, the forward-only passes' for the other) the cost
    model's memory estimate fits in MEMORY_SHARE of the free memory, at most what one micro-batch
    per mini-batch (training) or per step (forward) needs; at least one row. The training budget
    comes first (the forward one at one row, or as set), then the forward one beside it. With
    parallel.train_cuda_graphs a phase counts what the other roles' update graphs keep reserved
    in it (cost.memory: `reserved_phases_gib`), and the training budget, which sizes those pools,
    must leave every phase within the share.
    """
    from hybridflow.cost.efficiency import shipped_calibration
    from hybridflow.cost.from_config import plan_for, workload_fields
    from hybridflow.cost.gpus import get_gpu
    from hybridflow.cost.memory import FORWARD_STAGES, memory_for
    from hybridflow.cost.workload import Workload

    a, d, r = cfg.algo, cfg.data, cfg.rollout
    row = d.max_prompt_length + r.max_new_tokens
    plan = plan_for(cfg, world_size)
    dp = plan.layout.dp_t
    step_rows = math.ceil(d.prompts_per_step * r.n / dp)
    mini_rows = math.ceil(a.ppo_mini_batch_size / dp)
    # only the memory size of the machine matters to the memory model
    gpu = dataclasses.replace(get_gpu("H200"), name="this GPU", memory_gib=free_gib)
    calib = shipped_calibration()
    capacity = MEMORY_SHARE * (free_gib - calib.memory_headroom_gib)
    train_phases = ("update_actor", "update_critic")

    fields = workload_fields(cfg, decode_kernels="triton")
    every_phase = cfg.parallel.train_cuda_graphs  # the update graphs' pools sit in all of them

    def fits(train: int, forward: int, phases) -> bool:
        work = Workload(**{**fields, "micro_batch_tokens": train,
                           "forward_micro_batch_tokens": forward})
        est = memory_for(cfg.model, gpu, plan, work, calib)
        return all(max(sum(c.values()), est.reserved_phases_gib[ph]) <= capacity
                   for ph, c in est.phases_gib.items() if phases is None or ph in phases)

    def largest(max_rows: int, fits_rows) -> int:
        best = 1
        for rows in range(1, max_rows + 1):  # a few hundred evaluations of closed-form sums
            if not fits_rows(rows * row):
                break
            best = rows
        return best * row

    values, said = {}, []
    train = a.max_tokens_per_micro_batch_per_gpu
    forward = a.forward_max_tokens_per_micro_batch_per_gpu
    if train is None:
        phases = None if every_phase else train_phases  # (None: every phase)
        train = values["max_tokens_per_micro_batch_per_gpu"] = largest(
            mini_rows, lambda t: fits(t, forward or row, phases))
        said.append(f"training {train}")
    if forward is None:
        values["forward_max_tokens_per_micro_batch_per_gpu"] = largest(
            step_rows, lambda t: fits(train, t, FORWARD_STAGES))
        said.append(f"forward {values['forward_max_tokens_per_micro_batch_per_gpu']}")
    line = (f"auto: token budgets per micro-batch: {', '.join(said)} tokens (rows of up to {row} "
            f"tokens; sized for {free_gib:.0f} GiB free per GPU)")
    return _replace(cfg, "algo", **values), line


def size_for_memory(cfg: Config, *, asked, world_size: int,
                    free_gib: float) -> tuple[Config, list[str]]:
    """`size_token_budgets`, and where `asked` (the rollout options as set, before `resolve_auto`)
    left rollout.free_cache_engine null and it resolved false (generation in place on a GPU), the
    generator's cache decided beside the budgets: a kept generator's KV cache and graphs sit
    through training, so under a tight memory cap they can starve the update (Qwen2-7B LoRA under
    24 GiB: 416-token micro-batches kept against 2,496 freed; the kept run's update took 20 of its
    23.7 s per step). The generator is freed (its decode graphs re-captured every step, a fixed
    cost) when keeping it would leave the update less than half the training budget it gets freed;
    an auto rollout.decode_kv_window and an auto rollout.speculative.enable go with it
    (`resolve_auto`'s rule for a freed generator).
    Returns (cfg, the `auto:` lines)."""
    sized, line = size_token_budgets(cfg, world_size=world_size, free_gib=free_gib)
    if not (asked.free_cache_engine is None and cfg.rollout.free_cache_engine is False
            and cfg.algo.max_tokens_per_micro_batch_per_gpu is None):
        return sized, [line]
    freed, freed_line = size_token_budgets(_replace(cfg, "rollout", free_cache_engine=True),
                                           world_size=world_size, free_gib=free_gib)
    kept_t = sized.algo.max_tokens_per_micro_batch_per_gpu
    freed_t = freed.algo.max_tokens_per_micro_batch_per_gpu
    if 2 * kept_t >= freed_t:
        return sized, [line]
    lines = [f"auto: rollout.free_cache_engine=true: a generator kept across steps would hold its "
             f"KV cache through training and leave the update {kept_t}-token micro-batches, "
             f"against {freed_t} with it freed after generation (its decode graphs are then "
             f"captured every step)", freed_line]
    if asked.decode_kv_window is None and freed.rollout.decode_kv_window:
        freed = _replace(freed, "rollout", decode_kv_window=0)
        lines.append(FREED_WINDOW_NOTE)
    if asked.speculative.enable is None and freed.rollout.speculative.enable:
        freed = _replace(freed, "rollout", speculative=dataclasses.replace(
            freed.rollout.speculative, enable=False))
    return freed, lines


def resolve_for_run(cfg: Config, ctx) -> Config:
    """`cfg` with every auto option decided on this run's device (`ctx`: the ParallelContext), the
    token budgets agreed over all ranks, checked again by `config_checks.validate`; rank 0 prints
    the `auto:` lines."""
    import torch
    import torch.distributed as dist

    asked = cfg.rollout
    cfg, notes = resolve_auto(cfg, device_type=ctx.device.type)
    limit = apply_memory_limit(cfg.trainer.gpu_memory_limit_gib, ctx.device)
    if limit[1]:
        notes.append(limit[1])
    if ctx.device.type == "cuda" and budgets_unset(cfg):
        free, _ = torch.cuda.mem_get_info(ctx.device)
        if limit[0] is not None:  # what the cap leaves of the device
            free = min(free, limit[0] - torch.cuda.memory_reserved(ctx.device))
        free_t = torch.tensor([float(free)], device=ctx.device)
        dist.all_reduce(free_t, op=dist.ReduceOp.MIN)  # one budget on every rank of a TP group
        cfg, lines = size_for_memory(cfg, asked=asked, world_size=dist.get_world_size(),
                                     free_gib=free_t.item() / 2 ** 30)
        notes += lines
    validate(cfg, world_size=dist.get_world_size())
    if ctx.rank == 0:
        for line in notes:
            print(line, flush=True)
    return cfg
