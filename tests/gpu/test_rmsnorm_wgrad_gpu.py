"""kernels/rmsnorm_wgrad.py on a GPU (parallel.norm_wgrad=triton): the norm's output and input
gradient are torch's own kernels' (bit-equal), the weight gradient in bf16 is as close to fp32 as
torch's, at the recipe's shapes; a model with it gives torch's log-probs and gradients."""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


@pytest.mark.parametrize("M,N", [(1, 896), (777, 896), (20480, 896), (4096, 1536), (300, 200)])
def test_bf16_against_fp32(M, N):
    from hybridflow.kernels.rmsnorm_wgrad import rms_norm

    g = torch.Generator(device="cuda").manual_seed(M + N)
    x = torch.randn(M, 1, N, device="cuda", generator=g, dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(N, device="cuda", generator=g)).bfloat16()
    dout = torch.randn(x.shape, device="cuda", generator=g, dtype=torch.bfloat16)
    x32, w32 = (t.float().requires_grad_() for t in (x, w))
    torch.nn.functional.rms_norm(x32, (N,), w32, 1e-6).backward(dout.float())
    out = {}
    for name, fn in (("torch", lambda a, b: torch.nn.functional.rms_norm(a, (N,), b, 1e-6)),
                     ("triton", lambda a, b: rms_norm(a, b, 1e-6))):
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xa, wa)
        y.backward(dout)
        out[name] = (y, xa.grad, wa.grad)
    assert torch.equal(out["triton"][0], out["torch"][0])
    assert torch.equal(out["triton"][1], out["torch"][1])
    err = {k: float((v[2].float() - w32.grad).abs().max()) for k, v in out.items()}
    assert err["triton"] <= 2 * err["torch"] + 1e-3 * float(w32.grad.abs().max()), err


def test_model_with_it_equals_torchs(single_rank_ctx):
    from hybridflow.config import ModelConfig
    from hybridflow.models.build import TorchRMSNorm, build_model
    from hybridflow.models.logprob import vocab_parallel_logprobs

    cfg = ModelConfig(num_layers=2, hidden_size=128, ffn_hidden_size=384, num_attention_heads=4,
                      num_query_groups=2, vocab_size=100, add_qkv_bias=True)
    model = build_model(cfg, role="actor", ctx=single_rank_ctx, precision="fp32",
                        norm_wgrad=True).cuda()
    norms = [m for m in model.modules() if isinstance(m, TorchRMSNorm)]
    ids = torch.randint(0, 100, (3, 64), device="cuda")
    pos = torch.arange(64, device="cuda").expand(3, 64)
    out = {}
    for flag in (False, True):  # one model, its norms switched: the same weights on both sides
        for m in norms:
            m.wgrad_kernel = flag
        model.zero_grad(set_to_none=True)
        lp = vocab_parallel_logprobs(model(ids, pos, None).float(), torch.roll(ids, -1, 1),
                                     tp_group=None, true_vocab_size=100)
        (-lp.mean()).backward()
        out[flag] = (lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(out[True][0], out[False][0], rtol=0, atol=0)
    for n, grad in out[False][1].items():
        torch.testing.assert_close(out[True][1][n], grad, rtol=1e-4, atol=1e-6, msg=n)
