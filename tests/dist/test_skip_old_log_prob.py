"""Skipping the redundant old_log_prob pass changes nothing but the time (2 gloo ranks, real trainer).

Short GRPO runs of the synthetic task from the same seed, each the real Trainer with real generation
(rollout.return_logprobs=true, TIS on), one mini-batch per step, on 2 ranks: DP=2 with fixed
micro-batches and with token budgets (the mismatch metrics are gathered over DP after the update),
and PP=2 (the update's log-probs come from the last stage, broadcast to the first):
- skip off: the old_log_prob pass runs (the reference);
- skip on: no pass; the update's own forward gives pi_old, the mismatch metrics and TIS weights;
- skip on but two mini-batches per step: the decision refuses, the pass runs;
- skip on at PP=2 with the rule reward scored inside the reference pass (reward.score_in_pass).
The reward counts digits in the response, so groups score differently from the first step and the
policy gradient is not zero.

Tolerance: with the pass, pi_old comes from a forward-only pass with other micro-batch shapes than
the update's forward (8 rows vs 4, or token budgets), so in general it equals the update's log-probs
only up to fp32 rounding; the ratio is then 1 +- that and each token's gradient scales by as much.
Measured here: the weights are bitwise equal after 3 steps (this CPU's kernels do not depend on the
micro-batch shape), while merely regrouping the update's micro-batches (token budgets vs fixed rows,
both with the pass) moves them by 4e-7: atol 1e-6 is the size of legitimate fp32 rounding here; a
wrong pi_old (not detached, or rows out of order) changes the update itself (~1.5e-3 per weight) or
the mismatch metrics (~20 %). Metrics: rel 1e-4 / abs 1e-6, the DP parity test's bounds.
"""

import pytest
import torch

from tests.dist.launcher import run_ranks

STEPS = 3
BASE = ["algo=grpo", "trainer.sft_warmup_steps=0", f"trainer.total_steps={STEPS}",
        "trainer.save_final=false", "trainer.tensorboard=false", "trainer.progress_bar=false",
        "data.prompts_per_step=4", "rollout.n=4", "rollout.max_new_tokens=6",
        "rollout.return_logprobs=true", "algo.tis_imp_ratio_cap=2.0",
        "algo.ppo_mini_batch_size=16", "algo.micro_batch_size_per_gpu=4",
        "algo.forward_micro_batch_size_per_gpu=8",
        "reward.fn=tests.dist.test_skip_old_log_prob:digit_count"]
TOKEN_BUDGETS = ["algo.use_dynamic_bsz=true", "algo.max_tokens_per_micro_batch_per_gpu=30"]
OFF = ["algo.skip_redundant_old_log_prob=false"]
RUNS = {"off": OFF, "on": [], "off_token_budgets": OFF + TOKEN_BUDGETS,
        "on_token_budgets": TOKEN_BUDGETS,
        "off_pp2": OFF + ["parallel=pp2"], "on_pp2": ["parallel=pp2"],
        "on_pp2_reward_in_pass": ["parallel=pp2", "reward.score_in_pass=true"],
        "two_mini_batches": ["algo.ppo_mini_batch_size=8", "trainer.total_steps=1"]}


def digit_count(prompt, response, ground_truth, extra_info=None) -> float:
    return float(sum(c.isdigit() for c in response))


def _runs(out_dir):
    from hybridflow.config import load_config
    from hybridflow.config_checks import validate
    from hybridflow.parallel import groups
    from hybridflow.trainer import Trainer

    results = {}
    for name, extra in RUNS.items():
        cfg = load_config(["experiment=demo", *BASE, f"trainer.output_dir={out_dir}/{name}", *extra])
        validate(cfg, world_size=torch.distributed.get_world_size())
        ctx = groups.init_model_parallel(tp=1, pp=cfg.parallel.pipeline_parallel_size,
                                         seed=cfg.trainer.seed)  # re-seeds every RNG
        trainer = Trainer(cfg, ctx)
        trainer.rollout.generate = _skewed(trainer.rollout.generate)
        init = _weights(trainer)
        history = trainer.train()
        results[name] = {"history": history, "weights": _weights(trainer), "init": init}
    return results


def _weights(trainer) -> dict:
    return {k: p.detach().clone() for k, p in trainer.actor.module.named_parameters()}


