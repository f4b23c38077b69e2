"""Fit the cost model's efficiency factors to measured runs; leave-one-out check of the fit.

    python -m hybridflow.cost.calibrate runs/rl_*.json -o calibration.json

A results file holds one record, a list of records, {"records": [...]}, or JSON Lines (.jsonl).
Files with a top-level "calibration" or "validation" key (this tool's outputs) are skipped. One record:

    {"name": "qwen2_0_5b-1xH200-grpo",                # optional label for the tables
     "config": {"model": "qwen2_0_5b",                # conf/model name, HF config path, or a dict
                                                      # of ModelConfig fields
                "gpu": "H200", "num_gpus": 1,
                "layout": {"tp": 1, "pp": 1, "dp": 1, "tp_gen": 1,
                           "offload_ref": false, "recompute": false},
                "algorithm": "grpo", "prompts_per_step": 64, "samples_per_prompt": 4,
                "prompt_len": 128, "response_len": 256,   # decode steps actually run
                "ppo_epochs": 1, "mini_batches": 1, "micro_batch_tokens": 8192, "use_reference": true},
     "metrics": {"timing_s/gen": 5.1, "timing_s/update_actor": 2.3, ...,
                 "perf/max_memory_allocated_gb": 30.2}}   # GiB (bytes / 2**30), as verl logs it

`metrics` may instead sit flat in the record (as the trainer's JSONL lines do); any subset of the
stages may be present. Keys of config that are not inputs of the model are ignored.

The fit (each part of a stage is linear in one coefficient, see timing.py): memory_scale and
activation_memory_scale = least squares of the measured peak on the predicted peak phase's
(non-activation, activation) parts (one common ratio when the records cannot separate them);
then per group of stages, least squares of (measured - known terms) on the ideal times of the
group's unknown coefficients, in this order: reshard -> 1/comm_eff; gen -> 1/prefill_eff,
1/decode_bw_eff, 1/torch_kv_eff, seconds per layer per decode step; old_log_prob/ref/values and
update_actor/update_critic jointly -> 1/forward_mfu, 1/train_mfu (and their fused_elementwise
twins), layer_pass_overhead_s,
tp_collective_s, optimizer_step_s (joint because the fixed costs are shared:
a layer pass costs the same launches in either, fwd+bwd counting 3 passes; only updates step the
optimizer); the reward (timing_s/reward, where a record timed it) -> row_overhead_s, per generated
row; other -> step_overhead_s (and row_overhead_s when no record timed the reward), where "other" is
measured as timing_s/step minus the measured modelled stages (reward, advantages, gaps). A
coefficient that no measured stage depends on (tp_collective_s without a TP > 1 record) stays at
its prior; one that comes out <= 0 is held at its prior and the rest refit; when the records
cannot separate the unknowns (too few stages, or collinear terms) the fit that changes the priors
least (relative, least-norm) among the exact ones is taken; if every unknown ends up held, one
common scale of the group's prior prediction is fitted instead (a ratio fit). Gen and the
forward/update stages overlap two kinds of work (the calibration's `overlap_p`), which is not
linear: their groups are first fitted as if the parts added up, then refined by nonlinear least
squares of the overlapped seconds (`_refine_overlap`). The exponent itself is not fitted: it is
taken from the base calibration (`--base`; default 2.0) and written out unchanged. Predicted
timing_s/step = the sum of the predicted stages, "other" included. MoE records (model.moe) inform
only the MoE coefficients (gen -> expert_decode_s; the forward/update stages -> expert_pass_s),
fitted after the rest with the rest held (`MOE_GROUPS`); the memory scales and the other groups are
fitted on the dense records. Variable-length records (config `response_lengths`, hybridflow.cost.varlen)
take part in every dense group but the passes', whose efficiencies and fixed costs come from the
fixed-length records alone; masked attention's `masked_attention_efficiency` is then fitted on the
variable-length records with those held (`VARLEN_GROUPS`). In the nonlinear refinement every
efficiency stays at most 1. Quantized-rollout records (config `rollout_quantization` fp8 / int4)
inform only the quantized coefficients (gen -> fp8_decode_layer_s, 1/int4_decode_efficiency),
fitted last with the rest held (`QUANT_GROUPS`), each against its family's bf16 record of the same
call when there is one (measured minus that record's miss); the records of such a family stay out
of every other group and of the memory fit. LoRA records (config `lora_rank` or `critic_lora_rank`)
inform only the LoRA coefficients (reshard -> lora_merge_block_s; the forward/update stages ->
1/lora_bw_efficiency, lora_layer_pass_s), fitted last with the rest held, each against its
family's full-parameter record (measured minus that record's miss, stage by stage); a record marked
`"baseline_only": true` is such a baseline and takes part in no fit (`LORA_GROUPS`). A record may
name a "family" (runs of one code, model and lengths): the leave-one-out then holds the family out
together.

`--validation PATH` also writes the per-config leave-one-out summary (validate.py). Outputs are
written atomically; user errors (a results file that does not parse, names the file) are one line,
`hybridflow calibrate: error: ...`, exit code 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from hybridflow import cli
from hybridflow.atomic import atomic_write
from hybridflow.cost.efficiency import Calibration, load_calibration
from hybridflow.cost.gpus import GPU, get_gpu
from hybridflow.cost.memory import FORWARD_STAGES, memory_for
from hybridflow.cost.shapes import load_shape
from hybridflow.cost.timing import StageTerms, stage_terms
from hybridflow.cost.validate import QUANT_KEY, format_validation, validation
from hybridflow.cost.workload import Plan, Workload, make_plan
from hybridflow.model_config import ModelConfig

MEMORY_KEY = "perf/max_memory_allocated_gb"
STEP_KEY = "timing_s/step"
PASS_STAGES = (*FORWARD_STAGES, "update_actor", "update_critic")
GROUPS = [(("reshard",), ("inv_comm_eff",)),
          (("gen",), ("inv_prefill_eff", "inv_decode_bw_eff", "inv_torch_kv_eff",
                      "decode_layer_overhead_s",
                      "fused_decode_layer_overhead_s")),
          (PASS_STAGES, ("inv_forward_mfu", "inv_train_mfu", "inv_fused_forward_mfu",
                         "inv_fused_train_mfu", "layer_pass_overhead_s", "graphed_layer_pass_s",
                         "tp_collective_s",
                         "optimizer_step_s")),
          (("reward",), ("row_overhead_s",)),
          (("other",), ("step_overhead_s", "row_overhead_s"))]
# "other"'s per-row part is the reward's (detokenize, score each generated row): where records timed
# it (timing_s/reward, within "other") row_overhead_s is fitted on that alone and step_overhead_s on
# "other" with it held. On "other" alone the two are told apart only by the row counts of different
# workloads and code (64-row fixed-length records, 512- and ~1,300-row GSM8K steps), so what a
# GSM8K step's code spent once per step reads as a per-row cost.
REWARD_STAGE = "reward"
# MoE-only coefficients, fitted after the rest on the MoE records alone (the rest held): the dense
# groups and the memory scales see only dense records, so adding an MoE record leaves the dense
# fit as it was (the MoE passes' other costs cannot be told from theirs with so few records)
MOE_GROUPS = [(("gen",), ("expert_decode_s",)), (PASS_STAGES, ("expert_pass_s",))]
# The passes' efficiencies and fixed costs come from the fixed-length records alone; masked
# attention's own cost is then fitted on the variable-length records (Workload.response_lengths)
# with those held, so that a few such records do not move what the fixed-length matrix measured
VARLEN_GROUPS = [(PASS_STAGES, ("inv_masked_attn_eff",))]
# Quantized-rollout coefficients (Workload.rollout_quantization), fitted last on the quantized
# records alone with the rest held. A quantized record's family (the same call) may hold its bf16
# baseline: the quantized generation is then fitted as measured minus the bf16 model's miss on
# that baseline, so the coefficients describe what quantization adds on that very workload. The
# records of a family that holds a quantized one (the baselines too) stay out of the other groups
# and the memory fit: adding them leaves the rest of the fit as it was.
QUANT_GROUPS = [(("gen",), ("fp8_decode_layer_s", "inv_int4_decode_eff"))]
# LoRA coefficients (Workload.lora_rank / critic_lora_rank), fitted after the rest on the LoRA
# records alone with the rest held, each against its family's full-parameter record (the same call,
# preferably with the same train_cuda_graphs): every stage measured minus that record's miss. Only
# the LoRA records themselves stay out of the other groups and the memory fit. A record marked
# "baseline_only" (a full-parameter run measured only to pair with LoRA ones, e.g. an update
# benchmark's) serves as such a baseline and is fitted in no group.
LORA_GROUPS = [(("reshard",), ("lora_merge_block_s",)),
               (PASS_STAGES, ("inv_lora_bw_eff", "lora_layer_pass_s"))]


@dataclass
class Run:
    name: str
    shape: ModelConfig
    gpu: GPU
    plan: Plan
    workload: Workload
    metrics: dict[str, float]


def parse_record(rec: dict, default_name: str = "run") -> Run:
    cfg = rec.get("config")
    if not isinstance(cfg, dict):
        raise ValueError(f"record {rec.get('name', default_name)!r}: missing 'config' object")
    for key in ("model", "gpu", "num_gpus", "layout"):
        if key not in cfg:
            raise ValueError(f"record {rec.get('name', default_name)!r}: config lacks {key!r}")
    fields = Workload.__dataclass_fields__
    work = Workload(**{k: v for k, v in cfg.items() if k in fields})
    metrics = rec.get("metrics", rec)
    metrics = {k: float(v) for k, v in metrics.items()
               if (k.startswith("timing_s/") or k == MEMORY_KEY) and isinstance(v, (int, float))}
    shape = load_shape(cfg["model"])
    return Run(str(rec.get("name", default_name)), shape, get_gpu(cfg["gpu"]),
               make_plan(cfg["layout"], int(cfg["num_gpus"]), shape), work, metrics)


def load_records(paths: list[str | Path]) -> list[dict]:
    out = []
    for path in map(Path, paths):
        if not path.is_file():
            raise FileNotFoundError(f"results file {path} not found")
        data = _read_json(path)
        if isinstance(data, dict) and ("calibration" in data or "validation" in data):
            continue
        machine = data.get("machine") if isinstance(data, dict) else None
        data = data.get("records", [data]) if isinstance(data, dict) else data
        for i, r in enumerate(data if isinstance(data, list) else [data]):
            if not isinstance(r, dict):
                raise ValueError(f"{path}: record {i}: expected a JSON object, got "
                                 f"{type(r).__name__}")
        out += [{"machine": machine, **r, "name": r.get("name", f"{path.stem}[{i}]"),
                 "source": str(path)} for i, r in enumerate(data)]
    seen: dict[str, int] = {}
    for r in out:  # the validation is keyed by name: a repeated one gets its file's name too
        seen[r["name"]] = seen.get(r["name"], 0) + 1
    for r in out:
        if seen[r["name"]] > 1:
            r["name"] = f"{r['name']}@{Path(r['source']).stem}"
    return out


def _read_json(path: Path):
    """A results file's JSON: one document, or the list of a .jsonl file's lines."""
    try:
        text = path.read_bytes().decode("utf-8")
        if path.suffix != ".jsonl":
            return json.loads(text)
        docs = []
        for line_no, line in enumerate(text.splitlines(), start=1):
            try:
                docs += [json.loads(line)] if line.strip() else []
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {line_no}: not valid JSON ({e.msg}: column "
                                 f"{e.colno})") from None
        return docs
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text; expected a JSON or JSON Lines results file") \
            from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg}: line {e.lineno} column {e.colno})") \
            from None


def _solve(rows: list[list[float]], ys: list[float], prior: list[float]) -> list[float] | None:
    """Least squares for the coefficients, in relative steps from the prior: min ||A d - r|| with
    A[:, k] = x_k * prior_k and r = ys - x . prior, coefficient k = prior_k (1 + d_k). Overdetermined
    and full rank: the ordinary least squares. Fewer independent stages than unknowns (one record,
    or collinear terms): of the exact fits, the one with the smallest relative change of the priors.
    None when nothing can be solved (no rows)."""
    if not rows:
        return None
    x, p = np.asarray(rows, dtype=float), np.asarray(prior, dtype=float)
    a, r = x * p, np.asarray(ys, dtype=float) - x @ p
    d, *_ = np.linalg.lstsq(a, r, rcond=1e-9)
    return [float(v) for v in p * (1 + d)]


def _rows(runs, terms, stages, free, coefs) -> tuple[list[list[float]], list[float]]:
    """Rows (x[k] for k in free) and targets (measured - known terms) of the group's least squares."""
    rows, ys = [], []
    for run, t in zip(runs, terms):
        for stage in stages:
            y = run.metrics.get(f"timing_s/{stage}")
            if stage in t and y is not None and any(t[stage].x.get(k, 0) for k in free):
                known = t[stage].const + sum(v * coefs[k] for k, v in t[stage].x.items() if k not in free)
                # Least squares in seconds: a long stage weighs more, as it does in the step. Relative
                # residuals let the many short forward stages pull the MFUs up and held out worse.
                rows.append([t[stage].x.get(k, 0.0) for k in free])
                ys.append(y - known)
    return rows, ys


