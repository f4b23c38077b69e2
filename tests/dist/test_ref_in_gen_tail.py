"""trainer.ref_in_gen_tail changes nothing but when the reference pass runs (2 gloo ranks, the real
Trainer, real generation with compaction).

GRPO (KL loss against a reference model of its own) on the synthetic task from random weights,
rewarded by the digits in a response (groups differ from the first step), the same seed with the
option off and on. The responses stop unevenly (a frequent stop id, up to 40 tokens, polls every
16 steps), so on each rank compaction reaches a bucket of 4 rows while others still decode, and
the early pass runs in its thread beside them. A row's reference log-probs come from micro-batches
of other rows with it off than on: equal up to fp32 rounding (atol 1e-6 on the response tokens;
padding columns hold whatever their micro-batch computed, masked by every consumer); the metrics
within the DP parity test's bounds (rel 1e-4 / abs 1e-6), the weights within 1e-6.
"""

import pytest
import torch

from tests.dist.launcher import run_ranks

STEPS = 2
BASE = ["experiment=demo", "algo=grpo", "trainer.sft_warmup_steps=0", f"trainer.total_steps={STEPS}",
        "trainer.save_final=false", "trainer.tensorboard=false", "trainer.progress_bar=false",
        "data.prompts_per_step=8", "rollout.n=4", "rollout.max_new_tokens=40",
        "rollout.compact_finished_rows=true", "rollout.stop_token_ids=[3]",
        "algo.ppo_mini_batch_size=32", "algo.micro_batch_size_per_gpu=8",
        "algo.forward_micro_batch_size_per_gpu=8", "trainer.ref_in_gen_tail_rows=4",
        "reward.fn=tests.dist.test_skip_old_log_prob:digit_count"]
RUNS = {"off": ["trainer.ref_in_gen_tail=false"], "on": ["trainer.ref_in_gen_tail=true"]}


def _runs(out_dir):
    from hybridflow.config import load_config
    from hybridflow.config_checks import validate
    from hybridflow.parallel import groups
    from hybridflow.trainer import Trainer

    results = {}
    for name, extra in RUNS.items():
        cfg = load_config([*BASE, f"trainer.output_dir={out_dir}/{name}", *extra])
        validate(cfg, world_size=torch.distributed.get_world_size())
        ctx = groups.init_model_parallel(tp=1, pp=1, seed=cfg.trainer.seed)  # re-seeds every RNG
        trainer = Trainer(cfg, ctx)
        refs = []
        finish = trainer.tail_ref.finish if trainer.tail_ref is not None else None
        if finish is not None:
            def recorded(batch, _finish=finish):
                out = _finish(batch)
                refs.append((trainer.tail_ref.early_rows, out.clone(), batch.response_mask))
                return out
            trainer.tail_ref.finish = recorded
        else:
            compute = trainer.ref.compute_logprobs

            def recorded(batch, _compute=compute, **kw):
                out = _compute(batch, **kw)
                refs.append((0, out.clone(), batch.response_mask))
                return out
            trainer.ref.compute_logprobs = recorded
        init = _weights(trainer)
        history = trainer.train()
        results[name] = {"history": history, "weights": _weights(trainer), "init": init,
                         "refs": refs}
    return results


def _weights(trainer) -> dict:
    return {k: p.detach().clone() for k, p in trainer.actor.module.named_parameters()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(_runs, 2, str(tmp_path_factory.mktemp("ref_tail")))


def test_same_run_with_the_reference_pass_in_the_tail(runs):
    for rank in runs:
        off, on = rank["off"], rank["on"]
        assert len(on["history"]) == len(off["history"]) == STEPS
        assert len(on["refs"]) == len(off["refs"]) == STEPS
        for (early, lp_on, mask), (_, lp_off, mask_off) in zip(on["refs"], off["refs"]):
            assert 0 <= early < 16  # none when every row stopped before a poll
            assert torch.equal(mask, mask_off) and lp_on.shape == lp_off.shape == mask.shape
            # padding columns hold whatever their micro-batch computed there (masked by every
            # consumer); the response tokens' log-probs agree
            m = mask.bool()
            assert torch.allclose(lp_on[m], lp_off[m], atol=1e-6, rtol=0)
            assert (lp_off[m] < 0).all()
        assert all(early > 0 for early, _, _ in on["refs"])  # the early pass ran every step
        for m_off, m_on in zip(off["history"], on["history"]):
            assert "perf/ref_in_gen_tail_frac" not in m_off
            assert 0 < m_on["perf/ref_in_gen_tail_frac"] < 1
            keys = [k for k in m_off if k.split("/")[0] in ("actor", "critic", "response_length")
                    and k != "actor/lr"]
            assert {"actor/pg_loss", "actor/kl_loss", "critic/score/mean"} <= set(keys)
            for k in keys:
                assert m_on[k] == pytest.approx(m_off[k], rel=1e-4, abs=1e-6), k
        diff = moved = 0.0
        for name, w in off["weights"].items():
            diff = max(diff, float((on["weights"][name] - w).abs().max()))
            moved = max(moved, float((w - off["init"][name]).abs().max()))
        assert diff <= 1e-6 and moved > 1e-4, (diff, moved)
