"""Efficiency factors that turn ideal seconds (peak FLOP/s, peak bandwidth) into predicted seconds.

The estimator uses the fit to our H200 records (`shipped_calibration()`, calibration_h200.json)
unless given another. The dataclass defaults below are the priors of a fit (what a coefficient keeps
when no record informs it), and why (fit your own with `python -m hybridflow.cost.calibrate`; the
shipped fit's values and where its records come from are in docs/perf_log.md):
- train_mfu 0.35: fraction of dense bf16 peak reached by fwd+bwd in the update phases; Megatron with
  flash attention reaches 0.35-0.5 on 7B+ models. The fixed per-layer host cost below is charged
  apart and overlaps the FLOP time (overlap_p below), so a fit may put the MFUs well above this
  prior for small models at RL micro-batch sizes.
- forward_mfu 0.40: the same for forward-only passes (old_log_prob, ref, values).
- fused_train_mfu 0.45, fused_forward_mfu 0.50: train_mfu / forward_mfu of the passes with
  parallel.fused_elementwise (Workload.fused_elementwise: RoPE and SwiGLU fused, the trainer's
  default): unfused, Megatron's RoPE and SwiGLU are a dozen small memory-bound kernels per layer,
  a large share of a small model's forward pass, so the fused passes get their own coefficients.
- prefill_efficiency 0.50: fraction of peak FLOP/s in generation's matmuls (prefill and the compute
  part of decode); a large bf16 matmul on an H200 reaches about 0.8 of peak at best.
- decode_bw_efficiency 0.60: fraction of HBM bandwidth when a decode step reads its weight shard and
  KV cache; a device-to-device copy on an H200 reaches about 0.9 of peak at best.
- decode_layer_overhead_s 1e-4: fixed seconds per transformer layer per decode step of the
  CUDA-graph-replayed decode loop: the GPU-side latency of a layer's small kernels at decode batch
  sizes, with sampling and the stop check folded in. Per layer, not per step: across model sizes the
  decode steps leave a residual after the weight reads that grows with depth, not a constant. The
  plain megatron KV-cache loop without graphs is host-bound, some 20x slower per layer: use ~2e-3
  for such an engine.
- fused_decode_layer_overhead_s 5e-5: decode_layer_overhead_s of the decode step with the Triton
  decode kernels (rollout.decode_kernels=triton: RoPE + KV writes in one kernel, split-KV
  attention; Workload.decode_kernels), fewer and larger kernels per layer; the records that measure
  it also ran compile_decode=true.
- comm_efficiency 0.66: fraction of link bandwidth a collective reaches; an all_gather between two
  H200s over NVLink reaches about two thirds of the 450 GB/s per direction.
- layer_pass_overhead_s 0.0005: fixed seconds per transformer layer per pass over one micro-batch in
  the forward/update stages, on top of the FLOP time: host time of launching a layer's ~100 kernels,
  which the GPU cannot hide when a micro-batch's work per layer is small (a 0.5-1.5B model at RL
  micro-batch sizes). A forward pass counts 1, fwd+bwd 3 (backward launches ~2x the kernels), 4
  with recompute. The per-micro-batch work outside the layers (LM head, loss) is folded in: with
  20-30 layers it cannot be told apart from it. Order of magnitude: about a millisecond per layer
  pass, LM head and loss included, for a 0.5B actor's eager fwd+bwd.
- graphed_layer_pass_s 5e-5: layer_pass_overhead_s of the update passes with
  parallel.train_cuda_graphs (Workload.train_cuda_graphs): a layer's forward or backward is one
  graph replay (~10-20 us of host time), and the micro-batch's eager work outside the layers
  (embedding, LM head chunks, loss: a few hundred launches) is folded in per layer as above; the
  graphs cut a small model's host time per micro-batch several-fold.
- tp_collective_s 5e-5: fixed seconds per TP collective in the forward/update stages (4 per layer
  per forward pass under sequence parallelism: 2 all-gathers, 2 reduce-scatters; 8 for fwd+bwd):
  NCCL launch and latency, ~20-50 us on NVLink. Bytes are charged apart, at link bandwidth x
  comm_efficiency. Only records with TP > 1 inform it; fits land several times above the NCCL
  figure, because each sequence-parallel gather / reduce-scatter also pays its autograd wrapper's
  host time.
- optimizer_step_s 0.02: fixed seconds per optimizer step on top of the update's passes and of
  Adam's HBM traffic (charged apart, timing.ADAM_BYTES_PER_PARAM): Megatron's grad finalization,
  norm and clipping, the per-tensor launches of the Adam step and the bf16 param copy. Without apex
  these run as per-tensor PyTorch loops (host-bound).
  Only the update stages pay it, which tells it apart from the per-layer cost. No per-stage constant
  is charged besides: the records do not show one (at DP=2 a forward stage of one micro-batch per
  rank takes as long as each of the two micro-batches of the 1-GPU run: nothing fixed per stage).
- expert_pass_s 1e-4: MoE only: fixed seconds per local expert per layer pass over one micro-batch
  in the forward/update stages when the experts are megatron-core's SequentialMLP (no
  transformer-engine: `Workload.moe_grouped_gemm` false): each expert's two GEMMs, SwiGLU and
  slicing in turn, with the token permutation around them folded in. Zero cost with grouped GEMM.
  One record (qwen3_moe_2b on one H200) informs it; it cannot tell a per-expert cost from a
  per-dispatched-row one, so extrapolating to other micro-batch sizes is uncertain.
- expert_decode_s 1e-5: MoE only: fixed seconds per expert per layer per decode step: the
  CUDA-graph decode's MoE MLP runs every expert's small GEMMs one after another
  (rollout/moe.py `dense`); their weight reads are charged apart (hbm_read).
- fp8_decode_layer_s 2e-5: rollout.quantization=fp8 only: fixed seconds per layer per decode step
  that fp8 adds over bf16 (Workload.rollout_quantization), an MoE layer half of it (its two
  quantized attention matrices of four): each of the layer's GEMMs first quantizes its activation
  rows (one more kernel), then torch._scaled_mm, whose latency at decode row counts is above
  cuBLAS's bf16 GEMM (quant_gemm_probe_h200.json: bf16 7-28 us per GEMM, latency-bound, well
  above its weight-read floor; fp8's activation pass plus GEMM a few us more per GEMM inside the
  decode graph). The halved weight bytes are still charged in `hbm_read`
  (flops.ROLLOUT_BYTES_PER_WEIGHT); at these shapes the latency, not the bytes, limits a step.
- int4_decode_efficiency 0.01: rollout.quantization=int4 only: fraction of bf16 peak at which the
  Triton weight-only int4 kernel runs the quantized layer weights' FLOPs in generation ((prefilled
  tokens + decode row-steps) x 2 x quantized params, charged on top of the bf16 model's
  generation): its cost grows with the rows, compute-bound at ~0.4-1% of peak in the probe (0.5B
  fc1: 0.17 ms at 64 rows, 0.44 ms at 256), where bf16 cuBLAS stays latency-bound.
  Both are fitted on the generation benchmark's quantized records against the same call's bf16
  records (calibrate.QUANT_GROUPS), so no trainer record moves them.
- lora_bw_efficiency 0.5: LoRA only (Workload.lora_rank, critic_lora_rank): fraction of HBM
  bandwidth at which the adapters' GEMMs move their activations (flops.lora_bytes_per_token_layer:
  each adapted linear's input and output read again, the output written again, forward and
  backward), on the GPU side of a pass. At rank 16-64 these GEMMs are skinny: their reads, not
  their FLOPs, bound them (a profiled 0.5B update: the adapters' GEMMs 579 us per layer and
  micro-batch against 845 us of the base weight gradients they spare).
- lora_layer_pass_s 4e-4: LoRA only: host seconds per layer pass that the adapters' launches add
  to an eager pass (the four adapted linears' extra GEMMs and adds, a dozen or so launches at a
  few tens of us each: the profiled update launched 50% more kernels than the full one); the
  update's CUDA graphs (train_cuda_graphs) hold them in the replay.
- lora_merge_block_s 2e-4: LoRA only: seconds per row block of the merge before generation
  (models/lora.py merged_adapters, flops.lora_merge_work): each block's dozen launches and (in
  the record it is fitted on) its host wait for the positions the unmerge must fix, which the
  merge now makes once per many blocks; the merge's bytes are charged apart
  (flops.LORA_MERGE_BYTES_PER_PARAM at HBM bandwidth x timing.GRAD_ACCUM_BW_EFF, measured for
  such mixed-dtype element-wise kernels).
  The three are fitted on the LoRA records alone, the rest held, each against the same call's
  full-parameter record where there is one (calibrate.LORA_GROUPS); no other record moves them.
- elementwise_bw_efficiency 0.6: fraction of HBM bandwidth at which a forward/update pass's
  bandwidth-bound element-wise kernels (RMSNorm, residual adds, RoPE, SwiGLU, forward and
  backward: flops.elementwise_bytes_per_token_layer) move their activations, on the GPU side of
  every pass, beside the FLOP time at the MFUs. Their cost scales with tokens x widths, not with
  FLOPs: a small model's share of them is larger than a large one's (a profiled 0.5B packed
  update on an H100: 0.40 s of such kernels of 1.41 s, about half the bandwidth's worth of these
  bytes); a streaming copy reaches about 0.9 at best, mixed-dtype reductions (RMSNorm's weight
  gradient) far less. Fitted with the MFUs on the passes (calibrate.GROUPS).
- step_overhead_s 0.02: seconds per step outside the modelled stages (the stage "other") but the
  reward: advantages, metrics, host syncs between stages; a few tens of milliseconds.
- row_overhead_s 1e-4: seconds of the stage "other" per generated row of a DP rank: the reward
  (detokenize, score); ~0.1 ms a row (a copy-task reward on 64 rows takes 6-11 ms). Fitted on the
  records' timed reward (timing_s/reward) where they have it, step_overhead_s on the rest of
  "other" (calibrate.GROUPS).
- torch_kv_efficiency 0.5: fraction of HBM bandwidth at which the PyTorch decode layer
  (rollout.decode_kernels=torch) reads the KV cache: SDPA's masked (memory-efficient) kernel with
  a group's heads as query positions and an additive mask; its weight reads stay at
  decode_bw_efficiency. The Triton decode layer's split-KV attention reads the cache with the
  weights, at decode_bw_efficiency. Fixed-length records hardly inform it (the weights are most of
  their bytes); the long-tail GSM8K records, whose decode reads 500-1,500 rows' caches, do.
- masked_attention_efficiency 0.05: masked attention's extra cost: the attention FLOPs of a
  micro-batch whose rows differ in length are charged once more per attention kernel (1 forward,
  2 fwd+bwd) at this fraction of peak, on the GPU side. Such micro-batches need an attention mask
  (a packed row's document mask under flex_attention, padded rows' explicit mask under SDPA's
  memory-efficient kernel), where rows of one length run flash attention's maskless causal kernel,
  as every fixed-length record did. Empirical: only variable-length records inform it; fitted on
  the packed GSM8K runs it predicts the unpacked token-budget runs' passes within 12%
  (docs/cost_model.md).
- memory_scale 1.0: multiplies the predicted allocated peak (fit to perf/max_memory_allocated_gb).
- activation_memory_scale 1.0: multiplies the activation component (stored activations, logits, the
  prefill scratch) before memory_scale: what the counted tensors miss per token (framework copies,
  kernel workspaces) grows with the micro-batch, the rest does not. Fitted jointly with
  memory_scale when the records' micro-batches differ enough to separate the two.
- memory_headroom_gib 4.0: memory a GPU loses to the CUDA context, NCCL buffers and allocator
  fragmentation; a layout fits when scaled peak <= memory_gib - headroom.
- overlap_p 2.0: not a prior but a form constant that the fit holds (calibrate.py takes it from its
  base and writes it out unchanged): the exponent with which two kinds of work that overlap, but
  not fully, combine (timing.py): a forward/update pass's host side and GPU side, a decode step's
  FLOPs and its weight/KV reads, as (A^p + B^p)^(1/p), between their sum (p = 1) and max
  (p = inf). p = 2.0: with the H200 records refitted at each p, 2 puts the most configs within
  15% in leave-one-out and predicts the GSM8K runs outside the fit closer than 1.5; a larger p
  fits the GPU-bound packed passes better but fewer of the host-bound small-micro-batch records,
  and p = 1 fits a train MFU near 1, which no GPU reaches (docs/cost_model.md has the scan:
  benchmarks/overlap_scan.py).
"""
from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path


