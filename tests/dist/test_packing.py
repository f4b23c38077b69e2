"""Sequence packing gives the results of unpacked token-budget micro-batches, through the real Engine.

The same batch as test_dynamic_bsz (rows of varied prompt and response lengths) runs with token
budgets twice: unpacked (each micro-batch padded to its own widths; the reference) and packed (each
micro-batch one row of real tokens, a flex_attention document mask). Packed micro-batches count real
tokens, so they group the rows differently: the comparison also covers the row scatter. Compared,
fp32: log-probs and entropies on real tokens (forward-only: eager flex_attention on CPU), critic
values, reward-model scores, and one actor train step from identical weights (training: the dense
form of the same mask on CPU): metrics, every gradient, the grad norm and the weights after Adam.
Layouts: one rank (TP=1), and TP=2 with sequence parallel (packed length padded to a multiple of 2).
On CPU the packed kernel is flex_attention (torch's varlen_attn is CUDA only): the choice, printed
once, and algo.packed_attention=varlen refused with the reason.
"""

import contextlib
import dataclasses
import io

import pytest
import torch

from hybridflow.config import ParallelConfig
from hybridflow.engine import _on_device
from tests.dist.launcher import run_ranks
from tests.dist.test_dynamic_bsz import (BUDGET, MODEL, _batch, assert_same_results, engine_results,
                                         engines)


def _worker(tp: int, sp: bool):
    _, engine = engines(tp, sp)
    batch = _batch()
    actor = engine("actor", trainable=False)
    out = {"n_micro": len(actor._micro_batches(batch, micro_batch_size=2, max_tokens=BUDGET,
                                               pack=True)[0])}
    # the passes' lazy micro-batches (packed and copied as the schedule reaches each) are the
    # ones made up front, field by field
    for pack in (False, True):
        kw = dict(micro_batch_size=2, max_tokens=BUDGET, pack=pack)
        now, rows = actor._micro_batches(batch, **kw)
        later, rows_later = actor._micro_batches(batch, lazy=True, **kw)
        assert torch.equal(rows, rows_later) and len(now) == len(later)
        for a, b in zip(now, later):
            b = _on_device(b, actor.device)
            assert a[1] == b[1] and (a[2] is None) == (b[2] is None)
            for x, y in zip(a[::2], b[::2]):
                for f in ([] if x is None else dataclasses.fields(x)):
                    u, v = getattr(x, f.name), getattr(y, f.name)
                    assert (torch.equal(u, v) if isinstance(u, torch.Tensor) else u == v), f.name
    for name, pack in (("padded", False), ("packed", True)):
        out[name] = engine_results(engine, batch, max_tokens=BUDGET, pack=pack, scores=True,
                                   num_tokens=int(batch.response_mask.sum()),
                                   num_seqs=batch.batch_size)
    out["mask"] = batch.response_mask.bool()
    return out


@pytest.mark.parametrize("world,tp,sp", [(1, 1, False), (2, 2, True)], ids=["tp1", "tp2_sp"])
def test_packed_matches_padded_token_budgets(world, tp, sp):
    results = run_ranks(_worker, world, tp, sp)
    for res in results:
        padded, packed, mask = res["padded"], res["packed"], res["mask"]
        assert res["n_micro"] > 1
        assert_same_results(packed, padded, mask, atol=1e-5)
        diffs = {}
        for key in ("logprobs", "entropy", "logprobs_api", "values"):
            assert (packed[key][~mask] == 0).all(), key  # past a row's response: 0
            diffs[key] = float((packed[key][mask] - padded[key][mask]).abs().max())
        torch.testing.assert_close(packed["scores"], padded["scores"], atol=1e-5, rtol=1e-5)
        print("max |packed - padded|:", diffs,
              "grad_norm", packed["metrics"]["grad_norm"] - padded["metrics"]["grad_norm"])


