"""parallel.fused_elementwise on a GPU (hybridflow/models/fused.py): the training model with
Megatron's fused SwiGLU and the fused RoPE (kernels/rope_train.py at a head_dim it takes, the
compiled formula at one it does not) gives the unfused model's loss and gradients (fp32: to rounding; bf16: within bf16 rounding of the activations), at a fixed and at another sequence
length (dynamic shapes), in training and under no_grad; the fused model keeps less for backward."""

import pytest
import torch

from hybridflow.config import ModelConfig

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

# head_dim 32 (the Triton RoPE) and 48 (half 24, not a power of two: the compiled fallback)
CFGS = {"triton": ModelConfig(num_layers=2, hidden_size=128, ffn_hidden_size=384,
                              num_attention_heads=4, num_query_groups=2, vocab_size=100,
                              add_qkv_bias=True),
        "compiled": ModelConfig(num_layers=2, hidden_size=192, ffn_hidden_size=384,
                                num_attention_heads=4, num_query_groups=2, vocab_size=100,
                                add_qkv_bias=True)}


@pytest.fixture(scope="module")
def ctx(single_rank_ctx):
    return single_rank_ctx


def _build(ctx, cfg, fused, precision):
    from hybridflow.models.build import build_model

    torch.manual_seed(0)
    model = build_model(cfg, role="actor", ctx=ctx, precision=precision,
                        fused_elementwise=fused).cuda()
    return model.to(torch.bfloat16) if precision == "bf16" else model


def _step(model, ids, vocab_size):
    from hybridflow.models.logprob import vocab_parallel_logprobs

    model.zero_grad(set_to_none=True)
    pos = torch.arange(ids.shape[1], device="cuda").expand_as(ids)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    logits = model(ids, pos, None)
    lp = vocab_parallel_logprobs(logits.float(), torch.roll(ids, -1, 1), tp_group=None,
                                 true_vocab_size=vocab_size)
    kept = torch.cuda.memory_allocated() - base
    (-lp.mean()).backward()
    return lp.detach(), {n: p.grad.float().clone() for n, p in model.named_parameters()}, kept


@pytest.mark.parametrize("kernel", sorted(CFGS))
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fused_equals_unfused(ctx, precision, kernel):
    from megatron.core.models.common.embeddings import rope_utils

    from hybridflow.kernels.rope_train import supported
    from hybridflow.models import fused as fused_mod

    cfg = CFGS[kernel]
    hd = cfg.hidden_size // cfg.num_attention_heads
    table = torch.empty(1, 1, 1, hd, device="cuda")
    assert supported(torch.empty(1, 1, 1, hd, device="cuda"), table) == (kernel == "triton")

    g = torch.Generator(device="cuda").manual_seed(1)
    tol = dict(rtol=1e-4, atol=1e-5) if precision == "fp32" else dict(rtol=3e-2, atol=3e-2)
    try:
        plain = _build(ctx, cfg, False, precision)
        assert rope_utils._apply_rotary_pos_emb_bshd is fused_mod._UNFUSED_ROPE
        fused = _build(ctx, cfg, True, precision)
        fused.load_state_dict(plain.state_dict())
        assert fused.config.bias_activation_fusion and not plain.config.bias_activation_fusion
        for S in (48, 80):  # a second length: the compiled RoPE is dynamic, no wrong reuse
            ids = torch.randint(0, cfg.vocab_size, (3, S), device="cuda", generator=g)
            fused_mod.use_fused_rope(False)
            lp0, g0, kept0 = _step(plain, ids, cfg.vocab_size)
            fused_mod.use_fused_rope(True)
            lp1, g1, kept1 = _step(fused, ids, cfg.vocab_size)
            torch.testing.assert_close(lp1, lp0, **tol)
            for n in g0:
                err = (g1[n] - g0[n]).norm() / g0[n].norm().clamp(min=1e-12)
                assert err < (1e-4 if precision == "fp32" else 3e-2), (n, err.item())
            assert kept1 < kept0, (kept1, kept0)  # the silu output and the up copy are not kept
            with torch.no_grad():
                pos = torch.arange(S, device="cuda").expand(3, S)
                torch.testing.assert_close(fused(ids, pos, None).float(),
                                           plain(ids, pos, None).float(), **tol)
    finally:
        fused_mod.use_fused_rope(False)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_rope_from_qkv_equals_the_copy(ctx, precision):
    """parallel.rope_from_qkv: the RoPE kernel reading q in the QKV projection's groups gives the
    model's loss and gradients bit for bit as reading Megatron's reshaped copy of it."""
    from hybridflow.models import fused as fused_mod
    from hybridflow.models.build import build_model

    cfg = CFGS["triton"]
    models = {}
    for grouped in (False, True):
        torch.manual_seed(0)
        m = build_model(cfg, role="actor", ctx=ctx, precision=precision, fused_elementwise=True,
                        rope_from_qkv=grouped).cuda()
        models[grouped] = m.to(torch.bfloat16) if precision == "bf16" else m
    models[True].load_state_dict(models[False].state_dict())
    ids = torch.randint(0, cfg.vocab_size, (3, 64), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(2))
    try:
        got = {}
        for grouped, m in models.items():
            fused_mod.use_rope_from_qkv(grouped)
            got[grouped] = _step(m, ids, cfg.vocab_size)
        assert torch.equal(got[True][0], got[False][0])
        for n, g in got[False][1].items():
            assert torch.equal(got[True][1][n], g), n
    finally:
        fused_mod.use_rope_from_qkv(False)
        fused_mod.use_fused_rope(False)
