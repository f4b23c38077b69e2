"""Lean tensor-parallel linears: Megatron's parameters, plain `F.linear` compute.

Megatron's `ColumnParallelLinear` / `RowParallelLinear` run every matmul through the autograd function
`LinearWithGradAccumulationAndAsyncCommunication` (global buffers, async collectives, a fused
gradient-accumulation path that needs apex). Without transformer-engine/apex that machinery buys
nothing and costs host time on every linear of every pass, which a small model's step, already
launch-bound, cannot hide. These subclasses keep the parents' constructors, parameters and attributes
(`tensor_model_parallel`, `partition_dim`, `sequence_parallel`, `allreduce`, init,
`sharded_state_dict`), so DDP, the optimizer, checkpoints and our TP param rules see the same
modules; only `forward` changes:

  column: x -> [copy_to_tp | gather_from_sp] -> F.linear -> [gather_from_tp if gather_output]
  row:    x -> [scatter_to_tp if not input_is_parallel] -> F.linear
          -> [reduce_from_tp | reduce_scatter_to_sp] (+ bias)

Collectives are Megatron's own light mapping functions, skipped entirely at TP=1 (they are
identities there). Weight gradients: with `fuse_wgrad` (parallel.gradient_accumulation_fusion, set by
the Engine on its trainable decoder layers) and a weight that has Megatron DDP's `main_grad`, the
backward GEMM adds the weight gradient into `main_grad` itself (`accumulate_wgrad`: one GEMM that
reads and writes the fp32 buffer, Megatron's gradient_accumulation_fusion done with torch's
mixed-dtype addmm instead of apex's extension) and hands autograd none for the weight, so DDP's hook
does not fire for it (overlap_grad_reduce is off; the reduction reads `main_grad`). Otherwise the
gradient lands in `param.grad` by plain autograd and DDP's hook adds it into `main_grad`: a bf16
copy of the weight gradient written, read again and added in a second, mixed-dtype pass over every
weight per micro-batch (about a tenth of the update's kernel time at small micro-batches, which the
fusion saves). Megatron's own
gradient_accumulation_fusion stays off (it needs apex). One difference from Megatron under
sequence parallelism: the column linear keeps the gathered (full-sequence) input for
its weight gradient instead of re-gathering it in backward: more activation memory, one
all-gather fewer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (gather_from_sequence_parallel_region,
                                                    gather_from_tensor_model_parallel_region,
                                                    reduce_from_tensor_model_parallel_region,
                                                    reduce_scatter_to_sequence_parallel_region,
                                                    scatter_to_tensor_model_parallel_region)

from hybridflow.models.logprob import chunked_linear_logprobs


class _CopyToTP(torch.autograd.Function):
    """Identity forward; backward all-reduces the input grad over TP.

    Megatron's copy_to_tensor_model_parallel_region all-reduces `grad.contiguous()` but returns the
    original `grad`, so a non-contiguous grad (LeanOutputLinear's transposed input) lost its TP sum.
    Here the grad is made contiguous first and the reduced tensor is what flows back."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def accumulate_wgrad(main_grad: torch.Tensor, grad: torch.Tensor, x: torch.Tensor,
                     alpha: float = 1.0) -> None:
    """main_grad (out, in) += alpha * grad (N, out)^T @ x (N, in), accumulated in main_grad's
    dtype."""
    if grad.dtype == main_grad.dtype:
        main_grad.addmm_(grad.t(), x, alpha=alpha)
    elif main_grad.is_cuda:  # bf16 inputs, fp32 accumulate and output: one cuBLAS GEMM, beta = 1
        torch.addmm(main_grad, grad.t(), x, out_dtype=main_grad.dtype, alpha=alpha, out=main_grad)
    else:  # no mixed-dtype GEMM on CPU: what autograd + DDP's hook do
        main_grad.add_(grad.t().mm(x), alpha=alpha)