def _fit_group(runs, terms, stages, unknowns, coefs) -> dict[str, float]:
    # A coefficient that no measured stage depends on (e.g. tp_collective_s without a TP > 1
    # record) stays at its prior instead of making the system singular.
    free = [k for k in unknowns if _rows(runs, terms, stages, [k], coefs)[0]]
    while free:
        rows, ys = _rows(runs, terms, stages, free, coefs)
        sol = _solve(rows, ys, [coefs[k] for k in free])
        if sol is None:
            break
        if all(v > 0 for v in sol):
            return coefs | dict(zip(free, sol))
        free.remove(free[min(range(len(sol)), key=lambda i: sol[i])])   # hold the worst at its prior
    # Ratio fit: one scale s of the group's own terms, s = sum(p * y) / sum(p^2).
    num = den = 0.0
    for run, t in zip(runs, terms):
        for stage in stages:
            y = run.metrics.get(f"timing_s/{stage}")
            if stage in t and y is not None:
                p = sum(v * coefs[k] for k, v in t[stage].x.items() if k in unknowns)
                r = y - t[stage].const - sum(
                    v * coefs[k] for k, v in t[stage].x.items() if k not in unknowns)
                num, den = num + p * r, den + p * p
    s = num / den if den > 0 else 0.0
    return coefs | {k: coefs[k] * s for k in unknowns} if s > 0 else coefs


