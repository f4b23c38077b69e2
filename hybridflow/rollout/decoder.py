"""Functional Llama/Qwen2/Qwen3 decoder over a Megatron GPTModel parameter dict (the generation layout).

Input: `params`, Megatron names of a PP=1 model (global layer indices), each tensor this rank's TP_g
shard (rules in `hybridflow/parallel/param_rules.py`), and the TP_g process group (None: TP_g = 1).
Running plain tensor math over that dict instead of Megatron modules is what lets the decode step
work on static buffers and be captured as one CUDA graph.

The math follows Megatron's local spec exactly (so logits match `GPTModel` to fp32 rounding):
- RMSNorm via `F.rms_norm` (the same op as the training model's torch norm).
- QKV: one column-parallel matmul (+ optional bias); rows grouped per query group
  [q heads of group g (heads_per_group * hd); k_g (hd); v_g (hd)].
- q/k norm (model.qk_layernorm, Qwen3): each q head and k RMS-normed over hd (`F.rms_norm`, the
  model's eps; one (hd,) weight for the q heads, one for k) before RoPE, as Megatron's
  q_layernorm / k_layernorm; with decode_kernels=triton inside the RoPE kernels (same math).
- RoPE: non-interleaved (rotate-half), base `rotary_base`, frequencies in fp32, applied in the
  weight dtype; llama3 `rope_scaling` supported (its factors read from the dict with Megatron's
  defaults), other scaling types raise NotImplementedError. Positions are per row (left padding).
- Attention: SDPA. Prefill: causal + key-padding mask over the prompt, grouped K/V
  (`enable_gqa`: query head j reads K/V group j // hpg, no per-head copy of K/V); with
  decode_kernels=triton its RoPE + K/V writes are one kernel too.
  Decode: the heads of one query group are folded into the query-length axis, so
  (B, groups, heads_per_group, hd) queries attend to the cached (B, groups, T, hd) keys with no
  K/V copy; an additive mask hides padding and unwritten slots.
  With `kv_len` the keys are the first kv_len columns (a strided view, no copy). With
  decode_kernels=triton the decode step's RoPE, K/V writes and split-KV attention run as one
  kernel and the rest of the layer is Triton kernels + cuBLAS too (`_decode_step_fused`;
  hybridflow/kernels/: same math, PyTorch twins).
- MLP: SwiGLU from fc1 = [gate; up] (per shard); row-parallel proj/fc2 then all-reduce over TP_g.
  With decode_kernels=triton the prefill's SwiGLU is one kernel (kernels.layer_ops.silu_mul) and the
  decode step's fc1 + SwiGLU one Triton GEMM at large batches (kernels/gemm.py).
  MoE models (model.moe): the router and experts of rollout/moe.py in `_mlp` (torch path only).
Which variant runs is decided by a `DecodeOptions` (rollout/options.py) passed in, never by module
state.
- fp8 KV cache (rollout.kv_cache_dtype=fp8, kernels/kv_fp8.py): K/V stored as E4M3 codes with a
  scale per (row, group, column); the prefill attends over its exact K/V and writes them quantized,
  a decode step writes its token's K/V quantized and attends over the dequantized cache (the fused
  kernel dequantizes block by block; the PyTorch path dequantizes the attended columns first).
- Quantized rollouts (rollout.quantization, rollout/quantize.py): a layer's qkv_w / proj / fc1 /
  fc2 may be QuantWeights; every matmul with them goes through `quantize.linear` (F.linear for a
  plain tensor; the residual adds as its `residual=`, in place). The LM head stays unquantized.
- Embedding: vocab-parallel masked lookup + all-reduce. Output: vocab-parallel matmul, all-gather
  over TP_g, padded vocab ids (>= true vocab) dropped; fp32 logits out (a decode step's stay in
  the weights' dtype for the sampler).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridflow.config import ModelConfig
from hybridflow.kernels.kv_fp8 import readable, write_columns
from hybridflow.rollout.moe import MoEWeights, load_moe, moe_mlp
from hybridflow.rollout.options import DecodeOptions
from hybridflow.rollout.quantize import QuantWeight, linear


@dataclass(frozen=True)
class Dims:
    num_layers: int
    hidden: int
    head_dim: int
    heads: int  # local (this TP rank)
    groups: int  # local query groups
    ffn: int  # local
    vocab_local: int
    vocab_start: int
    true_vocab: int
    tp_size: int
    eps: float

    @property
    def heads_per_group(self) -> int:
        return self.heads // self.groups


@dataclass
class Layer:  # the four matrices: tensors, or QuantWeights with rollout.quantization
    ln1: torch.Tensor
    qkv_w: torch.Tensor
    qkv_b: Optional[torch.Tensor]
    proj: torch.Tensor
    ln2: torch.Tensor
    fc1: torch.Tensor
    fc2: torch.Tensor
    q_norm: Optional[torch.Tensor] = None  # (hd,) with model.qk_layernorm
    k_norm: Optional[torch.Tensor] = None
    moe: Optional[MoEWeights] = None  # model.moe: the experts (fc1 / fc2 None), rollout/moe.py


@dataclass
class Weights:
    dims: Dims
    embed: torch.Tensor  # (V_local, D)
    layers: list
    final_ln: torch.Tensor
    output: torch.Tensor  # (V_local, D); the embedding when tied
    inv_freq: torch.Tensor  # (hd/2,) fp32
    group: Optional[dist.ProcessGroup]


def rope_inv_freq(cfg: ModelConfig, head_dim: int) -> torch.Tensor:
    inv = 1.0 / (float(cfg.rotary_base) ** (torch.arange(0, head_dim, 2, dtype=torch.float32)
                                            / head_dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    if kind != "llama3":
        raise NotImplementedError(f"model.rope_scaling type {kind!r}: only llama3 is supported")
    factor = float(scaling.get("factor", 8.0))
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def rope_tables(inv_freq: torch.Tensor, length: int, *, dtype, device):
    """cos (T, hd) and signed sin (T, hd) so that rope(x) = x * cos + roll(x, hd/2) * sin."""
    freqs = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)  # (T, hd/2)
    cos = torch.cat([freqs.cos(), freqs.cos()], -1)
    sin = torch.cat([-freqs.sin(), freqs.sin()], -1)
    return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)


def _get(params: dict, name: str, shape: tuple) -> torch.Tensor:
    if name not in params:
        raise ValueError(f"generation params lack {name!r}")
    t = params[name]
    if tuple(t.shape) != shape:
        raise ValueError(f"generation param {name!r} has shape {tuple(t.shape)}, expected {shape} "
                         f"for this TP_g shard")
    return t.detach()


def load_weights(cfg: ModelConfig, params: dict, *, group, true_vocab_size: int, device,
                 dtype, matrices_as_given: bool = False) -> Weights:
    """Check names/shapes of the TP_g shard dict and gather the tensors (no copy when they already
    have the device and dtype). `matrices_as_given`: the layers' dense matrices are left where
    they are (e.g. on the host, for a quantization that brings them over one at a time)."""
    tp = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    hd = cfg.head_dim
    heads, groups, ffn = (cfg.num_attention_heads // tp, cfg.num_query_groups // tp,
                          cfg.ffn_hidden_size // tp)
    D = cfg.hidden_size
    emb_name = "embedding.word_embeddings.weight"
    if emb_name not in params:
        raise ValueError(f"generation params lack {emb_name!r}")
    v_local = params[emb_name].shape[0]
    if v_local * tp < true_vocab_size:
        raise ValueError(f"{emb_name}: {v_local} rows x TP_g={tp} < true vocab {true_vocab_size}")
    conv = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    mat = (lambda t: t) if matrices_as_given else conv  # noqa: E731
    qkv_rows = groups * (heads // groups + 2) * hd
    layers = []
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        bias = q_norm = k_norm = None
        if cfg.add_qkv_bias:
            bias = conv(_get(params, p + "self_attention.linear_qkv.bias", (qkv_rows,)))
        if cfg.qk_layernorm:  # replicated over TP: every rank holds the whole (hd,) weights
            q_norm = conv(_get(params, p + "self_attention.q_layernorm.weight", (hd,)))
            k_norm = conv(_get(params, p + "self_attention.k_layernorm.weight", (hd,)))
        layers.append(Layer(
            ln1=conv(_get(params, p + "input_layernorm.weight", (D,))),
            qkv_w=mat(_get(params, p + "self_attention.linear_qkv.weight", (qkv_rows, D))),
            qkv_b=bias,
            proj=mat(_get(params, p + "self_attention.linear_proj.weight", (D, heads * hd))),
            ln2=conv(_get(params, p + "pre_mlp_layernorm.weight", (D,))),
            fc1=None if cfg.moe.enabled else mat(_get(params, p + "mlp.linear_fc1.weight",
                                                      (2 * ffn, D))),
            fc2=None if cfg.moe.enabled else mat(_get(params, p + "mlp.linear_fc2.weight",
                                                      (D, ffn))),
            q_norm=q_norm, k_norm=k_norm,
            moe=load_moe(cfg, params, p, tp=tp, get=_get, conv=conv) if cfg.moe.enabled else None))
    embed = conv(_get(params, emb_name, (v_local, D)))
    if "output_layer.weight" in params:
        output = conv(_get(params, "output_layer.weight", (v_local, D)))
    elif cfg.tie_word_embeddings:
        output = embed
    else:
        raise ValueError("generation params lack 'output_layer.weight' and "
                         "model.tie_word_embeddings is false")
    dims = Dims(num_layers=cfg.num_layers, hidden=D, head_dim=hd, heads=heads, groups=groups,
                ffn=ffn, vocab_local=v_local, vocab_start=rank * v_local,
                true_vocab=true_vocab_size, tp_size=tp, eps=cfg.norm_epsilon)
    return Weights(dims=dims, embed=embed, layers=layers,
                   final_ln=conv(_get(params, "decoder.final_layernorm.weight", (D,))),
                   output=output, inv_freq=rope_inv_freq(cfg, hd), group=group)


def weight_tensors(w: Weights) -> list:
    """Every tensor the decoder reads from `w` (not the RoPE frequencies, computed at load)."""
    out = [w.embed, w.final_ln, w.output]
    for layer in w.layers:
        out += [t for t in (layer.ln1, layer.qkv_w, layer.qkv_b, layer.proj, layer.ln2, layer.fc1,
                            layer.fc2, layer.q_norm, layer.k_norm) if t is not None]
        out += layer.moe.tensors() if layer.moe is not None else []
    return out


def _norm(x, weight, eps):
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _qk_norm(qk, q_norm, k_norm, eps):
    """[q heads; k] (..., hpg + 1, hd) with each head RMS-normed (q_norm None: unchanged)."""
    if q_norm is None:
        return qk
    hpg = qk.shape[-2] - 1
    return torch.cat([_norm(qk[..., :hpg, :], q_norm, eps), _norm(qk[..., hpg:, :], k_norm, eps)],
                     -2)


def _all_reduce(x, w: Weights):
    if w.dims.tp_size > 1:
        dist.all_reduce(x, group=w.group)
    return x


def _row_parallel_add(x, a, weight, w: Weights, lin=linear):
    """x + all_reduce(a @ weight.T); x, a 2-D. TP=1 fuses the residual add into the GEMM.
    `lin`: quantize.linear with the call's kernel choices bound."""
    if w.dims.tp_size == 1:  # in place: an out-of-place addmm first copies x (the prefill's
        return lin(a, weight, residual=x)  # (B*S, D) twice per layer); x is the caller's own
    return x + _all_reduce(lin(a, weight), w)


