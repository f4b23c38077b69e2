"""parallel.norm_kernels=quack on a GPU (models/quack_norm.py): quack's RMSNorm against an fp32
reference (output, input gradient, weight gradient) at a ragged token count and both widths the
GSM8K models use, as close as torch's bf16 RMSNorm is; and a model with it gives the torch-norm
model's log-probs within bf16 rounding."""

import pytest
import torch
import torch.nn.functional as F

from hybridflow.config import ModelConfig
from tests.gpu.quack_util import require_quack

pytestmark = pytest.mark.gpu
require_quack()


def _errors(norm, x, dout):
    x32, w32 = (t.detach().float().requires_grad_(True) for t in (x, norm.weight))
    ref = F.rms_norm(x32, (x.shape[-1],), w32, eps=norm.eps)
    ref.backward(dout.float())
    x = x.detach().requires_grad_(True)
    norm.weight.grad = None
    out = norm(x)
    out.backward(dout)

    def rel(got, want):
        return ((got.float() - want).norm() / want.norm()).item()

    return rel(out, ref), rel(x.grad, x32.grad), rel(norm.weight.grad, w32.grad)


@pytest.mark.parametrize("hidden", [896, 1536])
def test_quack_rmsnorm_as_close_to_fp32_as_torchs(hidden, single_rank_ctx):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from hybridflow.models.build import QuackRMSNorm, TorchRMSNorm

    cfg = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=8,
                            params_dtype=torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(hidden)
    x = torch.randn(3001, hidden, device="cuda", generator=g).bfloat16()
    dout = torch.randn(x.shape, device="cuda", generator=g).bfloat16()
    norm = TorchRMSNorm(cfg, hidden, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(hidden, device="cuda", generator=g))
    torch_err = _errors(norm, x, dout)
    QuackRMSNorm.adopt(torch.nn.Sequential(norm))
    assert type(norm) is QuackRMSNorm
    quack_err = _errors(norm, x, dout)
    for what, q, t in zip(("out", "dx", "dw"), quack_err, torch_err):
        assert q < max(2 * t, 1e-2), (what, q, t)


def test_model_with_quack_norms_gives_torchs_logprobs(single_rank_ctx):
    from hybridflow.models.build import build_model
    from hybridflow.models.logprob import vocab_parallel_logprobs

    cfg = ModelConfig(num_layers=2, hidden_size=128, ffn_hidden_size=384, num_attention_heads=4,
                      num_query_groups=2, vocab_size=100, add_qkv_bias=True)
    ids = torch.randint(0, cfg.vocab_size, (3, 80), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(1))
    pos = torch.arange(80, device="cuda").expand(3, 80)
    lps, state = [], None
    for quack in (False, True):
        torch.manual_seed(0)
        model = build_model(cfg, role="actor", ctx=single_rank_ctx, precision="bf16",
                            fused_elementwise=True, quack_norm=quack).cuda().to(torch.bfloat16)
        if state is None:
            state = model.state_dict()
        model.load_state_dict(state)
        with torch.no_grad():
            logits = model(ids, pos, None)
        lps.append(vocab_parallel_logprobs(logits.float(), torch.roll(ids, -1, 1), tp_group=None,
                                           true_vocab_size=cfg.vocab_size))
    torch.testing.assert_close(lps[1], lps[0], rtol=3e-2, atol=3e-2)