def _refine_overlap(runs, terms, stages, unknowns, coefs) -> dict[str, float]:
    """Least squares of the stages' real (overlapped, so nonlinear) seconds, from the linear fit's
    coefficients: Levenberg-Marquardt on log(coefficient), which keeps them positive (on
    log(coefficient - 1) for the inverse efficiencies, which keeps every efficiency at most 1),
    with a faint pull (1e-6 per log unit) to the start so that directions no record informs stay
    put."""
    data = [(t[s], run.metrics[f"timing_s/{s}"]) for run, t in zip(runs, terms) for s in stages
            if s in t and f"timing_s/{s}" in run.metrics]
    free = [k for k in unknowns if any(k in t.x for t, _ in data)]
    if not data or not free:
        return coefs
    # an efficiency cannot pass 1 (its inverse, "inv_*", stays above 1): those as 1 + exp(theta)
    floor = np.array([1.0 if k.startswith("inv_") else 0.0 for k in free])
    start = np.log(np.maximum([coefs[k] - f for k, f in zip(free, floor)], 1e-4))

    def values(theta):
        return floor + np.exp(np.clip(theta, -60.0, 60.0))

    def residuals(theta):
        c = coefs | dict(zip(free, values(theta)))
        return np.array([t.seconds(c) - y for t, y in data] + list(1e-6 * (theta - start)))

    theta, lam = start.copy(), 1e-3
    r = residuals(theta)
    for _ in range(500):
        jac = np.empty((len(r), len(free)))
        for j in range(len(free)):                     # central differences in log space
            step = np.zeros(len(free))
            step[j] = 1e-5
            jac[:, j] = (residuals(theta + step) - residuals(theta - step)) / 2e-5
        a, g = jac.T @ jac, jac.T @ r
        delta = np.linalg.solve(a + lam * np.diag(np.diag(a) + 1e-15), -g)
        r_new = residuals(theta + delta)
        if r_new @ r_new <= r @ r:
            theta, r, lam = theta + delta, r_new, max(lam / 4, 1e-12)
            if np.abs(delta).max() < 1e-12:
                break
        else:
            lam *= 4
            if lam > 1e12:
                break
    return coefs | {k: float(v) for k, v in zip(free, values(theta))}


