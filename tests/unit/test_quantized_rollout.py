"""Quantized rollouts (rollout.quantization, hybridflow/rollout/quantize.py) on CPU.

- fp8: per-output-channel scales amax / 448, round trip within E4M3's half-ulp (2^-4 relative;
  2^-10 x scale below its normal range); `linear` = torch._scaled_mm of the per-token quantized
  activations equals the fp32 product of the dequantized operands.
- int4: group-wise (128) scale + offset, packing against a per-element reference, round trip within
  half a step; `linear` (the twin; fp8 weight-only too) equals F.linear with the dequantized
  weight, + bias, into a residual in place; the Triton kernels (interpreter,
  tests/unit/quant_kernels_check.py) equal their twins (split K too), the fp8 row kernel too, and a
  greedy generation through the fused decode kernels equals the torch path's (int4, fp8
  weight-only).
- Generation: weight-only modes generate exactly what the unquantized generator generates on the
  dequantized weights; fp8's and int4's prefill logits stay within the formats' error of the
  unquantized model's; `requantize` rewrites the codes in place from updated weights.
- Config: the quantized defaults (return_logprobs, TIS cap 2.0 and its line), refused combinations.
GPU (_scaled_mm on CUDA, the int4 kernel in bf16, CUDA graphs): tests/gpu/test_quantized_gpu.py.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from hybridflow.config import ModelConfig
from hybridflow.kernels import quant as kq
from hybridflow.rollout import Generator
from hybridflow.rollout.options import DecodeOptions
from hybridflow.rollout.quantize import QuantWeight, linear, quantize
from tests.unit.test_rollout import PROMPTS, random_params, rc
from tests.unit.triton_interp import run_check

# every matrix dimension a multiple of 128 (int4 groups) and 16 (fp8)
QCFG = ModelConfig(num_layers=2, hidden_size=128, ffn_hidden_size=128, num_attention_heads=4,
                   num_query_groups=2, vocab_size=37, add_qkv_bias=True)


def _gen(params, quantization="none", dtype=torch.float32):
    return Generator(model_cfg=QCFG, params=params, tp_group=None, device=torch.device("cpu"),
                     dtype=dtype, true_vocab_size=QCFG.vocab_size, quantization=quantization)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_round_trip_within_half_an_e4m3_ulp(dtype):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(64, 96, generator=g) * torch.logspace(-3, 1, 64)[:, None]).to(dtype)
    q = quantize(w, "fp8")
    wf = w.float()
    scale = wf.abs().amax(1) / 448
    assert torch.equal(q.scales.view(-1), scale) and q.codes.dtype == torch.float8_e4m3fn
    deq = q.codes.float() * q.scales.t()
    bound = torch.maximum(wf.abs() * 2 ** -4, scale[:, None] * 2 ** -10)
    assert ((deq - wf).abs() <= bound * (1 + 1e-6)).all()
    # each row's largest magnitude is code +-448 exactly
    assert torch.equal(q.codes.float().abs().amax(1), torch.full((64,), 448.0))
    assert q.dequantize().dtype == dtype and q.nbytes == 64 * 96 + 64 * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_round_trip_within_half_a_step_and_packing(dtype):
    g = torch.Generator().manual_seed(1)
    N, K = 24, 384
    w = (torch.randn(N, K, generator=g) + torch.linspace(-2, 2, K)).to(dtype)
    q = quantize(w, "int4")
    assert q.codes.shape == (N, K // 8) and q.scales.shape == (N, K // 128) and q.shape == (N, K)
    # per-element reference of the packing: code k of row n in word k // 8, bits 4 (k % 8)
    wg, s, lo = w.float().view(N, -1, 128), q.scales.float(), q.mins.float()
    codes = torch.round((wg - lo[..., None]) / s[..., None]).clamp(0, 15).view(N, K).long()
    words = q.codes.long() & 0xFFFFFFFF
    for n, k in [(0, 0), (3, 7), (5, 8), (N - 1, K - 1), (10, 200), (17, 131)]:
        assert (words[n, k // 8] >> (4 * (k % 8))) & 0xF == codes[n, k]
    deq = q.dequantize().float().view(N, -1, 128)
    # half a step, plus the offset's and the result's rounding to the dtype (the step rounds up)
    eps = 2 ** -8 if dtype == torch.bfloat16 else 2 ** -23
    bound = s[..., None] / 2 + (wg.amin(-1, keepdim=True).abs() + wg.abs() + s[..., None]) * eps \
        + 1e-6
    assert ((deq - wg).abs() <= bound).all()
    steps = (wg.amax(-1) - wg.amin(-1)) / 15
    assert (s >= steps).all() and (s <= steps * 1.02 + 1e-7).all()


def test_quantize_refuses_shapes_and_modes():
    with pytest.raises(ValueError, match="rollout.quantization=int4.*multiple of the group"):
        from hybridflow.rollout.quantize import check_shape

        check_shape("int4", "decoder.layers.0.fc2", (64, 96))
    with pytest.raises(ValueError, match="rollout.quantization='nf4'"):
        quantize(torch.zeros(16, 16), "nf4")
    with pytest.raises(ValueError, match="rollout.quantization=int4: decoder.layers.0.qkv_w"):
        Generator(model_cfg=dataclasses.replace(QCFG, hidden_size=64, num_attention_heads=2),
                  params=random_params(dataclasses.replace(QCFG, hidden_size=64,
                                                           num_attention_heads=2)),
                  tp_group=None, device=torch.device("cpu"), dtype=torch.float32,
                  true_vocab_size=37, quantization="int4")


def test_fp8_linear_is_the_product_of_the_dequantized_operands():
    g = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(7, 96, generator=g), torch.randn(48, 96, generator=g), torch.randn(48)
    q = quantize(w, "fp8")
    codes, sx = kq.quant_rows_fp8(x, impl="torch")
    assert torch.equal(sx.view(-1), (x.abs().amax(1) / 448))
    ref = (codes.float() * sx) @ (q.codes.float() * q.scales.t()).t() + b
    out = linear(x, q, b)
    assert (out - ref).abs().max() <= 1e-4 * ref.abs().max()
    # against the unquantized product: two E4M3 roundings per term, random in sign
    exact = F.linear(x, w, b)
    assert (out - exact).abs().max() <= 2 * 2 ** -4 * (x.abs() @ w.abs().t()).max() / 4


def test_weight_only_twins_are_f_linear_with_the_dequantized_weight():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(3, 2, 256, generator=g), torch.randn(40, 256, generator=g)
    b, r = torch.randn(40, generator=g), torch.randn(6, 40, generator=g)
    for mode, kw in (("int4", {}), ("fp8", {"fp8_weight_only_max_rows": 6})):
        q = quantize(w, mode)
        ref = F.linear(x, q.dequantize(), b)
        assert torch.allclose(linear(x, q, b, **kw), ref, atol=1e-5)
        res = r.clone()
        out = linear(x.view(6, 256), q, b, residual=res, **kw)
        assert out is res and torch.allclose(res, r + ref.view(6, 40), atol=1e-5)
    assert torch.equal(linear(x, w), F.linear(x, w))  # plain tensors: F.linear itself


@pytest.fixture(scope="module")
def interpreted():
    return run_check("quant_kernels_check.py")


def test_weight_only_triton_kernels_equal_their_twins(interpreted):
    """int4 and fp8 weight-only GEMMs: plain, + bias, + bias into a residual in place; one split
    and K split over programs (evenly and not), the split sums in their own kernel."""
    cases = interpreted["int4"]
    assert any(c["split"] > 1 for c in cases) and any(c["split"] == 1 for c in cases)
    assert {c["shape"][0] > 32 for c in cases} == {True, False}
    assert any(c["dequantized"] for c in cases) and not all(c["dequantized"] for c in cases)
    for c in cases:  # fp32: summation order only (relative to the largest output)
        assert c["err"] <= 2e-6 and c["in_place"], c


def test_int4_dequantization_kernel_gives_the_twins_bits(interpreted):
    """The weight that int4 GEMMs of many rows (prefill) dequantize once: bit for bit the twin's,
    masked rows included (fp32; bf16 on the GPU: tests/gpu/test_quantized_gpu.py)."""
    cases = interpreted["dequant"]
    assert len(cases) == 2 and all(c["equal"] for c in cases), cases


def test_fp8_row_kernel_equals_its_twin(interpreted):
    for c in interpreted["fp8_rows"]:
        assert c["scales_equal"] and c["codes_equal"], c


def test_fused_decode_kernels_generate_the_torch_paths_tokens(interpreted):
    """int4, and fp8 weight-only: the fused decode path (the quantized GEMMs through the Triton
    kernels, residual adds in their epilogues) generates the torch path's tokens."""
    assert [r["mode"] for r in interpreted["generate"]] == ["int4", "fp8"]
    for r in interpreted["generate"]:
        assert r["tokens_equal"] and r["lp_err"] < 1e-4, r


