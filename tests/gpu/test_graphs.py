"""Per-layer CUDA graphs (hybridflow/models/graphs.py) give the eager loss and gradients, replay
correctly on new inputs, and fall back to eager for another shape and under no_grad."""

import pytest
import torch

from hybridflow.config import ModelConfig

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

CFG = ModelConfig(num_layers=3, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                  num_query_groups=2, vocab_size=100, add_qkv_bias=True)
B, S = 2, 16


@pytest.fixture(scope="module")
def model(single_rank_ctx):
    from hybridflow.models.build import build_model

    return build_model(CFG, role="actor", ctx=single_rank_ctx, precision="fp32").cuda()


def _step(model, ids):
    from hybridflow.models.logprob import vocab_parallel_logprobs

    model.zero_grad(set_to_none=True)
    pos = torch.arange(ids.shape[1], device="cuda").expand_as(ids)
    logits = model(ids, pos, None)
    loss = -vocab_parallel_logprobs(logits, torch.roll(ids, -1, 1), tp_group=None,
                                    true_vocab_size=CFG.vocab_size).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_graphed_layers_match_eager(model):
    from hybridflow.models.graphs import graph_layers, ungraph_layers

    g = torch.Generator(device="cuda").manual_seed(0)
    batches = [torch.randint(0, CFG.vocab_size, (B, S), device="cuda", generator=g)
               for _ in range(2)]
    other = torch.randint(0, CFG.vocab_size, (B, S + 8), device="cuda", generator=g)
    eager = [_step(model, ids) for ids in batches + [other]]
    with torch.no_grad():
        eager_nograd = model(batches[0], torch.arange(S, device="cuda").expand(B, S), None)
    graph_layers(model, micro_batch_size=B, seq_len=S)
    try:
        for ids, (loss, grads) in zip(batches + [other], eager):
            g_loss, g_grads = _step(model, ids)
            torch.testing.assert_close(g_loss, loss, rtol=1e-5, atol=1e-5)
            for n in grads:
                torch.testing.assert_close(g_grads[n], grads[n], rtol=1e-4, atol=1e-5, msg=n)
        with torch.no_grad():
            out = model(batches[0], torch.arange(S, device="cuda").expand(B, S), None)
        torch.testing.assert_close(out, eager_nograd, rtol=1e-5, atol=1e-5)
    finally:
        ungraph_layers(model)
