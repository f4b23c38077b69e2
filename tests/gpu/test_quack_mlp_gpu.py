"""parallel.mlp_kernel=quack on a GPU (models/quack_mlp.py): the model with quack's fused gated MLP
gives Megatron's MLP's log-probs and gradients within bf16 rounding, at two sequence lengths, in
training and under no_grad, and keeps less for backward (fc1's output only, not the SwiGLU's)."""

import pytest
import torch

from hybridflow.config import ModelConfig

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
try:
    import quack.mlp  # noqa: F401
except Exception as e:  # noqa: BLE001
    pytest.skip(f"needs quack-kernels (installed with flash-attn-4): {e}", allow_module_level=True)

CFG = ModelConfig(num_layers=2, hidden_size=128, ffn_hidden_size=384, num_attention_heads=4,
                  num_query_groups=2, vocab_size=100, add_qkv_bias=True)


@pytest.fixture(scope="module")
def ctx(single_rank_ctx):
    return single_rank_ctx


def _build(ctx, kernel):
    from hybridflow.models.build import build_model

    torch.manual_seed(0)
    return build_model(CFG, role="actor", ctx=ctx, precision="bf16", fused_elementwise=True,
                       mlp_kernel=kernel).cuda().to(torch.bfloat16)


def _step(model, ids):
    from hybridflow.models.logprob import vocab_parallel_logprobs

    model.zero_grad(set_to_none=True)
    pos = torch.arange(ids.shape[1], device="cuda").expand_as(ids)
    base = torch.cuda.memory_allocated()
    logits = model(ids, pos, None)
    lp = vocab_parallel_logprobs(logits.float(), torch.roll(ids, -1, 1), tp_group=None,
                                 true_vocab_size=CFG.vocab_size)
    kept = torch.cuda.memory_allocated() - base
    (-lp.mean()).backward()
    return lp.detach(), {n: p.grad.float().clone() for n, p in model.named_parameters()}, kept


def test_quack_mlp_equals_megatrons(ctx):
    g = torch.Generator(device="cuda").manual_seed(1)
    plain, fused = _build(ctx, "megatron"), _build(ctx, "quack")
    fused.load_state_dict(plain.state_dict())
    for S in (48, 80):
        ids = torch.randint(0, CFG.vocab_size, (3, S), device="cuda", generator=g)
        lp0, g0, kept0 = _step(plain, ids)
        lp1, g1, kept1 = _step(fused, ids)
        torch.testing.assert_close(lp1, lp0, rtol=3e-2, atol=3e-2)
        for n in g0:
            err = (g1[n] - g0[n]).norm() / g0[n].norm().clamp(min=1e-12)
            assert err < 3e-2, (n, err.item())
        assert kept1 < kept0, (kept1, kept0)
        with torch.no_grad():
            pos = torch.arange(S, device="cuda").expand(3, S)
            torch.testing.assert_close(fused(ids, pos, None).float(),
                                       plain(ids, pos, None).float(), rtol=3e-2, atol=3e-2)
