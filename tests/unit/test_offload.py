"""Engine.offload / onload (trainer.offload_ref) on CPU: the weights round-trip unchanged, the host
copy is made once and reused (later offloads copy nothing back), a prefetching onload is waited for
by the next one, and a trainable engine refuses. The CUDA path (pinned host copy, side-stream
prefetch) is tests/gpu/test_offload_gpu.py."""

import pytest
import torch

from hybridflow.config import ModelConfig, OptimConfig, ParallelConfig

MODEL = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                    num_query_groups=2, vocab_size=50)


@pytest.fixture(scope="module")
def ctx(single_rank_ctx):
    return single_rank_ctx


def test_round_trip_and_one_host_copy(ctx):
    from hybridflow.engine import Engine

    ref = Engine(role="ref", model_cfg=MODEL, ctx=ctx, parallel=ParallelConfig(), precision="fp32")
    before = {n: p.detach().clone() for n, p in ref.module.named_parameters()}
    ref.offload()
    host = list(ref._host)
    for _ in range(2):
        ref.onload(prefetch=True)
        ref.onload()  # waits for the prefetch; a second call is a no-op
        for n, p in ref.module.named_parameters():
            assert p.device == ref.device and torch.equal(p, before[n]), n
        ref.offload()
        assert all(a is b for a, b in zip(ref._host, host))  # the first host copy, no new one
        assert all(p.data_ptr() == h.data_ptr() for p, h in zip(ref.model.parameters(), host))


def test_trainable_engine_is_not_offloaded(ctx):
    from hybridflow.engine import Engine

    actor = Engine(role="actor", model_cfg=MODEL, ctx=ctx, parallel=ParallelConfig(),
                   precision="fp32", optim=OptimConfig(lr=1e-3))
    with pytest.raises(AssertionError, match="only frozen roles"):
        actor.offload()
