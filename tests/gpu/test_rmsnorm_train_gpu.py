"""kernels/rmsnorm_train.py on a GPU in bf16 (parallel.norm_backward=triton): the input and weight
gradients against fp32, as close as torch's own bf16 backward, at the training passes' widths
(Qwen2.5-Coder-0.5B's 896, a q/k norm's 128) and packed micro-batch sizes; and a model built
with it gives torch's log-probs and gradients."""

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


@pytest.mark.parametrize("rows,width", [(20480, 896), (777, 896), (4096, 128), (1, 896)])
def test_bf16_against_fp32(rows, width):
    from hybridflow.kernels.rmsnorm_train import rms_norm

    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 1, width, device="cuda", generator=g, dtype=torch.bfloat16) * 2
    w = (1 + 0.2 * torch.randn(width, device="cuda", generator=g)).bfloat16()
    grad = torch.randn(x.shape, device="cuda", generator=g, dtype=torch.bfloat16)
    x32, w32 = (t.float().requires_grad_() for t in (x, w))
    F.rms_norm(x32, (width,), w32, 1e-6).backward(grad.float())
    errs = {}
    for name, fn in (("triton", lambda a, b: rms_norm(a, b, 1e-6, impl="triton")),
                     ("torch", lambda a, b: F.rms_norm(a, (width,), b, 1e-6))):
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        fn(xa, wa).backward(grad)
        errs[name] = (float((xa.grad.float() - x32.grad).abs().max() / x32.grad.abs().max()),
                      float((wa.grad.float() - w32.grad).abs().max() / w32.grad.abs().max()))
    assert errs["triton"][0] < 1e-2 and errs["triton"][1] < 1e-2, errs
    # fp32 accumulation of the weight gradient over all rows: no worse than torch's
    assert errs["triton"][0] <= 2 * errs["torch"][0] + 1e-6, errs
    assert errs["triton"][1] <= 2 * errs["torch"][1] + 1e-6, errs


def test_model_with_it_equals_torchs(single_rank_ctx):
    from hybridflow.config import ModelConfig
    from hybridflow.models.build import build_model
    from hybridflow.models.logprob import vocab_parallel_logprobs

    cfg = ModelConfig(num_layers=2, hidden_size=128, ffn_hidden_size=384, num_attention_heads=4,
                      num_query_groups=2, vocab_size=100, add_qkv_bias=True)
    ids = torch.randint(0, 100, (3, 64), device="cuda")
    pos = torch.arange(64, device="cuda").expand(3, 64)
    out = {}
    for kind in ("torch", "triton"):
        torch.manual_seed(0)
        model = build_model(cfg, role="actor", ctx=single_rank_ctx, precision="fp32",
                            norm_backward=kind).cuda()
        lp = vocab_parallel_logprobs(model(ids, pos, None).float(), torch.roll(ids, -1, 1),
                                     tp_group=None, true_vocab_size=100)
        (-lp.mean()).backward()
        out[kind] = (lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(out["triton"][0], out["torch"][0], rtol=0, atol=0)
    for n, grad in out["torch"][1].items():
        torch.testing.assert_close(out["triton"][1][n], grad, rtol=1e-4, atol=1e-6, msg=n)
