"""parallel.mlp_kernel=quack (models/quack_mlp.py): the settings it refuses, each naming its key;
the CPU refusal at build; and the wiring: with the fused MLP replaced by the same math in torch
(quack's kernels need a GPU: tests/gpu/test_quack_mlp_gpu.py runs them), the patched model gives
the unpatched one's outputs and the gradients of fc1's [gate; up] rows and of fc2."""
import pytest
import torch
import torch.nn.functional as F

from hybridflow.config import ModelConfig, load_config
from hybridflow.config_checks import validate

CFG = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4,
                  num_query_groups=2, vocab_size=64)


def _cfg(*overrides, world_size=1):
    cfg = load_config(["experiment=demo", *overrides])
    validate(cfg, world_size=world_size)
    return cfg


def test_megatron_is_the_default_and_quack_refuses_what_it_cannot_run():
    assert _cfg().parallel.mlp_kernel == "megatron"
    assert _cfg("parallel.mlp_kernel=quack").parallel.mlp_kernel == "quack"
    with pytest.raises(ValueError, match="parallel.mlp_kernel='fused' is not one of"):
        _cfg("parallel.mlp_kernel=fused")
    for overrides, why in (
            (["parallel.tensor_parallel_size=2"], "parallel.tensor_parallel_size=2"),
            (["actor.lora.rank=8"], "actor.lora.rank=8"),
            (["parallel.train_cuda_graphs=true"], "parallel.train_cuda_graphs=true"),
            (["trainer.precision=fp32"], "trainer.precision=fp32")):
        with pytest.raises(ValueError, match=f"mlp_kernel=quack does not run with {why}"):
            _cfg("parallel.mlp_kernel=quack", *overrides, world_size=2)


def test_build_refuses_without_a_gpu(single_rank_ctx):
    from hybridflow.models.build import build_model

    if torch.cuda.is_available():
        pytest.skip("the refusal is for machines without CUDA")
    with pytest.raises(ValueError, match="parallel.mlp_kernel=quack needs a CUDA GPU"):
        build_model(CFG, role="actor", ctx=single_rank_ctx, mlp_kernel="quack")


def test_missing_quack_is_named():
    from hybridflow.models import quack_mlp

    try:
        import quack.mlp  # noqa: F401
        pytest.skip("quack-kernels is installed here")
    except Exception:  # noqa: BLE001
        pass
    quack_mlp.quack_mlp_func.cache_clear()
    with pytest.raises(ValueError, match="parallel.mlp_kernel=quack needs quack-kernels"):
        quack_mlp.quack_mlp_func()


def _same_math(x, w1, w2, activation, concat_layout, tuned):
    """quack.mlp.mlp_func's result in torch: fc1's rows [gate; up], silu(gate) * up, fc2."""
    assert activation == "swiglu" and concat_layout is True and x.ndim == 2
    assert tuned is False  # the autotuner's cache is per shape: a tuning per micro-batch
    gate, up = F.linear(x, w1).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


def test_patched_mlp_gives_megatrons_outputs_and_gradients(single_rank_ctx):
    from hybridflow.models.build import build_model
    from hybridflow.models.quack_mlp import use_quack_mlp

    torch.manual_seed(0)
    plain = build_model(CFG, role="actor", ctx=single_rank_ctx)
    torch.manual_seed(0)
    patched = build_model(CFG, role="actor", ctx=single_rank_ctx)
    patched.load_state_dict(plain.state_dict())
    assert use_quack_mlp(patched, mlp_func=_same_math) == CFG.num_layers
    ids = torch.randint(0, CFG.vocab_size, (3, 10), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(10).expand(3, 10)
    outs, grads = [], []
    for model in (plain, patched):
        model.zero_grad(set_to_none=True)
        out = model(ids, pos, None)
        out.float().square().mean().backward()
        outs.append(out.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if "linear_fc" in n})
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    assert len(grads[0]) == 2 * CFG.num_layers
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-5, atol=1e-6)
