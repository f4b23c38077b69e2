"""The LM head at the scored positions only (LeanOutputLinear.select) gives the results of the full
head, through the real Engine.

The same batch as test_dynamic_bsz (rows of varied prompt and response lengths) runs through fresh
engines twice: with the engine's default (logits only at the positions that predict response
tokens) and with `_response_head = None` (logits over every position, the path before). Compared,
fp32: log-probs and entropies (from the pass and through compute_logprobs), critic values and one
actor train step (metrics, every gradient, the grad norm, the weights after Adam). Three micro-batch
forms: fixed micro-batches padded to the batch's widths, token-budget micro-batches trimmed to
their own widths, and packed rows. Layouts: one rank, and TP=2 with sequence parallel (the selection
applies after the output layer's sequence gather, whose backward reduce-scatters the zero-filled
gradient). The output layer's row counts are recorded, so the test fails if nothing was selected.
"""

import pytest
import torch

from tests.dist.launcher import run_each, run_ranks
from tests.dist.test_dynamic_bsz import BUDGET, _batch, assert_same_results, engine_results, engines

MODES = {"fixed": dict(max_tokens=None), "budget": dict(max_tokens=BUDGET),
         "packed": dict(max_tokens=BUDGET, pack=True)}


def _worker(tp: int, sp: bool):
    _, engine = engines(tp, sp)
    batch = _batch()
    out = {"mask": batch.response_mask.bool(), "rows": {}}

    for mode, kw in MODES.items():
        for selected in (True, False):
            rows = []

            def counted(role, trainable=True, selected=selected, rows=rows):
                eng = engine(role, trainable)
                if role in ("actor", "ref"):
                    assert eng._response_head is not None  # the lean output layer: selectable
                    eng._response_head.register_forward_hook(
                        lambda mod, args, res: rows.append(res[0].shape[0] * res[0].shape[1]))
                    if not selected:
                        eng._response_head = None
                return eng

            out[mode, selected] = engine_results(counted, batch, num_tokens=int(batch.response_mask.sum()),
                                                 num_seqs=batch.batch_size, **kw)
            out["rows"][mode, selected] = sum(rows)
    return out


@pytest.fixture(scope="module")
def one_rank():
    """The 1-rank cases of this file's default-tier tests, in one launch."""
    return run_each(1, {"tp1": (_worker, 1, False), "local_untied": (_local_backend, False),
                        "bf16": (_bf16_output,)})[0]


@pytest.mark.parametrize("world,tp,sp", [(1, 1, False), (2, 2, True)], ids=["tp1", "tp2_sp"])
def test_response_logits_match_full_head(request, world, tp, sp):
    results = ([request.getfixturevalue("one_rank")["tp1"]] if world == 1
               else run_ranks(_worker, world, tp, sp))
    for res in results:
        mask = res["mask"]
        for mode in MODES:
            got, ref = res[mode, True], res[mode, False]
            assert_same_results(got, ref, mask, atol=1e-6)
            if mode == "packed":
                assert all((got[k][~mask] == 0).all() for k in ("logprobs", "entropy", "logprobs_api"))
            full, selected = res["rows"][mode, False], res["rows"][mode, True]
            assert 0 < selected < full, (mode, selected, full)
        # packed: exactly the real response tokens (3 passes: forward, compute_logprobs, train)
        assert res["rows"]["packed", True] == 3 * int(mask.sum())


def _local_backend(tied: bool):
    import dataclasses

    from hybridflow.config import ParallelConfig
    from hybridflow.engine import Engine
    from hybridflow.parallel import groups
    from tests.dist.test_dynamic_bsz import MODEL

    ctx = groups.init_model_parallel(tp=1, pp=1, seed=0)
    cfg = dataclasses.replace(MODEL, attention_backend="local", tie_word_embeddings=tied)
    eng = Engine(role="ref", model_cfg=cfg, ctx=ctx, parallel=ParallelConfig(), precision="fp32")
    assert (eng._response_head.weight is None) == tied  # tied: the embedding's weight is passed in
    assert eng._response_head is not None  # Megatron's own layers, the lean output layer
    batch = _batch()
    selected = eng.compute_logprobs(batch, micro_batch_size=4)
    eng._response_head = None
    return selected, eng.compute_logprobs(batch, micro_batch_size=4), batch.response_mask.bool()


@pytest.mark.parametrize("tied", [pytest.param(False, id="untied"),
                                  pytest.param(True, id="tied_embeddings", marks=pytest.mark.slow)])
def test_response_logits_with_megatron_local_layers(request, tied):
    selected, full, mask = (run_ranks(_local_backend, 1, tied)[0] if tied
                            else request.getfixturevalue("one_rank")["local_untied"])
    torch.testing.assert_close(selected[mask], full[mask], atol=1e-6, rtol=1e-5)
    assert full[mask].abs().min() > 0


def _bf16_output():
    import hybridflow.engine as engine_mod
    from hybridflow.parallel import groups

    ctx = groups.init_model_parallel(tp=1, pp=1, seed=0)
    batch = _batch()
    dtypes, head = [], engine_mod._lm_head
    engine_mod._lm_head = lambda pred, *a, **kw: dtypes.append(pred.dtype) or head(pred, *a, **kw)
    out = {}
    try:
        _bf16_runs(engine_mod, ctx, batch, dtypes, out)
    finally:
        engine_mod._lm_head = head  # the launch's later calls see the real head
    return out


def _bf16_runs(engine_mod, ctx, batch, dtypes, out):
    from hybridflow.algo.objectives import actor_objective
    from hybridflow.config import AlgoConfig, OptimConfig, ParallelConfig
    from tests.dist.parity_util import fill_deterministic
    from tests.dist.test_dynamic_bsz import MODEL

    for upcast in (False, True):
        eng = engine_mod.Engine(role="actor", model_cfg=MODEL, ctx=ctx, precision="bf16",
                                parallel=ParallelConfig(use_distributed_optimizer=False),
                                optim=OptimConfig(lr=1e-3), total_updates=2)
        fill_deterministic(eng.module, num_layers=MODEL.num_layers)
        if upcast:
            eng._out_kw = {}  # Megatron's default: the wrapper upcasts the logits to fp32
        lp = eng.compute_logprobs(batch, micro_batch_size=4)
        loss_fn = actor_objective(AlgoConfig(), num_tokens=int(batch.response_mask.sum()),
                                  num_seqs=batch.batch_size)
        m = eng.train_step(batch, loss_fn, micro_batch_size=4, temperature=1.0, need_entropy=True)
        out[upcast] = {"logprobs": lp, "grad_norm": m["grad_norm"], "dtypes": dtypes[:],
                       "grads": {k: p.main_grad.clone() for k, p in eng.module.named_parameters()}}
        dtypes.clear()


def test_bf16_logits_reach_the_head_in_bf16(one_rank):
    """bf16 engines keep the logits in bf16 (no fp32 copy of tokens x vocab per micro-batch); the
    head computes in fp32 from them, so results equal Megatron's fp32 upcast bit for bit (CPU)."""
    out = one_rank["bf16"]
    kept, upcast = out[False], out[True]
    assert set(kept["dtypes"]) == {torch.bfloat16} and set(upcast["dtypes"]) == {torch.float32}
    assert torch.equal(kept["logprobs"], upcast["logprobs"]) and kept["grad_norm"] == upcast["grad_norm"] > 0
    assert all(torch.equal(g, upcast["grads"][k]) for k, g in kept["grads"].items())