@dataclass(frozen=True)
class Calibration:
    train_mfu: float = 0.35
    forward_mfu: float = 0.40
    fused_train_mfu: float = 0.45
    fused_forward_mfu: float = 0.50
    prefill_efficiency: float = 0.50
    decode_bw_efficiency: float = 0.60
    torch_kv_efficiency: float = 0.50
    decode_layer_overhead_s: float = 1e-4
    fused_decode_layer_overhead_s: float = 5e-5
    comm_efficiency: float = 0.66
    layer_pass_overhead_s: float = 0.0005
    graphed_layer_pass_s: float = 5e-5
    tp_collective_s: float = 5e-5
    optimizer_step_s: float = 0.02
    step_overhead_s: float = 0.02
    row_overhead_s: float = 1e-4
    masked_attention_efficiency: float = 0.05
    expert_pass_s: float = 1e-4
    expert_decode_s: float = 1e-5
    fp8_decode_layer_s: float = 2e-5
    int4_decode_efficiency: float = 0.01
    lora_bw_efficiency: float = 0.5
    lora_layer_pass_s: float = 4e-4
    lora_merge_block_s: float = 2e-4
    elementwise_bw_efficiency: float = 0.6
    memory_scale: float = 1.0
    activation_memory_scale: float = 1.0
    memory_headroom_gib: float = 4.0
    overlap_p: float = 2.0

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name.endswith("_s") or f.name == "memory_headroom_gib":
                if v < 0:
                    raise ValueError(f"calibration {f.name} must be >= 0, got {v}")
            elif f.name == "overlap_p":   # below 1 two overlapping parts would cost over their sum
                if not v >= 1:
                    raise ValueError(f"calibration overlap_p must be >= 1, got {v}")
            elif not v > 0:
                raise ValueError(f"calibration {f.name} must be > 0, got {v}")

    def coefs(self) -> dict[str, float]:
        """Coefficients of the linear time model: stage seconds = const + sum(x[k] * coef[k]), and
        "overlap_p", the exponent with which a stage's two overlapping sides combine
        (timing.StageTerms); no part is linear in it, and the fit holds it."""
        return {"inv_train_mfu": 1 / self.train_mfu, "inv_forward_mfu": 1 / self.forward_mfu,
                "inv_fused_train_mfu": 1 / self.fused_train_mfu,
                "inv_fused_forward_mfu": 1 / self.fused_forward_mfu,
                "inv_prefill_eff": 1 / self.prefill_efficiency,
                "inv_decode_bw_eff": 1 / self.decode_bw_efficiency,
                "inv_torch_kv_eff": 1 / self.torch_kv_efficiency,
                "decode_layer_overhead_s": self.decode_layer_overhead_s,
                "fused_decode_layer_overhead_s": self.fused_decode_layer_overhead_s,
                "inv_comm_eff": 1 / self.comm_efficiency,
                "layer_pass_overhead_s": self.layer_pass_overhead_s,
                "graphed_layer_pass_s": self.graphed_layer_pass_s,
                "tp_collective_s": self.tp_collective_s,
                "optimizer_step_s": self.optimizer_step_s, "step_overhead_s": self.step_overhead_s,
                "row_overhead_s": self.row_overhead_s,
                "inv_masked_attn_eff": 1 / self.masked_attention_efficiency,
                "expert_pass_s": self.expert_pass_s, "expert_decode_s": self.expert_decode_s,
                "fp8_decode_layer_s": self.fp8_decode_layer_s,
                "inv_int4_decode_eff": 1 / self.int4_decode_efficiency,
                "inv_lora_bw_eff": 1 / self.lora_bw_efficiency,
                "lora_layer_pass_s": self.lora_layer_pass_s,
                "lora_merge_block_s": self.lora_merge_block_s,
                "inv_elementwise_bw_eff": 1 / self.elementwise_bw_efficiency,
                "overlap_p": self.overlap_p}

    def with_coefs(self, **coefs: float) -> "Calibration":
        """The inverse of coefs(): a copy with the named coefficients replaced."""
        names = {"inv_train_mfu": "train_mfu", "inv_forward_mfu": "forward_mfu",
                 "inv_fused_train_mfu": "fused_train_mfu",
                 "inv_fused_forward_mfu": "fused_forward_mfu",
                 "inv_prefill_eff": "prefill_efficiency", "inv_decode_bw_eff": "decode_bw_efficiency",
                 "inv_torch_kv_eff": "torch_kv_efficiency",
                 "inv_masked_attn_eff": "masked_attention_efficiency",
                 "inv_comm_eff": "comm_efficiency",
                 "inv_int4_decode_eff": "int4_decode_efficiency",
                 "inv_lora_bw_eff": "lora_bw_efficiency",
                 "inv_elementwise_bw_eff": "elementwise_bw_efficiency"}
        return replace(self, **{names.get(k, k): (1 / v if k in names else v) for k, v in coefs.items()})

    def to_dict(self) -> dict:
        return asdict(self)