@pytest.mark.parametrize("mode", ["int4", "fp8_weight_only"])
def test_weight_only_generation_is_the_dequantized_models(mode):
    """Weight-only (int4; fp8 with rollout.kernel_options.fp8_weight_only_max_rows): the quantized
    generator computes what the unquantized one computes on the dequantized weights (same tokens,
    log-probs to fp32 rounding)."""
    params = random_params(QCFG)
    gen = _gen(params, mode.split("_")[0])
    cfg = rc(n=2, max_batch_size=3)
    opts = DecodeOptions.from_config(cfg).replace(fp8_weight_only_max_rows=1 << 20)
    deq = dict(params)
    names = {"qkv_w": "self_attention.linear_qkv.weight",
             "proj": "self_attention.linear_proj.weight",
             "fc1": "mlp.linear_fc1.weight", "fc2": "mlp.linear_fc2.weight"}
    for i, layer in enumerate(gen.w.layers):
        for f, name in names.items():
            assert isinstance(getattr(layer, f), QuantWeight)
            deq[f"decoder.layers.{i}.{name}"] = getattr(layer, f).dequantize()
    assert gen.w.output.data_ptr() == params["output_layer.weight"].data_ptr()  # LM head: as is
    a = gen.generate(PROMPTS, cfg=cfg, eos_id=36, pad_id=0, seed=5, options=opts)
    b = _gen(deq).generate(PROMPTS, cfg=cfg, eos_id=36, pad_id=0, seed=5, options=opts)
    assert torch.equal(a.response_ids, b.response_ids)
    assert (a.rollout_logprobs - b.rollout_logprobs).abs().max() < 1e-4
    assert gen.quantized_bytes == sum(getattr(layer, f).nbytes for layer in gen.w.layers
                                      for f in names)


