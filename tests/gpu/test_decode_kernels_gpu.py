"""rollout.decode_kernels=triton on a GPU: the compiled Triton kernels against their PyTorch twins in
bf16 (RoPE + KV writes: the twin's roundings, so within one bf16 ulp; attention: within bf16
rounding of the output) and fp32, also with Qwen3's q/k norm fused in (its fp32 sums in another
order: two bf16 ulps), and the generator under CUDA graphs (buckets, attention windows,
compaction, compiled decode, the decode options' variants): fp32 greedy tokens equal the torch
path's, nothing re-captured on a second call; programmatic dependent launch and the L2 hints
(DecodeOptions.pdl / prefetch_weights) change no bit.
The speed is measured by benchmarks/profile_decode.py and bench_generate.py, not here."""

import dataclasses

import pytest
import torch

from hybridflow.config import ModelConfig, RolloutConfig
from hybridflow.kernels import layer_ops as kern
from hybridflow.rollout import Generator
from hybridflow.rollout.cuda_graph import GraphedStep
from hybridflow.rollout.options import PREFETCHABLE, DecodeOptions

pytestmark = pytest.mark.gpu


def _torch_path(**kw) -> RolloutConfig:
    """The PyTorch decode path (rollout.decode_kernels=auto would take the Triton kernels here)."""
    return RolloutConfig(decode_kernels="torch", **kw)


if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
if not kern.HAVE_TRITON:
    pytest.skip("needs triton", allow_module_level=True)


def _tables(hd, length=512):
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    f = torch.outer(torch.arange(length).float(), inv)
    return torch.cat([f.cos(), f.cos()], -1), torch.cat([-f.sin(), f.sin()], -1)


def _qk_norm_args(on: bool, hd: int, dtype, g) -> tuple[dict, dict | None]:
    """(q_norm / k_norm / eps kwargs, its tolerance: the norm's sums run in another order) of the
    q/k-norm variant; ({}, None) without it."""
    if not on:
        return {}, None
    w = [(torch.rand(hd, generator=g, device="cuda") + 0.5).to(dtype) for _ in range(2)]
    tol = (dict(atol=2 ** -6, rtol=2 ** -6) if dtype == torch.bfloat16
           else dict(atol=1e-5, rtol=1e-5))
    return dict(q_norm=w[0], k_norm=w[1], eps=1e-6), tol


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B,S,G,hpg,hd", [(256, 1, 2, 7, 64), (16, 128, 2, 7, 64), (3, 77, 4, 6, 128)])
def test_prefill_rope_kernel_matches_twin(dtype, B, S, G, hpg, hd, qk_norm):
    """rope_kv_prefill (the prefill's RoPE + K/V writes): the twin's roundings, one bf16 ulp."""
    g = torch.Generator(device="cuda").manual_seed(0)
    cache = torch.randn(2, B, G, S + 5, hd, generator=g, device="cuda").to(dtype)
    cache2 = cache.clone()
    qkv = torch.randn(B, S, G, hpg + 2, hd, generator=g, device="cuda").to(dtype)
    cos_t, sin_t = (t.cuda().to(dtype) for t in _tables(hd))
    pos = torch.randint(0, 512, (B, S), generator=g, device="cuda")
    norm, norm_tol = _qk_norm_args(qk_norm, hd, dtype, g)
    q = kern.rope_kv_prefill(qkv, cos_t[pos], sin_t[pos], cache[0], cache[1], hpg=hpg,
                             impl="triton", **norm)
    q2 = kern.rope_kv_prefill(qkv, cos_t[pos], sin_t[pos], cache2[0], cache2[1], hpg=hpg,
                              impl="torch", **norm)
    # the twin's roundings (x cos, then the multiply-add); an FMA may move the last bit
    one_ulp = dict(atol=1e-6, rtol=2 ** -7) if dtype == torch.bfloat16 else dict(atol=1e-6, rtol=1e-6)
    one_ulp = norm_tol or one_ulp
    for got, want in ((q, q2), (cache, cache2)):
        torch.testing.assert_close(got.float(), want.float(), **one_ulp)


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B,G,hpg,hd,T,kv", [(256, 2, 7, 64, 384, 320), (64, 2, 6, 128, 384, 384),
                                             (3, 4, 7, 128, 1280, 77)])
