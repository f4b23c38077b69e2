"""parallel.activation_checkpointing (full recompute per decoder layer) and
parallel.lm_head_chunk_tokens (the LM head + log-prob pass a few positions at a time, logits
recomputed in backward) give the results of the plain pass, through the real Engine, and keep less
for backward. Both run in one launch per layout (the tests of both share it).

The batch of test_dynamic_bsz (rows of varied prompt and response lengths) runs through fresh
engines with checkpointing, with chunks of 3 positions and with neither, fixed / token-budget /
packed micro-batches, one rank and TP=2 with sequence parallel (the recompute re-runs the layers' TP/SP collectives in backward; the
vocab-parallel statistics of the chunks are combined over TP as the whole-logits kernels combine them).
Compared, fp32: log-probs, entropies, values (forward-only passes: unaffected by construction) and
one actor train step (metrics, every gradient, the weights after Adam). The memory side: the bytes
the autograd graph holds for backward after one training forward, counted by a saved-tensors hook;
with chunks, autograd holds no (positions x vocab) tensor for backward."""

import functools

import pytest
import torch

from hybridflow.config import ParallelConfig
from hybridflow.parallel import groups
from tests.dist.launcher import run_ranks
from tests.dist.test_dynamic_bsz import (BUDGET, MODEL, _batch, assert_same_results,
                                         engine_factory, engine_results)

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


def _vocab_wide_saved(eng, batch) -> int:
    """Elements of the vocab-wide tensors (last dim = the output layer's rows) autograd saves in a
    training forward and log-prob pass with the response head (as the engine runs them: response
    positions only; parallel.lm_head_chunk_tokens, test_chunked_lm_head_gives_the_same_results)."""
    from hybridflow.models.linear import LogprobSpec
    from hybridflow.models.logprob import vocab_parallel_logprobs

    total, head = [0], eng._response_head
    vocab, p = head.weight.shape[0], batch.prompt_len
    head.select = lambda x: x[p - 1:-1]
    if eng._lm_chunk:
        head.logprobs = LogprobSpec(targets=batch.response_ids.t(), true_vocab_size=MODEL.vocab_size,
                                    temperature=1.0, with_entropy=False, chunk_tokens=eng._lm_chunk)
    ids = torch.cat([batch.prompt_ids, batch.response_ids], 1)
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    eng.model.train()

    def pack(t):
        if t.dim() and t.shape[-1] == vocab and not isinstance(t, torch.nn.Parameter):
            total[0] += t.numel()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = eng.model(ids, pos, None)
            if not eng._lm_chunk:  # then the log-prob pass over the logits
                vocab_parallel_logprobs(out, batch.response_ids, tp_group=None,
                                        true_vocab_size=MODEL.vocab_size)
    finally:
        head.select = head.logprobs = None
    return total[0]


# the memory options against the plain pass, in one launch per layout (their tests share it)
VARIANTS = {"plain": {}, "ckpt": dict(activation_checkpointing=True),
            "lm_chunk": dict(lm_head_chunk_tokens=3)}


def _worker(tp: int, sp: bool):
    ctx = groups.init_model_parallel(tp=tp, pp=1, seed=3)
    batch = _batch()
    out = {"mask": batch.response_mask.bool()}
    for name, kw in VARIANTS.items():
        par = ParallelConfig(tensor_parallel_size=tp, sequence_parallel=sp,
                             use_distributed_optimizer=False, **kw)
        engine = engine_factory(ctx, par)
        for mode, mkw in MODES.items():
            out[mode, name] = engine_results(engine, batch, num_seqs=batch.batch_size,
                                             num_tokens=int(batch.response_mask.sum()), **mkw)
        out["saved", name] = _saved_bytes(engine("actor"), batch)
        if tp == 1:
            out["vocab_wide", name] = _vocab_wide_saved(engine("actor"), batch)
    return out


@functools.cache
def variant_results(world: int, tp: int, sp: bool) -> list:
    """Every rank's results of each VARIANTS entry, computed once per pytest process."""
    return run_ranks(_worker, world, tp, sp)


LAYOUTS = pytest.mark.parametrize("world,tp,sp", [
    pytest.param(1, 1, False, id="tp1", marks=pytest.mark.slow),  # tp2_sp runs the same variants
    pytest.param(2, 2, True, id="tp2_sp")])


@LAYOUTS
def test_checkpointed_layers_give_the_same_results(world, tp, sp):
    for res in variant_results(world, tp, sp):
        for mode in MODES:
            assert_same_results(res[mode, "ckpt"], res[mode, "plain"], res["mask"], atol=1e-6)
        # two layers: each keeps its input only; the rest (embedding, head) as before
        assert res["saved", "ckpt"] < 0.25 * res["saved", "plain"], (res["saved", "ckpt"],
                                                                     res["saved", "plain"])


@LAYOUTS
def test_chunked_lm_head_gives_the_same_results(world, tp, sp):
    for res in variant_results(world, tp, sp):
        for mode in MODES:
            assert_same_results(res[mode, "lm_chunk"], res[mode, "plain"], res["mask"], atol=1e-6)
        if tp == 1:  # the whole pass keeps the (positions x vocab) logits; chunks keep none
            b, r = _batch().response_ids.shape
            assert res["vocab_wide", "plain"] >= b * r * MODEL.vocab_size
            assert res["vocab_wide", "lm_chunk"] == 0


def test_negative_chunk_is_an_error():
    from hybridflow.config import load_config
    from hybridflow.config_checks import validate

    with pytest.raises(ValueError, match=r"parallel.lm_head_chunk_tokens=-1: expected 0 \(off\)"):
        validate(load_config(["experiment=demo", "parallel.lm_head_chunk_tokens=-1"]), world_size=1)
