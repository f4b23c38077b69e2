"""Temperature sampling from full-vocabulary logits and the drawn token's log-prob in two Triton
passes, with a counter-based random stream held on the device.

`sample_rows(logits, inv_temp, rng_state)` draws one token per row of logits (B, V) from
softmax(z), z = logits * inv_temp, by the inverse CDF: one uniform u per row, and the token is the
first id whose running sum of exp(z) passes u x the row's total mass; it returns that token and its
log-prob z[token] - logsumexp(z). PyTorch's sampler (sampling.py's exponential race) writes a
(B, V) fp32 tensor of exponentials, then reads it and the logits for the race and again (a fp32
copy, a gather, a logsumexp) for the log-probs. Here one random number per row, not one per id:
- pass 1, a program per (row, chunk of `chunk` ids): the chunk's logits read once in their own
  dtype, z in fp32, the chunk's max z and sum of exp(z - max) (online, one exp per id; a row split
  over ~19 programs at a 152k vocabulary, as next_token.argmax_rows: one program per row leaves
  the device idle at a few hundred rows). Chunk 0's program also makes the row's uniform u, here
  because pass 2 advances the counter;
- pass 2, a program per row: the chunks' masses rescaled to the row's max give the total (and the
  logsumexp); the chunk whose running mass first passes u x total holds the token, and a scan of
  that one chunk (its logits read again) finds the first id whose running sum passes what is left;
  the log-prob z[token] - logsumexp(z); rows of `replace` take the given token (its z read back
  from the logits); program 0 then advances the stream's counter.
Static shapes, no host sync: inside a captured CUDA graph each replay draws fresh numbers.

Precision: the distribution is softmax(z)'s up to fp32 rounding of the running sums: an id below
~1e-7 of its row's mass (fp32's resolution of a running sum) is not resolved one by one (its
interval may round into a neighbour's); should rounding leave a chunk's scan short of its target,
the chunk's last finite id is taken. -inf logits (masked ids) have no mass and are never drawn
while a row has a finite logit.

The stream: `rng_state` (2,) int64 = [key, counter] on the logits' device (`new_rng_state`,
`seed_rng_state_`). Row r's uniform in a call is word 0 of Philox4x32-10 (Triton's tl.philox)
under the 64-bit key at the counter (r, counter low, counter high, 2^32 - 1): u = (word + 1/2) /
2^32, in (0, 1) and below 1 in fp32. A call uses the current counter and adds 1 to it.
`impl="torch"` (the twin, any device) computes the same Philox words with int64 tensor ops and
takes the inverse CDF over the whole row (one running sum, where the kernel has chunk masses and
a scan within one chunk), advancing the same counter: tokens equal the kernel's but where fp32
rounding of the two sums puts u on the other side of a boundary; log-probs equal to float rounding.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._dispatch import HAVE_TRITON, launch_opts, use_triton

ROUNDS = 10  # Philox rounds (Random123's and Triton's default)
_MASK32 = 0xFFFFFFFF
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85  # Philox4x32 (tl.philox's constants)
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_W_SCALE, _W_HALF = 2.0 ** -32, 2.0 ** -33  # u = word * 2^-32 + 2^-33, word a uint32
_W_MAX = 1.0 - 2.0 ** -24  # the largest fp32 below 1 (a word near 2^32 rounds to 1.0 in fp32)

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from ._dispatch import pdl_enter

    @triton.jit
    def _rescaled(m, s, mx):
        """Running sums s of exp(z - m) as sums of exp(z - mx) (0 where nothing was added)."""
        return tl.where(m > float("-inf"), s * tl.exp(m - mx), 0.0)

    @triton.jit
    def _mass_chunk_kernel(x_ptr, rng_ptr, u_ptr, m_ptr, s_ptr, inv_temp, V, s_x, NCHUNK,
                           CHUNK: tl.constexpr, BLOCK: tl.constexpr, ROUNDS: tl.constexpr,
                           PDL: tl.constexpr = False):
        """Pass 1, a program per (row, chunk): the chunk's max z and sum of exp(z - max); chunk
        0's program also the row's uniform u (Philox word 0 at counter (row, counter low, counter
        high, 2^32 - 1)), read here because pass 2 advances the counter."""
        pdl_enter(PDL)
        row = tl.program_id(0)
        c = tl.program_id(1)
        if c == 0:
            key = tl.load(rng_ptr)
            ctr = tl.load(rng_ptr + 1)
            one = tl.full([1], 0, tl.uint32)
            r0, _, _, _ = tl.philox(key, one + row.to(tl.uint32),
                                    one + (ctr & 0xFFFFFFFF).to(tl.uint32),
                                    one + ((ctr >> 32) & 0xFFFFFFFF).to(tl.uint32),
                                    tl.full([1], 0xFFFFFFFF, tl.uint32), ROUNDS)
            u = tl.minimum(r0.to(tl.float32) * 2.3283064365386963e-10 + 1.1641532182693481e-10,
                           0.99999994039535522)  # (word + 1/2) / 2^32, below 1 in fp32
            tl.store(u_ptr + row, tl.sum(u, 0))
        x_row = x_ptr + row.to(tl.int64) * s_x
        m = tl.full([BLOCK], float("-inf"), tl.float32)  # per lane: max z, sum exp(z - max)
        s = tl.zeros([BLOCK], tl.float32)
        for start in range(0, CHUNK, BLOCK):
            cols = c * CHUNK + start + tl.arange(0, BLOCK)
            z = tl.load(x_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * inv_temp
            # one exp per id; -inf z (masked ids, padding) add 0
            d = z - m
            e = tl.exp(-tl.abs(d))
            s = tl.where(d > 0, s * e + 1.0, s + tl.where(z > float("-inf"), e, 0.0))
            m = tl.maximum(m, z)
        mx = tl.max(m, 0)
        tl.store(m_ptr + row * NCHUNK + c, mx)
        tl.store(s_ptr + row * NCHUNK + c, tl.sum(_rescaled(m, s, mx), 0))

    @triton.jit
    def _cdf_final_kernel(u_ptr, m_ptr, s_ptr, x_ptr, rep_ptr, rtok_ptr, tok_ptr, lp_ptr, rng_ptr,
                          inv_temp, V, s_x, NCHUNK, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                          N_PAD: tl.constexpr, HAS_REPLACE: tl.constexpr,
                          HAS_LP: tl.constexpr, PDL: tl.constexpr = False):
        """Pass 2, a program per row: the chunk holding u x the row's total mass, then the first
        id of that chunk whose running sum of exp(z - chunk max) passes the rest (the last finite
        id of the chunk should fp32 rounding leave the sum short); the log-prob
        z[token] - logsumexp(z); program 0 then advances the stream's counter."""
        pdl_enter(PDL)
        row = tl.program_id(0)
        c = tl.arange(0, N_PAD)
        ok = c < NCHUNK
        m = tl.load(m_ptr + row * NCHUNK + c, mask=ok, other=float("-inf"))
        s = tl.load(s_ptr + row * NCHUNK + c, mask=ok, other=0.0)
        mx = tl.max(m, 0)
        w = _rescaled(m, s, mx)  # each chunk's mass
        total = tl.sum(w, 0)
        target = tl.load(u_ptr + row) * total
        cum = tl.cumsum(w, 0)
        # the chunk: the first whose running mass passes the target (else the last with mass)
        k = tl.min(tl.where((cum > target) & (w > 0), c, N_PAD), 0)
        last = tl.max(tl.where(w > 0, c, -1), 0)
        k = tl.where(k == N_PAD, last, k)
        before = tl.sum(tl.where(c < k, w, 0.0), 0)
        m_k = tl.sum(tl.where(c == k, m, 0.0), 0)
        rest = (target - before) / tl.exp(m_k - mx)  # in the chunk's own scale
        x_row = x_ptr + row.to(tl.int64) * s_x
        tok = tl.zeros((), tl.int32) + V  # nothing found yet
        last_ok = tl.zeros((), tl.int32) - 1
        carry = tl.zeros((), tl.float32)
        for start in range(0, CHUNK, BLOCK):
            cols = k * CHUNK + start + tl.arange(0, BLOCK)
            z = tl.load(x_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * inv_temp
            fin = z > float("-inf")
            e = tl.where(fin, tl.exp(z - m_k), 0.0)
            run = tl.cumsum(e, 0) + carry
            first = tl.min(tl.where(fin & (run > rest), cols, V), 0)
            tok = tl.where(tok == V, first, tok)
            last_ok = tl.maximum(last_ok, tl.max(tl.where(fin, cols, -1), 0))
            carry += tl.sum(e, 0)
        tok = tl.where(tok == V, last_ok, tok).to(tl.int64)
        if HAS_REPLACE:
            forced = tl.load(rep_ptr + row) != 0
            tok = tl.where(forced, tl.load(rtok_ptr + row), tok)
        tl.store(tok_ptr + row, tok)
        if HAS_LP:
            z_tok = tl.load(x_row + tok).to(tl.float32) * inv_temp
            tl.store(lp_ptr + row, z_tok - (mx + tl.log(total)))
        if row == 0:  # pass 1 read the counter; nothing of this kernel does
            tl.store(rng_ptr + 1, tl.load(rng_ptr + 1) + 1)


def new_rng_state(seed: int, device) -> torch.Tensor:
    """A stream for sample_rows: (2,) int64 [key, counter] on `device`, keyed by `seed`."""
    state = torch.zeros(2, dtype=torch.long, device=device)
    return seed_rng_state_(state, seed)


def seed_rng_state_(state: torch.Tensor, seed: int) -> torch.Tensor:
    """Restart the stream `state` in place (its storage stays: graphs captured on it keep reading
    it): key = seed's low 63 bits, counter 0. Two kernel launches, no host sync."""
    if state.shape != (2,) or state.dtype != torch.long:
        raise ValueError(f"rng_state is a (2,) int64 tensor [key, counter], got "
                         f"{tuple(state.shape)} {state.dtype}")
    state[0].fill_(int(seed) & (2 ** 63 - 1))
    state[1].zero_()
    return state


def _check(logits, inv_temp, rng_state, replace, chunk, block):
    if logits.dim() != 2:
        raise ValueError(f"sample_rows takes (B, V) logits, got shape {tuple(logits.shape)}")
    if logits.stride(-1) != 1:
        raise ValueError("sample_rows needs logits contiguous in the last dimension")
    if not logits.dtype.is_floating_point:
        raise ValueError(f"sample_rows takes float logits, got {logits.dtype}")
    if not inv_temp > 0:
        raise ValueError(f"sample_rows: inv_temp={inv_temp!r}, expected > 0 (1 / temperature)")
    if (rng_state.shape != (2,) or rng_state.dtype != torch.long
            or rng_state.device != logits.device):
        raise ValueError(f"sample_rows: rng_state must be a (2,) int64 tensor on the logits' "
                         f"device {logits.device}, got {tuple(rng_state.shape)} {rng_state.dtype} "
                         f"on {rng_state.device}")
    if block < 1 or block & (block - 1):
        raise ValueError(f"sample_rows: block {block} is not a power of two")
    if chunk < block or chunk % block:
        raise ValueError(f"sample_rows: chunk {chunk} is not a multiple of block {block}")
    if replace is not None:
        where, given = replace
        B = logits.shape[0]
        if where.shape != (B,) or where.dtype != torch.bool or given.shape != (B,):
            raise ValueError(f"sample_rows: replace is (where (B,) bool, tokens (B,)) for B = {B}, "
                             f"got {tuple(where.shape)} {where.dtype}, {tuple(given.shape)}")


def sample_rows(logits: torch.Tensor, inv_temp: float, rng_state: torch.Tensor, *,
                replace: Optional[tuple] = None, need_logprobs: bool = True, pdl: bool = False,
                impl: str = "auto", chunk: int = 8192, block: int = 1024, warps: int = 4):
    """logits (B, V) over the true vocabulary (any float dtype, last dimension contiguous),
    inv_temp = 1 / temperature > 0, rng_state (2,) int64 [key, counter] on the logits' device
    (advanced in place) -> (tokens (B,) int64, log_softmax(logits * inv_temp) at the tokens (B,)
    fp32, or None without `need_logprobs`). `replace` (where (B,) bool, tokens (B,) int64): those
    rows emit the given token and its log-prob (the draw is still made). Kernel shape: `chunk`
    ids per program of pass 1 (and per scan of pass 2), tiles of `block` ids (a power of two
    dividing `chunk`), `warps` warps per program."""
    _check(logits, inv_temp, rng_state, replace, chunk, block)
    if not use_triton(logits, impl):
        return _sample_rows_torch(logits, inv_temp, rng_state, replace, need_logprobs)
    B, V = logits.shape
    dev = logits.device
    # a small vocabulary: one chunk, no empty tiles
    chunk = min(chunk, triton.cdiv(V, block) * block)
    nchunk = triton.cdiv(V, chunk)
    m, s = (torch.empty((B, nchunk), dtype=torch.float32, device=dev) for _ in range(2))
    u = torch.empty((B,), dtype=torch.float32, device=dev)
    tokens = torch.empty((B,), dtype=torch.long, device=dev)
    lp = torch.empty((B,), dtype=torch.float32, device=dev) if need_logprobs else None
    if not B:
        rng_state[1:].add_(1)
        return tokens, lp
    where, given = ((replace[0].contiguous().view(torch.uint8), replace[1].contiguous())
                    if replace is not None else (tokens, tokens))  # unread without it
    _mass_chunk_kernel[(B, nchunk)](logits, rng_state, u, m, s, float(inv_temp), V,
                                    logits.stride(0), nchunk, CHUNK=chunk, BLOCK=block,
                                    ROUNDS=ROUNDS, num_warps=warps, **launch_opts(logits, pdl))
    _cdf_final_kernel[(B,)](u, m, s, logits, where, given, tokens, tokens if lp is None else lp,
                            rng_state, float(inv_temp), V, logits.stride(0), nchunk, CHUNK=chunk,
                            BLOCK=block, N_PAD=max(16, triton.next_power_of_2(nchunk)),
                            HAS_REPLACE=replace is not None, HAS_LP=lp is not None,
                            num_warps=warps, **launch_opts(logits, pdl))
    return tokens, lp


# ---- the PyTorch twin ------------------------------------------------------------------------

def _mul32(a: int, x: torch.Tensor):
    """(high, low) 32-bit words of a * x for a uint32 constant `a` and uint32 values x held in
    int64 (16-bit halves: no product overflows int64)."""
    lo16, hi16 = x & 0xFFFF, x >> 16
    pl, ph = a * lo16, a * hi16  # < 2^48 each; a * x = ph * 2^16 + pl
    return (ph + (pl >> 16)) >> 16, (pl + ((ph & 0xFFFF) << 16)) & _MASK32


def philox4x32(key: torch.Tensor, c0, c1, c2, c3, rounds: int = ROUNDS):
    """Philox4x32 as tl.philox computes it, on uint32 values held in int64 tensors (broadcast
    together): key a 64-bit int64 tensor (its low word k0, high word k1) -> 4 word tensors."""
    k0, k1 = key & _MASK32, (key >> 32) & _MASK32
    for _ in range(rounds):
        hi_b, lo_b = _mul32(_ROUND_B, c2)
        hi_a, lo_a = _mul32(_ROUND_A, c0)
        c0, c2, c1, c3 = hi_b ^ c1 ^ k0, hi_a ^ c3 ^ k1, lo_b, lo_a
        k0, k1 = (k0 + _KEY_A) & _MASK32, (k1 + _KEY_B) & _MASK32
    return c0, c1, c2, c3


def row_uniforms(rng_state: torch.Tensor, rows: int) -> torch.Tensor:
    """(rows,) fp32: the uniform u of each row that sample_rows draws with at rng_state's current
    counter, as pass 1 makes it."""
    dev = rng_state.device
    key, ctr = rng_state[0], rng_state[1]
    row = torch.arange(rows, device=dev)
    word = philox4x32(key, row, ctr & _MASK32, (ctr >> 32) & _MASK32,
                      torch.full_like(row, _MASK32))[0]
    return (word.float() * _W_SCALE + _W_HALF).clamp_max_(_W_MAX)


def _sample_rows_torch(logits, inv_temp, rng_state, replace, need_logprobs):
    """sample_rows as PyTorch ops: the inverse CDF over the whole row (one running sum, not the
    kernel's chunk masses: tokens equal the kernel's but where fp32 rounding of the two sums puts
    u on the other side of a boundary)."""
    B, V = logits.shape
    z = logits.float() * inv_temp
    mx = z.amax(-1, keepdim=True)
    e = torch.exp(z - mx)  # 0 at -inf ids
    cum = e.cumsum(-1)
    target = row_uniforms(rng_state, B)[:, None] * cum[:, -1:]
    past = (cum > target) & (e > 0)
    last = torch.where(e > 0, torch.arange(V, device=z.device), -1).amax(-1)
    tokens = torch.where(past.any(-1), past.float().argmax(-1), last)
    if replace is not None:
        tokens = torch.where(replace[0], replace[1], tokens)
    rng_state[1:].add_(1)
    if not need_logprobs:
        return tokens, None
    return tokens, z.gather(1, tokens[:, None]).squeeze(1) - torch.logsumexp(z, dim=-1)
