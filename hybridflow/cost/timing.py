"""Seconds per stage of one RL step, as a model linear in the efficiency coefficients.

Each stage is `const + sum_k x[k] * coef[k]`, where x[k] is an ideal time (work at peak speed) and
coef[k] comes from `Calibration.coefs()` (1/efficiency, or seconds per decode step). Linearity is what
lets calibrate.py fit the coefficients by least squares. The terms are kept as labelled parts
(compute, pp_bubble, hbm_read, decode_overhead, tp_comm, dp_comm, reshard_comm, latency, pcie) so the
report can say where the time goes. Per stage (per GPU; the work is assumed split
evenly, ceil() where sequences do not divide by DP):
- reshard: bytes each GPU receives to build its gen TP_g shard (the shard minus the training shard it
  already holds) over NVLink (IB when the TP x PP group spans nodes), at bus bandwidth x comm eff.
- gen: prefill (2N + attention FLOPs per prompt token) + decode compute, at peak x prefill eff; plus
  per decode step: read the gen weight shard and the wave's KV cache at HBM bandwidth x decode eff
  (summed with compute, not a roofline max: the efficiencies absorb the overlap), plus a fixed
  overhead per step; plus TP_g all-reduces (2 per layer per step). Every response runs to full length.
- old_log_prob / ref / values: forward FLOPs at peak x forward MFU, times (1 + PP bubble), plus TP
  all-reduces (2 per layer); an offloaded reference adds its host-to-device copy over PCIe.
- update_actor / update_critic: ppo_epochs passes of fwd+bwd (6N + 6 L s q_dim per token; 8N + 8 L s
  q_dim with recompute) at peak x train MFU, times (1 + PP bubble); TP all-reduces (4 per layer, 6 with
  recompute); per optimizer step a DP reduce-scatter of fp32 grads and all-gather of bf16 params.
PP bubble of 1F1B: (PP - 1) / micro-batches. Ring collectives move 2 (n-1)/n of the data per GPU for
an all-reduce, (n-1)/n for a gather/scatter; each collective also pays a fixed latency (const term).
Not modelled: PP point-to-point transfers (small), reward and advantage stages (CPU rule rewards).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from hybridflow.cost.efficiency import Calibration
from hybridflow.cost.flops import (BYTES_PER_PARAM, decode_flops_per_token,
                                   forward_flops_per_token, kv_bytes_per_token, train_flops_per_token)
from hybridflow.cost.gpus import GPU
from hybridflow.cost.memory import gen_batch_size, reshard_buffer_bytes
from hybridflow.cost.shapes import ModelShape
from hybridflow.cost.workload import Layout, Workload

NVLINK_LATENCY_S = 10e-6   # per collective inside a node
IB_LATENCY_S = 30e-6       # per collective across nodes


@dataclass
class StageTerms:
    """A stage's seconds as labelled parts: (label, coefficient name or None for fixed seconds, x)."""
    parts: list[tuple[str, str | None, float]] = field(default_factory=list)

    def add(self, label: str, coef: str | None, x: float) -> None:
        if x:
            self.parts.append((label, coef, x))

    @property
    def x(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for _, coef, x in self.parts:
            if coef is not None:
                out[coef] = out.get(coef, 0.0) + x
        return out

    @property
    def const(self) -> float:
        return sum(x for _, coef, x in self.parts if coef is None)

    def breakdown(self, coefs: dict[str, float]) -> dict[str, float]:
        out: dict[str, float] = {}
        for label, coef, x in self.parts:
            out[label] = out.get(label, 0.0) + x * (1.0 if coef is None else coefs[coef])
        return out

    def seconds(self, coefs: dict[str, float]) -> float:
        return sum(self.breakdown(coefs).values())


def _link(gpu: GPU, group_span: int) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of a group of `group_span` consecutive ranks."""
    if group_span <= gpu.gpus_per_node:
        return gpu.nvlink_gbps * 1e9, NVLINK_LATENCY_S
    return gpu.ib_gbps * 1e9, IB_LATENCY_S


def _tp_comm(t: StageTerms, shape: ModelShape, gpu: GPU, tp: int, layers: int, tokens: float,
             num_collectives: int, per_layer: int) -> None:
    """`per_layer` all-reduces (or SP gather + scatter pairs) per layer over `tokens` tokens."""
    if tp == 1:
        return
    bw, lat = _link(gpu, tp)
    volume = per_layer * layers * tokens * shape.hidden_size * BYTES_PER_PARAM * 2 * (tp - 1) / tp
    t.add("tp_comm", "inv_comm_eff", volume / bw)
    t.add("latency", None, per_layer * layers * num_collectives * lat)


def _gen(shape: ModelShape, gpu: GPU, layout: Layout, w: Workload, calib: Calibration) -> StageTerms:
    t, tp_g = StageTerms(), layout.tp_gen
    per_replica = math.ceil(w.num_sequences / layout.dp_gen)
    batch, waves = gen_batch_size(shape, gpu, layout, w, calib)
    steps, context = waves * w.response_len, w.prompt_len + w.response_len / 2
    flops = per_replica * (w.prompt_len * forward_flops_per_token(shape, w.prompt_len)
                           + w.response_len * decode_flops_per_token(shape, context)) / tp_g
    t.add("compute", "inv_prefill_eff", flops / (gpu.bf16_tflops * 1e12))
    weights = BYTES_PER_PARAM * shape.num_dense_params / tp_g
    kv = per_replica * w.response_len * context * kv_bytes_per_token(shape, tp_g)
    t.add("hbm_read", "inv_decode_bw_eff", (steps * weights + kv) / (gpu.hbm_gbps * 1e9))
    t.add("decode_overhead", "decode_step_overhead_s", steps)
    _tp_comm(t, shape, gpu, tp_g, shape.num_layers, per_replica * w.seq_len,
             num_collectives=waves * (1 + w.response_len), per_layer=2)
    return t


def _reshard(shape: ModelShape, gpu: GPU, layout: Layout) -> StageTerms:
    t = StageTerms()
    received = reshard_buffer_bytes(shape, layout)
    if received > 0:
        bw, lat = _link(gpu, layout.tp * layout.pp)
        t.add("reshard_comm", "inv_comm_eff", received / bw)
        t.add("latency", None, lat)
    return t


def _forward(shape: ModelShape, gpu: GPU, layout: Layout, w: Workload, role: str) -> StageTerms:
    t, shard = StageTerms(), layout.tp * layout.pp
    seqs = math.ceil(w.num_sequences / layout.dp)
    micro = math.ceil(seqs / w.seqs_per_micro_batch)
    flops = seqs * w.seq_len * forward_flops_per_token(shape, w.seq_len, role) / shard
    ideal = flops / (gpu.bf16_tflops * 1e12)
    t.add("compute", "inv_forward_mfu", ideal)
    t.add("pp_bubble", "inv_forward_mfu", ideal * (layout.pp - 1) / micro)
    _tp_comm(t, shape, gpu, layout.tp, shape.num_layers // layout.pp, seqs * w.seq_len, micro, 2)
    return t


def _update(shape: ModelShape, gpu: GPU, layout: Layout, w: Workload, role: str) -> StageTerms:
    t, shard = StageTerms(), layout.tp * layout.pp
    opt_steps = w.ppo_epochs * w.mini_batches
    micro = w.num_micro_batches(layout.dp)                 # per optimizer step
    seqs = opt_steps * math.ceil(w.num_sequences / w.mini_batches / layout.dp)
    flops = seqs * w.seq_len * train_flops_per_token(shape, w.seq_len, role, layout.recompute) / shard
    ideal = flops / (gpu.bf16_tflops * 1e12)
    t.add("compute", "inv_train_mfu", ideal)
    t.add("pp_bubble", "inv_train_mfu", ideal * (layout.pp - 1) / micro)
    _tp_comm(t, shape, gpu, layout.tp, shape.num_layers // layout.pp, seqs * w.seq_len,
             opt_steps * micro, 6 if layout.recompute else 4)
    if layout.dp > 1:
        params = shape.num_params if role == "actor" else shape.num_critic_params
        bw, lat = _link(gpu, layout.num_gpus)
        volume = opt_steps * (4 + BYTES_PER_PARAM) * params / shard * (layout.dp - 1) / layout.dp
        t.add("dp_comm", "inv_comm_eff", volume / bw)
        t.add("latency", None, 2 * opt_steps * lat)
    return t


def stage_terms(shape: ModelShape, gpu: GPU, layout: Layout, w: Workload,
                calib: Calibration) -> dict[str, StageTerms]:
    """The linear terms of every stage the step runs, in the trainer's order."""
    stages = {"reshard": _reshard(shape, gpu, layout), "gen": _gen(shape, gpu, layout, w, calib),
              "old_log_prob": _forward(shape, gpu, layout, w, "actor")}
    if w.use_reference:
        stages["ref"] = _forward(shape, gpu, layout, w, "actor")
        if layout.offload_ref:
            stages["ref"].add("pcie", None, BYTES_PER_PARAM * shape.num_params
                              / (layout.tp * layout.pp) / (gpu.pcie_gbps * 1e9))
    if w.has_critic:
        stages["values"] = _forward(shape, gpu, layout, w, "critic")
        stages["update_critic"] = _update(shape, gpu, layout, w, "critic")
    stages["update_actor"] = _update(shape, gpu, layout, w, "actor")
    return stages


def stage_breakdown(shape: ModelShape, gpu: GPU, layout: Layout, w: Workload,
                    calib: Calibration) -> dict[str, dict[str, float]]:
    """stage -> part label (compute, pp_bubble, tp_comm, ...) -> seconds."""
    coefs = calib.coefs()
    return {k: t.breakdown(coefs) for k, t in stage_terms(shape, gpu, layout, w, calib).items()}


def step_seconds(shape: ModelShape, gpu: GPU, layout: Layout, w: Workload,
                 calib: Calibration) -> dict[str, float]:
    """Seconds per stage (keys as the trainer's `timing_s/<stage>`), plus their sum under "step"."""
    out = {k: sum(parts.values()) for k, parts in stage_breakdown(shape, gpu, layout, w, calib).items()}
    out["step"] = sum(out.values())
    return out


def actor_model_flops(shape: ModelShape, w: Workload) -> float:
    """Useful FLOPs of the actor update in one step (no recompute), for MFU."""
    return w.ppo_epochs * w.tokens_per_step * train_flops_per_token(shape, w.seq_len)
