"""Fused per-shard log-softmax statistics and their gradient, in Triton, with a PyTorch twin.

One program per token row reads that row of this rank's vocab slice once, in its own dtype (bf16
logits are never copied to fp32), and keeps fp32 running values in registers (online softmax over
chunks of BLOCK ids). With x = logits * inv_temp over the non-padded ids [0, v_valid) of the shard:
  m  = max_v x_v                 s = sum_v exp(x_v - m)
  t  = sum_v exp(x_v - m) x_v    (only with entropy)      xt = x_target if the target is in the shard
Shards combine as M = max m, S = sum s e^(m-M), T = sum t e^(m-M), XT = sum xt (the caller's
all-reduces); then lse = M + log S, logprob = XT - lse, E[x] = T / S, entropy = lse - E[x].

The gradient kernel rereads the logits row and writes d/dlogits in the logits' dtype:
  d logprob / dx_v = onehot_v - p_v,     d entropy / dx_v = p_v (E[x] - x_v),   p_v = exp(x_v - lse)
times inv_temp; padded ids get 0. Rows may be strided views (B, T, V) of a larger tensor (the
response slice of the model's logits): strides are passed, nothing is made contiguous.

`logprob_stats` / `logprob_grad` pick the Triton kernels for CUDA tensors (`impl="auto"`) and the
PyTorch twin otherwise; the twin is the readable reference the GPU test compares against.
"""

from __future__ import annotations

import torch

from ._dispatch import HAVE_TRITON, use_triton

if HAVE_TRITON:  # CPU-only installs: the PyTorch twin serves
    import triton
    import triton.language as tl

_M0 = -1e30  # running max before any id: finite, so exp(m - m_new) never sees inf - inf
BLOCK = 4096

