"""Core attention on PyTorch SDPA, plugged into Megatron's local layer spec.

Megatron's local `DotProductAttention` materialises the (b, heads, s, s) score matrix in the input
dtype and repeats K/V for grouped-query attention: quadratic memory traffic and a K/V copy per layer,
which leaves the local spec far behind a flash kernel (about half the throughput of transformers'
SDPA path for a whole training step). `SDPAttention` keeps Megatron's interface and layout
([s, b, heads, head_dim] in, [s, b, hidden] out) but calls
`torch.nn.functional.scaled_dot_product_attention`, which picks the flash / memory-efficient kernels
on GPU and handles GQA without copying K/V (`enable_gqa`).

Masks follow Megatron's convention: `attention_mask` is boolean with True meaning "masked out",
shape broadcastable to (b, 1, sq, sk). With a causal mask type and sq < sk (decoding or chunked
prefill against a KV cache) the causal diagonal is aligned to the bottom-right, i.e. query i sits at
absolute position sk - sq + i.

One kernel is routed around: torch 2.11's default cuDNN SDPA backward on H100/H200 returns NaN in dQ
when an explicit mask is given, the sequence length is 64 mod 128 and a query row's logsumexp is
below ln(FLT_MAX) ~ -88.7 (pytorch/pytorch#196678; Qwen2.5's massive-activation heads make such
rows). Fixed micro-batches rarely have such widths; token-budget micro-batches (trimmed to their
own longest row) do, and gave an inf/NaN gradient in about one GSM8K step in ten. Those calls, and
only those, run the memory-efficient kernel (K/V heads expanded, as it takes no `enable_gqa`); the
forward-only passes and every other shape keep the default dispatch.

Sequence packing (algo.pack_sequences, hybridflow/data/packing.py) passes a `PackedDocuments` as
`attention_mask` (Megatron hands it down untouched): the packed row's documents (cu_seqlens, the
longest one) and the kernel chosen for the run (algo.packed_attention, `choose_packed_attention`),
attending within one document, causally, with no dense mask:
- "varlen": torch's `torch.nn.attention.varlen.varlen_attn` (FlashAttention-2 varlen) on the
  [total_tokens, heads, head_dim] view of Megatron's [s, 1, heads, head_dim] (no padding, no copy),
  K/V with their own head count (GQA native), backward included. CUDA only, bf16/fp16, head_dim a
  multiple of 8 up to 256, compute capability 8.0+, a torch that ships it (2.10+).
- "fa4": FlashAttention-4's CuTe DSL kernels (`flash_attn.cute.flash_attn_varlen_func`, the
  `flash-attn-4` package: on sm_90 FA3's Hopper algorithm, on sm_100 its own) on the same views and
  cu_seqlens, GQA native, backward included; CUDA, bf16/fp16, compute capability 9.0+. What auto
  picks where it runs (faster than "varlen" on an H100: docs/performance.md); its kernels compile
  on first use (seconds) into an on-disk cache that later processes load
  (`fa4_compile_cache_env`). The update's packed CUDA graphs
  (parallel.train_cuda_graphs) keep varlen.
- "flex": a flex_attention `BlockMask` document mask (`document_causal_mask`). On CUDA it runs
  `torch.compile(flex_attention)` (compiled once, dynamic shapes); on CPU eager flex_attention when
  nothing will be differentiated, and SDPA with the same mask made dense otherwise (flex_attention
  has no CPU backward). The fallback wherever neither flash kernel applies.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import math
import os
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from hybridflow.kernels import rope_train
from hybridflow.models.packed_choice import (PACKED_KERNELS, FlashMachine, choose, fa4_why,
                                             varlen_why)


class SDPAttention(MegatronModule):
    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection=None, **kwargs):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention does not support context parallelism; "
                             "install transformer-engine for model.attention_backend=te")
        self.attn_mask_type = attn_mask_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPAttention: packed sequences / attention bias need TE")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        query = rope_train.heads(query)  # a 5-D q (parallel.rope_from_qkv) no RoPE rotated
        sq, b, nh, hd = query.shape
        sk = key.shape[0]
        dropout_p = self.dropout_p if self.training else 0.0
        if isinstance(attention_mask, PackedDocuments) and attention_mask.kernel != "flex":
            if dropout_p > 0 or sq != sk or b != 1:
                raise NotImplementedError("SDPAttention: packed documents need one packed row, no "
                                          "attention dropout and no KV cache")
            # [s, 1, h, d] -> [s, h, d]: a view (b = 1); any token and head strides, unit in d
            fn = fa4_packed_attention if attention_mask.kernel == "fa4" else varlen_packed_attention
            out = fn(query[:, 0], key[:, 0], value[:, 0], attention_mask, scale=self.softmax_scale)
            return out.reshape(sq, b, nh * hd)
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if isinstance(attention_mask, PackedDocuments):
            attention_mask = attention_mask.block_mask
        if isinstance(attention_mask, BlockMask):
            if dropout_p > 0 or sq != sk:
                raise NotImplementedError("SDPAttention: a block mask (packed sequences) needs no "
                                          "attention dropout and no KV cache")
            out = packed_attention(q, k, v, attention_mask, scale=self.softmax_scale)
            return out.permute(2, 0, 1, 3).reshape(sq, b, nh * hd)
        causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        attn_mask, is_causal = None, False
        if attention_mask is not None:
            attn_mask = ~attention_mask.to(torch.bool)
            if causal:
                attn_mask = attn_mask & _causal(sq, sk, q.device)
        elif causal and sq > 1:
            if sq == sk:
                is_causal = True
            else:
                attn_mask = _causal(sq, sk, q.device)
        if cudnn_backward_unsafe(q, sq, sk, attn_mask):
            out = sdpa_without_cudnn(q, k, v, attn_mask, dropout_p=dropout_p,
                                     scale=self.softmax_scale)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, is_causal=is_causal, dropout_p=dropout_p,
                scale=self.softmax_scale, enable_gqa=k.shape[1] != nh)
        # [b, h, sq, d] -> [sq, b, h*d]
        return out.permute(2, 0, 1, 3).reshape(sq, b, nh * hd)


def _causal(sq: int, sk: int, device) -> torch.Tensor:
    """(sq, sk) bool, True where query i (absolute position sk - sq + i) may attend key j."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril(diagonal=sk - sq)


