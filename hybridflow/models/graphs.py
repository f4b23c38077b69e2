"""Per-layer CUDA graphs for the training forward+backward of a GPTModel at one static shape.

Without transformer-engine a Megatron layer is ~100 small kernel launches forward and backward, each
behind several Python frames; at RL micro-batch sizes the GPU then waits on the CPU. Here each
transformer layer's forward and backward are captured once with `torch.cuda.make_graphed_callables`
(all layers in one call: one shared memory pool, captured in forward order, backward in reverse) and
replayed as one launch each. The layers keep their modules, parameter names and hooks: only the
instance's `forward` is wrapped, and it replays the graph only for calls that match the capture:
  grad enabled, module in training mode, hidden states of the captured shape/dtype/device, no mask
  (causal; a packed capture: its own documents, below), the captured rotary table shape and no
  other per-call inputs (KV cache, ...).
Anything else (eval, no_grad log-prob passes, a different length, generation) runs the eager layer.
Packed micro-batches (one row of variable-length documents, torch's varlen FlashAttention) replay
graphs captured at one `PackedShape` (hybridflow/data/packing.py): the engine pads each packed row
to its length, with a fixed count of documents (empty ones at the end) and a fixed longest one,
writes its cu_seqlens into the capture's static buffer and passes the capture's `PackedDocuments`
itself, which is what a call must carry to replay.

Constraints (checked where they can be): capture after DDP has moved parameters into its buffers
(graphs hold raw addresses); PP=1, since a graph holds one micro-batch's activations and needs each
forward to be followed by its backward before the next forward (true for Megatron's no-pipelining
schedule, not for 1F1B's warm-up forwards); no dropout (graphs would replay the same random mask).
Weight gradients, two ways:
- parameters with Megatron DDP's `main_grad` (the trainer's Engine): each layer's captured backward
  adds its weight gradients into `main_grad` itself (what DDP's hook does eagerly, the same
  `main_grad.add_(grad)`; linears with fused accumulation, models/linear.py, have done it in their
  backward GEMM and give no gradient), and only the input gradient leaves the graph. The warm-up
  passes before the capture run that backward for real: the caller zeroes `main_grad` after. The
  bf16 gradients are then temporaries of the capture, whose memory the next layers' captures reuse from the shared
  pool, instead of static outputs held for the run (the layers' weights over again in bf16: 2.4
  GiB at Qwen2-1.5B, 13 GiB at 8B). DDP's hooks do not fire for these parameters (they are not
  inputs of the replaying autograd function); its grad reduction after backward
  (`finalize_model_grads`, overlap_grad_reduce off) reads `main_grad` as before.
- plain parameters: `torch.cuda.make_graphed_callables`, whose backward returns the weight
  gradients like any autograd output; they alias the graph's static buffers until the next replay,
  so they must be consumed before the next backward (plain accumulation into `.grad` across
  micro-batches would not work).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer


def capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream (never without CUDA)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


_PER_CALL_INPUTS = ("context", "context_mask", "rotary_pos_cos", "rotary_pos_sin",
                    "rotary_pos_cos_sin", "attention_bias", "inference_context", "packed_seq_params",
                    "sequence_len_offset", "padding_mask")


class _LayerCall(torch.nn.Module):
    """(hidden (s, b, h), rotary (s, 1, 1, d)) -> hidden: one layer as a graphable module (`docs`:
    the static PackedDocuments of a packed capture, else causal without a mask)."""

    def __init__(self, layer: TransformerLayer, docs=None):
        super().__init__()
        self.layer, self.docs = layer, docs

    def forward(self, hidden, rotary):
        out, _ = TransformerLayer.forward(self.layer, hidden_states=hidden, attention_mask=self.docs,
                                          rotary_pos_emb=rotary)
        return out


def graph_layers(model, *, micro_batch_size: int, seq_len: int, docs=None,
                 num_warmup_iters: int = 2) -> None:
    """Capture every decoder layer of `model` (a GPTModel stage, training mode, on CUDA) for input
    (seq_len, micro_batch_size, hidden) and route matching calls to the graphs. `docs`: a packed
    capture (micro_batch_size 1): the PackedDocuments (static cu_seqlens buffer holding a valid
    layout, fixed max_seqlen) that the calls to replay pass as their attention mask."""
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
    if docs is not None and micro_batch_size != 1:
        raise ValueError("graph_layers: a packed capture is one row (micro_batch_size=1)")
    calls = tuple(_LayerCall(layer, docs) for layer in layers)
    samples = tuple((torch.randn(shape, device=device, dtype=cfg.params_dtype, requires_grad=True),
                     rotary) for _ in calls)
    params = [tuple(p for p in layer.parameters() if p.requires_grad) for layer in layers]
    if all(hasattr(p, "main_grad") for ps in params for p in ps):
        graphed = _capture_into_main_grad(calls, samples, params, num_warmup_iters)
    else:
        graphed = torch.cuda.make_graphed_callables(calls, samples,
                                                    num_warmup_iters=num_warmup_iters)
    for layer, g in zip(layers, graphed):
        layer.forward = _dispatch(layer.forward, g, shape=shape, dtype=cfg.params_dtype,
                                  rotary_shape=tuple(rotary.shape), docs=docs)


def _layer_backward(out, x, params, grad_out):
    """A layer's backward that adds its weight gradients into `main_grad` and returns the input
    gradient; the weight gradients die with this frame (in a capture: freed into the pool)."""
    grads = torch.autograd.grad(out, (x, *params), grad_out, allow_unused=True)
    for p, g in zip(params, grads[1:]):
        if g is not None:
            p.main_grad.add_(g)
    return grads[0]


class _Replay(torch.autograd.Function):
    """(hidden, rotary) -> hidden through one layer's captured forward and backward graphs.
    `anchor`: a leaf that requires a gradient, an input only so that autograd records the node
    when the hidden states need none (a frozen embedding under LoRA: the layers' adapters still
    train, inside the graph); it gets no gradient, and it is no parameter (no DDP hook fires)."""

    @staticmethod
    def forward(ctx, graphs, hidden, rotary, anchor):
        for static, new in ((graphs.x, hidden), (graphs.rotary, rotary)):
            if static.data_ptr() != new.data_ptr():
                static.copy_(new)
        graphs.fwd.replay()
        ctx.graphs = graphs
        return graphs.out.detach()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        g = ctx.graphs
        if g.grad_out.data_ptr() != grad.data_ptr():
            g.grad_out.copy_(grad)
        g.bwd.replay()
        return None, g.grad_in.detach(), None, None


class _LayerGraphs:
    """One layer's graphs and the static tensors they read and write."""

    def __init__(self, x, rotary, anchor):
        self.x, self.rotary, self.anchor = x, rotary, anchor
        self.fwd, self.bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        self.out = self.grad_out = self.grad_in = None

    def __call__(self, hidden, rotary):
        return _Replay.apply(self, hidden, rotary, self.anchor)