def _fitted_worker(tp: int, sp: bool):
    """One update with the packed rows as they are, and fitted to one PackedShape (padded to the
    token budget, a fixed count of documents: what the update's CUDA graphs replay; on CPU the
    layers run eagerly on the padded rows), from the same weights."""
    from tests.dist.test_dynamic_bsz import ALGO, gather_full
    from hybridflow.algo.objectives import actor_objective

    _, engine = engines(tp, sp)
    batch = _batch()
    out = {}
    for name, fit in (("packed", False), ("fitted", True)):
        eng = engine("actor")
        eng._fit_packed = fit
        loss_fn = actor_objective(ALGO, num_tokens=int(batch.response_mask.sum()),
                                  num_seqs=batch.batch_size)
        metrics = eng.train_step(batch, loss_fn, temperature=0.7, need_entropy=True,
                                 micro_batch_size=2, max_tokens=BUDGET, pack=True,
                                 keep_logprobs=True)
        grads = {k: p.main_grad for k, p in eng.module.named_parameters()}
        micro, _ = eng._micro_batches(batch, micro_batch_size=2, max_tokens=BUDGET, pack=True,
                                      fit=fit)
        out[name] = {"metrics": metrics, "grads": gather_full(grads, num_layers=MODEL.num_layers),
                     "shapes": [tuple(p.input_ids.shape) for _, _, p in micro if p is not None],
                     "fitted": [p.fitted for _, _, p in micro if p is not None],
                     "shape": eng._next_packed_shape}
    return out


@pytest.mark.parametrize("world,tp,sp", [(1, 1, False), (2, 2, True)], ids=["tp1", "tp2_sp"])
def test_packed_rows_fitted_to_one_shape_give_the_same_update(world, tp, sp):
    for res in run_ranks(_fitted_worker, world, tp, sp):
        packed, fitted = res["packed"], res["fitted"]
        shape = fitted["shape"]
        assert shape is not None and shape.length == BUDGET and packed["shape"] is None
        # every packed row fitted but those under train_graphs_min_fill of the budget (eager)
        small = [n < ParallelConfig.train_graphs_min_fill * BUDGET for _, n in packed["shapes"]]
        assert fitted["fitted"] == [not s for s in small] and sum(fitted["fitted"]) > 1
        assert {s for s, f in zip(fitted["shapes"], fitted["fitted"]) if f} == {(1, BUDGET)}
        assert set(packed["shapes"]) != {(1, BUDGET)}
        for key, value in packed["metrics"].items():
            if key == "logprobs":
                torch.testing.assert_close(fitted["metrics"][key], value, atol=1e-5, rtol=1e-5)
            elif key != "lr":
                assert abs(fitted["metrics"][key] - value) < 1e-5 * max(1.0, abs(value)), key
        assert packed["metrics"]["grad_norm"] > 0
        for name, g in packed["grads"].items():
            torch.testing.assert_close(fitted["grads"][name], g, atol=1e-6, rtol=1e-5, msg=name)


def _choice_worker():
    from hybridflow.config import ParallelConfig
    from hybridflow.engine import Engine

    ctx, _ = engines(1, False)
    par = ParallelConfig(use_distributed_optimizer=False)
    batch, out = _batch(), {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        for role in ("actor", "ref"):  # two engines, one choice printed
            eng = Engine(role=role, model_cfg=MODEL, ctx=ctx, parallel=par, precision="fp32",
                         packed_attention="auto")
            lp = eng.compute_logprobs(batch, micro_batch_size=2, max_tokens=BUDGET, pack=True)
            out[role] = (eng.packed_kernel(), bool(torch.isfinite(lp).all()))
    out["printed"] = printed.getvalue()
    eng = Engine(role="ref", model_cfg=MODEL, ctx=ctx, parallel=par, precision="fp32",
                 packed_attention="varlen")
    eng.compute_logprobs(batch, micro_batch_size=2, max_tokens=BUDGET)  # unpacked: no kernel
    try:
        eng.compute_logprobs(batch, micro_batch_size=2, max_tokens=BUDGET, pack=True)
        out["varlen_error"] = None
    except ValueError as e:
        out["varlen_error"] = str(e)
    return out


def test_cpu_takes_flex_and_says_so_once():
    res = run_ranks(_choice_worker, 1)[0]
    assert res["actor"] == res["ref"] == ("flex", True)
    assert res["printed"].splitlines() == [
        "hybridflow: packed attention: flex_attention document mask (algo.packed_attention=auto "
        "falls back: varlen_attn runs on CUDA only (device cpu))"]
    assert res["varlen_error"] == ("algo.packed_attention=varlen cannot run here: varlen_attn runs "
                                   "on CUDA only (device cpu); set algo.packed_attention=auto or "
                                   "flex")