def _with_other(run: Run, stages) -> Run:
    """`run` with the derived metric timing_s/other = step - the measured modelled stages (reward,
    advantages, gaps), when the step and every modelled stage were measured."""
    keys = [f"timing_s/{s}" for s in stages if s != "other"]
    if STEP_KEY not in run.metrics or not all(k in run.metrics for k in keys):
        return run
    other = run.metrics[STEP_KEY] - sum(run.metrics[k] for k in keys)
    return replace(run, metrics=run.metrics | {"timing_s/other": other})


def _with_reward(terms: dict[str, StageTerms]) -> dict[str, StageTerms]:
    """`terms` with the fit-only stage "reward": "other"'s per-row part (the step's own sum of
    stages leaves it out: it is inside "other")."""
    rows = terms["other"].x.get("row_overhead_s", 0.0)
    return terms | {REWARD_STAGE: StageTerms([("row_overhead", "row_overhead_s", rows)])}


def _memory_parts(run: Run, calib: Calibration) -> tuple[float, float]:
    """(everything but activations, activations) of the predicted peak phase, unscaled GiB."""
    comp = memory_for(run.shape, run.gpu, run.plan, run.workload, calib).components_gib
    act = comp["activations"] / (calib.memory_scale * calib.activation_memory_scale)
    return sum(comp.values()) / calib.memory_scale - act * calib.activation_memory_scale, act


