"""parallel.lm_head_chunk_tokens (the LM head + log-prob pass a few positions at a time, logits
recomputed in backward) gives the results of the whole-logits pass, through the real Engine.

The batch of test_dynamic_bsz runs through fresh engines with chunks of 3 positions and without,
fixed / token-budget / packed micro-batches, one rank and TP = 2 with sequence parallel (the
vocab-parallel statistics are combined over TP as the whole-logits kernels combine them).
Compared, fp32: log-probs, entropies, values, one actor train step (metrics, every gradient, the
weights after Adam). The memory side: autograd holds no (positions x vocab) tensor for backward."""

import pytest
import torch

from hybridflow.config import ParallelConfig
from hybridflow.parallel import groups
from tests.dist.launcher import run_ranks
from tests.dist.test_activation_checkpointing import MODES
from tests.dist.test_dynamic_bsz import (MODEL, _batch, assert_same_results, engine_factory,
                                         engine_results)


def _vocab_wide_saved(eng, batch) -> int:
    """Elements of the vocab-wide tensors (last dim = the output layer's rows) autograd saves in a
    training forward and log-prob pass with the response head (as the engine runs them: response
    positions only)."""
    from hybridflow.models.linear import LogprobSpec
    from hybridflow.models.logprob import vocab_parallel_logprobs

    sizes = [0]
    head = eng._response_head
    vocab = head.weight.shape[0]
    p = batch.prompt_len
    head.select = lambda x: x[p - 1:-1]
    if eng._lm_chunk:
        head.logprobs = LogprobSpec(targets=batch.response_ids.t(), true_vocab_size=MODEL.vocab_size,
                                    temperature=1.0, with_entropy=False, chunk_tokens=eng._lm_chunk)
    ids = torch.cat([batch.prompt_ids, batch.response_ids], 1)
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    eng.model.train()

    def pack(t):
        if t.dim() and t.shape[-1] == vocab and not isinstance(t, torch.nn.Parameter):
            sizes[0] += t.numel()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = eng.model(ids, pos, None)
            if not eng._lm_chunk:  # then the log-prob pass over the logits
                vocab_parallel_logprobs(out, batch.response_ids, tp_group=None,
                                        true_vocab_size=MODEL.vocab_size)
    finally:
        head.select = head.logprobs = None
    return sizes[0]


def _worker(tp: int, sp: bool):
    ctx = groups.init_model_parallel(tp=tp, pp=1, seed=3)
    batch = _batch()
    out = {"mask": batch.response_mask.bool()}
    for chunk in (0, 3):
        par = ParallelConfig(tensor_parallel_size=tp, sequence_parallel=sp,
                             use_distributed_optimizer=False, lm_head_chunk_tokens=chunk)
        engine = engine_factory(ctx, par)
        for mode, kw in MODES.items():
            out[mode, chunk] = engine_results(engine, batch, num_tokens=int(batch.response_mask.sum()),
                                              num_seqs=batch.batch_size, **kw)
        if tp == 1:
            out["vocab_wide", chunk] = _vocab_wide_saved(engine("actor"), batch)
    return out


@pytest.mark.parametrize("world,tp,sp", [(1, 1, False), (2, 2, True)], ids=["tp1", "tp2_sp"])
def test_chunked_lm_head_gives_the_same_results(world, tp, sp):
    for res in run_ranks(_worker, world, tp, sp):
        for mode in MODES:
            assert_same_results(res[mode, 3], res[mode, 0], res["mask"], atol=1e-6)
        if tp == 1:  # the whole pass keeps the (positions x vocab) logits; chunks keep none
            b, r = _batch().response_ids.shape
            assert res["vocab_wide", 0] >= b * r * MODEL.vocab_size
            assert res["vocab_wide", 3] == 0


def test_negative_chunk_is_an_error():
    from hybridflow.config import load_config, validate

    with pytest.raises(ValueError, match=r"parallel.lm_head_chunk_tokens=-1: expected 0 \(off\)"):
        validate(load_config(["parallel.lm_head_chunk_tokens=-1"]), world_size=1)
