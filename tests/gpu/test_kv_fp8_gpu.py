"""rollout.kv_cache_dtype=fp8 on a GPU: the fused decode kernel's codes and scales are its twins'
(the hardware's E4M3 cast after the kernel's own rounding: bit for bit where RoPE leaves k as
projected), its attention over the fp8 cache equals the twins' within bf16 rounding, and the
generator under CUDA graphs (buckets, windows, compaction) on the fp8 cache generates the eager
PyTorch path's greedy tokens (fp32), and with the kernels nearly every row's. The speed is
measured by benchmarks/bench_quantized.py (--modes kv_fp8)."""

import pytest
import torch

from hybridflow.config import RolloutConfig
from hybridflow.kernels import layer_ops as kern
from hybridflow.kernels.kv_fp8 import Fp8KV, quantize_kv
from hybridflow.rollout.options import DecodeOptions

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or not kern.HAVE_TRITON:
    pytest.skip("needs CUDA and triton", allow_module_level=True)

from tests.gpu.test_decode_kernels_gpu import _tables, small_generator  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B,G,hpg,hd,T", [(256, 2, 7, 64, 384), (3, 4, 7, 128, 1280)])
def test_fp8_rope_attention_matches_its_twins(dtype, B, G, hpg, hd, T):
    from hybridflow.kernels.rope_attention import rope_attention

    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(2, B, G, T, hd, generator=g, device="cuda").to(dtype) * 4
    codes, scale = quantize_kv(x)
    qkv = torch.randn(B, G, hpg + 2, hd, generator=g, device="cuda").to(dtype)
    cos_t, sin_t = (t.cuda().to(dtype) for t in _tables(hd))
    cur = torch.tensor([T - 7], device="cuda")
    valid = torch.rand(B, T, generator=g, device="cuda") < 0.7

    def cache():
        return [Fp8KV(codes[i].clone(), scale[i].clone()) for i in range(2)]

    for pos in (torch.zeros(B, dtype=torch.long, device="cuda"),
                torch.randint(0, 512, (B,), generator=g, device="cuda")):
        rk, rv = cache()
        ref = rope_attention(qkv, cos_t, sin_t, rk, rv, cur, valid, hpg=hpg, positions=pos,
                             impl="torch")
        # the attention of the twin's rotated q over the same codes and scales, in fp32
        ek, ev = cache()
        q = kern.rope_kv_write(qkv, cos_t.index_select(0, pos), sin_t.index_select(0, pos), ek, ev,
                               cur, hpg=hpg)
        exact = kern.decode_attention(q.float(), ek, ev, kern.mark_columns(valid.clone(), cur))
        twin_err = (ref.float() - exact).abs()
        for splits in (None, 1, 2):
            k, v = cache()
            a = rope_attention(qkv, cos_t, sin_t, k, v, cur, valid, hpg=hpg, positions=pos,
                               splits=splits, impl="triton")
            if dtype == torch.bfloat16:
                # the kernel rounds in other places than its twin (codes into the products as
                # they are, the V scales folded into P): no further from the fp32 attention than
                # the twin is (values 4x the other tests': kernel and twin differ by up to 0.125)
                err = (a.float() - exact).abs()
                assert err.max() <= 1.5 * twin_err.max() and err.mean() <= 1.5 * twin_err.mean()
            else:
                torch.testing.assert_close(a.float(), ref.float(), atol=1e-4, rtol=1e-4)
            if not pos.any():  # k as projected: the same bits
                for got, want in ((k, rk), (v, rv)):
                    assert torch.equal(got.codes.view(torch.uint8), want.codes.view(torch.uint8))
                    assert torch.equal(got.scale, want.scale)
            else:  # RoPE's roundings may differ by an ulp: a code by one step at most
                diff = (k.codes.float() - rk.codes.float()).abs() / rk.codes.float().abs().clamp(
                    min=2 ** -9)
                assert diff.max() <= 2 ** -2


def test_generator_on_the_fp8_cache_under_graphs():
    gen, prompts, R, stops = small_generator(R=60, kv_cache_dtype="fp8")
    assert len(stops) >= 2  # rows that stop early: compaction
    cfg = RolloutConfig(decode_kernels="torch", max_new_tokens=R, temperature=0.0,
                        max_batch_size=20, return_logprobs=True, stop_token_ids=stops[:2],
                        compact_finished_rows=True, decode_kv_window=64, kv_cache_dtype="fp8")
    base = DecodeOptions.from_config(cfg).replace(check_every=2, min_graphed_bucket=1,
                                                  cuda_graphs=False)
    ref = gen.generate(prompts, cfg=cfg, eos_id=-1, pad_id=0, seed=0, options=base)
    graphed = gen.generate(prompts, cfg=cfg, eos_id=-1, pad_id=0, seed=0,
                           options=base.replace(cuda_graphs=True))
    assert gen._cache.fp8 and gen.stats["compactions"] > 0
    assert torch.equal(graphed.response_ids, ref.response_ids)
    assert torch.allclose(graphed.rollout_logprobs, ref.rollout_logprobs, atol=1e-5)
    # the kernels: RoPE's fp32 roundings may move a value across an E4M3 midpoint (about one
    # code in 2^20; a moved code shifts a log-prob by ~1e-3), and this random model has near-tied
    # logits: nearly every row and log-prob equal (the interpreter run: 24 of 24 rows, 2 of 960
    # log-probs off by more than 1e-4, at most 1.6e-3)
    fused = gen.generate(prompts, cfg=cfg, eos_id=-1, pad_id=0, seed=0,
                         options=base.replace(cuda_graphs=True, kernels="triton"))
    same = (fused.response_ids == ref.response_ids).all(1)
    assert same.sum() >= len(prompts) - 2
    diff = (fused.rollout_logprobs[same] - ref.rollout_logprobs[same]).abs()
    assert (diff > 1e-4).sum() <= diff.numel() // 100 and diff.max() < 1e-2
