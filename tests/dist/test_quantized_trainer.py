"""The trainer with rollout.quantization=fp8 on CPU (one gloo rank, the demo's tiny model): two GRPO
steps run end to end with truncated importance sampling turned on by the quantized defaults (cap
2.0), the rollout/training mismatch metrics reported every step (non-zero: the fp8 model's
log-probs differ from the training forward's), and the quantized weights' bytes in the step's
metrics."""

import pytest
import torch

from tests.dist.launcher import run_ranks

BASE = ["experiment=demo", "algo=grpo", "trainer.sft_warmup_steps=0", "trainer.total_steps=2",
        "trainer.save_final=false", "trainer.tensorboard=false", "trainer.progress_bar=false",
        "data.prompts_per_step=4", "rollout.n=2", "rollout.max_new_tokens=4",
        "algo.ppo_mini_batch_size=8", "algo.micro_batch_size_per_gpu=4",
        "algo.forward_micro_batch_size_per_gpu=8", "rollout.quantization=fp8"]


def _run(out_dir):
    from hybridflow.config import load_config
    from hybridflow.parallel import groups
    from hybridflow.trainer import Trainer

    cfg = load_config([*BASE, f"trainer.output_dir={out_dir}"])
    ctx = groups.init_model_parallel(tp=1, pp=1, tp_gen=None, seed=cfg.trainer.seed)
    trainer = Trainer(cfg, ctx)
    return {"cap": trainer.cfg.algo.tis_imp_ratio_cap, "history": trainer.train()}


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return run_ranks(_run, 1, str(tmp_path_factory.mktemp("quant_trainer")))[0]


def test_fp8_rollout_trains_with_tis_and_mismatch_metrics(result):
    assert result["cap"] == 2.0
    assert len(result["history"]) == 2
    for m in result["history"]:
        assert m["rollout_corr/kl"] != 0.0 and "rollout_corr/rollout_is_mean" in m, m
        assert 0 < m["rollout_corr/rollout_is_mean"] <= 2.0
        assert m["perf/rollout_quantized_weights_gb"] > 0
        assert torch.isfinite(torch.tensor(m["actor/pg_loss"]))


# validation (trainer.val_quantized=false: unquantized) before training and after every step, with
# the quantized generator kept across steps (rollout.free_cache_engine=false) or not
VAL_STEPS = 3
KEEP_RUNS = {"free": [], "keep": ["rollout.free_cache_engine=false"],
             "keep_no_room": ["rollout.free_cache_engine=false"]}
# 2 ranks, room on rank 0 only: every rank must decide alike (a rank that rebuilt alone would
# capture its graphs, collectives included, without the others)
SPLIT_RUNS = {"keep_split_room": ["rollout.free_cache_engine=false", "data.prompts_per_step=4",
                                  "rollout.n=2", "algo.ppo_mini_batch_size=8",
                                  "algo.micro_batch_size_per_gpu=4",
                                  "algo.forward_micro_batch_size_per_gpu=4"]}


def _val_runs(out_dir, val_file, runs=KEEP_RUNS):
    import torch.distributed as dist

    from hybridflow.config import load_config
    from hybridflow.parallel import groups
    from hybridflow.rollout import stage
    from hybridflow.trainer import Trainer

    built, released = [], []

    class Counted(stage.Generator):
        def __init__(self, **kw):
            super().__init__(**kw)
            built.append(self.quantization)

        def release(self):  # the releases that free a cache
            if self._cache is not None:
                released.append(self.quantization)
            super().release()

    stage.Generator = Counted
    room = stage._room_for
    results = {}
    for name, extra in runs.items():
        built.clear()
        released.clear()
        stage._room_for = {"keep_no_room": lambda *a: False,
                           "keep_split_room": lambda *a: dist.get_rank() == 0}.get(name, room)
        cfg = load_config([*BASE, f"trainer.total_steps={VAL_STEPS}", f"data.val_files={val_file}",
                           "trainer.val_every=1", "trainer.val_before_train=true",
                           f"trainer.output_dir={out_dir}/{name}", *extra])
        ctx = groups.init_model_parallel(tp=1, pp=1, tp_gen=None, seed=cfg.trainer.seed)
        trainer = Trainer(cfg, ctx)
        history = trainer.train()
        results[name] = {"history": history, "built": list(built), "released": list(released),
                         "weights": {k: p.detach().clone()
                                     for k, p in trainer.actor.module.named_parameters()}}
    stage._room_for = room
    return results


@pytest.fixture(scope="module")
def val_runs(tmp_path_factory):
    import json

    from hybridflow.data.synthetic import make_task

    tmp = tmp_path_factory.mktemp("quant_val")
    val_file = tmp / "val.jsonl"
    with open(val_file, "w") as f:
        for rec in make_task("arith", size=6, seed=12345):
            f.write(json.dumps(rec) + "\n")
    return {**run_ranks(_val_runs, 1, str(tmp), str(val_file))[0],
            "split": run_ranks(_val_runs, 2, str(tmp), str(val_file), SPLIT_RUNS)}


def test_validation_keeps_the_quantized_generator_of_the_steps(val_runs):
    """With room, validation's unquantized generator is built beside the kept fp8 one and freed
    after each validation; the fp8 one is built once and serves every step (before: rebuilt after
    each validation). Without room (keep_no_room) the kept one is freed first, as before. Every
    way gives the same run: training and validation metrics, and weights."""
    keep = val_runs["keep"]
    assert keep["built"] == ["none", "fp8", "none", "none", "none"]
    assert sorted(keep["released"]) == sorted(keep["built"])  # each val call's, the kept at the end
    assert keep["released"][-1] == "fp8" and keep["released"][:-1] == ["none"] * 4
    no_room = val_runs["keep_no_room"]
    assert no_room["built"] == ["none"] + ["fp8", "none"] * VAL_STEPS
    assert sorted(no_room["released"]) == sorted(no_room["built"])
    free = val_runs["free"]
    assert free["built"] == no_room["built"]
    for other in (keep, no_room):
        assert len(other["history"]) == len(free["history"]) == VAL_STEPS
        for m_free, m in zip(free["history"], other["history"]):
            keys = [k for k in m_free if k.split("/")[0] in ("actor", "critic", "response_length",
                                                           "rollout_corr", "val-core")]
            assert "val-core/synthetic_arith/reward/mean@1" in keys, sorted(m_free)
            for k in keys:
                assert m[k] == m_free[k], k
        for n, w in free["weights"].items():
            assert torch.equal(other["weights"][n], w), n


def test_the_room_decision_is_every_ranks(val_runs):
    """Room on one rank of two: both free the kept generator before each validation and rebuild it
    at the next step, as with no room anywhere."""
    for rank in val_runs["split"]:
        r = rank["keep_split_room"]
        assert r["built"] == ["none"] + ["fp8", "none"] * VAL_STEPS, r["built"]
        assert sorted(r["released"]) == sorted(r["built"])
