"""rollout.decode_kernels=triton on CPU, through Triton's interpreter (TRITON_INTERPRET=1, in a fresh
process: tests/unit/decode_kernels_check.py): the fused RoPE + K/V write + split-KV attention
kernel, the prefill's RoPE + KV-write kernel, the one-pass SwiGLU, the residual sum + RMSNorm, the
fc1 + SwiGLU GEMM, the argmax and the bookkeeping kernels equal their PyTorch twins (fp32; several
group sizes, head dims 16-128, attention windows shorter than the cache, strided cache views,
left-padded keys, a row whose only key is its own token; 1, 2 and one-per-block attention splits),
writing only the current column of the given layer; with Qwen3's q/k norm fused into the RoPE
kernels too; the generator with the kernels generates the torch path's tokens, greedy with windows
and compaction and sampled with n = 3 (and for a q/k-norm model), at TP_g = 1 and (2 gloo ranks)
TP_g = 2; DecodeOptions.pdl reaches every launch; on an fp8 KV cache (rollout.kv_cache_dtype=fp8)
the kernel writes its twins' codes and scales and the generation equals the torch path's.
bf16 and CUDA graphs: tests/gpu/test_decode_kernels_gpu.py. Also: clear errors where the kernels
do not apply."""

import pytest
import torch

from hybridflow.config import ModelConfig, RolloutConfig
from hybridflow.kernels import layer_ops as kern
from tests.unit.test_rollout import PROMPTS, make, rc
from tests.unit.triton_interp import run_check


@pytest.fixture(scope="module")
def checked():
    return run_check("decode_kernels_check.py")