SHIPPED = Path(__file__).with_name("calibration_h200.json")


@functools.lru_cache(maxsize=1)
def shipped_calibration() -> Calibration:
    """The fit to our H200 records (`calibration_h200.json`, calibrate.py's output): what the
    estimator uses when given no calibration. The dataclass defaults above are the priors the fit
    starts from, not a calibration."""
    return load_calibration(SHIPPED) if SHIPPED.is_file() else Calibration()


def load_calibration(calibration: "Calibration | dict | str | Path | None") -> Calibration:
    """None (the shipped H200 fit), a Calibration, a dict of its fields, or a path to calibrate.py's
    JSON."""
    if calibration is None:
        return shipped_calibration()
    if isinstance(calibration, Calibration):
        return calibration
    where = "calibration"
    if not isinstance(calibration, dict):
        where = path = Path(calibration)
        if not path.is_file():
            raise FileNotFoundError(f"calibration file {path} not found")
        try:
            calibration = json.loads(path.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            what = (f"{e.msg}: line {e.lineno} column {e.colno}"
                    if isinstance(e, json.JSONDecodeError) else "not UTF-8 text")
            raise ValueError(f"{path}: not valid JSON ({what}); expected the calibration JSON "
                             "python -m hybridflow.cost.calibrate writes") from None
    if isinstance(calibration, dict):
        calibration = calibration.get("calibration", calibration)   # calibrate.py nests it
    if not isinstance(calibration, dict):
        raise ValueError(f"{where}: expected a JSON object of calibration values (as python -m "
                         f"hybridflow.cost.calibrate writes), got {type(calibration).__name__}")
    known = {f.name for f in fields(Calibration)}
    unknown = set(calibration) - known
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; expected some of "
                         f"{sorted(known)}")
    for key, value in calibration.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}: {key}={value!r}: expected a number")
    return Calibration(**calibration)
