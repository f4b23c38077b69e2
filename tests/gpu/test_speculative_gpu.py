"""rollout.speculative on a GPU: the tail step captured as a CUDA graph (after compaction, with
attention windows), on the decode kernels (speculative.verify_fused, kernels/spec_attention.py)
and on PyTorch ops: fp32 greedy tokens equal plain decoding's, log-probs close, a second call
captures nothing new; the attention kernel in bf16 within bf16 rounding of its twin. Sampled
tails reproduce under the graphs. The speed is for
`benchmarks/bench_long_tail.py --spec-ab` and the GSM8K variant `spec`."""

import pytest
import torch

from hybridflow.kernels import layer_ops as kern
from hybridflow.kernels.spec_attention import rope_attention_multi
from hybridflow.rollout.options import DecodeOptions

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
if not kern.HAVE_TRITON:
    pytest.skip("needs triton", allow_module_level=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B,S,G,hpg,hd,T", [(16, 5, 2, 7, 64, 1280), (4, 3, 4, 6, 128, 512)])
def test_kernel_matches_twin(dtype, B, S, G, hpg, hd, T):
    from tests.gpu.test_decode_kernels_gpu import _tables as tables

    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(B, S, G, hpg + 2, hd, generator=g, device="cuda").to(dtype)
    kc = torch.randn(B, G, T, hd, generator=g, device="cuda").to(dtype)
    vc = torch.randn(B, G, T, hd, generator=g, device="cuda").to(dtype)
    cos, sin = (t.to("cuda", dtype) for t in tables(hd, T))
    pos = torch.randint(S, T // 2, (B,), generator=g, device="cuda")
    col = pos + torch.randint(0, T // 4, (B,), generator=g, device="cuda")
    n_valid = torch.randint(1, S + 1, (B,), generator=g, device="cuda")
    finished = torch.zeros(B, dtype=torch.bool, device="cuda")
    finished[-1] = True
    key_valid = torch.rand(B, T, generator=g, device="cuda") < 0.9
    outs = {}
    for impl in ("triton", "torch"):
        k, v, kv = kc.clone(), vc.clone(), key_valid.clone()
        outs[impl] = (rope_attention_multi(qkv, cos, sin, k, v, col, pos, n_valid, finished, kv,
                                           mark=True, impl=impl), k, v, kv)
    ok = (torch.arange(S, device="cuda")[None] < n_valid[:, None]) & ~finished[:, None]
    tol = dict(atol=2 ** -6, rtol=2 ** -6) if dtype == torch.bfloat16 else dict(atol=1e-5,
                                                                                 rtol=1e-5)
    torch.testing.assert_close(outs["triton"][0][ok].float(), outs["torch"][0][ok].float(), **tol)
    for i in (1, 2):  # the caches: RoPE rounded as the twin rounds, within one ulp (an FMA)
        torch.testing.assert_close(outs["triton"][i].float(), outs["torch"][i].float(),
                                   atol=2 ** -7 if dtype == torch.bfloat16 else 1e-6,
                                   rtol=2 ** -7 if dtype == torch.bfloat16 else 1e-6)
    assert torch.equal(outs["triton"][3], outs["torch"][3])  # the marks


@pytest.mark.parametrize("kernels,qk_norm,fused_advance", [
    ("triton", False, False), ("torch", False, False), ("triton", True, False),
    ("triton", False, True)])  # the last: the bookkeeping as one kernel (next_token.advance_tail)
def test_graphed_tail_keeps_greedy_tokens(kernels, qk_norm, fused_advance):
    from tests.gpu.test_decode_kernels_gpu import _torch_path, small_generator

    gen, prompts, R, stops = small_generator(R=40, qk_norm=qk_norm)
    cfg = _torch_path(max_new_tokens=R, temperature=0.0, max_batch_size=32, return_logprobs=True,
                      stop_token_ids=stops, compact_finished_rows=True, decode_kv_window=64)
    base = DecodeOptions.from_config(cfg).replace(check_every=2, min_graphed_bucket=1,
                                                  kernels=kernels)
    ref = gen.generate(prompts, cfg=cfg, eos_id=-1, pad_id=0, seed=0, options=base)
    # the tail takes over once only the rows longer than R / 2 run: half the steps or more
    long = int((ref.response_mask.sum(1) > R // 2).sum())
    assert 1 <= long <= 16, ref.response_mask.sum(1)
    spec = base.replace(spec_rows=long, spec_draft_tokens=4, spec_fused_advance=fused_advance)
    out = gen.generate(prompts, cfg=cfg, eos_id=-1, pad_id=0, seed=0, options=spec)
    assert gen.stats["spec_steps"] > 0
    captured = len(gen._steps)
    again = gen.generate(prompts, cfg=cfg, eos_id=-1, pad_id=0, seed=0, options=spec)
    assert len(gen._steps) == captured
    for o in (out, again):
        assert torch.equal(o.response_ids, ref.response_ids)
        assert torch.allclose(o.rollout_logprobs, ref.rollout_logprobs, atol=1e-4)


def test_graphed_sampled_tail_reproduces():
    """Sampled: a seed's tail draws again the same tokens under the graphs (the tail step's draws
    come from the generator's registered stream), and every emitted token's log-prob is finite."""
    from tests.gpu.test_decode_kernels_gpu import _torch_path, small_generator

    gen, prompts, R, stops = small_generator(R=40)
    cfg = _torch_path(max_new_tokens=R, temperature=1.0, n=2, max_batch_size=64,
                      return_logprobs=True, stop_token_ids=stops)
    o = DecodeOptions.from_config(cfg).replace(check_every=2, spec_rows=16, kernels="triton")
    a = gen.generate(prompts, cfg=cfg, eos_id=-1, pad_id=0, seed=3, options=o)
    assert gen.stats["spec_steps"] > 0
    b = gen.generate(prompts, cfg=cfg, eos_id=-1, pad_id=0, seed=3, options=o)
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.rollout_logprobs, b.rollout_logprobs)
    lp = a.rollout_logprobs[a.response_mask.bool()]
    assert torch.isfinite(lp).all() and (lp <= 0).all()


def test_graphed_sampled_tail_with_the_fused_acceptance():
    """rollout.speculative.fused_advance with unfiltered sampling (next_token.accept_advance_tail):
    under the graphs, the same seed's tail draws the tokens the PyTorch acceptance draws (T = 1:
    the race's score needs no product that a fused multiply-add could round differently), with
    log-probs to rounding."""
    from tests.gpu.test_decode_kernels_gpu import _torch_path, small_generator

    gen, prompts, R, stops = small_generator(R=40)
    cfg = _torch_path(max_new_tokens=R, temperature=1.0, n=2, max_batch_size=64,
                      return_logprobs=True, stop_token_ids=stops)
    o = DecodeOptions.from_config(cfg).replace(check_every=2, spec_rows=16, kernels="triton")
    ref = gen.generate(prompts, cfg=cfg, eos_id=-1, pad_id=0, seed=3, options=o)
    fused = gen.generate(prompts, cfg=cfg, eos_id=-1, pad_id=0, seed=3,
                         options=o.replace(spec_fused_advance=True))
    assert gen.stats["spec_steps"] > 0
    assert torch.equal(fused.response_ids, ref.response_ids)
    torch.testing.assert_close(fused.rollout_logprobs, ref.rollout_logprobs, atol=1e-4, rtol=0)