def test_rope_attention_equals_the_two_kernels_twins(checked):
    """kernels/rope_attention.py: RoPE + K/V write + attention in one kernel equals rope_kv_write
    then decode_attention (twins) with 1, 2 and one-per-block splits; only column cur written."""
    cases = checked["rope_attention"]
    assert len(cases) == 4 and any(c["splits"][1] == 2 for c in cases)
    for case in cases:
        assert case["attn_err"] < 1e-5 and case["cache_err"] < 1e-5, case
        assert case["only_column_written"], case
        assert case["splits"][0] == 1 and case["splits"][-1] == -(-case["shape"][5] // kern.BLOCK_T)
        assert case["row0_is_its_value"] < 1e-6, case
        # the RoPE tables + positions (as the decode step passes them): the same bits
        assert case["tables_equal"] and case["tables_twin_equal"], case
        # mark_valid (the decode step's KV-valid fill folded in): column cur set, nothing else
        assert case["mark_equal"] and case["marked"], case


def test_rope_attention_reads_only_each_rows_own_columns(checked):
    """With `finished` (the generator's step) the kernel reads a row's own columns only (the rest
    is NaN in the check and no output is poisoned), bit-equal to the kernel without it and equal
    to the twin for the unfinished rows; a finished row gets its own token's value."""
    cases = checked["own"]
    assert len(cases) == 3
    for case in cases:
        assert max(case["errs"]) < 1e-5 and case["bit_equal"], case
        assert case["finished_is_its_value"] < 1e-6, case


def test_argmax_kernel_equals_torch_argmax(checked):
    """kernels/sampling.argmax_rows: torch.argmax's ids, the first on ties (inside a chunk, across
    chunks and across lanes), in fp32 and fp16."""
    assert len(checked["argmax"]) == 2
    for case in checked["argmax"]:
        assert case["equal"], case
        assert case["tokens"][1:] == [3, 10, 0, 999, 260], case


def test_swiglu_gemm_equals_fc1_then_swiglu(checked):
    """kernels/gemm.swiglu_linear: F.linear + the SwiGLU (fp32), ragged tiles, a K needing masked
    loads, grouped tile order, the default configs."""
    cases = checked["swiglu"]
    assert [c["shape"] for c in cases] == [[5, 64, 48], [70, 96, 80], [3, 64, 96], [600, 32, 24]]
    for case in cases:
        assert case["err"] < 1e-6 * max(1.0, case["scale"]) * 10, case


def test_advance_rows_equals_the_generators_bookkeeping(checked):
    """kernels/sampling.advance_rows: the output column (pad / 0 on finished rows), stop tokens
    finishing rows, tokens / positions / cur / step advanced, from drawn tokens or greedy partials,
    with and without log-probs, over one and two row blocks."""
    cases = checked["advance"]
    assert [(c["rows"], c["with_lp"], c["from_partials"]) for c in cases] == [
        (7, True, False), (300, False, False), (300, False, True), (5, True, True)]
    for case in cases:
        assert all(case["equal"].values()), case
        assert 0 < case["finished_now"] < case["rows"], case


def test_prefill_kernel_equals_its_twin_and_the_decoders_rope(checked):
    """rope_kv_prefill (the prefill's RoPE + K/V writes, rollout.decode_kernels=triton): the twin's
    q and cache, the decoder's own RoPE, and only columns 0..S-1 of the given rows written."""
    assert len(checked["prefill"]) == 3
    for case in checked["prefill"]:
        assert case["q_err"] < 1e-5 and case["cache_err"] < 1e-5, case
        assert case["q_vs_decoder"] < 1e-5 and case["k_vs_decoder"] < 1e-5, case
        assert case["only_prefix_written"], case


def test_silu_mul_equals_its_twin(checked):
    assert [c["shape"] for c in checked["silu_mul"]] == [[7, 37], [3, 1024], [2, 1500]]
    for case in checked["silu_mul"]:
        assert case["err"] < 1e-6, case


def test_add_rms_norm_equals_its_twin(checked):
    cases = checked["add_rms_norm"]
    assert [c["shape"] for c in cases] == [[5, 64], [3, 96], [4, 200]]
    for case in cases:
        assert case["err"] < 1e-5 and case["h_err"] == 0.0, case
        assert case["h_is_x"] == (not case["with_y"]), case
        # rows gathered from a table (the embedding lookup folded into the first norm)
        assert case["gather_h_err"] == 0.0 and case["gather_err"] < 1e-5, case
        assert case["gather_twin_equal"] and case["gather_h_is_copy"], case


def test_generation_with_the_kernels_equals_torch(checked):
    for name, case in checked["generation"].items():
        assert case["tokens_equal"] and case["mask_equal"], (name, case)
        assert case["logprob_err"] < 1e-4, (name, case)
        # fc1 + SwiGLU as one Triton GEMM, every L2 hint asked for, PDL off; with and without
        # log-probs (greedy without them: the argmax's pass 2 in the bookkeeping kernel)
        assert case["gemm_tokens_equal"] and case["gemm_mask_equal"], (name, case)
        assert case["gemm_logprob_err"] < 1e-4 and case["gemm_no_logprobs_tokens_equal"], (name,
                                                                                          case)
        # each row's attention over its own columns only (rollout.kernel_options.own_columns_only)
        assert case["own_tokens_equal"] and case["own_logprob_err"] < 1e-4, (name, case)
        assert case["tokens"] > 50, (name, case)
    assert checked["generation"]["greedy_window_compaction"]["compactions"] > 0


def test_qk_norm_in_the_rope_kernels(checked):
    """Qwen3's q/k norm inside the decode and prefill RoPE kernels: their twins' output and cache,
    the decoder's own norm + RoPE, and the generator's tokens with the kernels equal torch's."""
    case = checked["qk_norm"]
    assert len(case["decode"]) == len(case["prefill"]) == 2
    for c in case["decode"]:
        assert c["attn_err"] < 1e-5 and c["cache_err"] < 1e-5 and c["norm_effect"] > 0.1, c
    for c in case["prefill"]:
        assert c["q_err"] < 1e-5 and c["cache_err"] < 1e-5, c
        assert c["q_vs_decoder"] < 1e-5 and c["k_vs_decoder"] < 1e-5, c
    gen = case["generation"]
    assert gen["tokens_equal"] and gen["mask_equal"] and gen["logprob_err"] < 1e-4, gen
    assert gen["tokens"] > 50, gen


def test_pdl_option_reaches_every_launch(checked):
    """DecodeOptions.pdl is what each kernel module hands launch_opts (no module global)."""
    modules = {"layer_ops", "rope_attention", "next_token", "gemm"}
    assert checked["launch"] == {"True": dict.fromkeys(modules, [True]),
                                 "False": dict.fromkeys(modules, [False])}


def test_generation_with_the_kernels_at_tp2(checked):
    """TP_g = 2 (2 gloo ranks, one query group each): both ranks generate the torch path's tokens."""
    assert len(checked["tp2"]) == 2
    for rank in checked["tp2"]:
        for name, case in rank.items():
            assert case["tokens_equal"] and case["logprob_err"] < 1e-4, (name, case)
            assert case["tokens"] > 20, (name, case)


def test_auto_takes_triton_only_where_it_applies():
    """rollout.decode_kernels=auto (the default): triton on CUDA with triton installed and a
    power-of-two head_dim >= 16; torch on CPU (also under the interpreter) and for other head_dims;
    explicit values as given."""
    from hybridflow.rollout.options import resolve_decode_kernels

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_decode_kernels("auto", cpu, 64) == "torch"
    assert resolve_decode_kernels("auto", cuda, 64) == ("triton" if kern.HAVE_TRITON else "torch")
    assert resolve_decode_kernels("auto", cuda, 80) == "torch"
    assert resolve_decode_kernels("auto", cuda, 8) == "torch"
    assert resolve_decode_kernels("triton", cpu, 8) == "triton"  # the generator then says why not
    assert resolve_decode_kernels("torch", cuda, 64) == "torch"
    assert RolloutConfig().decode_kernels == "auto"


def test_decode_kernels_errors_name_the_key(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gen = make(ModelConfig(num_layers=1, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                           num_query_groups=2, vocab_size=37))
    with pytest.raises(ValueError, match="rollout.decode_kernels='cuda': expected 'auto', 'torch' "
                                         "or 'triton'"):
        gen.generate(PROMPTS, cfg=rc(decode_kernels="cuda"), eos_id=5, pad_id=0, seed=0)
    if kern.HAVE_TRITON:
        match = "rollout.decode_kernels=triton needs a CUDA device"
    else:
        match = "rollout.decode_kernels=triton needs the triton package"
    with pytest.raises(ValueError, match=match):
        gen.generate(PROMPTS, cfg=rc(decode_kernels="triton"), eos_id=5, pad_id=0, seed=0)
    if kern.HAVE_TRITON:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        small = make()  # head_dim 8
        with pytest.raises(ValueError, match="power-of-two head_dim >= 16 \\(the model has 8\\)"):
            small.generate(PROMPTS, cfg=rc(decode_kernels="triton"), eos_id=5, pad_id=0, seed=0)


def test_fp8_kv_cache_in_the_fused_kernel(checked):
    """rollout.kv_cache_dtype=fp8: the fused kernel writes the codes and scales its twins write (the
    same bits where RoPE leaves k as projected; the fp32 rounding of RoPE otherwise), only at
    column cur, attends over the dequantized cache as the twins do, and the generator with the
    kernels (the prefill's K/V quantized from a scratch pair, windows, compaction) generates the
    torch path's tokens on the fp8 cache."""
    for case in checked["kv_fp8"]["attention"]:
        assert case["bits_equal"] and case["only_cur_written"], case
        assert case["err"] < 2e-5 and case["rope_err"] < 2e-5, case
    assert any(c["per_row"] for c in checked["kv_fp8"]["attention"])
    gens = checked["kv_fp8"]["generation"]
    for name, case in gens.items():
        assert case["tokens_equal"] and case["mask_equal"] and case["fp8_cache"], (name, case)
        assert case["logprob_err"] < 1e-4 and case["tokens"] > 100, (name, case)
        assert case["own_tokens_equal"] and case["own_logprob_err"] < 1e-4, (name, case)
    assert gens["greedy_window_compaction"]["compactions"] > 0