def _capture_into_main_grad(calls, samples, params, num_warmup_iters: int) -> list:
    """make_graphed_callables' procedure (warm-up on a side stream; forwards captured in order,
    backwards in reverse, one memory pool) with the weight gradients added into `main_grad`
    inside each backward graph."""
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.Stream()):  # lazy init (cuDNN plans, compiles) out of captures
        for call, (x, rotary), ps in zip(calls, samples, params):
            for _ in range(num_warmup_iters):
                out = call(x, rotary)
                torch.autograd.grad(out, (x, *ps), torch.empty_like(out), allow_unused=True)
        # the last warm-up graph would keep its layer's gradient-accumulator nodes, made on the
        # warm-up stream, alive into that layer's capture on another stream
        out = None
    torch.cuda.synchronize()
    pool = torch.cuda.graph_pool_handle()
    anchor = torch.zeros((), device=samples[0][0].device, requires_grad=True)
    graphs = [_LayerGraphs(x, rotary, anchor) for x, rotary in samples]
    for call, g in zip(calls, graphs):
        with torch.cuda.graph(g.fwd, pool=pool):
            g.out = call(g.x, g.rotary)
    for g, ps in zip(reversed(graphs), reversed(params)):
        g.grad_out = torch.empty_like(g.out)
        with torch.cuda.graph(g.bwd, pool=pool):
            g.grad_in = _layer_backward(g.out, g.x, ps, g.grad_out)
        # keep the storage, drop the captured autograd graph: it held the parameters' gradient
        # accumulator nodes made on the capture stream, which eager passes (other shapes) would
        # then use across streams
        g.out = g.out.detach()
    return graphs


def ungraph_layers(model) -> None:
    """Back to the eager layers (frees nothing the graphs' pool still holds until they are GC'd)."""
    for layer in model.decoder.layers:
        layer.__dict__.pop("forward", None)


def _dispatch(eager, graphed, *, shape, dtype, rotary_shape, docs=None):
    def forward(hidden_states, attention_mask=None, rotary_pos_emb=None, **kwargs):
        if (torch.is_grad_enabled() and eager.__self__.training and attention_mask is docs
                and tuple(hidden_states.shape) == shape and hidden_states.dtype == dtype
                and hidden_states.is_cuda and isinstance(rotary_pos_emb, torch.Tensor)
                and tuple(rotary_pos_emb.shape) == rotary_shape
                and all(kwargs.get(k) is None for k in _PER_CALL_INPUTS)):
            return graphed(hidden_states, rotary_pos_emb), kwargs.get("context")
        return eager(hidden_states=hidden_states, attention_mask=attention_mask,
                     rotary_pos_emb=rotary_pos_emb, **kwargs)

    return forward
