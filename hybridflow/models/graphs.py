"""Per-layer CUDA graphs for the training forward+backward of a GPTModel at one static shape.

Without transformer-engine a Megatron layer is ~100 small kernel launches forward and backward, each
behind several Python frames; at RL micro-batch sizes the GPU then waits on the CPU. Here each
transformer layer's forward and backward are captured once with `torch.cuda.make_graphed_callables`
(all layers in one call: one shared memory pool, captured in forward order, backward in reverse) and
replayed as one launch each. The layers keep their modules, parameter names and hooks: only the
instance's `forward` is wrapped, and it replays the graph only for calls that match the capture:
  grad enabled, module in training mode, hidden states of the captured shape/dtype/device, no mask
  (causal), the captured rotary table shape and no other per-call inputs (KV cache, packing, ...).
Anything else (eval, no_grad log-prob passes, a different length, generation) runs the eager layer.

Constraints (checked where they can be): capture after DDP has moved parameters into its buffers
(graphs hold raw addresses); PP=1, since a graph holds one micro-batch's activations and needs each
forward to be followed by its backward before the next forward (true for Megatron's no-pipelining
schedule, not for 1F1B's warm-up forwards); no dropout (graphs would replay the same random mask).
Weight gradients are returned by the graphed backward like any autograd output, so DDP's
grad-accumulation hooks see them as usual; they alias the graph's static buffers until the next
replay, so they must be consumed before the next backward (Megatron DDP adds them into `main_grad`
in its hook and drops `.grad`; plain accumulation into `.grad` across micro-batches would not work).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer

_PER_CALL_INPUTS = ("context", "context_mask", "rotary_pos_cos", "rotary_pos_sin",
                    "rotary_pos_cos_sin", "attention_bias", "inference_context", "packed_seq_params",
                    "sequence_len_offset", "padding_mask")


class _LayerCall(torch.nn.Module):
    """(hidden (s, b, h), rotary (s, 1, 1, d)) -> hidden: one layer as a graphable module."""

    def __init__(self, layer: TransformerLayer):
        super().__init__()
        self.layer = layer

    def forward(self, hidden, rotary):
        out, _ = TransformerLayer.forward(self.layer, hidden_states=hidden, attention_mask=None,
                                          rotary_pos_emb=rotary)
        return out


def graph_layers(model, *, micro_batch_size: int, seq_len: int, num_warmup_iters: int = 2) -> None:
    """Capture every decoder layer of `model` (a GPTModel stage, training mode, on CUDA) for input
    (seq_len, micro_batch_size, hidden) and route matching calls to the graphs."""
    cfg = model.config
    if cfg.pipeline_model_parallel_size > 1:
        raise ValueError("graph_layers needs pipeline_model_parallel_size=1 (1F1B keeps several "
                         "micro-batches in flight; a graph holds one)")
    if cfg.hidden_dropout > 0 or cfg.attention_dropout > 0:
        raise ValueError("graph_layers needs hidden_dropout=attention_dropout=0")
    if not model.training:
        raise ValueError("graph_layers captures the training pass: call model.train() first")
    layers = list(model.decoder.layers)
    if not layers:
        return
    tp = cfg.tensor_model_parallel_size
    s_local = seq_len // tp if cfg.sequence_parallel else seq_len
    device = next(model.parameters()).device
    # (s, 1, 1, d) float32; the same lru-cached tensor GPTModel.forward gets, so no copy per replay
    rotary = model.rotary_pos_emb(seq_len, packed_seq=False, cp_group=None)
    shape = (s_local, micro_batch_size, cfg.hidden_size)
    calls = tuple(_LayerCall(layer) for layer in layers)
    samples = tuple((torch.randn(shape, device=device, dtype=cfg.params_dtype, requires_grad=True),
                     rotary) for _ in calls)
    graphed = torch.cuda.make_graphed_callables(calls, samples, num_warmup_iters=num_warmup_iters)
    for layer, g in zip(layers, graphed):
        layer.forward = _dispatch(layer.forward, g, shape=shape, dtype=cfg.params_dtype,
                                  rotary_shape=tuple(rotary.shape))


def ungraph_layers(model) -> None:
    """Back to the eager layers (frees nothing the graphs' pool still holds until they are GC'd)."""
    for layer in model.decoder.layers:
        layer.__dict__.pop("forward", None)


def _dispatch(eager, graphed, *, shape, dtype, rotary_shape):
    def forward(hidden_states, attention_mask=None, rotary_pos_emb=None, **kwargs):
        if (torch.is_grad_enabled() and eager.__self__.training and attention_mask is None
                and tuple(hidden_states.shape) == shape and hidden_states.dtype == dtype
                and hidden_states.is_cuda and isinstance(rotary_pos_emb, torch.Tensor)
                and tuple(rotary_pos_emb.shape) == rotary_shape
                and all(kwargs.get(k) is None for k in _PER_CALL_INPUTS)):
            return graphed(hidden_states, rotary_pos_emb), kwargs.get("context")
        return eager(hidden_states=hidden_states, attention_mask=attention_mask,
                     rotary_pos_emb=rotary_pos_emb, **kwargs)

    return forward
