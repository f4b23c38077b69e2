"""parallel.train_cuda_graphs: refused, naming the keys, with activation recompute or a pipeline;
on CPU a no-op (the training results are the eager ones, and no graph metric is reported). The
graphed runs themselves are compared with eager ones on a GPU (tests/gpu/test_train_graphs_gpu.py)."""

from types import SimpleNamespace

import pytest
import torch

from hybridflow.config import ModelConfig, OptimConfig, ParallelConfig

MODEL = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                    num_query_groups=2, vocab_size=50)


@pytest.mark.parametrize("parallel,pp,match", [
    (ParallelConfig(train_cuda_graphs=True, activation_checkpointing=True), 1,
     "parallel.train_cuda_graphs=true and parallel.activation_checkpointing=true"),
    (ParallelConfig(train_cuda_graphs=True), 2, "pipeline_parallel_size=1, got 2"),
])
def test_refused_combinations(parallel, pp, match):
    from hybridflow.engine import Engine

    ctx = SimpleNamespace(pp_size=pp)  # refused before anything is built
    with pytest.raises(ValueError, match=match):
        Engine(role="actor", model_cfg=MODEL, ctx=ctx, parallel=parallel, precision="fp32",
               optim=OptimConfig(lr=1e-3))


def test_cpu_runs_eager(single_rank_ctx):
    from hybridflow.algo.objectives import actor_objective
    from hybridflow.config import AlgoConfig
    from hybridflow.data.batch import RolloutBatch
    from hybridflow.engine import Engine
    from tests.dist.parity_util import fill_deterministic

    ctx = single_rank_ctx
    g = torch.Generator().manual_seed(0)
    ones = torch.ones(4, 5, dtype=torch.long)
    batch = RolloutBatch(prompt_ids=torch.randint(1, 50, (4, 5), generator=g), prompt_mask=ones,
                         response_ids=torch.randint(1, 50, (4, 5), generator=g),
                         response_mask=ones, group_ids=torch.arange(4) // 2,
                         indices=torch.arange(4), old_logprobs=torch.full((4, 5), -3.9),
                         advantages=torch.randn(4, 1, generator=g))
    results = []
    for graphs in (False, True):
        eng = Engine(role="actor", model_cfg=MODEL, ctx=ctx, precision="fp32",
                     parallel=ParallelConfig(train_cuda_graphs=graphs),
                     optim=OptimConfig(lr=1e-3))
        fill_deterministic(eng.module, num_layers=MODEL.num_layers)
        loss_fn = actor_objective(AlgoConfig(), num_tokens=20, num_seqs=4)
        results.append(eng.train_step(batch, loss_fn, micro_batch_size=2))
    assert "graphed_micro_batch_frac" not in results[1]
    assert results[1] == results[0]