def cudnn_backward_unsafe(q: torch.Tensor, sq: int, sk: int,
                          attn_mask: Optional[torch.Tensor]) -> bool:
    """Whether this call would meet the cuDNN backward bug (see the module docstring): a CUDA call
    that will be differentiated, with an explicit mask and a length of 64 mod 128."""
    return (attn_mask is not None and q.is_cuda and q.requires_grad and torch.is_grad_enabled()
            and (sq % 128 == 64 or sk % 128 == 64))


_NO_CUDNN = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa_without_cudnn(q, k, v, attn_mask, *, dropout_p: float, scale: float) -> torch.Tensor:
    """SDPA on the memory-efficient kernel (math as its fallback), GQA by expanded K/V heads."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    with sdpa_kernel(_NO_CUDNN):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                              scale=scale)


BLOCK = 128  # flex_attention's default block (both axes)


def document_causal_mask(document_ids: torch.Tensor) -> BlockMask:
    """(S,) document id of each packed position (0, 1, 2, ... in order, each a contiguous run) ->
    BlockMask: query q may attend key kv iff both lie in the same document and kv <= q. Broadcast
    over batch (1 packed row) and heads.

    Built from the documents' spans per 128-block, O((S/128)^2), the same block lists that
    `create_block_mask` derives from the dense (S, S) mask it materialises (1.7 GB of booleans and
    larger index intermediates at a 40,960-token micro-batch, every micro-batch): query block i and
    key block j <= i interact iff their document ranges overlap (ids are consecutive, so every id
    between a block's first and last occurs in it); the pair is full (no mask_mod needed) iff j < i
    and both blocks are 128 real tokens of one and the same document."""
    def mask_mod(b, h, q_idx, kv_idx):
        return (document_ids[q_idx] == document_ids[kv_idx]) & (q_idx >= kv_idx)

    s, dev = document_ids.shape[0], document_ids.device
    starts = torch.arange(0, s, BLOCK, device=dev)
    first = document_ids[starts]
    last = document_ids[(starts + BLOCK).clamp(max=s) - 1]
    q, k = (slice(None), None), (None, slice(None))  # (query block, key block) broadcasts
    blocks = torch.arange(first.shape[0], device=dev)
    touch = (blocks[k] <= blocks[q]) & (first[k] <= last[q]) & (first[q] <= last[k])
    whole = (first == last) & (starts + BLOCK <= s)  # 128 tokens of one document
    full = (blocks[k] < blocks[q]) & whole[q] & whole[k] & (first[q] == first[k])
    partial = touch & ~full

    def ordered(m):  # (nq, nk) bool -> count (1, 1, nq), indices (1, 1, nq, nk): listed first
        return (m.sum(-1, dtype=torch.int32)[None, None],
                torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)[None, None])

    return BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=BLOCK,
                                    mask_mod=mask_mod, seq_lengths=(s, s))


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=True)


def packed_attention(q, k, v, block_mask: BlockMask, *, scale: float) -> torch.Tensor:
    """q (b, h, s, d), k/v (b, h_kv, s, d) -> (b, h, s, d), attention allowed by `block_mask`."""
    gqa = k.shape[1] != q.shape[1]
    if q.is_cuda:
        return _compiled_flex()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    sq, sk = q.shape[2], k.shape[2]
    allowed = block_mask.mask_mod(0, 0, torch.arange(sq, device=q.device)[:, None],
                                  torch.arange(sk, device=q.device)[None])  # (sq, sk)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale,
                                          enable_gqa=gqa)


# --------------------------------------------------------------------------- varlen (FlashAttention)


@dataclass
class PackedDocuments:
    """A packed row's documents as SDPAttention's `attention_mask` (see the module docstring):
    document i spans positions cu_seqlens[i]:cu_seqlens[i + 1], attended causally within itself."""
    cu_seqlens: torch.Tensor  # (n + 1,) int32 on the device: 0, each document's end (the last: S)
    max_seqlen: int  # the longest document (a host int: the varlen kernel's grid)
    kernel: str  # "varlen" | "flex" | "fa4"
    block_mask: Optional[BlockMask] = None  # flex: document_causal_mask of the row


def packed_documents(document_ids: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, *,
                     kernel: str) -> PackedDocuments:
    """The `attention_mask` of a packed row for `kernel`; the block mask is built only for flex."""
    if kernel not in PACKED_KERNELS:
        raise ValueError(f"packed attention kernel {kernel!r} is not one of {PACKED_KERNELS}")
    return PackedDocuments(cu_seqlens=cu_seqlens, max_seqlen=int(max_seqlen), kernel=kernel,
                           block_mask=document_causal_mask(document_ids) if kernel == "flex"
                           else None)


@functools.cache
def _varlen():
    """(varlen_attn, its causal / GQA keywords) or None where this torch lacks it. torch 2.10
    takes `is_causal`; later ones a causal `window_size` (-1, 0) and `enable_gqa` (2.10 reads fewer
    K/V heads as GQA without a flag)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    return varlen_attn, causal, "enable_gqa" in params


def _torch_varlen_missing() -> Optional[str]:
    """Why this torch cannot run varlen_attn (the op or its kernels missing); None where it can."""
    if _varlen() is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn (2.10+)"
    if not torch.backends.cuda.is_flash_attention_available():
        return "this torch build has no FlashAttention kernels"
    return None


def live_machine(device: torch.device) -> FlashMachine:
    """This process on `device`, as the packed-attention rule (models/packed_choice) reads it."""
    return FlashMachine(device.type, lambda: torch.cuda.get_device_capability(device),
                        _torch_varlen_missing, lambda: _fa4_import()[1])


def varlen_unsupported(device: torch.device, dtype: torch.dtype, head_dim: int) -> Optional[str]:
    """Why torch's varlen_attn cannot run the packed passes here; None where it can."""
    return varlen_why(live_machine(device), dtype, head_dim)


# what the CuTe DSL warns, several hundred characters long, each time it compiles one of
# flash-attn-4's kernels (an argument it passes through as a Python object)
FA4_COMPILE_NOISE = r"Argument aux_data \(position \d+\) cannot be converted to a JitArgument"
FA4_CACHE_ENV = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"
FA4_CACHE_DIR_ENV = "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"


def fa4_compile_cache_env(environ=None) -> dict:
    """The environment flash-attn-4 reads at import to keep its compiled kernels on disk, with
    hybridflow's defaults where the user set nothing: the cache on, in
    `$XDG_CACHE_HOME/hybridflow/flash_attention_cute` (`~/.cache/...`). Keys are the source
    fingerprint of flash_attn.cute, the CuTe DSL version and each kernel's compile key (dtype, head
    dims, GPU arch, ...), so a later process loads what an earlier one compiled instead of compiling
    again. Off where that folder cannot be written; `FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED` set
    by the user (0 or 1) is left as it is."""
    environ = os.environ if environ is None else environ
    if FA4_CACHE_ENV in environ:
        return {}
    own = environ.get(FA4_CACHE_DIR_ENV)
    folder = own or os.path.join(
        environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "hybridflow", "flash_attention_cute")
    try:  # flash-attn-4 creates it at import and would fail to import where it cannot
        os.makedirs(folder, exist_ok=True)
        writable = os.access(folder, os.W_OK)
    except OSError:
        writable = False
    return {**({} if own else {FA4_CACHE_DIR_ENV: folder}), FA4_CACHE_ENV: "1" if writable else "0"}


@functools.cache
def _fa4_import() -> tuple:
    """(flash-attn-4's varlen function, None), or (None, why it cannot be imported). Imported with
    its on-disk compile cache on (`fa4_compile_cache_env`)."""
    if importlib.util.find_spec("flash_attn") is not None:
        os.environ.update(fa4_compile_cache_env())
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except ImportError as e:
        return None, f"flash-attn-4 is not installed (pip install flash-attn-4; {e})"
    except Exception as e:  # installed but broken (its CUDA libraries): auto falls back, saying why
        return None, f"flash-attn-4 does not import: {type(e).__name__}: {e}"
    warnings.filterwarnings("ignore", message=FA4_COMPILE_NOISE, category=UserWarning)
    return flash_attn_varlen_func, None


def _fa4():
    """flash-attn-4's varlen function, or None where it cannot be imported."""
    return _fa4_import()[0]


def fa4_installed() -> bool:
    """Whether flash-attn-4 imports here (what the cost model's `fa4_installed` asks)."""
    return _fa4() is not None


def fa4_unsupported(device: torch.device, dtype: torch.dtype, head_dim: int) -> Optional[str]:
    """Why FlashAttention-4 cannot run the packed passes here; None where it can."""
    return fa4_why(live_machine(device), dtype, head_dim)


def choose_packed_attention(option: str, *, device: torch.device, dtype: torch.dtype,
                            head_dim: int) -> tuple[str, str]:
    """algo.packed_attention (auto | varlen | flex | fa4) -> (kernel, the line that says why) for
    this process on `device` (models/packed_choice.choose: fa4 where it runs, else varlen, else
    flex; varlen or fa4 by name where it cannot run: a ValueError naming the key and the reason)."""
    return choose(option, live_machine(device), dtype=dtype, head_dim=head_dim)


def varlen_packed_attention(q, k, v, docs: PackedDocuments, *, scale: float) -> torch.Tensor:
    """q (S, h, d), k/v (S, h_kv, d) of one packed row -> (S, h, d): each document of `docs`
    attends causally within itself (FlashAttention-2 varlen; K/V heads as they are)."""
    fn, causal, gqa_flag = _varlen()
    if q.stride(-1) != 1:  # the kernel needs unit stride in head_dim only
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    gqa = {"enable_gqa": True} if gqa_flag and k.shape[1] != q.shape[1] else {}
    return fn(q, k, v, docs.cu_seqlens, docs.cu_seqlens, docs.max_seqlen, docs.max_seqlen,
              scale=scale, **causal, **gqa)


def fa4_packed_attention(q, k, v, docs: PackedDocuments, *, scale: float) -> torch.Tensor:
    """varlen_packed_attention on FlashAttention-4's kernels (flash_attn.cute)."""
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out, _ = _fa4()(q, k, v, cu_seqlens_q=docs.cu_seqlens, cu_seqlens_k=docs.cu_seqlens,
                    max_seqlen_q=docs.max_seqlen, max_seqlen_k=docs.max_seqlen,
                    softmax_scale=scale, causal=True)
    return out
