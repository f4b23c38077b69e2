"""Micro-batches by token budget give the results of fixed micro-batches, through the real Engine.

Each layout runs the same batch (rows of varied prompt and response lengths, split over DP) twice:
fixed micro-batches of 2 rows padded to the batch's widths (the reference), and token-budget
micro-batches (`max_tokens`: rows sorted by length, each micro-batch trimmed to its own widths, so
micro-batches hold different numbers of rows and DP ranks run different numbers of them). Compared,
fp32: log-probs, entropies and critic values on real tokens; and one actor train step (policy loss +
entropy bonus + KL loss with the trainer's global normalisers) from identical weights: every
gradient, the grad norm, the loss metrics and the weights after one Adam step.
Layouts: DP=2, TP=2 and TP=2 with sequence parallel (each TP rank must build the same micro-batches).
"""

import pytest
import torch

from hybridflow.algo.objectives import actor_objective
from hybridflow.config import AlgoConfig, ModelConfig, OptimConfig, ParallelConfig
from hybridflow.data.batch import RolloutBatch
from hybridflow.data.microbatch import token_budget_groups
from hybridflow.parallel import groups
from hybridflow.parallel.dp import dp_sum
from tests.dist.launcher import run_ranks
from tests.ragged import ragged_batch
from tests.dist.parity_util import fill_deterministic, gather_full

MODEL = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                    num_query_groups=2, vocab_size=50, add_qkv_bias=True)
ALGO = AlgoConfig(loss_agg_mode="seq-mean-token-mean", entropy_coeff=0.01, use_kl_loss=True,
                  kl_loss_type="k3", kl_loss_coef=0.1)
BUDGET = 40  # tokens per micro-batch: 2 rows of the longest (7 + 10 = 17), 6 rows of the shortest
# rows 0-5 (DP rank 0) long, rows 6-11 (DP rank 1) short: the ranks run different micro-batch counts
PROMPT_LENS = [7, 5, 6, 3, 7, 4, 2, 3, 5, 2, 4, 3]
RESPONSE_LENS = [10, 9, 4, 10, 6, 8, 1, 3, 2, 4, 1, 2]


def _batch() -> RolloutBatch:
    return ragged_batch(PROMPT_LENS, RESPONSE_LENS)


def engines(tp: int, sp: bool):
    """The parallel context and a factory of Engines of MODEL with deterministic weights."""
    ctx = groups.init_model_parallel(tp=tp, pp=1, seed=3)
    return ctx, engine_factory(ctx, ParallelConfig(tensor_parallel_size=tp, sequence_parallel=sp,
                                                   use_distributed_optimizer=False))


def engine_factory(ctx, par: ParallelConfig, **engine_kw):
    """role, trainable -> a fresh Engine of MODEL under `par` (and `engine_kw`, Engine's keyword
    options) with deterministic weights."""
    from hybridflow.engine import Engine

    def engine(role, trainable=True):
        eng = Engine(role=role, model_cfg=MODEL, ctx=ctx, parallel=par, precision="fp32",
                     optim=OptimConfig(lr=1e-3, clip_grad=0.0) if trainable else None,
                     total_updates=1, **engine_kw)
        fill_deterministic(eng.module, num_layers=MODEL.num_layers)
        return eng

    return engine


def engine_results(engine, batch, *, max_tokens, num_tokens: int, num_seqs: int,
                   pack: bool = False, scores: bool = False) -> dict:
    """Fresh engines' per-token results over `batch` (log-probs and entropy from the pass itself
    and through compute_logprobs, critic values, with `scores` the reward model's) and one actor
    update (its metrics, the gradients and the updated weights, gathered over TP)."""
    kw = dict(micro_batch_size=2, max_tokens=max_tokens, pack=pack)
    actor, critic = engine("actor", trainable=False), engine("critic", trainable=False)
    o, rows = actor._run(batch, forward_only=True, loss_fn=None, temperature=0.7,
                         need_entropy=True, **kw)
    out = {"logprobs": actor._from_last_stage(o, "logprobs", batch, rows),
           "entropy": actor._from_last_stage(o, "entropy", batch, rows),
           "logprobs_api": actor.compute_logprobs(batch, temperature=0.7, **kw),
           "values": critic.compute_values(batch, **kw)}
    if scores:
        out["scores"] = engine("reward", trainable=False).compute_scores(batch, **kw)
    eng = engine("actor")
    loss_fn = actor_objective(ALGO, num_tokens=num_tokens, num_seqs=num_seqs)
    metrics = eng.train_step(batch, loss_fn, temperature=0.7, need_entropy=True, **kw)
    grads = {k: p.main_grad for k, p in eng.module.named_parameters()}
    return {**out, "metrics": metrics, "grads": gather_full(grads, num_layers=MODEL.num_layers),
            "weights": gather_full(dict(eng.module.named_parameters()),
                                   num_layers=MODEL.num_layers)}


