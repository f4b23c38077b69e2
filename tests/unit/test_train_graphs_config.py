"""parallel.train_cuda_graphs: refused, naming the keys, with activation recompute or a pipeline;
on CPU a no-op (the training results are the eager ones, and no graph metric is reported). The
graphed runs themselves are compared with eager ones on a GPU (tests/gpu/test_train_graphs_gpu.py)."""

import pytest
import torch

from hybridflow.config import ModelConfig, OptimConfig, ParallelConfig

MODEL = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                    num_query_groups=2, vocab_size=50)


@pytest.mark.parametrize("overrides,world_size,match", [
    (["parallel.train_cuda_graphs=true", "parallel.activation_checkpointing=true"], 1,
     "parallel.train_cuda_graphs=true and parallel.activation_checkpointing=true"),
    (["parallel.train_cuda_graphs=true", "parallel.pipeline_parallel_size=2"], 2,
     "pipeline_parallel_size=1, got 2"),
    (["parallel.train_cuda_graphs=true", "actor.lora.rank=8", "actor.lora.dropout=0.1"], 1,
     "actor.lora.dropout=0.1: a graphed layer would replay one dropout mask"),
    (["parallel.train_graphs_min_fill=1.5"], 1,
     r"parallel.train_graphs_min_fill=1.5: expected a share of the token budget in \[0, 1\]"),
])
def test_refused_combinations(overrides, world_size, match):
    from hybridflow.config import load_config
    from hybridflow.config_checks import validate

    cfg = load_config(["experiment=demo", *overrides])  # refused before anything is built
    with pytest.raises(ValueError, match=match):
        validate(cfg, world_size=world_size)


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