def test_quantized_prefill_logits_within_the_formats_error():
    """The prompt's logits of the quantized models against the unquantized one (weights at a
    trained model's scale, std 0.05: a random model at std 0.3 amplifies any error): about one
    GEMM's relative error (fp8: two E4M3 roundings, ~2^-4 / sqrt(3) each; int4: half a step of
    a 16-level group), not more; and the log-probs returned are the fp8 model's (its
    teacher-forced log-probs of the tokens it drew)."""
    from hybridflow.rollout import decoder

    params = {k: v / 6 if k.endswith(("linear_qkv.weight", "linear_proj.weight", "fc1.weight",
                                      "fc2.weight", "output_layer.weight")) else v
              for k, v in random_params(QCFG).items()}
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    pos, valid = torch.arange(6)[None], torch.ones(1, 6, dtype=torch.bool)
    outs = {}
    for mode in ("none", "fp8", "int4"):
        gen = _gen(params, mode)
        cos, sin = decoder.rope_tables(gen.w.inv_freq, 16, dtype=torch.float32, device="cpu")
        outs[mode] = decoder.forward(gen.w, ids, pos, valid, cos_tab=cos, sin_tab=sin)
    rel = {m: float((outs[m] - outs["none"]).norm() / outs["none"].norm()) for m in ("fp8", "int4")}
    assert 0 < rel["fp8"] < 2 * 2 ** -4 / 3 ** 0.5, rel
    assert 0 < rel["int4"] < 0.15 and rel["fp8"] < rel["int4"], rel
    gen = _gen(params, "fp8")
    out = gen.generate(PROMPTS[:2], cfg=rc(max_new_tokens=4), eos_id=36, pad_id=0, seed=1)
    row = torch.cat([torch.tensor(PROMPTS[1]), out.response_ids[1]])[None]
    n = row.shape[1]
    cos, sin = decoder.rope_tables(gen.w.inv_freq, 64, dtype=torch.float32, device="cpu")
    lg = decoder.forward(gen.w, row, torch.arange(n)[None], torch.ones(1, n, dtype=torch.bool),
                         cos_tab=cos, sin_tab=sin)
    P = len(PROMPTS[1])
    lp = torch.log_softmax(lg[0, P - 1:n - 1], -1).gather(1, row[0, P:, None])[:, 0]
    mask = out.response_mask[1].bool()
    assert torch.allclose(lp[mask], out.rollout_logprobs[1][mask], atol=1e-3)


def test_requantize_rewrites_the_codes_in_place():
    params = random_params(QCFG)
    for mode in ("fp8", "int4"):
        gen = _gen(params, mode)
        q = gen.w.layers[1].fc1
        ptrs = (q.codes.data_ptr(), q.scales.data_ptr())
        new = {k: v * 1.5 if v.dim() == 2 else v for k, v in params.items()}
        gen.requantize(new)
        fresh = quantize(new["decoder.layers.1.mlp.linear_fc1.weight"], mode)
        assert (q.codes.data_ptr(), q.scales.data_ptr()) == ptrs
        assert torch.equal(q.codes.view(torch.uint8) if mode == "fp8" else q.codes,
                           fresh.codes.view(torch.uint8) if mode == "fp8" else fresh.codes)
        assert torch.equal(q.scales, fresh.scales)