def _skewed(generate):
    """The generator's log-probs off by a fixed pattern of up to +-0.3 (a stand-in for bf16 decode
    and other kernels), so that the mismatch metrics and TIS weights are far from zero and one."""

    def wrapped(*args, **kw):
        batch = generate(*args, **kw)
        b, r = batch.rollout_logprobs.shape
        skew = 0.3 * torch.sin(torch.arange(b)[:, None] * 7.0 + torch.arange(r)[None, :])
        batch.rollout_logprobs = batch.rollout_logprobs + skew * batch.response_mask
        return batch

    return wrapped


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(_runs, 2, str(tmp_path_factory.mktemp("skip_old")))


@pytest.mark.parametrize("variant", ["", "_token_budgets", "_pp2"])
def test_skip_gives_the_same_run(runs, variant):
    """_token_budgets: the update's micro-batches are grouped by length (rows reordered), so its
    log-probs must be put back in the batch's row order for the mismatch metrics."""
    for rank in runs:
        off, on = rank[f"off{variant}"], rank[f"on{variant}"]
        assert len(on["history"]) == len(off["history"]) == STEPS
        for m_off, m_on in zip(off["history"], on["history"]):
            assert "timing_s/old_log_prob" in m_off and "timing_s/old_log_prob" not in m_on
            assert m_off["actor/old_log_prob_skipped"] == 0.0
            assert m_on["actor/old_log_prob_skipped"] == 1.0
            assert m_off["actor/grad_norm"] > 0  # a real update was compared
            keys = [k for k in m_off if k.split("/")[0] in ("actor", "critic", "response_length")
                    and k not in ("actor/lr", "actor/old_log_prob_skipped")]
            assert {"actor/pg_loss", "actor/kl_loss", "critic/score/mean"} <= set(keys)
            for k in keys:
                assert m_on[k] == pytest.approx(m_off[k], rel=1e-4, abs=1e-6), k
        diff = moved = 0.0
        for name, w in off["weights"].items():
            diff = max(diff, float((on["weights"][name] - w).abs().max()))
            moved = max(moved, float((w - off["init"][name]).abs().max()))
        print(f"max |weight diff| {diff:.2e}, max |weight change| {moved:.2e}")
        assert diff <= 1e-6 and moved > 1e-3, (diff, moved)


@pytest.mark.parametrize("variant", ["", "_token_budgets", "_pp2"])
def test_mismatch_metrics_from_the_update_forward(runs, variant):
    """training/rollout_* and rollout_corr/*: the training forward against the generator's
    log-probs, present with the skip and equal to the pass's (both are the same weights' forward)."""
    for rank in runs:
        for m_off, m_on in zip(rank[f"off{variant}"]["history"], rank[f"on{variant}"]["history"]):
            keys = [k for k in m_off if k.startswith(("training/rollout_", "rollout_corr/"))]
            assert {"training/rollout_probs_diff_mean", "training/rollout_probs_diff_max",
                    "training/rollout_logprobs_diff_mean", "rollout_corr/kl",
                    "rollout_corr/rollout_is_mean"} <= set(keys)
            assert set(keys) == {k for k in m_on if k.startswith(("training/rollout_",
                                                                  "rollout_corr/"))}
            for k in keys:
                assert m_on[k] == pytest.approx(m_off[k], rel=1e-4, abs=1e-6), k


def test_two_mini_batches_keep_the_pass(runs):
    for rank in runs:
        (m,) = rank["two_mini_batches"]["history"]
        assert "timing_s/old_log_prob" in m and m["actor/old_log_prob_skipped"] == 0.0


def test_reward_scored_in_the_reference_pass_at_pp2(runs):
    """reward.score_in_pass (a GPU run's default) at PP=2: each stage scores the rule inside the
    reference pass, after the pass's result is broadcast from the last stage; the same run."""
    for rank in runs:
        assert_reward_in_pass_same_run(rank["on_pp2"], rank["on_pp2_reward_in_pass"])


def assert_reward_in_pass_same_run(plain: dict, in_pass: dict) -> None:
    """Two runs' histories and final weights, the second with reward.score_in_pass: scored inside
    a pass every step, the same metrics, bitwise the same weights."""
    assert len(in_pass["history"]) == len(plain["history"]) == STEPS
    for m, m_in in zip(plain["history"], in_pass["history"]):
        assert "perf/reward_in_pass_s" not in m and m_in["perf/reward_in_pass_s"] > 0
        keys = [k for k in m if k.split("/")[0] in ("actor", "critic", "response_length")
                and k != "actor/lr"]
        assert {"actor/pg_loss", "critic/score/mean", "critic/advantages/mean"} <= set(keys)
        for k in keys:
            assert m_in[k] == pytest.approx(m[k], rel=1e-4, abs=1e-6), k
    for name, w in plain["weights"].items():
        assert torch.equal(in_pass["weights"][name], w), name
