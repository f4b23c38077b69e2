"""Seconds per stage of one RL step, as labelled parts, each linear in one efficiency coefficient.

Each part is `x[k] * coef[k]` (or fixed seconds), where x[k] is an ideal time (work at peak speed) or
a count, and coef[k] comes from `Calibration.coefs()` (1/efficiency, or seconds per event). A stage
is the sum of its parts, except where two kinds of work overlap (the calibration's `overlap_p`):
forward/update passes' host side (per-layer and TP collective launches) and GPU side (FLOPs, TP
bytes); decode's FLOPs and its HBM reads.
The parts (compute, decode_compute, layer_overhead, optimizer, pp_bubble, hbm_read, decode_overhead,
sampler_delta, quant_overhead, quant_compute, quant_dequant, tp_comm, tp_latency, ep_comm, dp_comm,
reshard_comm, latency, pcie, step_overhead) let the report say where the time goes. MoE models: FLOPs count the active parameters (router + top_k experts),
memory every expert, a decode step reads (and multiplies) every expert, and under EP each layer
pass adds the all-to-all of each token's hidden state to its top_k experts and back (`ep_comm`). Per stage (per GPU; the work is assumed split evenly, ceil() where sequences do not
divide by DP):
- reshard: bytes each GPU receives to build its gen TP_g shard (the shard minus the training shard it
  already holds) over NVLink (IB when the TP x PP group spans nodes), at bus bandwidth x comm eff.
- gen: prefill (2N + attention FLOPs per prompt token, each prompt once: its n samples share it) at
  peak x prefill eff; decode FLOPs at the
  same rate overlapped (`overlap_p`) with each decode step's reads of the gen weight shard and the
  wave's KV cache at HBM bandwidth x decode eff; plus a fixed cost per layer per decode step
  (`decode_layer_overhead_s`: the CUDA graph's small kernels, with sampling folded in); plus TP_g
  all-reduces (2 per layer per step). The records drew by the exponential race, whose draw the
  fitted decode terms hold; the Triton decode's inverse-CDF draw (`Workload.cdf_sampler`) adds
  what it takes beyond the race per decode step at the step's bucket rows (`sampler_delta`: fixed
  seconds, SAMPLER_RACE_S / SAMPLER_CDF_S, each a + b x rows measured on one H100, not scaled per
  GPU, b with the vocabulary; negative beyond a few rows), except in the speculative tail, whose
  draw is PyTorch's. A quantized rollout (`Workload.rollout_quantization`) reads its layer weights
  at their bytes (flops.ROLLOUT_BYTES_PER_WEIGHT) and pays what its kernels cost over bf16's at
  decode row counts: fp8 a fixed cost per layer per decode step
  (`fp8_decode_layer_s`, `quant_overhead`), int4 its weight-only kernel's FLOPs over the decode
  row-steps of buckets of at most `Workload.int4_kernel_max_rows` rows at `int4_decode_efficiency`
  (`quant_compute`), and for each prefill sub-batch and wider decode step a bf16 copy of every
  quantized matrix written and read (`quant_dequant`). Every response runs to full length, unless the workload is
  variable-length (`Workload.varlen`): then the decode steps, bucket rows and attended columns come
  from cost.varlen's simulation of the generator (chunks, graph buckets, compaction, KV windows,
  the long tail), the PyTorch decode layer's KV reads at their own efficiency (`kv_read`), and
  compactions' K/V copies at HBM bandwidth. An fp8 KV cache (`Workload.kv_cache_dtype`) moves
  its bytes in compactions and holds them in memory, but its decode reads are charged as bf16's:
  the measured generation is no faster.
- variable-length passes: the trainer's micro-batches of the step's rows (cost.varlen.pass_work):
  FLOPs of their computed tokens (matmuls), response tokens (LM head) and sum of squared row
  lengths (attention); micro-batches of rows of different lengths (packed, or padded) run masked
  attention kernels: their attention FLOPs are charged once more per kernel (1 forward, 2
  fwd+bwd) at `masked_attention_efficiency`, on the GPU side; packed ones on FlashAttention's
  varlen kernels at the kernel's share of it (cost.varlen.MASKED_SHARE; the update's graphed
  micro-batches at varlen's, which the graphs capture).
- old_log_prob / ref / values: forward FLOPs at peak x forward MFU, plus a fixed cost per layer per
  micro-batch (`layer_pass_overhead_s`: kernel launches; at RL micro-batch sizes a small model's
  passes are launch-bound, not FLOP-bound), both times (1 + PP bubble); plus TP traffic under
  sequence parallelism (2 all-gathers + 2 reduce-scatters per layer: the bytes of 2 all-reduces at
  link bandwidth x comm eff, and `tp_collective_s` per collective); an offloaded reference copied in
  the ref stage (`offload_ref_prefetch` false) adds its host-to-device copy over PCIe (from pinned
  memory); prefetched (the default) the copy runs behind generation and is not charged. Host parts
  (layer and collective launches) overlap GPU parts.
- update_actor / update_critic: ppo_epochs passes of fwd+bwd (6N + 6 L s q_dim per token; 8N + 8 L s
  q_dim with recompute) at peak x train MFU, plus 3 layer passes (4 with recompute) of fixed cost
  per layer per micro-batch (`graphed_layer_pass_s` instead with parallel.train_cuda_graphs: one
  graph replay per layer pass), times (1 + PP bubble); TP traffic twice the forward's (3x with
  recompute); per optimizer step a DP reduce-scatter of fp32 grads and all-gather of bf16 params.
  The critic's passes use its value head instead of the LM head (flops.dense_params).
- updates also pay per micro-batch DDP's gradient accumulation of the parameters autograd hands a
  bf16 gradient (all of them; with gradient_accumulation_fusion all but the layers' matmul
  weights): GRAD_ACCUM_BYTES_PER_PARAM at HBM bandwidth x GRAD_ACCUM_BW_EFF (measured, not fitted),
  on the GPU side; and per optimizer step `optimizer_step_s` plus Adam's HBM traffic (30 bytes per
  parameter of the DP shard, at peak bandwidth).
- other: `step_overhead_s` per step (advantages, bookkeeping) and `row_overhead_s` per generated
  row of a DP rank (the reward), so the stages sum to the step.
- LoRA (`Workload.lora_rank`, `critic_lora_rank`; all-linear): the update drops the frozen base's
  weight-gradient FLOPs (one forward's matmuls) and adds the adapters' FLOPs; the passes that run
  the adapters (update, old_log_prob, a LoRA critic's values; not the LoRA reference, whose
  adapters are off) add their activation traffic (flops.lora_bytes_per_token_layer) at HBM
  bandwidth x lora_bw_efficiency on the GPU side and, eager, `lora_layer_pass_s` per layer pass on
  the host side (part `lora`); the optimizer and grad accumulation cover the adapters only;
  `reshard` adds the merge (flops.LORA_MERGE_BYTES_PER_PARAM at HBM bandwidth x GRAD_ACCUM_BW_EFF,
  `lora_merge_block_s` per row block) and `other` the restore after generation.
PP bubble of 1F1B: (PP - 1) / micro-batches. Ring collectives move 2 (n-1)/n of the data per GPU for
an all-reduce, (n-1)/n for a gather/scatter. Generation's TP_g all-reduces (inside CUDA graphs) and the
reshard / DP collectives pay a fixed latency per collective (const term, NVLINK/IB_LATENCY_S).
Training at TP > 1 is assumed to use sequence parallelism (conf/parallel/tp2.yaml; memory.py assumes
it too). Not modelled: PP point-to-point transfers (small), the embedding's and LM head's few TP
collectives (see efficiency.py for what the fixed costs absorb).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from hybridflow.cost.efficiency import Calibration
from hybridflow.cost.flops import (BYTES_PER_PARAM, LORA_MERGE_BYTES_PER_PARAM,
                                   LORA_UNMERGE_BYTES_PER_PARAM, ROLLOUT_BYTES_PER_WEIGHT,
                                   dense_params, forward_flops_per_token, kv_bytes_per_token,
                                   lora_bytes_per_token_layer, lora_merge_work,
                                   train_flops_per_token)
from hybridflow.cost.gpus import GPU
from hybridflow.cost.memory import (FORWARD_STAGES, gen_batch_size, lora_params,
                                    reshard_received_bytes)
from hybridflow.cost.varlen import PREFILL_TOKENS, PassWork, decode_schedule, pass_work
from hybridflow.cost.workload import Plan, Workload
from hybridflow.model_config import ModelConfig
from hybridflow.parallel.layout import Layout

# Adam's HBM traffic per parameter of the optimizer's shard: fp32 grad read, fp32 master, m and v read
# and written, bf16 param written.
ADAM_BYTES_PER_PARAM = 4 + 3 * 8 + 2
# Megatron DDP's gradient accumulation per micro-batch, where autograd hands a parameter its bf16
# gradient: bf16 gradient written by its GEMM and read, fp32 main_grad read and written. The add is
# an unvectorised mixed-dtype kernel that reaches under half of HBM bandwidth: GRAD_ACCUM_BW_EFF is
# measured on an H200 (a profiled Qwen2-1.5B update, docs/perf_log.md), not fitted.
# With parallel.gradient_accumulation_fusion the decoder layers' matmul weights skip it (their
# backward GEMM reads and writes main_grad itself, hidden behind its FLOPs); the embedding / LM
# head, norms and biases still pay it.
GRAD_ACCUM_BYTES_PER_PARAM = 2 + 2 + 4 + 4
GRAD_ACCUM_BW_EFF = 0.46
NVLINK_LATENCY_S = 10e-6   # per collective inside a node
IB_LATENCY_S = 30e-6       # per collective across nodes
# an int4 GEMM wider than the weight-only kernel takes: the bf16 weight written, then read by cuBLAS
INT4_DEQUANT_BYTES_PER_WEIGHT = 2 * BYTES_PER_PARAM
DEVICE_COPY_EFF = 0.9  # of HBM bandwidth, a streaming device copy on an H200 (docs/perf_log.md)
# rollout.speculative: what one tail step costs beyond a decode step of its rows x (1 + drafts)
# tokens: the host's round trip (read the emitted tokens, draft, copy the drafts in) and the
# verify attention; the residual of the GSM8K recipe's A/B on an H100 with the tokens per row-step
# it measured (benchmarks/results/gsm8k_spec_ab_h100.json, docs/performance.md), not a fit over
# several records
SPEC_TAIL_STEP_S = 6.2e-4
# what rollout.speculative.fused_advance takes off a tail step with unfiltered sampling
# (`Workload.spec_fused_accept`): the difference of the fitted tail-step costs of the GSM8K
# recipe's A/B in both orders on one H100 (benchmarks/decode_step_costs.py; docs/perf_log.md)
SPEC_FUSED_ACCEPT_S = 2.2e-4
# The fused sampler's draw per decode step, a + b x rows seconds (b at SAMPLER_VOCAB ids; it
# scales with the vocabulary, the logits each row reads): least squares over bench_sampler.py's
# 16-512 rows on one H100 (CUDA graphs, bf16 logits; docs/performance.md), for the exponential
# race the calibration records drew by and the inverse CDF that replaced it.
SAMPLER_VOCAB = 151_936
SAMPLER_RACE_S = (9.06e-6, 5.94e-7)
SAMPLER_CDF_S = (1.149e-5, 1.28e-7)


# Two kinds of work that overlap, but not fully: a forward/update pass's host side (per-layer kernel
# launches, TP collective launches) and its GPU side (FLOPs, TP bytes), as the host queues kernels
# while earlier ones run, except across syncs and kernels that finish before the next launch; and a
# decode step's matmul FLOPs and its weight/KV reads (a roofline). They cost (A^p + B^p)^(1/p),
# between their sum (p = 1) and max (p = inf), p being the calibration's `overlap_p` (carried in
# `Calibration.coefs()`; efficiency.py says how p = 2 was chosen).
HOST_COEFS = frozenset({"layer_pass_overhead_s", "graphed_layer_pass_s", "tp_collective_s",
                        "lora_layer_pass_s"})
GPU_COEFS = frozenset({"inv_forward_mfu", "inv_train_mfu", "inv_fused_forward_mfu",
                       "inv_fused_train_mfu", "inv_masked_attn_eff", "inv_lora_bw_eff"})


def _side(rule: str | None, label: str, coef: str | None) -> str:
    """Which of the two overlapping sides ("a", "b") a part is on under `rule`, or "serial"."""
    if rule == "pass":
        if coef in HOST_COEFS:
            return "a"
        if coef in GPU_COEFS or label in ("tp_comm", "grad_accum"):
            return "b"
    elif rule == "decode":
        if label == "decode_compute":
            return "a"
        if label in ("hbm_read", "kv_read"):
            return "b"
    return "serial"


@dataclass
class StageTerms:
    """A stage's seconds as labelled parts: (label, coefficient name or None for fixed seconds, x).

    Seconds = the sum of the parts, except that under an `overlap` rule ("pass": host vs GPU parts,
    "decode": decode FLOPs vs HBM reads; see `_side`) the two sides combine as (A^p + B^p)^(1/p),
    p = coefs["overlap_p"] (the calibration's `overlap_p`)."""
    parts: list[tuple[str, str | None, float]] = field(default_factory=list)
    overlap: str | None = None

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

    def sides(self, coefs: dict[str, float]) -> dict[str, float]:
        """Seconds of the two overlapping sides ("a", "b") and of the rest ("serial")."""
        out = {"a": 0.0, "b": 0.0, "serial": 0.0}
        for label, coef, x in self.parts:
            out[_side(self.overlap, label, coef)] += x * (1.0 if coef is None else coefs[coef])
        return out

    def breakdown(self, coefs: dict[str, float]) -> dict[str, float]:
        """Seconds per label; the overlapping parts are scaled down together so that the labels sum
        to the stage's seconds."""
        sides = self.sides(coefs)
        both = sides["a"] + sides["b"]
        scale = overlapped(sides["a"], sides["b"], coefs["overlap_p"]) / both if both > 0 else 1.0
        out: dict[str, float] = {}
        for label, coef, x in self.parts:
            v = x * (1.0 if coef is None else coefs[coef])
            if _side(self.overlap, label, coef) != "serial":
                v *= scale
            out[label] = out.get(label, 0.0) + v
        return out

    def seconds(self, coefs: dict[str, float]) -> float:
        sides = self.sides(coefs)
        return sides["serial"] + overlapped(sides["a"], sides["b"], coefs["overlap_p"])


def overlapped(a: float, b: float, p: float) -> float:
    """Seconds of two overlapping kinds of work of `a` and `b` seconds: (a^p + b^p)^(1/p)."""
    return (a ** p + b ** p) ** (1 / p) if a > 0 and b > 0 else a + b


def _link(gpu: GPU, group_span: int) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of a group of `group_span` consecutive ranks."""
    if group_span <= gpu.gpus_per_node:
        return gpu.nvlink_gbps * 1e9, NVLINK_LATENCY_S
    return gpu.ib_gbps * 1e9, IB_LATENCY_S


def _tp_comm(t: StageTerms, shape: ModelConfig, gpu: GPU, tp: int, layers: int, tokens: float, *,
             all_reduces: int, num_collectives: float, fitted_latency: bool) -> None:
    """TP traffic: per layer over `tokens` tokens the bytes of `all_reduces` all-reduces; and
    `num_collectives` collectives in all, each paying the link's fixed latency (CUDA-graph replays)
    or, with `fitted_latency`, the calibrated `tp_collective_s`."""
    if tp == 1:
        return
    bw, lat = _link(gpu, tp)
    volume = all_reduces * layers * tokens * shape.hidden_size * BYTES_PER_PARAM * 2 * (tp - 1) / tp
    t.add("tp_comm", "inv_comm_eff", volume / bw)
    if fitted_latency:
        t.add("tp_latency", "tp_collective_s", num_collectives)
    else:
        t.add("latency", None, num_collectives * lat)


def _prefill_calls(tokens: float, groups: int) -> int:
    """Prefill sub-batches of `tokens` prompt tokens split evenly over `groups` (chunks or waves),
    each group in sub-batches of at most PREFILL_TOKENS."""
    return groups * math.ceil(tokens / groups / PREFILL_TOKENS)


def _gen(shape: ModelConfig, gpu: GPU, plan: Plan, w: Workload, calib: Calibration) -> StageTerms:
    t, tp_g = StageTerms(overlap="decode"), plan.layout.tp_g
    peak = gpu.bf16_tflops * 1e12
    batch, waves = gen_batch_size(shape, gpu, plan, w, calib)
    kv_token = kv_bytes_per_token(shape, tp_g, fp8=w.kv_cache_dtype == "fp8")
    # the fp8 cache's decode attention reads its codes and scales no faster than bf16's K/V
    # (measured: docs/perf_log.md): charged at bf16's bytes
    kv_read_token = kv_bytes_per_token(shape, tp_g)
    if w.varlen:   # row by row: buckets, compaction, KV windows, the long tail (cost.varlen)
        calls = w.gen_rounds
        rows = math.ceil(w.num_sequences * w.gen_prompt_factor / w.gen_rounds / plan.layout.dp_g)
        prompts = math.ceil(w.prompts_per_step * w.gen_prompt_factor / w.gen_rounds
                            / plan.layout.dp_g)
        chunk = min(rows, w.gen_max_batch_size or batch)
        d = decode_schedule(w, rows, chunk)
        prompt = w.prompt_len_max or w.prompt_len
        prefilled = (prompts + d.chunks - 1) if w.prefill_once_per_prompt else rows
        steps, row_steps, row_columns = calls * d.steps, calls * d.row_steps, calls * d.row_columns
        wide_steps, wide_row_steps = calls * d.wide_steps, calls * d.wide_row_steps
        prefill_tokens = calls * (prefilled * prompt + d.carried_prefill_tokens)
        prefills = _prefill_calls(prefill_tokens, calls * d.chunks)
        prefill = prefill_tokens * forward_flops_per_token(shape, prompt) / tp_g
        t.add("compaction", None, calls * d.moved_bytes * kv_token / (gpu.hbm_gbps * 1e9))
        tail_step_s = SPEC_TAIL_STEP_S - (SPEC_FUSED_ACCEPT_S if w.spec_fused_accept else 0.0)
        t.add("spec_tail_step", None, calls * d.spec_steps * tail_step_s)
        spec_steps, spec_row_steps = calls * d.spec_steps, calls * d.spec_row_steps
        collectives, comm_tokens = 2 * shape.num_layers * (steps + calls * d.chunks), \
            calls * (row_steps + prefilled * prompt)
    else:  # every row prompt_len + response_len; per-step costs until each wave's longest ends
        per_replica = math.ceil(w.num_sequences / plan.layout.dp_g)
        steps = waves * w.longest_response
        row_steps = per_replica * w.response_len
        row_columns = row_steps * (w.prompt_len + w.response_len / 2)
        prefilled = math.ceil(w.prompts_per_step / plan.layout.dp_g) if w.prefill_once_per_prompt \
            else per_replica  # rows run through the prefill (a prompt group stays on one replica)
        prefill_tokens = prefilled * w.prompt_len
        prefill = prefill_tokens * forward_flops_per_token(shape, w.prompt_len) / tp_g
        wide = math.ceil(per_replica / waves) > w.int4_kernel_max_rows
        wide_steps, wide_row_steps = (steps, row_steps) if wide else (0, 0.0)
        prefills = _prefill_calls(prefill_tokens, waves)
        collectives = 2 * shape.num_layers * waves * (1 + w.longest_response)
        comm_tokens = per_replica * w.seq_len
        spec_steps, spec_row_steps = 0, 0.0
    decode = (row_steps * 2 * shape.num_decode_params
              + row_columns * 4 * shape.num_layers * shape.q_dim) / tp_g
    t.add("compute", "inv_prefill_eff", prefill / peak)
    t.add("decode_compute", "inv_prefill_eff", decode / peak)
    # rollout.quantization: the layers' matmul weights (MoE: attention only; experts stay bf16)
    per_layer = shape.attn_matmul_params if shape.moe.enabled else shape.layer_matmul_params
    quantized = shape.num_layers * per_layer
    weights = (ROLLOUT_BYTES_PER_WEIGHT[w.rollout_quantization] * quantized
               + BYTES_PER_PARAM * (shape.num_decode_params - quantized)) / tp_g  # MoE: every expert
    kv = row_columns * kv_read_token
    if w.decode_kernels == "torch":  # SDPA's masked kernel reads the K/V at its own rate
        t.add("hbm_read", "inv_decode_bw_eff", steps * weights / (gpu.hbm_gbps * 1e9))
        t.add("kv_read", "inv_torch_kv_eff", kv / (gpu.hbm_gbps * 1e9))
    else:
        t.add("hbm_read", "inv_decode_bw_eff", (steps * weights + kv) / (gpu.hbm_gbps * 1e9))
    t.add("decode_overhead", "fused_decode_layer_overhead_s" if w.decode_kernels == "triton"
          else "decode_layer_overhead_s", steps * shape.num_layers)
    if w.cdf_sampler and w.decode_kernels == "triton":  # (the speculative tail draws in PyTorch)
        t.add("sampler_delta", None, sampler_delta(shape, steps - spec_steps,
                                                   row_steps - spec_row_steps))
    # what the quantized kernels cost over bf16's at decode row counts (only when quantized)
    if w.rollout_quantization == "fp8":   # activation quantization + _scaled_mm latency per GEMM
        gemms = 2 if shape.moe.enabled else 4          # the quantized matrices of a layer
        t.add("quant_overhead", "fp8_decode_layer_s", steps * shape.num_layers * gemms / 4)
    elif w.rollout_quantization == "int4":
        # decode GEMMs of at most int4_kernel_max_rows rows: the weight-only kernel, compute-bound
        t.add("quant_compute", "inv_int4_decode_eff",
              (row_steps - wide_row_steps) * 2 * quantized / tp_g / peak)
        # wider ones (prefill sub-batches, wide decode buckets) dequantize each matrix to bf16
        # (written, then read by cuBLAS) and run at bf16's rate, counted above
        t.add("quant_dequant", None, (prefills + wide_steps) * quantized
              * INT4_DEQUANT_BYTES_PER_WEIGHT / tp_g / (gpu.hbm_gbps * 1e9 * DEVICE_COPY_EFF))
    if shape.moe.enabled:  # the graphed decode's MoE MLP runs every expert, one after another
        t.add("expert_overhead", "expert_decode_s", steps * shape.num_layers * shape.moe.num_experts)
    _tp_comm(t, shape, gpu, tp_g, shape.num_layers, comm_tokens, all_reduces=2,
             num_collectives=collectives, fitted_latency=False)
    return t


def sampler_delta(shape: ModelConfig, steps: float, row_steps: float) -> float:
    """Seconds the inverse-CDF draw takes beyond the race over `steps` decode steps of
    `row_steps` rows in all (negative beyond a few rows a step)."""
    (a0, b0), (a1, b1) = SAMPLER_RACE_S, SAMPLER_CDF_S
    return (a1 - a0) * steps + (b1 - b0) * shape.vocab_size / SAMPLER_VOCAB * row_steps


def _reshard(shape: ModelConfig, gpu: GPU, plan: Plan, w: Workload) -> StageTerms:
    t, layout = StageTerms(), plan.layout
    if w.lora_rank:  # the adapters merged into the training weights before the switch
        params, blocks = lora_merge_work(shape, layout.tp_t)
        params /= layout.pp_t
        t.add("lora_merge", None, LORA_MERGE_BYTES_PER_PARAM * params
              / (gpu.hbm_gbps * 1e9 * GRAD_ACCUM_BW_EFF))
        t.add("lora_merge", "lora_merge_block_s", blocks / layout.pp_t)
    received = reshard_received_bytes(shape, layout, plan)
    if received > 0:  # MoE: the EP group's all-gather of the experts
        span = plan.ep * layout.tp_t if shape.moe.enabled else layout.tp_t * layout.pp_t
        bw, lat = _link(gpu, span)
        t.add("reshard_comm", "inv_comm_eff", received / bw)
        t.add("latency", None, lat)
    return t


def _passes(t: StageTerms, shape: ModelConfig, gpu: GPU, layout: Layout, *, ideal: float, coef: str,
            tokens: float, micro: int, flushes: int, layer_passes: int,
            graphed: bool = False, ep: int = 1, grouped_gemm: bool = False,
            lora_bytes: float = 0.0, eager_micro: int = 0) -> None:
    """Compute, fixed per-layer cost, PP bubble and TP traffic of `micro` micro-batches in `flushes`
    pipeline flushes (optimizer steps), each micro-batch run through the stage's layers
    `layer_passes` times (1: forward, 3: fwd+bwd, 4: fwd+bwd with recompute); `graphed`: the layer
    passes are CUDA graph replays (parallel.train_cuda_graphs, PP = 1: no bubble). `lora_bytes`:
    the LoRA adapters' activation traffic of the whole stage on this GPU (GPU side, at HBM
    bandwidth x lora_bw_efficiency); with it, eager layer passes also pay the adapters' launches
    (`lora_layer_pass_s` per layer pass; graphed, they are inside the replay). `eager_micro` of
    the graphed micro-batches run the eager layers instead (too small to pad to the shape)."""
    layers = shape.num_layers // layout.pp_t
    bubble = (layout.pp_t - 1) * flushes / micro
    overhead = layers * micro * layer_passes
    eager = layers * (eager_micro if graphed else micro) * layer_passes
    t.add("compute", coef, ideal)
    t.add("layer_overhead", "layer_pass_overhead_s", eager)
    t.add("layer_overhead", "graphed_layer_pass_s", overhead - eager)
    t.add("pp_bubble", coef, ideal * bubble)
    t.add("pp_bubble", "layer_pass_overhead_s", eager * bubble)
    t.add("pp_bubble", "graphed_layer_pass_s", (overhead - eager) * bubble)
    if lora_bytes:
        traffic = lora_bytes / (gpu.hbm_gbps * 1e9)
        t.add("lora", "inv_lora_bw_eff", traffic)
        t.add("pp_bubble", "inv_lora_bw_eff", traffic * bubble)
        t.add("lora", "lora_layer_pass_s", eager)
        t.add("pp_bubble", "lora_layer_pass_s", eager * bubble)
    # SP: a layer's forward all-gathers twice and reduce-scatters twice (the bytes of 2 all-reduces);
    # backward mirrors it (twice the launches, the same collectives), recompute repeats the forward.
    comm_passes = max(1, layer_passes - 1)
    _tp_comm(t, shape, gpu, layout.tp_t, layers, tokens, all_reduces=2 * comm_passes,
             num_collectives=4 * comm_passes * layers * micro, fitted_latency=True)
    _ep_comm(t, shape, gpu, layout, ep, tokens, comm_passes=comm_passes)
    if shape.moe.enabled and not grouped_gemm:  # SequentialMLP: each local expert in turn
        local = shape.moe.num_experts // ep
        t.add("expert_overhead", "expert_pass_s", overhead * (1 + bubble) * local)


def _ep_comm(t: StageTerms, shape: ModelConfig, gpu: GPU, layout: Layout, ep: int, tokens: float,
             *, comm_passes: int) -> None:
    """MoE all-to-all under EP: per layer pass each token's hidden state to its top_k experts and
    back ((EP - 1) / EP of it off the rank), over the EP x TP ranks' link (IB once they span
    nodes); a rank sends its own sequence-parallel slice of the tokens (1 / TP of them); serial
    with compute (megatron-core's alltoall dispatcher does not overlap it)."""
    if ep == 1 or not shape.moe.enabled:
        return
    bw, _ = _link(gpu, ep * layout.tp_t)
    volume = (comm_passes * tokens * shape.all_to_all_bytes_per_token(BYTES_PER_PARAM)
              / (layout.pp_t * layout.tp_t) * (ep - 1) / ep)
    t.add("ep_comm", "inv_comm_eff", volume / bw)


def _matmul_flops(shape: ModelConfig, role: str, tokens: float, head_tokens: float) -> float:
    """One forward's matmul FLOPs: 2 per weight per computed token, the LM head's at its head
    positions (also the weight gradients' FLOPs, which a LoRA model's frozen base skips)."""
    head = 0 if role == "critic" else shape.embedding_params
    return 2 * (dense_params(shape, role) - head) * tokens + 2 * head * head_tokens


def _lora_flops(shape: ModelConfig, role: str, rank: int, tokens: float, head_tokens: float,
                layer_passes: int) -> float:
    """What LoRA changes in an update's FLOPs: the frozen base computes no weight gradients (one
    forward's matmuls fewer), the adapters add theirs (2 per adapter weight per token per pass)."""
    return (2 * lora_params(shape, rank) * layer_passes * tokens
            - _matmul_flops(shape, role, tokens, head_tokens))


def _varlen_flops(shape: ModelConfig, work: PassWork, role: str) -> float:
    """Forward FLOPs of a pass over variable-length rows: the matmuls (`_matmul_flops`), causal
    attention 2 L q_dim per (row length)^2."""
    return (_matmul_flops(shape, role, work.tokens, work.head_tokens)
            + 2 * shape.num_layers * shape.q_dim * work.attention)


def _masked(t: StageTerms, layout: Layout, shape: ModelConfig, gpu: GPU, work: PassWork | None,
            kernels: int, repeat: int = 1) -> None:
    """Masked attention's own cost: the attention FLOPs of the micro-batches whose rows differ in
    length (2 L q_dim per attended token pair, forward) once more per attention kernel (`kernels`:
    1 forward, 2 forward + backward, 3 with recompute) at `masked_attention_efficiency`."""
    if work is not None and work.masked_attention:
        flops = 2 * shape.num_layers * shape.q_dim * work.masked_attention / (layout.tp_t * layout.pp_t)
        t.add("masked_attention", "inv_masked_attn_eff",
              repeat * kernels * flops / (gpu.bf16_tflops * 1e12))


def _multiple(layout: Layout) -> int:
    return layout.tp_t if layout.tp_t > 1 else 1   # SP: a micro-batch's length divides by TP


def _lora_rank(w: Workload, role: str) -> int:
    return w.critic_lora_rank if role == "critic" else w.lora_rank


def _lora_bytes(shape: ModelConfig, layout: Layout, tokens: float, passes: str) -> float:
    """The adapters' activation bytes on one GPU over `tokens` tokens of its stage's layers;
    `passes`: "f" forward, "fb" forward + backward, "ffb" with recompute."""
    fwd, bwd = lora_bytes_per_token_layer(shape, layout.tp_t)
    per_token = passes.count("f") * fwd + passes.count("b") * bwd
    return tokens * per_token * shape.num_layers / layout.pp_t


def _forward(shape: ModelConfig, gpu: GPU, layout: Layout, w: Workload, role: str,
             ep: int = 1, adapters: bool = False) -> StageTerms:
    """A forward-only pass of `role`; `adapters`: a LoRA model's pass with its adapters on (the
    old_log_prob and values passes; a LoRA actor's reference pass turns them off)."""
    t, shard = StageTerms(overlap="pass"), layout.tp_t * layout.pp_t
    seqs = math.ceil(w.num_sequences / layout.dp_t)
    work = None
    if w.varlen:
        work = pass_work(w, seqs, w.forward_micro_batch_tokens or w.micro_batch_tokens,
                         _multiple(layout))
        micro, tokens, flops = work.micro, work.tokens, _varlen_flops(shape, work, role) / shard
    else:
        micro, tokens = math.ceil(seqs / w.seqs_per_forward_micro_batch), seqs * w.seq_len
        flops = seqs * w.seq_len * forward_flops_per_token(shape, w.seq_len, role,
                                                           w.head_fraction) / shard
    lora = _lora_bytes(shape, layout, tokens, "f") if adapters and _lora_rank(w, role) else 0.0
    coef = "inv_fused_forward_mfu" if w.fused_elementwise else "inv_forward_mfu"
    _passes(t, shape, gpu, layout, ideal=flops / (gpu.bf16_tflops * 1e12), coef=coef,
            tokens=tokens, micro=micro, flushes=1, layer_passes=1, ep=ep,
            grouped_gemm=w.moe_grouped_gemm, lora_bytes=lora)
    _masked(t, layout, shape, gpu, work, 1)
    return t


def _update(shape: ModelConfig, gpu: GPU, plan: Plan, w: Workload, role: str) -> StageTerms:
    layout = plan.layout
    t, shard = StageTerms(overlap="pass"), layout.tp_t * layout.pp_t
    opt_steps = w.ppo_epochs * w.mini_batches
    layer_passes = 4 if plan.recompute else 3
    per_mini = math.ceil(w.num_sequences / w.mini_batches / layout.dp_t)
    work = None
    if w.varlen:
        # the update's CUDA graphs pad each packed micro-batch to the budget (models/graphs.py)
        # (they capture varlen: under fa4 too, the graphed micro-batches are varlen's)
        padded = (w.train_cuda_graphs and w.pack_sequences
                  and w.packed_attention in ("varlen", "fa4"))
        work = pass_work(w, per_mini, w.micro_batch_tokens, _multiple(layout), padded)
        micro, tokens = work.micro, opt_steps * work.tokens
        flops = opt_steps * (layer_passes * _varlen_flops(shape, work, role) / shard)
        head_tokens = opt_steps * work.head_tokens
    else:
        micro = w.num_micro_batches(layout.dp_t)                 # per optimizer step
        seqs = opt_steps * per_mini
        tokens, head_tokens = seqs * w.seq_len, seqs * w.seq_len * w.head_fraction
        flops = seqs * w.seq_len * train_flops_per_token(shape, w.seq_len, role, plan.recompute,
                                                         w.head_fraction) / shard
    if w.lm_head_chunk_tokens and role != "critic":  # each chunk's logits made again in backward
        flops += head_tokens * 2 * shape.embedding_params / shard
    rank, lora = _lora_rank(w, role), 0.0
    if rank:  # LoRA: its FLOPs and the adapters' activation traffic
        flops += _lora_flops(shape, role, rank, tokens, head_tokens, layer_passes) / shard
        lora = _lora_bytes(shape, layout, tokens, "ffb" if plan.recompute else "fb")
    coef = "inv_fused_train_mfu" if w.fused_elementwise else "inv_train_mfu"
    _passes(t, shape, gpu, layout, ideal=flops / (gpu.bf16_tflops * 1e12), coef=coef,
            tokens=tokens, micro=opt_steps * micro, flushes=opt_steps,
            layer_passes=layer_passes, graphed=w.train_cuda_graphs, ep=plan.ep,
            grouped_gemm=w.moe_grouped_gemm, lora_bytes=lora,
            eager_micro=opt_steps * work.eager_micro if work is not None else 0)
    _masked(t, layout, shape, gpu, work, layer_passes - 1, repeat=opt_steps)
    params = shape.num_params if role == "actor" else shape.num_critic_params
    fused = shape.attn_matmul_params if shape.moe.enabled else shape.layer_matmul_params
    accumulated = params - (shape.num_layers * fused  # (experts keep Megatron's linears)
                            if w.gradient_accumulation_fusion else 0)
    if rank:  # only the adapters (and a critic's value head) train; with the fusion their
        # gradients go into main_grad inside their own GEMMs
        params = lora_params(shape, rank) + (shape.hidden_size + 1 if role == "critic" else 0)
        accumulated = 0 if w.gradient_accumulation_fusion else params
    t.add("grad_accum", None, opt_steps * micro * GRAD_ACCUM_BYTES_PER_PARAM * accumulated / shard
          / (gpu.hbm_gbps * 1e9 * GRAD_ACCUM_BW_EFF))
    t.add("optimizer", "optimizer_step_s", opt_steps)
    t.add("optimizer", None, opt_steps * ADAM_BYTES_PER_PARAM * params / (shard * layout.dp_t)
          / (gpu.hbm_gbps * 1e9))
    if layout.dp_t > 1:
        bw, lat = _link(gpu, layout.world_size)
        volume = opt_steps * (4 + BYTES_PER_PARAM) * params / shard * (layout.dp_t - 1) / layout.dp_t
        t.add("dp_comm", "inv_comm_eff", volume / bw)
        t.add("latency", None, 2 * opt_steps * lat)
    return t


def offload_params_copies(shape: ModelConfig, plan: Plan, w: Workload,
                          stages) -> list[tuple[str, str, float]]:
    """actor.offload_params: the PCIe copies of the actor's weights in one step, as the trainer
    makes them: (stage, "d2h" or "h2d", bytes per GPU). A drop copies to the host only what
    changed since the last copy (full training: every weight once a step, the optimizer step
    changed them; LoRA's frozen base has its host copy from the first step); a return copies
    back. With G the bytes leaving in generation (the generator owns its matrices) and L the
    whole shard:
    - gen: G to the host; a quantized rollout in place reads them back one matrix at a time to
      quantize them (G again, host to device); and G back after generation, behind the reward,
      unless a later pass keeps the weights away until the actor's update (the old_log_prob pass
      skipped, and a reference model's pass or a critic to come: RolloutStage
      params_back_after_gen);
    - ref / values (the first of them the step runs, when the weights leave for it): L - G to the
      host (L when G stayed), and L back at the actor's update with a critic, else behind the
      advantages (counted in `ref`)."""
    from hybridflow.cost.memory import offloaded_params_bytes

    full = not w.lora_rank
    gen = offloaded_params_bytes(shape, plan, w, "gen") if "gen" in stages else 0.0
    out = next((p for p in ("ref", "values") if p in stages
                and offloaded_params_bytes(shape, plan, w, p)), None)
    # the trainer's LoRA reference (the actor's base) reads the weights: they come back after gen
    held = (out is not None and w.skip_old_log_prob
            and not (w.lora_rank and w.use_reference))
    copies = []
    if gen:
        copies += [("gen", "d2h", gen)] if full else []
        copies += [("gen", "h2d", gen)] if not plan.layout.needs_reshard else []  # quantize
        copies += [] if held else [("gen", "h2d", gen)]
    if out is not None:
        local = offloaded_params_bytes(shape, plan, w, out)
        copies += [(out, "d2h", local - gen)] if full and local > gen else []
        copies.append(("update_actor" if w.has_critic else out, "h2d", local))
    return copies


def stage_terms(shape: ModelConfig, gpu: GPU, plan: Plan, w: Workload,
                calib: Calibration) -> dict[str, StageTerms]:
    """The linear terms of every stage the step runs, in the trainer's order."""
    layout = plan.layout
    stages = {"reshard": _reshard(shape, gpu, plan, w), "gen": _gen(shape, gpu, plan, w, calib)}
    if not w.skip_old_log_prob:
        stages["old_log_prob"] = _forward(shape, gpu, layout, w, "actor", plan.ep, adapters=True)
    if w.use_reference:
        stages["ref"] = _forward(shape, gpu, layout, w, "actor", plan.ep)
        if plan.offload_ref and not w.offload_ref_prefetch:  # else hidden behind generation
            stages["ref"].add("pcie", None, BYTES_PER_PARAM * shape.num_params
                              / (layout.tp_t * layout.pp_t) / (gpu.pcie_gbps * 1e9))
    if w.has_critic:
        stages["values"] = _forward(shape, gpu, layout, w, "critic", adapters=True)
        stages["update_critic"] = _update(shape, gpu, plan, w, "critic")
    stages["update_actor"] = _update(shape, gpu, plan, w, "actor")
    for stage, _, nbytes in offload_params_copies(shape, plan, w, stages):
        stages[stage].add("pcie", None, nbytes / (gpu.pcie_gbps * 1e9))
    stages["other"] = StageTerms([("step_overhead", "step_overhead_s", 1.0)])
    if w.lora_rank:  # the training weights restored after generation (models/lora.py)
        params = lora_merge_work(shape, layout.tp_t)[0] / layout.pp_t
        stages["other"].add("lora_unmerge", None, LORA_UNMERGE_BYTES_PER_PARAM * params
                            / (gpu.hbm_gbps * 1e9 * GRAD_ACCUM_BW_EFF))
    # reward, advantages and bookkeeping per generated row of this rank; reward.score_in_pass
    # hides it in the first forward-only pass
    if not (w.reward_in_pass and any(s in stages for s in FORWARD_STAGES)):
        stages["other"].add("row_overhead", "row_overhead_s",
                            math.ceil(w.num_sequences * w.gen_prompt_factor / layout.dp_t))
    return stages


def stage_breakdown(shape: ModelConfig, gpu: GPU, plan: Plan, w: Workload,
                    calib: Calibration) -> dict[str, dict[str, float]]:
    """stage -> part label (compute, pp_bubble, tp_comm, ...) -> seconds."""
    coefs = calib.coefs()
    return {k: t.breakdown(coefs) for k, t in stage_terms(shape, gpu, plan, w, calib).items()}


def step_seconds(shape: ModelConfig, gpu: GPU, plan: Plan, w: Workload,
                 calib: Calibration) -> dict[str, float]:
    """Seconds per stage (keys as the trainer's `timing_s/<stage>`; "other": reward, advantages,
    bookkeeping), plus their sum under "step"."""
    out = {k: sum(parts.values()) for k, parts in stage_breakdown(shape, gpu, plan, w, calib).items()}
    out["step"] = sum(out.values())
    return out


def actor_model_flops(shape: ModelConfig, w: Workload) -> float:
    """Useful FLOPs of the actor update in one step (no recompute), for MFU; with LoRA, without
    the frozen base's weight gradients and with the adapters' own."""
    tokens = w.ppo_epochs * w.tokens_per_step
    flops = tokens * train_flops_per_token(shape, w.seq_len, head_fraction=w.head_fraction)
    if w.lora_rank:
        flops += _lora_flops(shape, "actor", w.lora_rank, tokens, tokens * w.head_fraction, 3)
    return flops
