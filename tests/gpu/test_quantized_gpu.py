"""Quantized rollouts on a GPU (rollout.quantization): torch._scaled_mm's fp8 linear (row-wise
scales, bf16 out) against the fp32 product of the dequantized operands; the fp8 row kernel against
its twin (the hardware's E4M3 rounding); the weight-only Triton GEMMs (int4, fp8) in bf16 against
the dequantized product at decode and prefill row counts (split K too, bias + residual fused), the
int4 dequantization kernel's bits against its twin;
generation with CUDA graphs on quantized weights equals the
eager decode, for both modes, with the fused kernels and the torch path, and requantize keeps the
captured graphs valid (after it, graphs replay what a fresh generator generates)."""

import pytest
import torch
import torch.nn.functional as F

from hybridflow.config import RolloutConfig
from hybridflow.kernels import quant as kq
from hybridflow.rollout import Generator
from hybridflow.rollout.options import DecodeOptions
from hybridflow.rollout.quantize import linear, quantize
from tests.unit.test_quantized_rollout import QCFG
from tests.unit.test_rollout import PROMPTS, random_params

pytestmark = pytest.mark.gpu


def test_scaled_mm_fp8_linear_equals_the_dequantized_product():
    g = torch.Generator(device="cuda").manual_seed(0)
    for M in (1, 64, 300):
        x = torch.randn(M, 896, device="cuda", generator=g).bfloat16()
        w = (torch.randn(1152, 896, device="cuda", generator=g) * 0.02).bfloat16()
        b = torch.randn(1152, device="cuda", generator=g).bfloat16()
        q = quantize(w, "fp8")
        codes, sx = kq.quant_rows_fp8(x)
        c_ref, s_ref = kq.quant_rows_fp8(x, impl="torch")
        assert torch.equal(sx, s_ref) and torch.equal(codes.float(), c_ref.float())
        ref = (codes.float() * sx) @ (q.codes.float() * q.scales.t()).t() + b.float()
        out = linear(x, q, b)
        assert out.dtype == torch.bfloat16
        assert (out.float() - ref).abs().max() <= 2 ** -7 * ref.abs().max()
        exact = F.linear(x.float(), w.float(), b.float())
        assert ((out.float() - exact).norm() / exact.norm()) < 0.06


@pytest.mark.parametrize("M", [1, 16, 64, 256, 4096])
@pytest.mark.parametrize("mode", ["int4", "fp8"])
def test_weight_only_kernels_bf16_equal_the_dequantized_product(M, mode):
    """int4 and fp8 weight-only GEMMs in bf16 (split K at decode rows), + bias into a residual in
    place, against the fp32 product with the dequantized weight: bf16 output rounding."""
    g = torch.Generator(device="cuda").manual_seed(M)
    for N, K in ((1152, 896), (896, 4864), (17920, 1536)):
        x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
        q = quantize((torch.randn(N, K, device="cuda", generator=g) * 0.02).bfloat16(), mode)
        b = torch.randn(N, device="cuda", generator=g).bfloat16()
        r = torch.randn(M, N, device="cuda", generator=g).bfloat16()
        deq = (q.codes.float() * q.scales.t()) if mode == "fp8" else q.dequantize().float()
        ref = F.linear(x.float(), deq, b.float()) + r.float()
        out = linear(x, q, b, residual=r.clone(), fp8_weight_only_max_rows=1 << 20)
        assert out.dtype == torch.bfloat16
        assert (out.float() - ref).abs().max() <= 2 ** -7 * ref.abs().max() + 1e-3, (N, K)


def test_int4_dequantization_kernel_gives_the_twins_bits():
    """The weight int4 GEMMs of more than kernel_max_rows rows dequantize once (prefill): the
    kernel's bf16 bits are the twin's; 65 rows through that path equal them through the tiled
    kernel within bf16 rounding."""
    g = torch.Generator(device="cuda").manual_seed(1)
    for N, K in ((1152, 896), (17920, 1536), (100, 384)):
        q = quantize((torch.randn(N, K, device="cuda", generator=g) * 0.02).bfloat16(), "int4")
        ref = kq.dequantize_int4(q.codes, q.scales, q.mins)
        assert torch.equal(kq.dequantize_int4(q.codes, q.scales, q.mins, impl="triton"), ref)
        x = torch.randn(65, K, device="cuda", generator=g).bfloat16()
        many = kq.int4_linear(x, q.codes, q.scales, q.mins, kernel_max_rows=64)
        tiled = kq.int4_linear(x, q.codes, q.scales, q.mins, kernel_max_rows=65)
        assert (many.float() - tiled.float()).abs().max() <= 2 ** -7 * tiled.abs().max().float()


@pytest.mark.parametrize("mode", ["fp8", "fp8_weight_only", "int4"])
@pytest.mark.parametrize("kernels", ["triton", "torch"])
def test_graphed_quantized_generation_equals_eager(mode, kernels):
    params = {k: v.cuda().bfloat16() for k, v in random_params(QCFG).items()}
    rc = RolloutConfig(max_new_tokens=12, temperature=0.0, return_logprobs=True,
                       decode_kernels=kernels)

    def run(graphs, p=params, gen=None):
        gen = gen or Generator(model_cfg=QCFG, params=p, tp_group=None,
                               device=torch.device("cuda"), dtype=torch.bfloat16,
                               true_vocab_size=QCFG.vocab_size, quantization=mode.split("_")[0])
        opts = DecodeOptions.from_config(rc).replace(
            cuda_graphs=graphs, fp8_weight_only_max_rows=256 if "weight" in mode else 0)
        return gen, gen.generate(PROMPTS, cfg=rc, eos_id=36, pad_id=0, seed=0, options=opts)

    gen, graphed = run(True)
    _, eager = run(False)
    assert torch.equal(graphed.response_ids, eager.response_ids)
    assert torch.allclose(graphed.rollout_logprobs, eager.rollout_logprobs, atol=1e-2)
    # new weights in place: requantize, replay the kept graphs
    with torch.no_grad():
        for v in params.values():
            if v.dim() == 2:
                v.mul_(0.7)
    gen.requantize(params)
    _, again = run(True, gen=gen)
    _, fresh = run(False)
    assert torch.equal(again.response_ids, fresh.response_ids)
