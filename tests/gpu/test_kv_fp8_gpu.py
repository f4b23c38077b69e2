"""rollout.kv_cache_dtype=fp8 on a GPU: the fused decode kernel's codes and scales are its twins'
(the hardware's E4M3 cast after the kernel's own rounding: bit for bit where RoPE leaves k as
projected), its attention over the fp8 cache equals the twins' within bf16 rounding, and the
generator under CUDA graphs (buckets, windows, compaction) on the fp8 cache generates the PyTorch
path's greedy tokens (fp32) and stays within the E4M3 error of the exact cache's log-probs (bf16,
teacher-forced by its own tokens). The speed is measured by benchmarks/bench_quantized.py
(--kv-cache-dtype)."""

import pytest
import torch

from hybridflow.config import ModelConfig, RolloutConfig
from hybridflow.kernels import layer_ops as kern
from hybridflow.kernels.kv_fp8 import Fp8KV, quantize_kv
from hybridflow.rollout import Generator
from hybridflow.rollout.options import DecodeOptions

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
if not kern.HAVE_TRITON:
    pytest.skip("needs triton", allow_module_level=True)


def _tables(hd, length=512):
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    f = torch.outer(torch.arange(length).float(), inv)
    return torch.cat([f.cos(), f.cos()], -1), torch.cat([-f.sin(), f.sin()], -1)


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
        for splits in (None, 1, 2):
            k, v = cache()
            a = rope_attention(qkv, cos_t, sin_t, k, v, cur, valid, hpg=hpg, positions=pos,
                               splits=splits, impl="triton")
            tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
            torch.testing.assert_close(a.float(), ref.float(), atol=tol, rtol=tol)
            if not pos.any():  # k as projected: the same bits
                for got, want in ((k, rk), (v, rv)):
                    assert torch.equal(got.codes.view(torch.uint8), want.codes.view(torch.uint8))
                    assert torch.equal(got.scale, want.scale)
            else:  # RoPE's roundings may differ by an ulp: a code by one step at most
                diff = (k.codes.float() - rk.codes.float()).abs() / rk.codes.float().abs().clamp(
                    min=2 ** -9)
                assert diff.max() <= 2 ** -2


def test_generator_on_the_fp8_cache_under_graphs():
    from tests.unit.test_compaction import random_prompts, uneven_stops
    from tests.unit.test_rollout import random_params

    cfg_m = ModelConfig(num_layers=2, hidden_size=128, ffn_hidden_size=192, num_attention_heads=4,
                        num_query_groups=2, vocab_size=37, add_qkv_bias=True)  # head_dim 32
    gen = Generator(model_cfg=cfg_m, params=random_params(cfg_m), tp_group=None,
                    device=torch.device("cuda"), dtype=torch.float32, true_vocab_size=37)
    prompts, R = random_prompts(24, vocab=37), 150
    base_cfg = RolloutConfig(decode_kernels="torch", max_new_tokens=R, temperature=0.0,
                             kv_cache_dtype="fp8")
    free = gen.generate(prompts, cfg=base_cfg, eos_id=-1, pad_id=0, seed=0).response_ids
    stops = uneven_stops(free.cpu(), [0, 5, 14], 37)
    cfg = RolloutConfig(decode_kernels="torch", max_new_tokens=R, temperature=0.0,
                        max_batch_size=20, return_logprobs=True, stop_token_ids=stops[:2],
                        compact_finished_rows=True, decode_kv_window=64, kv_cache_dtype="fp8")
    base = DecodeOptions.from_config(cfg).replace(check_every=2, min_graphed_bucket=1,
                                                  cuda_graphs=False)
    ref = gen.generate(prompts, cfg=cfg, eos_id=-1, pad_id=0, seed=0, options=base)
    for variant in (base.replace(cuda_graphs=True), base.replace(cuda_graphs=True,
                                                                 kernels="triton")):
        out = gen.generate(prompts, cfg=cfg, eos_id=-1, pad_id=0, seed=0, options=variant)
        assert gen._cache.fp8 and gen.stats["compactions"] > 0
        assert torch.equal(out.response_ids, ref.response_ids)
        assert torch.allclose(out.rollout_logprobs, ref.rollout_logprobs, atol=1e-3)
