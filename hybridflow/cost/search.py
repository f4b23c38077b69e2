"""Layout search: every layout megatron-core can build on the GPUs, ranked by predicted step time.

Candidates: TP dividing the GPU count, within one node (TP all-reduces every layer); PP dividing the
rest; DP the remainder; the model split as the trainer accepts it (`workload.check_model_split`: TP
divides the heads, KV groups and FFN width, PP the layers); gen TP_g any divisor of TP; the reference
offloaded or not; full activation recompute or not. MoE models: PP = 1 and TP_g = TP (in-place
generation), and every EP dividing the experts with EP x TP dividing the GPUs (megatron-core 0.16's
rule: EP x expert TP x PP divides the world; expert TP = TP here). Layouts that fit
rank by step seconds (ties: no offload, no recompute first); when none fits, by peak / capacity, and
`suggest` searches what would fit: more GPUs (doubling), a GPU with more memory, smaller micro-batches.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from hybridflow.config_checks import QUANTIZATION
from hybridflow.cost.efficiency import Calibration
from hybridflow.cost.gpus import GPU, GPUS
from hybridflow.cost.memory import MemoryEstimate, memory_for
from hybridflow.cost.timing import stage_breakdown
from hybridflow.cost.workload import Plan, Workload, check_model_split
from hybridflow.model_config import ModelConfig
from hybridflow.parallel.layout import Layout


@dataclass
class Evaluation:
    plan: Plan
    memory: MemoryEstimate
    breakdown: dict[str, dict[str, float]]    # stage -> part -> seconds

    @property
    def seconds(self) -> dict[str, float]:
        out = {k: sum(parts.values()) for k, parts in self.breakdown.items()}
        return out | {"step": sum(out.values())}

    @property
    def step(self) -> float:
        return self.seconds["step"]

    @property
    def fits(self) -> bool:
        return self.memory.fits

    def rank_key(self) -> tuple:
        size = self.step if self.fits else self.memory.peak_gib / self.memory.capacity_gib
        return (not self.fits, size, self.plan.offload_ref, self.plan.recompute, self.plan.layout.pp_t)

    def overflow(self) -> dict:
        m = self.memory
        return {"component": m.largest_component, "phase": m.peak_phase,
                "gib": m.components_gib[m.largest_component], "peak_gib": m.peak_gib,
                "capacity_gib": m.capacity_gib}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _splits(shape: ModelConfig, num_gpus: int, tp: int, pp: int, ep: int = 1) -> bool:
    try:
        check_model_split(shape, Layout(world_size=num_gpus, tp_t=tp, pp_t=pp, tp_g=tp), ep)
    except ValueError:
        return False
    return True


def expert_parallel_sizes(shape: ModelConfig, num_gpus: int, tp: int, pp: int) -> list[int]:
    """The EP sizes megatron-core can build with this TP and PP (1 for a dense model)."""
    if not shape.moe.enabled:
        return [1]
    return [ep for ep in _divisors(shape.moe.num_experts) if _splits(shape, num_gpus, tp, pp, ep)]


def candidate_plans(shape: ModelConfig, gpu: GPU, num_gpus: int, use_reference: bool) -> list[Plan]:
    out = []
    for tp in _divisors(num_gpus):
        if tp > gpu.gpus_per_node:
            continue
        for pp in _divisors(num_gpus // tp):
            if not _splits(shape, num_gpus, tp, pp) or (shape.moe.enabled and pp > 1):
                continue  # MoE generates in place: PP = 1, TP_g = TP (config_checks)
            for tp_gen in ([tp] if shape.moe.enabled else _divisors(tp)):
                layout = Layout(world_size=num_gpus, tp_t=tp, pp_t=pp, tp_g=tp_gen)
                for ep in expert_parallel_sizes(shape, num_gpus, tp, pp):
                    for offload in ((False, True) if use_reference else (False,)):
                        for recompute in (False, True):
                            out.append(Plan(layout, offload_ref=offload, recompute=recompute,
                                            ep=ep))
    return out


def graphs_compatible(plan: Plan, workload: Workload) -> bool:
    """parallel.train_cuda_graphs runs with PP = 1 and without activation recompute (the trainer
    refuses the others)."""
    return not workload.train_cuda_graphs or (plan.layout.pp_t == 1 and not plan.recompute)


def evaluate(shape: ModelConfig, gpu: GPU, plan: Plan, workload: Workload,
             calib: Calibration) -> Evaluation:
    return Evaluation(plan, memory_for(shape, gpu, plan, workload, calib),
                      stage_breakdown(shape, gpu, plan, workload, calib))


def search(shape: ModelConfig, gpu: GPU, num_gpus: int, workload: Workload,
           calib: Calibration) -> list[Evaluation]:
    """All candidates, best first. Empty when no layout can be built (e.g. TP cannot divide heads)."""
    evals = [evaluate(shape, gpu, plan, workload, calib)
             for plan in candidate_plans(shape, gpu, num_gpus, workload.use_reference)
             if graphs_compatible(plan, workload)]
    return sorted(evals, key=Evaluation.rank_key)


def reason(ev: Evaluation, best: Evaluation, forced: bool = False) -> str:
    """One line: why this layout is where it is in the ranking."""
    m = ev.memory
    # the update graphs' pools hold reserved memory beyond the allocated peak (memory_for)
    pool = (f"; {m.reserved_peak_gib:.1f} GiB reserved with the update's CUDA graphs"
            if m.reserved_peak_gib > m.peak_gib else "")
    if not ev.fits and m.peak_gib <= m.capacity_gib:  # only the graphs' reserved pool overflows
        return f"won't fit: peak {m.peak_gib:.1f} of {m.capacity_gib:.1f} GiB{pool}"
    if not ev.fits:
        o = ev.overflow()
        return (f"won't fit: {o['component']} {o['gib']:.1f} GiB at {o['phase']}, "
                f"peak {m.peak_gib:.1f} > {m.capacity_gib:.1f} GiB")
    if ev is best:
        head = "forced layout" if forced else "fastest layout that fits"
        return (f"{head}: {ev.step:.2f} s/step, peak {m.peak_gib:.1f} of {m.capacity_gib:.1f} GiB "
                f"(at {m.peak_phase}){pool}")
    deltas = {k: v - best.seconds.get(k, 0.0) for k, v in ev.seconds.items() if k != "step"}
    stage = max(deltas, key=deltas.get)
    return (f"{ev.step / best.step:.2f}x the best step time, mostly {stage} "
            f"({deltas[stage]:+.2f} s); peak {m.peak_gib:.1f} GiB")


def runners_up(ranked: list[Evaluation], num: int = 3) -> list[Evaluation]:
    """The next best with a distinct (TP, PP, TP_g, EP): variants of one split say little."""
    seen = {(ranked[0].plan.layout, ranked[0].plan.ep)}
    out = []
    for ev in ranked[1:]:
        key = (ev.plan.layout, ev.plan.ep)
        if key not in seen and len(out) < num:
            seen.add(key)
            out.append(ev)
    return out


def _first_fit(shape, gpu, num_gpus, workload, calib) -> Evaluation | None:
    ranked = search(shape, gpu, num_gpus, workload, calib)
    return ranked[0] if ranked and ranked[0].fits else None


def suggest(shape: ModelConfig, gpu: GPU, num_gpus: int, workload: Workload, calib: Calibration,
            max_doublings: int = 10) -> list[str]:
    """What would fit when nothing does on `num_gpus` x `gpu`."""
    out = [f"searched TP <= {min(gpu.gpus_per_node, num_gpus)}, every PP, gen TP_g, "
           + ("EP, " if shape.moe.enabled else "")
           + "reference offload and full recompute on this setup"]
    for k in range(1, max_doublings + 1):
        ev = _first_fit(shape, gpu, num_gpus * 2 ** k, workload, calib)
        if ev:
            waves = f", {ev.memory.gen_waves} generation waves" if ev.memory.gen_waves > 1 else ""
            out.append(f"more GPUs: {num_gpus * 2 ** k} x {gpu.name} with {ev.plan.short()} "
                       f"(peak {ev.memory.peak_gib:.1f} of {ev.memory.capacity_gib:.1f} GiB, "
                       f"{ev.step:.1f} s/step{waves})")
            break
    for other in sorted(GPUS.values(), key=lambda g: g.memory_gib):
        if other.memory_gib > gpu.memory_gib and (ev := _first_fit(shape, other, num_gpus, workload, calib)):
            out.append(f"bigger GPU: {num_gpus} x {other.name} with {ev.plan.short()}")
            break
    if workload.seqs_per_micro_batch > 1:
        small = replace(workload, micro_batch_tokens=workload.seq_len)
        if ev := _first_fit(shape, gpu, num_gpus, small, calib):
            out.append(f"one sequence per micro-batch (micro_batch_tokens={small.seq_len}) with "
                       f"{ev.plan.short()}")
    if line := memory_options(shape, gpu, num_gpus, workload, calib):
        out.append(line)
    return out


LORA_RANK = 16  # the rank suggested when LoRA is what makes a run fit


def memory_options(shape: ModelConfig, gpu: GPU, num_gpus: int, workload: Workload,
                   calib: Calibration) -> str | None:
    """On these GPUs: the first of the fp8 KV cache (rollout.kv_cache_dtype=fp8: half the cache at
    no measured speed cost, but rollout log-probs of the rounded cache), LoRA, offload (optimizer
    state and grads), parameter offload (actor.offload_params, where it lowers a phase: the
    critic's, or a generator that owns its weights), their combinations, then each with one
    sequence per micro-batch, that fits (the search adds recompute and reference offload itself);
    None if none does."""
    tries = [replace(workload, kv_cache_dtype="fp8")] \
        if workload.kv_cache_dtype != "fp8" and not workload.multi_turn else []
    for lora in sorted({workload.lora_rank, workload.lora_rank or LORA_RANK}):
        for offload in sorted({workload.offload_optimizer and workload.offload_grads, True}):
            for params in sorted({workload.offload_params, True}):
                tries.append(replace(workload, lora_rank=lora,
                                     offload_optimizer=offload or workload.offload_optimizer,
                                     offload_grads=offload or workload.offload_grads,
                                     offload_params=params))
    tries = [w for w in tries if w != workload]
    tries += [replace(w, micro_batch_tokens=w.seq_len) for w in tries
              if w.seqs_per_micro_batch > 1]
    for w in tries:
        ev = _first_fit(shape, gpu, num_gpus, w, calib)
        if ev is None:
            continue
        needs = (["the fp8 KV cache (rollout.kv_cache_dtype=fp8)"]
                 if w.kv_cache_dtype != workload.kv_cache_dtype else []) + \
            ([f"LoRA (actor.lora.rank={w.lora_rank})"] if w.lora_rank else []) + \
            (["optimizer offload (actor.offload_optimizer=true)"] if w.offload_optimizer else []) + \
            (["grad offload (actor.offload_grads=true)"] if w.offload_grads else []) + \
            (["parameter offload (actor.offload_params=true)"]
             if w.offload_params else []) + \
            (["activation recompute (parallel.activation_checkpointing=true)"]
             if ev.plan.recompute else []) + \
            ([f"one sequence per micro-batch (micro_batch_tokens={w.seq_len})"]
             if w.micro_batch_tokens != workload.micro_batch_tokens else [])
        return (f"fits on {num_gpus} x {gpu.name} ({gpu.memory_gib:g} GiB) with "
                f"{' + '.join(needs)}: {ev.plan.short()}, peak {ev.memory.peak_gib:.1f} of "
                f"{ev.memory.capacity_gib:.1f} GiB, {ev.step:.1f} s/step")
    return None


# what a quantized rollout adds to generation, and what it saves: timing._gen's part labels
_QUANT_COST = {"fp8": ("quant_overhead", "its activation quantization and _scaled_mm latency "
                                         "per layer per decode step"),
               "int4": ("quant_compute", "its weight-only kernel's compute-bound GEMMs")}


def _best_with(shape, gpu, num_gpus, workload, calib, plan: Plan | None) -> Evaluation | None:
    """The best evaluation of `workload`: on `plan` when the layout is forced, else searched."""
    if plan is not None:
        return evaluate(shape, gpu, plan, workload, calib)
    ranked = search(shape, gpu, num_gpus, workload, calib)
    return ranked[0] if ranked else None


def quantization_choice(shape: ModelConfig, gpu: GPU, num_gpus: int, workload: Workload,
                        calib: Calibration, best: Evaluation, plan: Plan | None = None) -> dict:
    """rollout.quantization for this step: each mode's best predicted step (the same layout when
    `plan` forces one, else searched; with actor.offload_params too where the mode alone does not
    fit: the quantized codes let the bf16 matrices leave the GPU in generation), and the mode to
    recommend: another mode than the workload's only when it fits and is predicted faster, or fits
    where the workload's does not. Considered when generation is the step's largest stage, when
    the workload is already quantized, or when nothing fits. Returns {"recommended": mode or None,
    "reason": one line, "options": {mode: {step_s, gen_s, fits, offload_params}}}."""
    current = workload.rollout_quantization
    stages = {k: v for k, v in best.seconds.items() if k != "step"}
    largest = max(stages, key=stages.get)
    if workload.multi_turn:
        return {"recommended": None, "options": {},
                "reason": f"keep {current}, not considered: multi-turn rollouts decode on plain "
                          f"weights"}
    if current == "none" and largest != "gen" and best.fits:
        share = 100 * stages["gen"] / best.step
        return {"recommended": None, "options": {},
                "reason": f"keep none, not considered: generation is {share:.0f}% of the step "
                          f"(the largest stage is {largest})"}
    options, evals = {}, {}
    for mode in QUANTIZATION:
        w = replace(workload, rollout_quantization=mode)
        ev = best if mode == current else _best_with(shape, gpu, num_gpus, w, calib, plan)
        if (ev is None or not ev.fits) and mode != "none" and not w.offload_params:
            w = replace(w, offload_params=True)   # the codes in, the bf16 matrices out
            ev = _best_with(shape, gpu, num_gpus, w, calib, plan) or ev
        if ev is None:
            continue
        evals[mode] = (ev, w)
        options[mode] = {"step_s": ev.step, "gen_s": ev.seconds["gen"], "fits": ev.fits,
                         "offload_params": w.offload_params}
    better = [m for m, (ev, _) in evals.items() if m != current and ev.fits
              and (not best.fits or ev.step < best.step)]
    if better:
        mode = min(better, key=lambda m: evals[m][0].step)
        ev, w = evals[mode]
        why = (f"fits where {current} does not" if not best.fits else
               f"predicted {ev.step:.2f} s/step vs {best.step:.2f} with {current} (gen "
               f"{ev.seconds['gen']:.2f} vs {stages['gen']:.2f} s)")
        extra = " + actor.offload_params=true" if w.offload_params and not workload.offload_params \
            else ""
        return {"recommended": mode, "options": options,
                "reason": f"recommend rollout.quantization={mode}{extra}: {why}, {ev.plan.short()}"}
    return {"recommended": None, "options": options,
            "reason": f"keep {current}: " + "; ".join(_why_not(m, evals[m][0], best)
                                                       for m in evals if m != current)}


def _why_not(mode: str, ev: Evaluation, best: Evaluation) -> str:
    """Why `mode` is not recommended over `best`: it does not fit, or its generation costs more
    than the bytes it saves."""
    if not ev.fits:
        return f"{mode} does not fit either (peak {ev.memory.peak_gib:.1f} GiB)"
    gen, base = ev.breakdown["gen"], best.breakdown["gen"]
    delta = ev.step - best.step
    head = f"{mode}: predicted {ev.step:.2f} s/step vs {best.step:.2f} ({delta:+.2f} s)"
    if mode in _QUANT_COST:
        label, what = _QUANT_COST[mode]
        saved = base.get("hbm_read", 0.0) - gen.get("hbm_read", 0.0)
        return (f"{head}: {what} (+{gen.get(label, 0.0):.2f} s) outweigh the weight reads "
                f"it saves ({saved:.2f} s)")
    return head


def partial_choice(shape: ModelConfig, gpu: GPU, num_gpus: int, workload: Workload,
                   calib: Calibration, best: Evaluation, plan: Plan | None = None) -> dict:
    """rollout.partial for this step: the predicted step at a few decode caps (a quarter, three
    eighths and half of rollout.max_new_tokens; extra_prompts half of a step's prompts) and two
    rollout.max_batch_size values each (the steady state's rows per call, rounded up to 64: the
    first step, which generates every in-flight group, then runs in two chunks; or the first
    step's rows: one chunk always, but the steady state's call padded to that graph bucket), and
    the choice to recommend when one fits and is predicted at least 3% faster, and the speculative
    tail is off (with it on the pair was measured no faster than the tail alone, against a
    predicted gain). Considered only when the response lengths are known, the longest is at least
    twice the mean (the long tail a cap cuts), max_new_tokens is set, partial rollouts are off and
    every step generates once (no dynamic sampling). Returns {"recommended": overrides or None,
    "reason": one line, "options": {"<cap>/<max_batch_size>": {step_s, gen_s, fits, peak_gib}}}."""
    from hybridflow.cost.varlen import partial_segments, row_lengths

    w = workload
    R = w.max_new_tokens
    why_not = next((why for refused, why in (
        (w.partial_decode_steps, "already on"),
        (w.multi_turn, "multi-turn rollouts do not run with partial rollouts"),
        (w.response_lengths is None, "no response lengths (--lengths or a config's probe)"),
        (R is None, "no rollout.max_new_tokens"),
        (w.gen_rounds != 1 or w.gen_prompt_factor != 1 or w.gen_batches_per_round != 1,
         "dynamic sampling generates more than once a step"),
        (w.longest_response < 2 * w.response_len,
         f"no long tail (longest {w.longest_response} < 2 x mean {w.response_len})"))
        if refused), None)
    if why_not:
        return {"recommended": None, "options": {}, "reason": f"not considered: {why_not}"}
    dp = best.plan.layout.dp_g
    extra = max(dp, w.prompts_per_step // 2 // dp * dp)
    rows = -(-w.num_sequences // dp)
    first = -(-(w.prompts_per_step + extra) * w.samples_per_prompt // dp)
    options, evals = {}, {}
    for cap in sorted({max(64, R * k // 8 // 64 * 64) for k in (2, 3, 4)}):
        if cap >= R:
            continue
        steady = len(partial_segments(row_lengths(w, rows), cap)[0])
        for mbs in sorted({min(-(-steady // 64) * 64, first), first}):
            pw = replace(w, partial_decode_steps=cap, partial_extra_prompts=extra,
                         gen_max_batch_size=mbs)
            ev = _best_with(shape, gpu, num_gpus, pw, calib, plan)
            if ev is None:
                continue
            evals[(cap, mbs)] = ev
            options[f"{cap}/{mbs}"] = {"step_s": ev.step, "gen_s": ev.seconds["gen"],
                                       "fits": ev.fits, "peak_gib": ev.memory.peak_gib}
    better = [k for k, ev in evals.items() if ev.fits and ev.step < 0.97 * best.step]
    if not better:
        return {"recommended": None, "options": options,
                "reason": f"keep off: no cap predicted 3% faster than {best.step:.2f} s/step"}
    cap, mbs = min(better, key=lambda k: evals[k].step)
    ev = evals[(cap, mbs)]
    if w.spec_rows:  # the cap ends the calls before the tail the speculative steps would decode
        return {"recommended": None, "options": options,
                "reason": f"keep off: predicted {ev.step:.2f} s/step at cap {cap} vs "
                          f"{best.step:.2f}, but with the speculative tail on partial rollouts "
                          f"replace it, and that pair was measured no faster than the tail alone "
                          f"on the GSM8K recipe (docs/cost_model.md: the model does not predict "
                          f"it); measure before turning them on"}
    keys = (f"rollout.partial.enable=true rollout.partial.max_decode_steps={cap} "
            f"rollout.partial.extra_prompts={extra} rollout.max_batch_size={mbs} "
            f"algo.tis_imp_ratio_cap=2.0")
    return {"recommended": keys, "options": options,
            "reason": f"consider {keys}: predicted {ev.step:.2f} s/step vs {best.step:.2f} (gen "
                      f"{ev.seconds['gen']:.2f} vs {best.seconds['gen']:.2f} s, peak "
                      f"{ev.memory.peak_gib:.1f} vs {best.memory.peak_gib:.1f} GiB); it changes "
                      f"which samples a step trains on (a carried row's first tokens come from "
                      f"the previous step's policy: check the val curve, docs/performance.md)"}