if HAVE_TRITON:

    @triton.jit
    def _stats_kernel(x_ptr, tgt_ptr, m_ptr, s_ptr, t_ptr, xt_ptr, T, sxb, sxt, stb, stt, start,
                      v_valid, inv_temp, WITH_ENT: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        b, tt = row // T, row % T
        base = x_ptr + b * sxb + tt * sxt
        m = -1e30
        s = 0.0
        t = 0.0
        for off in range(0, v_valid, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            mask = cols < v_valid
            x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_temp
            m_new = tl.maximum(m, tl.max(x, 0))
            alpha = tl.exp(m - m_new)
            e = tl.exp(x - m_new)  # 0 on masked ids
            s = s * alpha + tl.sum(e, 0)
            if WITH_ENT:
                t = t * alpha + tl.sum(tl.where(mask, e * x, 0.0), 0)
            m = m_new
        loc = tl.load(tgt_ptr + b * stb + tt * stt) - start
        ok = (loc >= 0) & (loc < v_valid)
        xt = tl.load(base + tl.where(ok, loc, 0), mask=ok, other=0.0).to(tl.float32) * inv_temp
        tl.store(m_ptr + row, m)
        tl.store(s_ptr + row, s)
        tl.store(t_ptr + row, t)
        tl.store(xt_ptr + row, xt)

    @triton.jit
    def _grad_kernel(x_ptr, tgt_ptr, lse_ptr, ex_ptr, glp_ptr, gent_ptr, g_ptr, T, sxb, sxt, stb,
                     stt, start, v_local, v_valid, inv_temp, HAS_LP: tl.constexpr,
                     HAS_ENT: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        b, tt = row // T, row % T
        base = x_ptr + b * sxb + tt * sxt
        out = g_ptr + row * v_local
        lse = tl.load(lse_ptr + row)
        loc = tl.load(tgt_ptr + b * stb + tt * stt) - start
        glp = 0.0
        if HAS_LP:
            glp = tl.load(glp_ptr + row)
        gent = 0.0
        ex = 0.0
        if HAS_ENT:
            gent = tl.load(gent_ptr + row)
            ex = tl.load(ex_ptr + row)
        for off in range(0, v_local, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            valid = cols < v_valid
            x = tl.load(base + cols, mask=valid, other=float("-inf")).to(tl.float32) * inv_temp
            p = tl.where(valid, tl.exp(x - lse), 0.0)  # 0 on padded ids
            g = tl.where((cols == loc) & valid, glp, 0.0) - glp * p
            if HAS_ENT:
                g += tl.where(valid, gent * p * (ex - x), 0.0)
            tl.store(out + cols, (g * inv_temp).to(g_ptr.dtype.element_ty), mask=cols < v_local)


def logprob_stats(logits: torch.Tensor, targets: torch.Tensor, *, start: int, v_valid: int,
                  inv_temp: float = 1.0, with_entropy: bool = False, impl: str = "auto"):
    """logits (B, T, V/TP) this shard (any dtype, last dim contiguous); targets (B, T) global ids;
    ids [0, v_valid) of the shard are real (the rest is vocab padding).

    Returns m, s, t, xt: (B, T) float32 each (t is zeros without `with_entropy`)."""
    bsz, seq, v_local = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if not use_triton(logits, impl):
        return _stats_torch(logits, targets, start=start, v_valid=v_valid, inv_temp=inv_temp,
                            with_entropy=with_entropy)
    m, s, t, xt = torch.empty(4, bsz, seq, dtype=torch.float32, device=logits.device)
    if bsz * seq:
        _stats_kernel[(bsz * seq,)](
            logits, targets, m, s, t, xt, seq, logits.stride(0), logits.stride(1),
            targets.stride(0), targets.stride(1), start, v_valid, inv_temp,
            WITH_ENT=with_entropy, BLOCK=BLOCK, num_warps=8)
    return m, s, t, xt


def logprob_grad(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, ex: torch.Tensor,
                 grad_logprobs, grad_entropy, *, start: int, v_valid: int, inv_temp: float = 1.0,
                 impl: str = "auto") -> torch.Tensor:
    """d(sum grad_logprobs * logprob + grad_entropy * entropy)/d logits, (B, T, V/TP) contiguous in
    the logits' dtype. lse, ex: (B, T) float32 after the TP combine; either grad may be None."""
    bsz, seq, v_local = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if not use_triton(logits, impl):
        return _grad_torch(logits, targets, lse, ex, grad_logprobs, grad_entropy, start=start,
                           v_valid=v_valid, inv_temp=inv_temp)
    grad = torch.empty(bsz, seq, v_local, dtype=logits.dtype, device=logits.device)
    glp = grad_logprobs.float().contiguous() if grad_logprobs is not None else lse
    gent = grad_entropy.float().contiguous() if grad_entropy is not None else lse
    if bsz * seq:
        _grad_kernel[(bsz * seq,)](
            logits, targets, lse.contiguous(), ex.contiguous(), glp, gent, grad, seq,
            logits.stride(0), logits.stride(1), targets.stride(0), targets.stride(1), start,
            v_local, v_valid, inv_temp, HAS_LP=grad_logprobs is not None,
            HAS_ENT=grad_entropy is not None, BLOCK=BLOCK, num_warps=8)
    return grad


# ---- PyTorch twin (reference) -------------------------------------------------------------------

def _stats_torch(logits, targets, *, start, v_valid, inv_temp, with_entropy):
    bsz, seq, _ = logits.shape
    zeros = torch.zeros(bsz, seq, dtype=torch.float32, device=logits.device)
    if v_valid <= 0:
        return torch.full_like(zeros, _M0), zeros, zeros.clone(), zeros.clone()
    x = logits[..., :v_valid].float() * inv_temp  # (B, T, v_valid)
    m = x.amax(-1)
    e = (x - m.unsqueeze(-1)).exp()
    s = e.sum(-1)
    t = (e * x).sum(-1) if with_entropy else zeros
    loc = targets - start
    ok = (loc >= 0) & (loc < v_valid)
    xt = x.gather(-1, loc.clamp(0, v_valid - 1).unsqueeze(-1)).squeeze(-1)
    return m, s, t, torch.where(ok, xt, zeros)


def _grad_torch(logits, targets, lse, ex, grad_logprobs, grad_entropy, *, start, v_valid,
                inv_temp):
    grad = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    if v_valid > 0:
        x = logits[..., :v_valid].float() * inv_temp  # (B, T, v_valid)
        p = (x - lse.unsqueeze(-1)).exp()
        g = torch.zeros_like(x)
        if grad_logprobs is not None:
            glp = grad_logprobs.float().unsqueeze(-1)
            loc = targets - start
            ok = (loc >= 0) & (loc < v_valid)
            onehot = torch.zeros_like(x).scatter_(-1, loc.clamp(0, v_valid - 1).unsqueeze(-1),
                                                  ok.unsqueeze(-1).float())
            g = g + glp * (onehot - p)
        if grad_entropy is not None:
            g = g + grad_entropy.float().unsqueeze(-1) * p * (ex.unsqueeze(-1) - x)
        grad[..., :v_valid] = g * inv_temp
    return grad.to(logits.dtype)