def _worker(tp: int, sp: bool):
    ctx, engine = engines(tp, sp)
    full = _batch()
    dp, rank = ctx.dp_size, ctx.train.dp
    n = full.batch_size // dp
    batch = full.select(slice(rank * n, (rank + 1) * n))
    out = {"n_micro": len(token_budget_groups(batch.prompt_mask.sum(1), batch.response_mask.sum(1),
                                              max_tokens=BUDGET, multiple=tp if sp else 1))}
    num_tokens = int(dp_sum(float(batch.response_mask.sum()), group=ctx.dp_group))
    for name, tokens in (("fixed", None), ("dyn", BUDGET)):
        out[name] = engine_results(engine, batch, max_tokens=tokens, num_tokens=num_tokens,
                                   num_seqs=full.batch_size)
    out["mask"] = batch.response_mask.bool()
    return out


def _layouts(layouts: list) -> dict:
    """{(tp, sp): _worker(tp, sp)} in this one launch (each layout re-builds the groups and re-seeds)."""
    return {layout: _worker(*layout) for layout in layouts}


@pytest.fixture(scope="module")
def default_layouts():
    """DP=2 and TP=2 with SP in one launch of 2 ranks (the tests of both share it)."""
    return run_ranks(_layouts, 2, [(1, False), (2, True)])


@pytest.mark.parametrize("tp,sp", [pytest.param(1, False, id="dp2"),
                                   pytest.param(2, False, id="tp2", marks=pytest.mark.slow),
                                   pytest.param(2, True, id="tp2_sp")])
def test_token_budget_matches_fixed_micro_batches(request, tp, sp):
    if (tp, sp) == (2, False):  # the slow tier's twin: a launch of its own
        results = run_ranks(_worker, 2, tp, sp)
    else:
        results = [rank[tp, sp] for rank in request.getfixturevalue("default_layouts")]
    if tp == 1:  # uneven micro-batch counts over DP: the loss scaling must stay exact
        assert results[0]["n_micro"] != results[1]["n_micro"], [r["n_micro"] for r in results]
    else:  # TP ranks share rows and must agree on the micro-batches
        assert results[0]["n_micro"] == results[1]["n_micro"] > 1
    for res in results:
        assert_same_results(res["dyn"], res["fixed"], res["mask"], atol=1e-6)


def assert_same_results(got: dict, ref: dict, mask, *, atol: float) -> None:
    """Two runs of the same engine calls (a worker's result dicts): per-token results under `mask`
    (atol), the update's metrics (atol, relative above 1), gradients and the updated weights."""
    for key in ("logprobs", "entropy", "logprobs_api", "values"):
        assert got[key].shape == ref[key].shape
        torch.testing.assert_close(got[key][mask], ref[key][mask], atol=atol, rtol=1e-5, msg=key)
    assert ref["logprobs"][mask].abs().min() > 0 and ref["values"][mask].abs().sum() > 0
    for key, value in ref["metrics"].items():
        if key != "lr":
            assert abs(got["metrics"][key] - value) < atol * max(1.0, abs(value)), key
    assert ref["metrics"]["grad_norm"] > 0
    assert set(got["grads"]) == set(ref["grads"]) and ref["grads"]
    for name, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], g, atol=1e-6, rtol=1e-5, msg=name)
    # Adam's first step is lr x g / (|g| + eps): grads of ~1e-8, equal to fp32 rounding, still
    # move weights by ~1e-6 differently; the tolerance of test_parallel_parity's weights
    for name, w in ref["weights"].items():
        torch.testing.assert_close(got["weights"][name], w, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.slow  # a benchmark script end to end
def test_bench_rl_step_dynamic_bsz_smoke(tmp_path):
    """The GPU session's measurement: bench_rl_step.py --dynamic-bsz runs (tiny model, CPU) and its
    calibration record names the token budgets; with --recompute the trainer runs with
    parallel.activation_checkpointing and the record's layout says so, as it says an offloaded
    reference given as an override."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "rl.json"
    subprocess.run([sys.executable, "benchmarks/bench_rl_step.py", "--model", "tiny", "--prompts",
                    "2", "--samples", "4", "--response", "8", "--steps", "2", "--algos", "grpo",
                    "--dynamic-bsz", "400", "--dynamic-bsz-forward", "800", "--recompute",
                    "--override", "trainer.offload_ref=true", "--out", str(out)],
                   check=True, cwd=root, capture_output=True,
                   env=dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1"))
    r = json.loads(out.read_text())
    rec = r["records"][0]
    assert rec["name"].endswith("-offref") and "-rc-dyn400f800" in rec["name"]
    assert rec["config"]["dynamic_bsz"] is True
    assert rec["config"]["layout"]["recompute"] is True and rec["config"]["layout"]["offload_ref"] is True
    assert (rec["config"]["micro_batch_tokens"], rec["config"]["forward_micro_batch_tokens"]) == \
        (400, 800)
    assert len(r["results"]["grpo"]["steps"]) == 2
    assert rec["metrics"]["timing_s/update_actor"] > 0
