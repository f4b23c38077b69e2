"""rollout.free_cache_engine=false keeps one Generator (KV cache, captured graphs, buffers) across
steps and changes nothing else (2 gloo ranks, real trainer).

Short GRPO runs of the synthetic task from the same seed, DP=2: the default (a new generator per
step, released after it) against the kept one. The kept generator aliases the training weights, so
the optimizer's in-place updates must be what the next step generates with: equal histories and
weights after 3 steps, with weights that moved, show that it does (a generator on stale weights
samples other responses from step 2 on). With TP=2 and generation at TP_g=1 (resharding) the
gathered weights are re-allocated every step (the resharder frees its buffers after generation):
the kept generator is reused only for a step whose buffers come back at the same addresses (it then
reads them, the same storage), rebuilt otherwise (the allocator decides which), and the run is
unchanged either way; every rank decides alike (a rank that rebuilt alone would capture its graphs,
and their collectives at TP_g > 1, alone). Also at TP=2: the rule reward scored inside the
reference pass (reward.score_in_pass) against the same run without it.
"""

import pytest
import torch

from tests.dist.launcher import run_ranks

STEPS = 3
BASE = ["algo=grpo", "trainer.sft_warmup_steps=0", f"trainer.total_steps={STEPS}",
        "trainer.save_final=false", "trainer.tensorboard=false", "trainer.progress_bar=false",
        "data.prompts_per_step=4", "rollout.n=4", "rollout.max_new_tokens=6",
        "algo.ppo_mini_batch_size=16", "algo.micro_batch_size_per_gpu=4",
        "algo.forward_micro_batch_size_per_gpu=8", "actor_optim.lr=1e-3",
        "reward.fn=tests.dist.test_skip_old_log_prob:digit_count"]
KEEP = ["rollout.free_cache_engine=false"]
TP2 = ["parallel.tensor_parallel_size=2", "rollout.tensor_parallel_size=1"]
RUNS = {"free": [], "keep": KEEP, "free_tp2": TP2, "keep_tp2": TP2 + KEEP,
        "keep_tp2_reward_in_pass": TP2 + KEEP + ["reward.score_in_pass=true"]}


def _runs(out_dir):
    from hybridflow.config import load_config
    from hybridflow.config_checks import validate
    from hybridflow.parallel import groups
    from hybridflow.rollout import stage
    from hybridflow.trainer import Trainer

    built, released = [], []

    class Counted(stage.Generator):
        def __init__(self, **kw):
            super().__init__(**kw)
            built.append(1)

        def release(self):  # count the releases that free a cache (not _ensure_cache's first)
            if self._cache is not None:
                released.append(1)
            super().release()

    stage.Generator = Counted
    results = {}
    for name, extra in RUNS.items():
        built.clear()
        released.clear()
        cfg = load_config(["experiment=demo", *BASE, f"trainer.output_dir={out_dir}/{name}", *extra])
        validate(cfg, world_size=torch.distributed.get_world_size())
        ctx = groups.init_model_parallel(tp=cfg.parallel.tensor_parallel_size, pp=1,
                                         tp_gen=cfg.rollout.tensor_parallel_size,
                                         seed=cfg.trainer.seed)  # re-seeds every RNG
        trainer = Trainer(cfg, ctx)
        init = _weights(trainer)
        history = trainer.train()
        results[name] = {"history": history, "weights": _weights(trainer), "init": init,
                         "built": len(built), "released": len(released)}
    return results


def _weights(trainer) -> dict:
    return {k: p.detach().clone() for k, p in trainer.actor.module.named_parameters()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(_runs, 2, str(tmp_path_factory.mktemp("free_cache")))


@pytest.mark.parametrize("variant", ["", "_tp2"])
def test_kept_generator_gives_the_same_run(runs, variant):
    for rank in runs:
        free, keep = rank[f"free{variant}"], rank[f"keep{variant}"]
        assert len(free["history"]) == len(keep["history"]) == STEPS
        for m_free, m_keep in zip(free["history"], keep["history"]):
            keys = [k for k in m_free if k.split("/")[0] in ("actor", "critic", "response_length")]
            assert {"actor/pg_loss", "critic/score/mean", "response_length/mean"} <= set(keys)
            for k in keys:
                assert m_keep[k] == m_free[k], k
        moved = max(float((w - free["init"][n]).abs().max()) for n, w in free["weights"].items())
        assert moved > 1e-3
        for n, w in free["weights"].items():
            assert torch.equal(keep["weights"][n], w), n


def test_generator_built_once_and_released_at_the_end(runs):
    for rank in runs:
        assert (rank["free"]["built"], rank["free"]["released"]) == (STEPS, STEPS)
        assert (rank["keep"]["built"], rank["keep"]["released"]) == (1, 1)  # at the end of train


def test_resharding_rebuilds_unless_the_weights_stay_put(runs):
    for rank in runs:  # every generator built is released once (at a rebuild or at the end)
        built = rank["keep_tp2"]["built"]
        assert 1 <= built <= STEPS and rank["keep_tp2"]["released"] == built
    # the ranks decide alike (one all-reduce): a rank rebuilding alone would capture alone
    assert len({rank["keep_tp2"]["built"] for rank in runs}) == 1


def test_reward_scored_in_the_reference_pass_at_tp2(runs):
    """reward.score_in_pass (a GPU run's default) at TP=2 (the kept generator at TP_g=1): each TP
    rank scores the rule inside the reference pass; the same run."""
    from tests.dist.test_skip_old_log_prob import assert_reward_in_pass_same_run

    for rank in runs:
        assert_reward_in_pass_same_run(rank["keep_tp2"], rank["keep_tp2_reward_in_pass"])
