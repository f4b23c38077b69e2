"""Padded batches stay causal with every attention backend: a later token never changes an earlier
log-prob (Megatron's own softmax adds the causal mask only when no mask is given)."""

import dataclasses

import pytest
import torch

from hybridflow.config import ModelConfig, ParallelConfig
from hybridflow.data.batch import RolloutBatch
from hybridflow.parallel import groups
from tests.dist.launcher import run_ranks


def _logprobs_before_after(backend: str):
    from hybridflow.engine import Engine

    ctx = groups.init_model_parallel(tp=1, pp=1, seed=0)
    cfg = dataclasses.replace(ModelConfig(), attention_backend=backend)
    eng = Engine(role="ref", model_cfg=cfg, ctx=ctx, parallel=ParallelConfig(), precision="fp32")
    g = torch.Generator().manual_seed(0)
    prompt_mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])  # row 0 is left-padded
    response_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    batch = RolloutBatch(prompt_ids=torch.randint(1, 60, (2, 4), generator=g) * prompt_mask,
                         prompt_mask=prompt_mask,
                         response_ids=torch.randint(1, 60, (2, 5), generator=g) * response_mask,
                         response_mask=response_mask, group_ids=torch.arange(2),
                         indices=torch.arange(2))
    before = eng.compute_logprobs(batch, micro_batch_size=2)
    changed = dataclasses.replace(batch, response_ids=batch.response_ids.clone())
    changed.response_ids[0, -1] = (changed.response_ids[0, -1] + 7) % 60
    after = eng.compute_logprobs(changed, micro_batch_size=2)
    return before, after


@pytest.mark.parametrize("backend", ["sdpa", "local"])
def test_padded_batches_are_causal(backend):
    before, after = run_ranks(_logprobs_before_after, 1, backend)[0]
    torch.testing.assert_close(after[:, :-1], before[:, :-1], atol=1e-6, rtol=0)
    assert not torch.allclose(after[0, -1], before[0, -1])  # the changed token itself does move
