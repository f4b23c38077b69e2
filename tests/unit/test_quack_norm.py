"""parallel.norm_kernels off CUDA: a model whose RMSNorms are QuackRMSNorm computes exactly what
torch's compute (its forward falls back); resolving the option is tested with the MLP's
(tests/unit/test_quack_mlp.py, one rule). quack's kernel itself is checked against fp32 on a GPU in
tests/gpu/test_quack_norm_gpu.py."""

import torch

from hybridflow.config import ModelConfig
from hybridflow.models.build import QuackRMSNorm

MODEL = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                    num_query_groups=2, vocab_size=50, qk_layernorm=True)


def test_every_rmsnorm_adopted_and_equal_on_cpu(single_rank_ctx):
    from hybridflow.models.build import TorchRMSNorm, build_model
    from tests.dist.parity_util import fill_deterministic

    out = []
    for quack in (False, True):
        model = build_model(MODEL, role="actor", ctx=single_rank_ctx, quack_norm=quack)
        fill_deterministic(model, num_layers=MODEL.num_layers)
        kinds = [type(m) for m in model.modules() if isinstance(m, TorchRMSNorm)]
        # per layer: input, pre-MLP, q and k norms; then the final norm
        assert len(kinds) == 4 * MODEL.num_layers + 1
        assert all((k is QuackRMSNorm) == quack for k in kinds), kinds
        ids = torch.arange(1, 13).view(2, 6) % 50
        out.append(model(ids, torch.arange(6).expand(2, 6), None))
    torch.testing.assert_close(out[0], out[1], rtol=0, atol=0)