def _fit_memory(runs: list[Run], base: Calibration) -> Calibration:
    """memory_scale and activation_memory_scale by least squares of the measured peaks on the
    predicted peak phase's (rest, activations); the peak phase depends on the scales, so the fit
    is repeated until it settles. When the two columns cannot be told apart (one record, or
    activations in a fixed ratio to the rest) or a scale comes out <= 0: one common scale
    (activation_memory_scale 1), the least-squares ratio of measured to predicted peak."""
    measured = [r for r in runs if MEMORY_KEY in r.metrics]
    calib = replace(base, memory_scale=1.0, activation_memory_scale=1.0)
    if not measured:
        return base
    y = np.array([r.metrics[MEMORY_KEY] for r in measured])
    for _ in range(8):
        A = np.array([_memory_parts(r, calib) for r in measured])
        (a, c), *_ = np.linalg.lstsq(A, y, rcond=None)
        if np.linalg.matrix_rank(A, tol=1e-6 * np.abs(A).max()) < 2 or a <= 0 or c <= 0 \
                or np.linalg.cond(A) > 1e3:
            p = A.sum(axis=1)
            return replace(base, memory_scale=float(p @ y / (p @ p)), activation_memory_scale=1.0)
        new = replace(calib, memory_scale=float(a), activation_memory_scale=float(c / a))
        if (abs(new.memory_scale - calib.memory_scale) < 1e-6
                and abs(new.activation_memory_scale - calib.activation_memory_scale) < 1e-6):
            break
        calib = new
    return new


def _quantized(run: Run) -> bool:
    return run.workload.rollout_quantization != "none"


def quantized_families(records: list[dict]) -> tuple[list[bool], list[int | None]]:
    """Per record: whether it belongs to the quantized set (a quantized record, or any record of
    a family that holds one), and the index of its bf16 baseline (a record of its family whose
    config says rollout_quantization none; None for the rest)."""
    quant = [(r.get("config") or {}).get("rollout_quantization", "none") != "none" for r in records]
    fams = [r.get("family") for r in records]
    qfams = {f for f, q in zip(fams, quant) if q and f is not None}
    in_set = [q or (f is not None and f in qfams) for q, f in zip(quant, fams)]
    baseline = [next((j for j, (g, qj) in enumerate(zip(fams, quant))
                      if q and f is not None and g == f and not qj), None)
                for f, q in zip(fams, quant)]
    return in_set, baseline


def _lora(config: dict) -> bool:
    return bool(config.get("lora_rank") or config.get("critic_lora_rank"))


def lora_families(records: list[dict]) -> tuple[list[bool], list[int | None]]:
    """Per record: whether it is a LoRA record, and the index of its full-parameter baseline (a
    record of its family without LoRA, one with the same train_cuda_graphs first; None for the
    rest)."""
    cfgs = [r.get("config") or {} for r in records]
    lora = [_lora(c) for c in cfgs]
    fams = [r.get("family") for r in records]
    baseline = []
    for i, (f, c) in enumerate(zip(fams, cfgs)):
        full = [j for j, (g, lj) in enumerate(zip(fams, lora)) if lora[i] and f is not None
                and g == f and not lj]
        same = [j for j in full if cfgs[j].get("train_cuda_graphs", False)
                == c.get("train_cuda_graphs", False)]
        baseline.append((same or full or [None])[0])
    return lora, baseline