def _config(*overrides):
    from hybridflow.config import load_config

    return load_config(["experiment=demo", *overrides])


def test_quantized_rollout_defaults_turn_on_tis_and_logprobs():
    from hybridflow.config_auto import resolve_auto

    cfg, notes = resolve_auto(_config("rollout.quantization=fp8"), device_type="cpu")
    assert cfg.algo.tis_imp_ratio_cap == 2.0 and cfg.rollout.return_logprobs
    assert any("algo.tis_imp_ratio_cap=2.0" in line for line in notes)
    assert not any("val accuracy" in line for line in notes)  # fp8 learned within noise
    cfg, notes = resolve_auto(_config("rollout.quantization=int4", "algo.tis_imp_ratio_cap=3.0"),
                              device_type="cuda")
    assert cfg.algo.tis_imp_ratio_cap == 3.0 and cfg.rollout.return_logprobs
    assert not any("tis_imp_ratio_cap" in line for line in notes)
    assert any("int4" in line and "val accuracy" in line for line in notes)
    cfg, _ = resolve_auto(_config(), device_type="cpu")  # unquantized: unchanged
    assert cfg.algo.tis_imp_ratio_cap is None and not cfg.rollout.return_logprobs
    cfg, _ = resolve_auto(_config("rollout.quantization=fp8", "rollout.decode_kernels=torch"),
                          device_type="cuda")
    assert cfg.rollout.compile_decode is False


def test_config_checks_refuse_quantized_combinations():
    from hybridflow.config_checks import validate

    with pytest.raises(ValueError, match="rollout.quantization='int8' is not one of"):
        validate(_config("rollout.quantization=int8"), world_size=1)
    with pytest.raises(ValueError, match="rollout.compile_decode=true"):
        validate(_config("rollout.quantization=fp8", "rollout.decode_kernels=torch",
                         "rollout.compile_decode=true"), world_size=1)
    validate(_config("rollout.quantization=fp8", "rollout.decode_kernels=triton",
                     "rollout.compile_decode=true"), world_size=1)  # compiles the sampler only


def test_cost_model_reads_the_quantized_bytes_per_weight():
    """The decode read term: layer weights at 1 (fp8) / 0.5 + 4/128 (int4) bytes, the LM head at 2;
    the KV read unchanged."""
    from hybridflow.cost import Calibration
    from hybridflow.cost.calibrate import parse_record
    from hybridflow.cost.timing import stage_terms
    from tests.unit.test_cost import TINY_WORK

    reads = {}
    for q in ("none", "fp8", "int4"):
        r = parse_record({"config": {"model": "qwen2_1_5b", "gpu": "H200", "num_gpus": 1,
                                     "layout": {"tp": 1}, **TINY_WORK, "rollout_quantization": q}})
        reads[q] = stage_terms(r.shape, r.gpu, r.plan, r.workload, Calibration())["gen"].x[
            "inv_decode_bw_eff"]
    shape = r.shape
    layer = shape.num_layers * shape.layer_matmul_params
    steps_bytes = {q: reads["none"] - reads[q] for q in ("fp8", "int4")}  # same steps and KV
    assert steps_bytes["fp8"] / steps_bytes["int4"] == pytest.approx((2 - 1) / (2 - 0.5 - 4 / 128))
    assert reads["int4"] < reads["fp8"] < reads["none"]
    assert layer < shape.num_dense_params  # the LM head is left at 2 bytes
    with pytest.raises(ValueError, match="rollout_quantization 'nf4'"):
        parse_record({"config": {"model": "tiny", "gpu": "H200", "num_gpus": 1,
                                 "layout": {"tp": 1}, **TINY_WORK, "rollout_quantization": "nf4"}})


def test_validation_generates_unquantized_unless_val_quantized():
    """trainer.val_quantized=false (default): the validation's generation config asks the rollout
    stage for unquantized weights; true: the rollout's quantization."""
    from types import SimpleNamespace

    from hybridflow.validation import Validator

    ctx = SimpleNamespace(train=SimpleNamespace(dp=0), dp_size=1)
    for extra, want in (([], "none"), (["trainer.val_quantized=true"], "fp8")):
        v = Validator(_config("rollout.quantization=fp8", *extra), ctx, rollout=None, dataset=[])
        assert v.gen_cfg.quantization == want and v.gen_cfg.temperature == 0.0
