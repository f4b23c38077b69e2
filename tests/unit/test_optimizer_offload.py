"""actor.offload_optimizer on CPU: the optimizer's master weights and Adam state round-trip through
their host buffers bit for bit, and updates with offload equal updates without (fp32 and bf16, where
the fp32 master copies are offloaded too). The device here is the CPU: "host" is a second buffer."""

import pytest
import torch

from hybridflow.config import ModelConfig, OptimConfig, ParallelConfig
from tests.dist.test_parallel_parity import _global_batch

MODEL = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                    num_query_groups=2, vocab_size=50)


@pytest.fixture(scope="module")
def ctx(single_rank_ctx):
    return single_rank_ctx


def _loss(out, mb):
    from hybridflow.algo import get_policy_loss

    loss, _ = get_policy_loss("vanilla")(
        logprobs=out["logprobs"], old_logprobs=mb.old_logprobs, advantages=mb.advantages,
        response_mask=mb.response_mask, num_tokens=int(mb.response_mask.sum()))
    return loss, {"pg_loss": loss}


def _train(ctx, precision, offload):
    from hybridflow.engine import Engine

    torch.manual_seed(0)
    eng = Engine(role="actor", model_cfg=MODEL, ctx=ctx, parallel=ParallelConfig(),
                 precision=precision, optim=OptimConfig(lr=1e-2), offload_optimizer=offload)
    for step in range(2):
        eng.train_step(_global_batch(), _loss, micro_batch_size=4)
        if offload:  # between steps the state is the host buffers
            host = {t.data_ptr() for t in eng._opt_offload._host.values()}
            assert eng._opt_offload.on_host and host
            for _, get, _ in eng._opt_offload._slots():
                assert get().data_ptr() in host
    return {n: p.detach().clone() for n, p in eng.module.named_parameters()}, eng


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_offloaded_updates_equal_plain_ones(ctx, precision):
    plain, _ = _train(ctx, precision, False)
    offloaded, eng = _train(ctx, precision, True)
    for n, w in plain.items():
        assert torch.equal(offloaded[n], w), n
    slots = list(eng._opt_offload._slots())
    kinds = {key[1] for key, _, _ in slots}
    assert "state" in kinds and (("param" in kinds) == (precision == "bf16"))


def test_round_trip_is_bitwise(ctx):
    _, eng = _train(ctx, "bf16", True)
    off = eng._opt_offload
    before = [get().clone() for _, get, _ in off._slots()]
    off.to_device()
    moved = [get() for _, get, _ in off._slots()]
    host = {t.data_ptr() for t in off._host.values()}
    assert all(t.data_ptr() not in host for t in moved)  # fresh device tensors
    assert all(torch.equal(a, b) for a, b in zip(before, moved))
    off.to_host()
    assert all(torch.equal(a, get()) for a, (_, get, _) in zip(before, off._slots()))


def test_grad_buffers_exist_only_in_the_update(ctx):
    from hybridflow.engine import Engine

    plain, _ = _train(ctx, "bf16", False)
    torch.manual_seed(0)
    eng = Engine(role="actor", model_cfg=MODEL, ctx=ctx, parallel=ParallelConfig(),
                 precision="bf16", optim=OptimConfig(lr=1e-2), offload_grads=True,
                 offload_optimizer=True)
    buffers = [b.grad_data for b in eng.model.buffers]
    assert buffers and all(b.untyped_storage().nbytes() == 0 for b in buffers)
    for _ in range(2):
        metrics = eng.train_step(_global_batch(), _loss, micro_batch_size=4)
        assert metrics["grad_norm"] > 0
        assert all(b.untyped_storage().nbytes() == 0 for b in buffers)  # released again
    for n, p in eng.module.named_parameters():
        assert torch.equal(p, plain[n]), n