def _baseline_corrected(run: Run, base: tuple | None, coefs: dict[str, float],
                        stages=("gen",)) -> Run:
    """`run` with each of its measured `stages` less its baseline's miss there (measured -
    predicted); `base`: the baseline's (Run, stage terms)."""
    if base is None:
        return run
    metrics = dict(run.metrics)
    for stage in stages:
        key = f"timing_s/{stage}"
        if key in run.metrics and key in base[0].metrics and stage in base[1]:
            metrics[key] -= base[0].metrics[key] - base[1][stage].seconds(coefs)
    return replace(run, metrics=metrics)


def fit(records: list[dict], base: Calibration | None = None) -> Calibration:
    """Calibration fitted to `records` (see the module docstring); `base` supplies the priors."""
    base = base or Calibration()
    runs = [parse_record(r, f"run{i}") for i, r in enumerate(records)]
    in_qset, baseline = quantized_families(records)
    lora, lora_base = lora_families(records)
    quant = [_quantized(r) for r in runs]
    # kept out of the other groups: the quantized set (only quantized records when it is all
    # there is: its bf16 records then fit the groups the quantized step holds), the LoRA records
    # and the baseline-only ones
    out = quant if all(in_qset) else in_qset
    out = [o or lo or bool(r.get("baseline_only")) for o, lo, r in zip(out, lora, records)]
    pool = [i for i, x in enumerate(out) if not x]
    moe = [r.shape.moe.enabled for r in runs]
    dense_i = [i for i in pool if not moe[i]] or pool   # (MoE records only: fit them all)
    calib = _fit_memory([runs[i] for i in dense_i], base)
    terms = [stage_terms(r.shape, r.gpu, r.plan, r.workload, calib) for r in runs]
    runs = [_with_other(r, t) for r, t in zip(runs, terms)]
    terms = [_with_reward(t) for t in terms]
    coefs = calib.coefs()
    varlen = [r.workload.response_lengths is not None for r in runs]
    main = [(runs[i], terms[i], varlen[i]) for i in pool if not moe[i] or len(dense_i) == len(pool)]
    steps = [(GROUPS, main),
             (VARLEN_GROUPS, [(runs[i], terms[i], varlen[i]) for i in pool
                              if varlen[i] and not moe[i]]),
             (MOE_GROUPS, [(runs[i], terms[i], varlen[i]) for i in pool if moe[i]]),
             (QUANT_GROUPS, [(i, terms[i], varlen[i]) for i, q in enumerate(quant) if q]),
             (LORA_GROUPS, [(i, terms[i], varlen[i]) for i, lo in enumerate(lora) if lo])]
    for groups, pairs in steps:
        if groups is QUANT_GROUPS:   # against the same call's bf16 record, the rest held
            pairs = [(_baseline_corrected(runs[i], None if baseline[i] is None else
                                          (runs[baseline[i]], terms[baseline[i]]), coefs), t, v)
                     for i, t, v in pairs]
        elif groups is LORA_GROUPS:  # against the same call's full-parameter record
            stages = ("reshard",) + PASS_STAGES
            pairs = [(_baseline_corrected(runs[i], None if lora_base[i] is None else
                                          (runs[lora_base[i]], terms[lora_base[i]]), coefs,
                                          stages), t, v) for i, t, v in pairs]
        for stages, unknowns in groups:
            use = pairs
            if groups is GROUPS and stages == PASS_STAGES:    # fixed-length records (if any)
                use = [p for p in pairs if not p[2]] or pairs
            if not use:
                continue
            g_runs, g_terms = [p[0] for p in use], [p[1] for p in use]
            if stages == ("other",) and _rows(g_runs, g_terms, (REWARD_STAGE,),
                                              ["row_overhead_s"], coefs)[0]:
                unknowns = ("step_overhead_s",)   # the per-row part: from the timed reward
            coefs = _fit_group(g_runs, g_terms, stages, unknowns, coefs)
            if any(t[s].overlap for t in g_terms for s in stages if s in t):   # nonlinear: refine
                coefs = _refine_overlap(g_runs, g_terms, stages, unknowns, coefs)
    return calib.with_coefs(**coefs)


def predict(run: Run, calib: Calibration) -> dict[str, float]:
    """Predicted `timing_s/<stage>`, `timing_s/step` (their sum) and peak memory of one run."""
    coefs = calib.coefs()
    out = {f"timing_s/{k}": t.seconds(coefs)
           for k, t in stage_terms(run.shape, run.gpu, run.plan, run.workload, calib).items()}
    out[STEP_KEY] = sum(out.values())
    out[MEMORY_KEY] = memory_for(run.shape, run.gpu, run.plan, run.workload, calib).peak_gib
    return out