def test_rope_attention_matches_its_twins(dtype, B, G, hpg, hd, T, kv, qk_norm):
    """kernels/rope_attention.py against its twins rope_kv_write + decode_attention (PyTorch): the
    same cache (the same roundings, to one bf16 ulp) and the same output within the rounding of a
    different summation order; the device's split count (one split at 256 x 2, several at 3 x 4)
    and forced ones."""
    from hybridflow.kernels.rope_attention import rope_attention

    g = torch.Generator(device="cuda").manual_seed(2)
    cache = torch.randn(2, 2, B, G, T, hd, generator=g, device="cuda").to(dtype)
    qkv = torch.randn(B, G, hpg + 2, hd, generator=g, device="cuda").to(dtype)
    cos_t, sin_t = (t.cuda().to(dtype) for t in _tables(hd))
    pos = torch.randint(0, 512, (B,), generator=g, device="cuda")
    cos, sin = cos_t[pos], sin_t[pos]
    cur = torch.tensor([kv - 3], device="cuda")
    valid = torch.rand(B, T, generator=g, device="cuda") < 0.7
    valid[:, kv - 3] = True
    norm, norm_tol = _qk_norm_args(qk_norm, hd, dtype, g)
    cache2 = cache.clone()
    kc2, vc2 = cache2[0, 1, :, :, :kv], cache2[1, 1, :, :, :kv]
    q = kern.rope_kv_write(qkv, cos, sin, kc2, vc2, cur, hpg=hpg, **norm)
    a2 = kern.decode_attention(q, kc2, vc2, valid[:, :kv])
    # the same roundings; an FMA the compiler forms in one kernel and not the other may move a bit
    one_ulp = dict(atol=1e-6, rtol=2 ** -7) if dtype == torch.bfloat16 else dict(atol=1e-6, rtol=1e-6)
    one_ulp = norm_tol or one_ulp
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for splits in (None, 1, 2, -(-kv // kern.BLOCK_T)):
        got = cache.clone()
        kc, vc = got[0, 1, :, :, :kv], got[1, 1, :, :, :kv]
        a = rope_attention(qkv, cos, sin, kc, vc, cur, valid[:, :kv], hpg=hpg, splits=splits,
                           impl="triton", **norm)
        torch.testing.assert_close(got.float(), cache2.float(), **one_ulp)
        torch.testing.assert_close(a.float(), a2.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B,V", [(256, 151936), (64, 151936), (3, 37)])
def test_argmax_kernel_equals_torch_argmax(dtype, B, V):
    """kernels/next_token.argmax_rows: torch.argmax's ids exactly, ties (bf16 has many) included."""
    from hybridflow.kernels.next_token import argmax_rows

    g = torch.Generator(device="cuda").manual_seed(3)
    x = (torch.randn(B, V, generator=g, device="cuda") * 4).to(dtype)
    x[0, [V // 3, V - 1]] = 100.0  # a tie across chunks: the first id
    assert torch.equal(argmax_rows(x), torch.argmax(x, dim=-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N,D,F", [(64, 1536, 8960), (256, 896, 4864), (3, 200, 37)])
def test_norm_and_swiglu_kernels_match_twins(dtype, N, D, F):
    """add_rms_norm (with and without the residual) and silu_mul: equal to their twins up to one
    rounding of the output (an FMA or exp2 may move the last bit)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    x, y = (torch.randn(N, D, generator=g, device="cuda").to(dtype) for _ in range(2))
    w = (torch.rand(D, generator=g, device="cuda") + 0.5).to(dtype)
    one_ulp = (dict(atol=1e-6, rtol=2 ** -7) if dtype == torch.bfloat16
               else dict(atol=1e-5, rtol=1e-5))
    for res in (y, None):
        h, out = kern.add_rms_norm(x, res, w, 1e-6, impl="triton")
        h2, out2 = kern.add_rms_norm(x, res, w, 1e-6, impl="torch")
        assert torch.equal(h, h2)
        torch.testing.assert_close(out.float(), out2.float(), **one_ulp)
    z = torch.randn(N, 2 * F, generator=g, device="cuda").to(dtype)
    torch.testing.assert_close(kern.silu_mul(z, impl="triton").float(),
                               kern.silu_mul(z, impl="torch").float(), **one_ulp)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M,D,F", [(256, 896, 4864), (64, 1536, 8960), (1000, 896, 4864), (3, 200, 37)])
def test_swiglu_gemm_matches_cublas_then_silu_mul(dtype, M, D, F):
    """kernels/gemm.swiglu_linear (its default configs, decode's rows and a prefill's): equal to
    cuBLAS's fc1 + silu_mul up to the GEMM's summation order (bf16: a rounding of gate / up)."""
    from hybridflow.kernels.gemm import swiglu_linear

    g = torch.Generator(device="cuda").manual_seed(2)
    h = torch.randn(M, D, generator=g, device="cuda").to(dtype)
    fc1 = (torch.randn(2 * F, D, generator=g, device="cuda") / D ** 0.5).to(dtype)
    ref = kern.silu_mul(torch.nn.functional.linear(h, fc1), impl="triton").float()
    got = swiglu_linear(h, fc1, impl="triton").float()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4  # TF32 off: fp32 dots are IEEE in both
    assert (got - ref).abs().max() <= tol * ref.abs().max()


def test_advance_rows_under_a_graph():
    """kernels/next_token.advance_rows captured in a CUDA graph and replayed: each replay writes the
    next output column and advances step / cur / positions, as the PyTorch bookkeeping does."""
    from hybridflow.kernels.next_token import advance_rows, argmax_chunks

    B, R, V = 256, 5, 151936
    g = torch.Generator(device="cuda").manual_seed(4)
    logits = torch.randn(B, V, generator=g, device="cuda").to(torch.bfloat16)
    stops = torch.tensor([7, 11], device="cuda")
    tok = torch.argmax(logits, dim=-1)
    st = dict(finished=torch.zeros(B, dtype=torch.bool, device="cuda"),
              out_tokens=torch.full((B, R), -1, dtype=torch.long, device="cuda"),
              tokens=torch.zeros(B, dtype=torch.long, device="cuda"),
              positions=torch.arange(B, device="cuda"), cur=torch.tensor([9], device="cuda"),
              step=torch.tensor([1], device="cuda"))
    st["finished"][::3] = True
    fn = lambda: advance_rows(stop_ids=stops, pad=0, partials=argmax_chunks(logits), vocab=V,  # noqa
                              **st)
    # one warm-up run on the side stream compiles (step 1 -> 2); the capture runs nothing
    graph = GraphedStep(fn, pool=None, side=torch.cuda.Stream(), generator=None, warmup=1)
    graph()
    graph()
    torch.cuda.synchronize()
    assert int(st["step"]) == 4 and int(st["cur"]) == 12
    assert torch.equal(st["positions"], torch.arange(B, device="cuda") + 3)
    assert torch.equal(st["tokens"], tok)
    expect = torch.where(torch.arange(B, device="cuda") % 3 == 0, 0, tok)
    for col in (1, 2, 3):
        assert torch.equal(st["out_tokens"][:, col], expect)
    assert (st["out_tokens"][:, [0, 4]] == -1).all()


def test_graphed_step_keeps_the_tensors_its_step_closes_over():
    """A step made by a factory closes over tensors nothing else holds (the speculative tail's
    index ramps and stop ids): the graph reads their addresses, so GraphedStep must keep them
    alive; freed, the allocator hands their blocks to the next tensors of that size."""
    def factory(out):
        ramp = torch.arange(64, device="cuda") * 3  # held by the closure only

        def step():
            out.copy_(ramp + 1)
        return step

    out = torch.zeros(64, dtype=torch.long, device="cuda")
    graph = GraphedStep(factory(out), pool=None, side=torch.cuda.Stream(), generator=None,
                        warmup=1)
    junk = [torch.full((64,), -7, dtype=torch.long, device="cuda") for _ in range(32)]
    out.zero_()
    graph()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.arange(64, device="cuda") * 3 + 1), out[:8].tolist()
    del junk


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B,G,hpg,hd,T", [(256, 2, 7, 64, 1024), (40, 2, 6, 128, 700)])
def test_rope_attention_reads_only_each_rows_own_columns(dtype, B, G, hpg, hd, T):
    """rope_attention's `finished` (the generator's step): with every column outside a row's own
    (left padding, the window past cur, all of a finished row's) NaN, the unfinished rows' output
    is bit-equal to the kernel's without it on a clean cache, for the device's split count and
    forced ones; a finished row gets its own token's value."""
    from hybridflow.kernels.rope_attention import rope_attention

    g = torch.Generator(device="cuda").manual_seed(3)
    cur_col = T - 100
    clean = torch.randn(2, B, G, T, hd, generator=g, device="cuda").to(dtype)
    qkv = torch.randn(B, G, hpg + 2, hd, generator=g, device="cuda").to(dtype)
    cos_t, sin_t = (t.cuda().to(dtype) for t in _tables(hd, length=T))
    pos = torch.randint(1, cur_col + 1, (B,), generator=g, device="cuda")
    cur = torch.tensor([cur_col], device="cuda")
    col = torch.arange(T, device="cuda")
    valid = (col[None, :] >= cur_col - pos[:, None]) & (col[None, :] < cur_col)
    finished = torch.rand(B, generator=g, device="cuda") < 0.3
    poisoned = clean.clone()
    poisoned[:, ~valid[:, None, :, None].expand(B, G, T, hd)] = float("nan")
    poisoned[:, finished] = float("nan")
    poisoned[:, :, :, cur_col] = clean[:, :, :, cur_col]
    live = ~finished
    for splits in (None, 1, 3, -(-T // kern.BLOCK_T)):
        c = poisoned.clone()
        a = rope_attention(qkv, cos_t, sin_t, c[0], c[1], cur, valid, hpg=hpg, positions=pos,
                           finished=finished, splits=splits, impl="triton")
        c = clean.clone()
        plain = rope_attention(qkv, cos_t, sin_t, c[0], c[1], cur, valid, hpg=hpg, positions=pos,
                               splits=splits, impl="triton")
        assert torch.equal(a[live], plain[live])
        torch.testing.assert_close(a[finished].float(), qkv[finished][:, :, hpg + 1:].expand(
            -1, -1, hpg, -1).float(), atol=0, rtol=0)


def small_generator(R: int = 90, qk_norm: bool = False, **free_kw):
    """A 2-layer fp32 generator on the GPU (head_dim 32, 37 ids; `qk_norm`: with Qwen3's q/k
    norms), 24 random prompts, R new tokens and the ids that rows 0, 5 and 14 never produce
    in a greedy run of `free_kw`'s RolloutConfig keys (stop ids that leave them running to the
    end; none when they use every id) -> (gen, prompts, R, stops)."""
    from tests.unit.test_compaction import random_prompts, uneven_stops
    from tests.unit.test_rollout import random_params

    cfg_m = ModelConfig(num_layers=2, hidden_size=128, ffn_hidden_size=192, num_attention_heads=4,
                        num_query_groups=2, vocab_size=37, add_qkv_bias=True,
                        qk_layernorm=qk_norm)  # head_dim 32
    gen = Generator(model_cfg=cfg_m, params=random_params(cfg_m), tp_group=None,
                    device=torch.device("cuda"), dtype=torch.float32, true_vocab_size=37)
    prompts = random_prompts(24, vocab=37)
    free = gen.generate(prompts, cfg=_torch_path(max_new_tokens=R, temperature=0.0, **free_kw),
                        eos_id=-1, pad_id=0, seed=0).response_ids
    return gen, prompts, R, uneven_stops(free.cpu(), [0, 5, 14], 37)


def test_generator_with_kernels_under_graphs():
    gen, prompts, R, stops = small_generator()
    cfg = _torch_path(max_new_tokens=R, temperature=0.0, max_batch_size=20, return_logprobs=True,
                      stop_token_ids=stops[:2], compact_finished_rows=True, decode_kv_window=64)
    # polls every 2 steps, graphed compaction buckets down to 1 row
    base = DecodeOptions.from_config(cfg).replace(check_every=2, min_graphed_bucket=1)
    ref = gen.generate(prompts, cfg=cfg, eos_id=-1, pad_id=0, seed=0, options=base)
    # (at 150 new tokens rows 0, 5 and 14 used every id: no stop id, nothing compacted)
    assert stops and gen.stats["compactions"] > 0
    fused = base.replace(kernels="triton")
    # the Triton fc1 GEMM and every L2 hint at this test's few rows
    gemm = fused.replace(swiglu_gemm_min_rows=0, prefetch_min_rows=0,
                         prefetch_weights=PREFETCHABLE)
    no_lp = dataclasses.replace(cfg, return_logprobs=False)
    # one Generator for all variants: the captured steps are keyed by the options
    # prefill widths rounded up to 64 columns (the GPU default): cuDNN's attention and the
    # Triton RoPE + K/V write over the added left padding
    for rcfg, variant in ((cfg, fused), (cfg, fused.replace(compile=True)), (cfg, gemm),
                          (no_lp, gemm), (cfg, fused.replace(own_columns_only=False)),
                          (cfg, fused.replace(prefill_width_multiple=64))):
        out = gen.generate(prompts, cfg=rcfg, eos_id=-1, pad_id=0, seed=0, options=variant)
        captured = len(gen._steps)
        again = gen.generate(prompts, cfg=rcfg, eos_id=-1, pad_id=0, seed=0, options=variant)
        assert len(gen._steps) == captured
        for o in (out, again):
            assert torch.equal(o.response_ids, ref.response_ids)
            if rcfg.return_logprobs:
                assert torch.allclose(o.rollout_logprobs, ref.rollout_logprobs, atol=1e-4)


def test_pdl_launches_keep_every_result():
    """Programmatic dependent launch (DecodeOptions.pdl, sm_90+): a chain of kernels each reading
    its predecessor's output, eager and replayed from a CUDA graph, and a bf16 generation with
    every decode kernel, bitwise equal to the plain launches'; so is the generation with the
    kernels' L2 hints of the next GEMM's weights (DecodeOptions.prefetch_weights) on and off."""
    from hybridflow.kernels import _dispatch
    from hybridflow.kernels.gemm import swiglu_linear
    from tests.unit.test_compaction import random_prompts
    from tests.unit.test_rollout import random_params

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90+")
    t = torch.empty(1, device="cuda")
    assert _dispatch.launch_opts(t, True) == {"PDL": True, "launch_pdl": True}
    assert _dispatch.launch_opts(t, False) == {}
    g = torch.Generator(device="cuda").manual_seed(5)
    x0 = torch.randn(256, 896, generator=g, device="cuda").to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(896, generator=g, device="cuda")).to(torch.bfloat16)
    fc1 = (0.05 * torch.randn(2 * 896, 896, generator=g, device="cuda")).to(torch.bfloat16)
    x = x0.clone()

    def chain(pdl):  # 40 dependent launches: norm -> SwiGLU GEMM -> (h, y) -> norm ...
        h, y = x, x
        for _ in range(20):
            h, y = kern.add_rms_norm(h, y, w, 1e-6, prefetch=fc1, pdl=pdl, impl="triton")
            y = swiglu_linear(y, fc1, pdl=pdl, impl="triton")
        x.copy_(h + y)

    results = {}
    for pdl in (False, True):
        x.copy_(x0)
        chain(pdl)
        eager = x.clone()
        x.copy_(x0)
        graph = GraphedStep(lambda: chain(pdl), pool=None, side=torch.cuda.Stream(), generator=None,
                            warmup=1)  # ran once on the side stream
        x.copy_(x0)
        graph()
        torch.cuda.synchronize()
        results[pdl] = (eager, x.clone())
    assert torch.equal(results[True][0], results[False][0])
    assert torch.equal(results[True][1], results[False][1])
    assert torch.equal(results[True][1], results[True][0])

    cfg_m = ModelConfig(num_layers=3, hidden_size=256, ffn_hidden_size=512, num_attention_heads=4,
                        num_query_groups=2, vocab_size=37, add_qkv_bias=True)
    prompts = random_prompts(64, vocab=37)
    cfg = RolloutConfig(decode_kernels="triton", max_new_tokens=48, temperature=0.0,
                        return_logprobs=True, decode_kv_window=64)
    # fc1's GEMM and the L2 hints at 64 rows too
    base = DecodeOptions.from_config(cfg).replace(swiglu_gemm_min_rows=0, prefetch_min_rows=0)
    assert _dispatch.prefetch_args(x, fc1)[2]  # the hints are issued on this device
    gen = Generator(model_cfg=cfg_m, params=random_params(cfg_m), tp_group=None,
                    device=torch.device("cuda"), dtype=torch.bfloat16, true_vocab_size=37)
    outs = []
    for pdl, prefetch in ((False, False), (True, False), (True, True), (False, True)):
        options = base.replace(pdl=pdl, prefetch_weights=PREFETCHABLE if prefetch else ())
        outs.append(gen.generate(prompts, cfg=cfg, eos_id=-1, pad_id=0, seed=0, options=options))
    assert len(gen._steps) == 4  # a step per options object
    for o in outs[1:]:
        assert torch.equal(o.response_ids, outs[0].response_ids)
        assert torch.equal(o.rollout_logprobs, outs[0].rollout_logprobs)