class _LinearWgradIntoMainGrad(torch.autograd.Function):
    """F.linear(x, weight, bias) whose backward adds the weight gradient into weight.main_grad."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        # the buffer itself, not through the saved weight: activation recompute hands backward a
        # recomputed copy of the saved tensors, without the parameter's attributes
        ctx.main_grad = weight.main_grad
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_in = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        grad2d = grad.reshape(-1, grad.shape[-1])
        accumulate_wgrad(ctx.main_grad, grad2d, x.reshape(-1, x.shape[-1]))
        return grad_in, None, grad2d.sum(0) if ctx.has_bias else None


def _linear(layer, x, weight, bias):
    if layer.fuse_wgrad and weight.requires_grad and torch.is_grad_enabled() \
            and hasattr(weight, "main_grad"):
        return _LinearWgradIntoMainGrad.apply(x, weight, bias)
    return F.linear(x, weight, bias)


def _sharded_state_dict(layer, axes: dict, prefix, sharded_offsets, metadata):
    """Megatron's sharded state dict of the linear, with a LoRA adapter's split factors sharded
    along their TP axis (its replicated factors are replicated, as Megatron assumes by default)."""
    from megatron.core.transformer.utils import (ensure_metadata_has_dp_cp_group,
                                                 make_sharded_tensors_for_checkpoint)

    metadata = ensure_metadata_has_dp_cp_group(metadata)
    lora = layer._modules.get("lora")
    if lora is not None:
        axes = {**axes, **{f"lora.{k}": v for k, v in lora.tp_axes().items()}}
    return make_sharded_tensors_for_checkpoint(
        layer.state_dict(prefix="", keep_vars=True), prefix, axes, sharded_offsets,
        tp_group=layer.tp_group, dp_cp_group=metadata["dp_cp_group"])


def _check_supported(layer) -> None:
    cfg = layer.config
    if layer.explicit_expert_comm or cfg.gradient_accumulation_fusion \
            or cfg.defer_embedding_wgrad_compute or getattr(cfg, "cpu_offloading", False):
        raise ValueError(f"{type(layer).__name__} does not support experts, "
                         "gradient_accumulation_fusion, defer_embedding_wgrad_compute or CPU "
                         "offloading; use Megatron's linears (transformer-engine spec) for those")


class LeanColumnParallelLinear(ColumnParallelLinear):
    """Y = X A^T (+ b), A split along the output dim. Input (s, b, h) [s/tp under SP]."""

    fuse_wgrad = False  # see the module docstring

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _check_supported(self)
        self._tp = self.tp_group.size()

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None):
        x, weight = self._prepare(input_, weight)  # (s, b, h)
        bias = None if self.skip_bias_add else self.bias
        lora = self._modules.get("lora")  # models/lora.py: its own collectives on input_
        if lora is not None and lora.enabled and lora.fusable(self, weight, bias):  # TP = 1
            out = lora.fused_linear(x, weight, bias)
        else:
            out = _linear(self, x, weight, bias)  # (s, b, out/tp)
            if lora is not None and lora.enabled:
                out = lora.add_to(out, input_)
        return self._finish(out, runtime_gather_output)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return _sharded_state_dict(self, {"weight": 0, "bias": 0}, prefix, sharded_offsets,
                                   metadata)

    def _prepare(self, input_, weight):
        if weight is None:
            if self.weight is None:
                raise RuntimeError("weight was not supplied to ColumnParallelLinear forward pass "
                                   "and skip_weight_param_allocation is True.")
            weight = self.weight
        elif weight.shape != (self.output_size_per_partition, self.input_size):
            raise RuntimeError(f"supplied weight's shape is {tuple(weight.shape)}, not "
                               f"{(self.output_size_per_partition, self.input_size)} as expected")
        x = input_
        if self._tp > 1:
            if self.sequence_parallel:  # (s/tp, b, h) -> (s, b, h); backward reduce-scatters
                x = gather_from_sequence_parallel_region(x, group=self.tp_group)
            elif not self.disable_grad_reduce:  # identity; backward all-reduces the input grad
                x = _CopyToTP.apply(x, self.tp_group)
        return x, weight

    def _finish(self, out, runtime_gather_output):
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather and self._tp > 1:  # along the last dim, whatever the layout
            out = gather_from_tensor_model_parallel_region(out, group=self.tp_group)
        return out, (self.bias if self.skip_bias_add else None)


class LeanOutputLinear(LeanColumnParallelLinear):
    """GPTModel's vocab-parallel output layer, computed batch-major.

    GPTModel returns `logits.transpose(0, 1).contiguous()`: with (s, b, V) logits that is a full
    copy of the largest activation, and its backward another one (plus Megatron's `.contiguous()`
    of the transposed grad for the weight gradient). Here the matmul writes (b, s, V/tp) directly
    and returns its (s, b, V/tp) transposed view, so GPTModel's transpose-contiguous is free and the
    gradient arrives contiguous. Callers that need (s, b, V)-contiguous logits (Megatron's own
    `labels=` loss path) must not use it.

    `select` (None, or a function of the full-sequence (s, b, h) input returning (s', b', h)): the
    logits are computed only at the positions it keeps. The engine sets it around each forward so
    that only the positions that predict response tokens pay for the vocab-wide matmul and the
    log-prob pass over it (prompt positions are ~30% of a GSM8K step's tokens, the LM head ~27% of
    a Qwen2-0.5B forward's FLOPs). Under sequence parallel it applies after the gather, whose
    backward reduce-scatters the (zero-filled) full-sequence gradient as before.

    `logprobs` (None, or a LogprobSpec; parallel.lm_head_chunk_tokens): instead of logits, the
    layer returns the log-probs of `targets` at the kept positions, and the entropy with
    `with_entropy`, as (s', b', 1 or 2) fp32, computed `chunk_tokens` positions at a time
    (models/logprob.chunked_linear_logprobs): the vocab-wide logits are never held whole."""

    select = None
    logprobs = None

    @classmethod
    def adopt(cls, layer: ColumnParallelLinear) -> "LeanOutputLinear":
        """Turn GPTModel's constructed output layer into this class in place (same parameters,
        tied-weight setup and attributes: only `forward` changes)."""
        if type(layer) is not ColumnParallelLinear:
            raise ValueError(f"expected Megatron's ColumnParallelLinear, got {type(layer).__name__}")
        _check_supported(layer)
        layer.__class__ = cls
        layer._tp = layer.tp_group.size()
        return layer

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None):
        x, weight = self._prepare(input_, weight)  # (s, b, h)
        if self.select is not None:
            x = self.select(x)
        bias = None if self.skip_bias_add else self.bias
        if self.logprobs is not None:
            return self._logprobs(x, weight, bias), None
        out = F.linear(x.transpose(0, 1), weight, bias)  # (b, s, V/tp) contiguous
        out, out_bias = self._finish(out, runtime_gather_output)
        return out.transpose(0, 1), out_bias  # (s, b, V/tp) view

    def _logprobs(self, x, weight, bias):
        spec = self.logprobs
        if self.gather_output and self._tp > 1:
            raise ValueError("parallel.lm_head_chunk_tokens needs a vocab-parallel output layer "
                             "(parallel_output=True)")
        s, b, h = x.shape
        if spec.targets.shape != (s, b):
            raise ValueError(f"log-prob targets of shape {tuple(spec.targets.shape)} for "
                             f"{(s, b)} kept positions")
        res = chunked_linear_logprobs(
            x.reshape(s * b, h), weight, spec.targets.reshape(-1), bias=bias,
            tp_group=self.tp_group if self._tp > 1 else None,
            true_vocab_size=spec.true_vocab_size, temperature=spec.temperature,
            with_entropy=spec.with_entropy, chunk_tokens=spec.chunk_tokens)
        res = res if spec.with_entropy else (res,)
        return torch.stack(res, -1).view(s, b, len(res))  # (s', b', 1 or 2)


@dataclass(frozen=True)
class LogprobSpec:
    """What LeanOutputLinear.logprobs scores: targets (s', b') global ids of the kept positions."""
    targets: torch.Tensor
    true_vocab_size: int
    temperature: float
    with_entropy: bool
    chunk_tokens: int


class LeanRowParallelLinear(RowParallelLinear):
    """Y = X A^T (+ b), A split along the input dim; partial sums reduced over TP."""

    fuse_wgrad = False  # see the module docstring

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _check_supported(self)
        self._tp = self.tp_group.size()

    def forward(self, input_: torch.Tensor):
        x = input_
        if not self.input_is_parallel and self._tp > 1:
            x = scatter_to_tensor_model_parallel_region(x, group=self.tp_group)
        lora = self._modules.get("lora")  # models/lora.py: added after the base's reduction
        if lora is not None and lora.enabled and lora.fusable(self, self.weight, None):  # TP = 1
            out = lora.fused_linear(x, self.weight, None)
        else:
            out = _linear(self, x, self.weight, None)  # (s, b, h) partial sum over this rank's slice
            if self._tp > 1:
                if self.sequence_parallel:  # (s, b, h) -> (s/tp, b, h)
                    out = reduce_scatter_to_sequence_parallel_region(out, group=self.tp_group)
                else:
                    out = reduce_from_tensor_model_parallel_region(out, group=self.tp_group)
            if lora is not None and lora.enabled:
                out = lora.add_to(out, x)
        if self.skip_bias_add:
            return out, self.bias
        return (out + self.bias if self.bias is not None else out), None

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return _sharded_state_dict(self, {"weight": 1}, prefix, sharded_offsets, metadata)