def predict_vs_measured(records: list[dict], calibration=None) -> list[dict]:
    """Leave-one-out: for each record, fit on all the others (priors: `calibration`) and predict it.
    Records that name a "family" (runs sharing code, model and lengths, e.g. two budgets of one
    recipe) are held out together: each is predicted by a fit that saw none of its family.

    Returns rows {name, metric, measured, predicted, error_pct}, one per measured metric."""
    if len(records) < 2:
        raise ValueError("leave-one-out needs at least 2 records")
    base = Calibration() if calibration is None else load_calibration(calibration)
    group = [r.get("family", f"\0{i}") for i, r in enumerate(records)]
    if len(set(group)) < 2:
        raise ValueError("leave-one-out needs records of at least 2 families")
    fits: dict[str, Calibration] = {}
    _, baseline = quantized_families(records)
    rows = []
    for i, rec in enumerate(records):
        run = parse_record(rec, f"run{i}")
        if group[i] not in fits:
            fits[group[i]] = fit([r for r, g in zip(records, group) if g != group[i]], base)
        pred = predict(run, fits[group[i]])
        gen, b = "timing_s/gen", baseline[i]
        bf16 = None if b is None else parse_record(records[b], f"run{b}")
        if bf16 is not None and gen in run.metrics and gen in bf16.metrics:
            # the quantized coefficients' own check: from the same call's bf16 measurement
            pred[QUANT_KEY] = (bf16.metrics[gen] + pred[gen]
                               - predict(bf16, fits[group[i]])[gen])
            run.metrics[QUANT_KEY] = run.metrics[gen]
        for metric, measured in run.metrics.items():
            if metric in pred:
                p = pred[metric]
                rows.append({"name": run.name, "metric": metric, "measured": measured, "predicted": p,
                             "error_pct": 100 * (p - measured) / measured if measured else float("nan")})
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [f"{'run':<46} {'metric':<30} {'measured':>10} {'predicted':>10} {'error':>8}"]
    lines += [f"{r['name'][:46]:<46} {r['metric']:<30} {r['measured']:>10.3f} {r['predicted']:>10.3f} "
              f"{r['error_pct']:>7.1f}%" for r in rows]
    return "\n".join(lines)


@cli.tool("calibrate")
def main(argv: list[str] | None = None) -> int:
    p = cli.ArgumentParser(prog="python -m hybridflow.cost.calibrate", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="measured-run JSON / JSONL files")
    p.add_argument("-o", "--output", help="where to write the fitted calibration JSON")
    p.add_argument("--base", help="calibration JSON whose values are the priors (and whose "
                                  "overlap_p the fit keeps)")
    p.add_argument("--validation", help="where to write the per-config leave-one-out summary JSON "
                                        "(step time and peak memory, measured vs predicted)")
    a = p.parse_args(argv)
    command = "python -m hybridflow.cost.calibrate " + " ".join(sys.argv[1:] if argv is None else argv)
    records = load_records(a.results)
    if not records:
        raise ValueError("no records found in the given files")
    base = Calibration() if a.base is None else load_calibration(a.base)
    calib = fit(records, base)
    loo = predict_vs_measured(records, base) if len(records) > 1 else []
    print(f"fitted on {len(records)} record(s):")
    print("\n".join(f"  {k:<24}{v:.4g}" for k, v in calib.to_dict().items()))
    if loo:
        print("\nleave-one-out (fit on the others, predict this one):\n" + format_table(loo))
        in_sample = {r["name"]: predict(parse_record(r), calib) for r in records}
        summary = validation(records, loo, command=command, in_sample=in_sample)
        print("\nper config (leave-one-out):\n" + format_validation(summary))
        if a.validation:
            _write_json(a.validation, summary)
            print(f"\nwrote {a.validation}")
    if a.output:
        out = {"calibration": calib.to_dict(), "num_records": len(records),
               "records": [r["name"] for r in records], "leave_one_out": loo}
        _write_json(a.output, out)
        print(f"\nwrote {a.output}")
    return 0


def _write_json(path: str, data: dict) -> None:
    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(data, indent=2) + "\n")
    atomic_write(path, write)


if __name__ == "__main__":
    sys.exit(main())