def embed(w: Weights, ids: torch.Tensor) -> torch.Tensor:
    """ids (...) -> (..., D), vocab-parallel masked lookup + all-reduce."""
    d = w.dims
    if d.tp_size == 1:
        return F.embedding(ids, w.embed)
    local = ids - d.vocab_start
    outside = (local < 0) | (local >= d.vocab_local)
    out = F.embedding(local.masked_fill(outside, 0), w.embed).masked_fill(outside[..., None], 0)
    return _all_reduce(out, w)


def logits(w: Weights, h: torch.Tensor, *, fp32: bool = True) -> torch.Tensor:
    """h (N, D) normed -> logits (N, true_vocab), gathered over TP_g; fp32, or (fp32=False) in the
    weights' dtype (a decode step's: the sampler reads them once, no fp32 copy of (N, V))."""
    d = w.dims
    local = F.linear(h, w.output)  # (N, V_local)
    if d.tp_size > 1:
        full = torch.empty((d.tp_size * h.shape[0], d.vocab_local), dtype=local.dtype,
                           device=local.device)
        dist.all_gather_into_tensor(full, local.contiguous(), group=w.group)
        local = full.view(d.tp_size, h.shape[0], d.vocab_local).transpose(0, 1).reshape(
            h.shape[0], d.tp_size * d.vocab_local)
    local = local[:, :d.true_vocab]
    return local.float() if fp32 else local


