"""parallel.activation_checkpointing (full recompute per decoder layer) gives the results of the plain
pass, through the real Engine, and keeps less for backward.

The batch of test_dynamic_bsz (rows of varied prompt and response lengths) runs through fresh
engines with and without checkpointing, fixed / token-budget / packed micro-batches, one rank and
TP=2 with sequence parallel (the recompute re-runs the layers' TP/SP collectives in backward).
Compared, fp32: log-probs, entropies, values (forward-only passes: unaffected by construction) and
one actor train step (metrics, every gradient, the weights after Adam). The memory side: the bytes
the autograd graph holds for backward after one training forward, counted by a saved-tensors hook."""

import pytest
import torch

from hybridflow.config import ParallelConfig
from hybridflow.parallel import groups
from tests.dist.launcher import run_ranks
from tests.dist.test_dynamic_bsz import (BUDGET, _batch, assert_same_results, engine_factory,
                                         engine_results)

MODES = {"fixed": dict(max_tokens=None), "budget": dict(max_tokens=BUDGET),
         "packed": dict(max_tokens=BUDGET, pack=True)}


def _saved_bytes(eng, batch) -> int:
    """Bytes of the distinct tensors autograd saves in one training forward of the actor."""
    from hybridflow.engine import attention_mask

    seen, total = set(), [0]

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key not in seen and not isinstance(t, torch.nn.Parameter):
            seen.add(key)
            total[0] += t.numel() * t.element_size()
        return t

    ids = torch.cat([batch.prompt_ids, batch.response_ids], 1)
    mask = torch.cat([batch.prompt_mask, batch.response_mask], 1)
    if ids.shape[1] % 2:  # sequence parallel splits the sequence over TP=2: one more left pad
        ids, mask = (torch.cat([torch.zeros_like(t[:, :1]), t], 1) for t in (ids, mask))
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    eng.model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        eng.model(ids, pos, attention_mask(mask, padded=True))
    return total[0]


def _worker(tp: int, sp: bool):
    ctx = groups.init_model_parallel(tp=tp, pp=1, seed=3)
    batch = _batch()
    out = {"mask": batch.response_mask.bool()}
    for ckpt in (False, True):
        par = ParallelConfig(tensor_parallel_size=tp, sequence_parallel=sp,
                             use_distributed_optimizer=False, activation_checkpointing=ckpt)
        engine = engine_factory(ctx, par)
        for mode, kw in MODES.items():
            out[mode, ckpt] = engine_results(engine, batch, num_tokens=int(batch.response_mask.sum()),
                                             num_seqs=batch.batch_size, **kw)
        out["saved", ckpt] = _saved_bytes(engine("actor"), batch)
    return out


@pytest.mark.parametrize("world,tp,sp", [(1, 1, False), (2, 2, True)], ids=["tp1", "tp2_sp"])
def test_checkpointed_layers_give_the_same_results(world, tp, sp):
    for res in run_ranks(_worker, world, tp, sp):
        for mode in MODES:
            assert_same_results(res[mode, True], res[mode, False], res["mask"], atol=1e-6)
        # two layers: each keeps its input only; the rest (embedding, head) as before
        assert res["saved", True] < 0.25 * res["saved", False], (res["saved", True],
                                                                 res["saved", False])