def _swiglu(h, fc1, silu_mul=None, lin=linear):
    """silu(gate) * up of fc1 = [gate; up]; `silu_mul`: a one-pass kernel for it (the prefill's,
    kernels.layer_ops.silu_mul) instead of PyTorch's ops."""
    z = lin(h, fc1)
    if silu_mul is not None:
        return silu_mul(z)
    gate, up = z.chunk(2, dim=-1)
    return F.silu(gate) * up


def _mlp(x, layer: Layer, w: Weights, swiglu=_swiglu, norm=_norm, lin=linear, experts=None):
    """x + the MLP of x; `swiglu` (h, fc1) -> act and `norm` (x, weight, eps): the ops to use.
    `experts` (MoE): a buffer receiving each row's chosen experts (rows x k elements)."""
    h = norm(x, layer.ln2, w.dims.eps)
    if layer.moe is not None:  # the experts stay unquantized (rollout/moe.py)
        return x + _all_reduce(moe_mlp(h, layer.moe, experts), w)
    return _row_parallel_add(x, swiglu(h, layer.fc1), layer.fc2, w, lin)


def forward(w: Weights, ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, *,
            cos_tab: torch.Tensor, sin_tab: torch.Tensor, cache=None, cache_row0: int = 0,
            cache_col0: int = 0, last_only: bool = False,
            opts: DecodeOptions = DecodeOptions(kernels="torch"),
            experts: Optional[torch.Tensor] = None):
    """Full causal forward over left-padded rows (prefill, or the no-cache reference).

    ids, positions (B, S) int64, valid (B, S) bool (False = left padding). With `cache`, K/V land in
    columns cache_col0..cache_col0+S-1 of cache rows cache_row0.. With opts.kernels "triton"
    (resolved, with a cache): RoPE and the K/V writes as one kernel
    (kernels.layer_ops.rope_kv_prefill), the attention reading K/V from the cache, the SwiGLU in
    one pass (kernels.layer_ops.silu_mul), the RMSNorms as kernels.layer_ops.add_rms_norm.
    Returns fp32 logits (B, S, V) or, with last_only, (B, V).
    `experts` (B, S, L, k) (MoE): receives each token's chosen experts per layer.
    """
    d = w.dims
    B, S = ids.shape
    hpg, hd = d.heads_per_group, d.head_dim
    fused = opts.kernels == "triton" and cache is not None
    x = embed(w, ids.masked_fill(~valid, 0)).reshape(B * S, d.hidden)
    lin = _linear_for(opts, fused)
    swiglu, norm = functools.partial(_swiglu, lin=lin), _norm
    if fused:
        from hybridflow.kernels import layer_ops as kern

        pdl = opts.pdl
        cos, sin = cos_tab[positions], sin_tab[positions]  # (B, S, hd)
        swiglu = functools.partial(_swiglu, silu_mul=functools.partial(kern.silu_mul, pdl=pdl,
                                                                       impl="triton"), lin=lin)
        norm = lambda t, weight, eps: kern.add_rms_norm(t, None, weight, eps, pdl=pdl,  # noqa
                                                        impl="triton")[1]
    else:
        cos = cos_tab[positions][:, :, None, None]  # (B, S, 1, 1, hd)
        sin = sin_tab[positions][:, :, None, None]
    causal = torch.ones(S, S, dtype=torch.bool, device=ids.device).tril()
    eye = torch.eye(S, dtype=torch.bool, device=ids.device)
    mask = ((causal & valid[:, None, :]) | eye)[:, None]  # (B, 1, S, S); pad rows see themselves
    for i, layer in enumerate(w.layers):
        h = norm(x, layer.ln1, d.eps)
        qkv = lin(h, layer.qkv_w, layer.qkv_b).view(B, S, d.groups, hpg + 2, hd)
        if fused:
            kc, vc = cache.layer(i, cache_row0 + B, cache_row0)
            # (B, G, S, hd); fp8: a scratch pair, attended exactly, then quantized into the cache
            k, v = ((torch.empty((B, d.groups, S, hd), dtype=qkv.dtype, device=qkv.device)
                     for _ in range(2)) if cache.fp8 else (kc[:, :, cache_col0:cache_col0 + S],
                                                           vc[:, :, cache_col0:cache_col0 + S]))
            q = kern.rope_kv_prefill(qkv, cos, sin, k, v, hpg=hpg, q_norm=layer.q_norm,
                                     k_norm=layer.k_norm, eps=d.eps, pdl=pdl, impl="triton")
            q = q.view(B, S, d.heads, hd).transpose(1, 2)  # (B, H, S, hd)
            if cache.fp8:
                write_columns(kc, k, cache_col0)
                write_columns(vc, v, cache_col0)
        else:
            qk = _qk_norm(qkv[:, :, :, :hpg + 1], layer.q_norm, layer.k_norm, d.eps)
            qk = qk * cos + qk.roll(hd // 2, -1) * sin  # (B, S, G, hpg+1, hd)
            q = qk[:, :, :, :hpg].flatten(2, 3).transpose(1, 2)  # (B, H, S, hd)
            k = qk[:, :, :, hpg].transpose(1, 2)  # (B, G, S, hd)
            v = qkv[:, :, :, hpg + 1].transpose(1, 2)
            if cache is not None:
                kc, vc = cache.layer(i, cache_row0 + B, cache_row0)
                write_columns(kc, k, cache_col0)
                write_columns(vc, v, cache_col0)
        # query head j reads K/V group j // hpg (no per-head K/V copy)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=hpg > 1)
        x = _row_parallel_add(x, a.transpose(1, 2).reshape(B * S, d.heads * hd), layer.proj, w,
                              lin)
        x = _mlp(x, layer, w, swiglu, norm, lin, None if experts is None else experts[:, :, i])
    x = x.view(B, S, d.hidden)
    if last_only:
        return logits(w, _norm(x[:, -1], w.final_ln, d.eps))
    return logits(w, _norm(x, w.final_ln, d.eps).reshape(B * S, d.hidden)).view(B, S, -1)


def decode_step(w: Weights, tokens: torch.Tensor, positions: torch.Tensor, cur: torch.Tensor,
                key_valid: torch.Tensor, *, cache, cos_tab: torch.Tensor, sin_tab: torch.Tensor,
                kv_len: Optional[int] = None, opts: DecodeOptions = DecodeOptions(kernels="torch"),
                experts: Optional[torch.Tensor] = None, mark: Optional[torch.Tensor] = None,
                finished: Optional[torch.Tensor] = None):
    """One token per row against the static cache; graph-capturable (no host sync, static shapes).

    tokens, positions (B,) int64; cur (1,) int64: the cache column this token is written to, or
    (B,): row b's own column cur[b] (the multi-turn step); key_valid (B, T) bool, updated in place
    (column cur[b] of row b becomes valid; `mark` (B,) bool / int: only in the rows where it is
    set, the others' entries unchanged; every row attends to its own token either way).
    `finished` (B,) bool, each row's tokens filling the columns cur[b] - positions[b] .. cur[b] - 1
    (left-padded rows at one column, or the multi-turn step's rows at their own): the triton
    path's attention reads only those columns, and none
    for the finished rows, whose logits are then not the model's (the caller discards them); the
    torch path ignores it. `kv_len`:
    attend over cache columns 0..kv_len-1 only (the caller keeps cur < kv_len; None: all T).
    `opts` (resolved: kernels "torch" or "triton"): "torch" runs RoPE, KV writes and SDPA as PyTorch ops, with
    opts.compile each layer's pure parts compiled (TP_g = 1); "triton" the fused kernels
    (`_decode_step_fused`). Returns logits (B, V) in the weights' dtype.

    At TP = 1 a layer runs as two parts (`_layer_parts`): eager, each residual add happens inside
    its GEMM, in place on the step's own hidden state (cuBLAS adds into it: no copy of x first, as
    an out-of-place addmm makes); compiled, the MLP's output y is handed to the next layer's part,
    which adds it inside its RMSNorm kernel.
    """
    d = w.dims
    B = tokens.shape[0]
    hpg, hd = d.heads_per_group, d.head_dim
    seen = key_valid if kv_len is None else key_valid[:, :kv_len]
    if opts.kernels == "triton":  # it marks column cur valid itself
        return _decode_step_fused(w, tokens, positions, cur, seen, cache=cache, cos_tab=cos_tab,
                                  sin_tab=sin_tab, kv_len=kv_len, opts=opts, mark=mark,
                                  finished=finished)
    from hybridflow.kernels.layer_ops import mark_columns, write_column

    before = None if mark is None else key_valid.gather(1, cur.expand(B)[:, None])
    mark_columns(key_valid, cur)  # every row sees its own token
    bias = torch.zeros(seen.shape, dtype=cos_tab.dtype, device=tokens.device)
    bias = bias.masked_fill_(~seen, float("-inf"))[:, None, None, :]  # (B, 1, 1, kv_len)
    if mark is not None:  # the unmarked rows' entries as they were
        key_valid.scatter_(1, cur.expand(B)[:, None], before | mark.bool()[:, None])
    cos = cos_tab.index_select(0, positions)[:, None, None, :]  # (B, 1, 1, hd)
    sin = sin_tab.index_select(0, positions)[:, None, None, :]
    attn_in, attn_out = _layer_parts(opts)
    x, y = embed(w, tokens), None  # (B, D); the layer input is x + y (y None: x)
    for i, layer in enumerate(w.layers):
        x, qk, v = attn_in(x, y, layer.ln1, layer.qkv_w, layer.qkv_b, layer.q_norm, layer.k_norm,
                           cos, sin, d.eps, (d.groups, hpg, hd))
        kc, vc = cache.layer(i, B)
        write_column(kc, cur, qk[:, :, hpg:])
        write_column(vc, cur, v)
        if kv_len is not None:
            kc, vc = kc[:, :, :kv_len], vc[:, :, :kv_len]
        # the heads of a group act as hpg query positions sharing that group's K/V
        a = F.scaled_dot_product_attention(qk[:, :, :hpg], readable(kc, qk.dtype),
                                           readable(vc, qk.dtype), attn_mask=bias)
        a = a.reshape(B, d.heads * hd)
        if d.tp_size == 1 and layer.moe is None:
            x, y = attn_out(x, a, layer.proj, layer.ln2, layer.fc1, layer.fc2, d.eps)
        else:  # TP > 1 or MoE (attn_in added y)
            lin = _linear_for(opts, False)
            x = _mlp(_row_parallel_add(x, a, layer.proj, w, lin), layer, w,
                     functools.partial(_swiglu, lin=lin), lin=lin,
                     experts=None if experts is None else experts[:, i])
    return logits(w, _norm(x if y is None else x + y, w.final_ln, d.eps), fp32=False)


def _decode_step_fused(w: Weights, tokens, positions, cur, seen, *, cache, cos_tab, sin_tab,
                       kv_len, opts: DecodeOptions, mark=None, finished=None):
    """decode_step with the layer as Triton kernels and cuBLAS (impl "triton": on CPU only under
    TRITON_INTERPRET=1, the tests' way), per layer:
    1. the residual sum + RMSNorm as one kernel (add_rms_norm; in the first layer at TP = 1 it
       also does the embedding lookup, `rows=`: no launch of its own);
    2. cuBLAS's QKV GEMM;
    3. (the q/k norm +) RoPE + the K/V write + split-KV attention as one kernel
       (kernels/rope_attention.py; cur (1,) or a column per row (B,); in the first layer it
       also marks column cur valid, in the rows `mark` sets when given: it never reads that
       column itself);
    4. the projection accumulated in place into the residual (cuBLAS's beta = 1; an out-of-place
       addmm, as inductor makes, first copies the residual);
    5. the second norm kernel, then fc1 + SwiGLU as one Triton GEMM at buckets of at least
       opts.swiglu_gemm_min_rows rows (else cuBLAS + silu_mul);
    6. fc2: at TP = 1 accumulated into the residual in place like the projection (no y to add
       later); at TP > 1 written out, all-reduced and added by the next norm kernel.
    rollout.compile_decode changes nothing here (each op above is already one kernel; the sampler
    is compiled by the caller). Every Triton launch takes opts.pdl; at buckets of at least
    opts.prefetch_min_rows rows the kernel before each GEMM named in opts.prefetch_weights hints
    its weight into L2 (fc2's only from fc1's Triton GEMM)."""
    from hybridflow.kernels import layer_ops as kern
    from hybridflow.kernels.gemm import swiglu_linear
    from hybridflow.kernels.rope_attention import rope_attention

    d = w.dims
    B = tokens.shape[0]
    hpg, hd, pdl = d.heads_per_group, d.head_dim, opts.pdl
    swiglu_gemm = B >= opts.swiglu_gemm_min_rows
    lin = _linear_for(opts, True)
    hints = opts.prefetch_weights if B >= opts.prefetch_min_rows else ()

    def hint(name, t):  # L2 hints (a QuantWeight: its codes, what its GEMM streams)
        return (t.codes if isinstance(t, QuantWeight) else t) if name in hints else None

    if not w.layers:  # no attention kernel to mark the column
        kern.mark_columns(seen, cur, mark)
    # the layer input is x + y (y None: x); x None: the first norm gathers the embedding (TP = 1)
    x, y = (None if d.tp_size == 1 else embed(w, tokens)), None
    for i, layer in enumerate(w.layers):
        pf = hint("qkv", layer.qkv_w)
        x, h = (kern.add_rms_norm(w.embed, None, layer.ln1, d.eps, rows=tokens, prefetch=pf,
                                  pdl=pdl, impl="triton")
                if x is None else kern.add_rms_norm(x, y, layer.ln1, d.eps, prefetch=pf, pdl=pdl,
                                                    impl="triton"))
        qkv = lin(h, layer.qkv_w, layer.qkv_b).view(B, d.groups, hpg + 2, hd)
        kc, vc = cache.layer(i, B)
        if kv_len is not None:
            kc, vc = kc[:, :, :kv_len], vc[:, :, :kv_len]
        a = rope_attention(qkv, cos_tab, sin_tab, kc, vc, cur, seen, hpg=hpg, positions=positions,
                           q_norm=layer.q_norm, k_norm=layer.k_norm, eps=d.eps,
                           mark_valid=(True if mark is None else mark) if i == 0 else False,
                           prefetch=hint("proj", layer.proj), finished=finished, pdl=pdl,
                           impl="triton").reshape(B, d.heads * hd)
        if d.tp_size == 1:  # x is this step's own buffer (add_rms_norm's sum, or the embedding)
            x = lin(a, layer.proj, residual=x)
        else:
            x = x + _all_reduce(lin(a, layer.proj), w)
        h = kern.add_rms_norm(x, None, layer.ln2, d.eps, prefetch=hint("fc1", layer.fc1), pdl=pdl,
                              impl="triton")[1]
        if swiglu_gemm and not isinstance(layer.fc1, QuantWeight):
            act = swiglu_linear(h, layer.fc1, prefetch=hint("fc2", layer.fc2), pdl=pdl,
                                impl="triton")
        else:
            act = kern.silu_mul(lin(h, layer.fc1), pdl=pdl, impl="triton")
        if d.tp_size == 1:
            x, y = lin(act, layer.fc2, residual=x), None
        else:
            y = _all_reduce(lin(act, layer.fc2), w)
    h = kern.add_rms_norm(x, y, w.final_ln, d.eps, pdl=pdl, impl="triton")[1]
    return logits(w, h, fp32=False)


def _qkv(x, y, ln1, qkv_w, qkv_b, eps: float, shape: tuple, lin=F.linear):
    """Layer input x + y (y None: x) -> (it, its QKV projection (B, G, hpg + 2, hd) before RoPE)."""
    x = x if y is None else x + y
    return x, lin(_norm(x, ln1, eps), qkv_w, qkv_b).view(x.shape[0], *shape)


def _attn_in(x, y, ln1, qkv_w, qkv_b, q_norm, k_norm, cos, sin, eps: float, shape: tuple,
             lin=F.linear):
    """Layer input x + y -> (it, RoPE'd [q heads; k] (B, G, hpg + 1, hd), v (B, G, 1, hd))."""
    groups, hpg, hd = shape
    x, qkv = _qkv(x, y, ln1, qkv_w, qkv_b, eps, (groups, hpg + 2, hd), lin)
    qk = _qk_norm(qkv[:, :, :hpg + 1], q_norm, k_norm, eps)
    return x, torch.addcmul(qk * cos, qk.roll(hd // 2, -1), sin), qkv[:, :, hpg + 1:]


def _attn_out(x, a, proj, ln2, fc1, fc2, eps: float, lin=linear):
    """Eager, TP = 1: (x + a @ proj.T, then + the SwiGLU MLP of it; None), both residual adds
    inside their GEMMs, in place on x (the step's own hidden state; as _row_parallel_add and _mlp
    compute them at TP = 1)."""
    x = lin(a, proj, residual=x)
    return lin(_swiglu(_norm(x, ln2, eps), fc1, lin=lin), fc2, residual=x), None


def _attn_out_split(x, a, proj, ln2, fc1, fc2, eps: float):
    """Compiled, TP = 1: (h = x + a @ proj.T, the MLP's output of h): the layer's output is their
    sum, added by the next part inside its norm (no in-place update of a compiled input)."""
    x = x + F.linear(a, proj)
    return x, F.linear(_swiglu(_norm(x, ln2, eps), fc1), fc2)


def _layer_parts(opts: DecodeOptions):
    """(attention-in part, attention-out + MLP part) of a TP = 1 decode layer: with opts.compile
    both through torch.compile (dynamic batch size; the cache writes and collectives stay eager
    between them), inductor fusing the RMSNorm, RoPE, SwiGLU and residual element-wise work around
    the GEMMs; CPU tests pass the aot_eager backend (dynamo's trace without inductor's C++
    builds)."""
    if opts.compile:  # plain weights only (quantized ones are refused with it)
        return _compiled(opts.compile_backend, opts.compile_mode)
    lin = _linear_for(opts, False)
    return functools.partial(_attn_in, lin=lin), functools.partial(_attn_out, lin=lin)


def _linear_for(opts: DecodeOptions, fused: bool):
    """quantize.linear with this call's choices bound: the Triton kernels (fused) or each kernel's
    dispatch default, PDL, and the fp8 weight-only and int4 kernel row bounds."""
    return functools.partial(linear, pdl=opts.pdl and fused, impl="triton" if fused else "auto",
                             fp8_weight_only_max_rows=opts.fp8_weight_only_max_rows,
                             int4_kernel_max_rows=opts.int4_kernel_max_rows)


@functools.cache
def _compiled(backend: str, mode: Optional[str]):
    kw = dict(dynamic=True, backend=backend, mode=mode)
    return torch.compile(_attn_in, **kw), torch.compile(_attn_out_split, **kw)
