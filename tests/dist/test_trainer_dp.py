"""A full trainer step at DP=2 equals the same step at DP=1 (gloo, CPU).

The trainer's docstring claims that advantages (group statistics, whitening) are computed on the
global batch, and the engine that losses are normalised by global denominators, so nothing depends
on how the batch is split over data-parallel ranks. Here one step of PPO (critic, GAE, whitening, KL
in the reward) and one of GRPO (group statistics, KL loss) run at DP=1 and at DP=2 (distributed
optimizer) from the same seed; the advantages, the losses, the gradient norms and the updated
weights must agree.

Sampling depends on the rank's seed by design, so the rollout is replaced by a deterministic one:
each response is a function of (dataset index, sample number) alone, the correct answer for some
samples and other tokens for the rest (so rewards and advantages are not all zero). Everything after
generation is the trainer's own code.
"""

import pytest
import torch

from tests.dist.launcher import run_ranks

OVERRIDES = {
    "ppo": ["algo=ppo", "algo.use_kl_in_reward=true", "algo.kl_coef=0.05"],
    "grpo": ["algo=grpo", "algo.use_kl_loss=true", "algo.kl_loss_coef=0.1"],
    "grpo_no_kl": ["algo=grpo", "algo.use_kl_loss=false"],
}


def _fake_generate(trainer):
    tok, n = trainer.tokenizer, trainer.cfg.rollout.n
    width = trainer.cfg.rollout.max_new_tokens

    def generate(items, *, step, timer, **_):
        rows_p, rows_r = [], []
        for it in items:
            for j in range(n):
                g = torch.Generator().manual_seed(it.index * 131 + j)
                if (it.index + j) % 3 == 0:
                    resp = tok.encode(str(it.ground_truth)) + [tok.eos_id]
                else:
                    resp = torch.randint(3, tok.vocab_size, (1 + j % width,), generator=g).tolist()
                rows_p.append(it.prompt_ids)
                rows_r.append(resp[:width])
        P, R = max(map(len, rows_p)), max(map(len, rows_r))
        p_ids = torch.full((len(rows_p), P), tok.pad_id)
        p_mask = torch.zeros_like(p_ids)
        r_ids = torch.full((len(rows_r), R), tok.pad_id)
        r_mask = torch.zeros_like(r_ids)
        for i, (p, r) in enumerate(zip(rows_p, rows_r)):
            p_ids[i, P - len(p):], p_mask[i, P - len(p):] = torch.tensor(p), 1
            r_ids[i, :len(r)], r_mask[i, :len(r)] = torch.tensor(r), 1
        first = trainer.ctx.train.dp * len(items)
        group_ids = (first + torch.arange(len(items))).repeat_interleave(n)
        indices = torch.tensor([it.index for it in items]).repeat_interleave(n)
        from hybridflow.data.batch import RolloutBatch

        return RolloutBatch(prompt_ids=p_ids, prompt_mask=p_mask, response_ids=r_ids,
                            response_mask=r_mask, group_ids=group_ids, indices=indices)

    return generate


def one_step(algo, out_dir, extra=()):
    from hybridflow.config import load_config
    from hybridflow.config_checks import validate
    from hybridflow.parallel import groups
    from hybridflow.trainer import Trainer

    world = torch.distributed.get_world_size()
    cfg = load_config(["experiment=demo", *OVERRIDES[algo], 
        f"trainer.output_dir={out_dir}", "trainer.sft_warmup_steps=0", "trainer.total_steps=1",
        "trainer.save_final=false", "trainer.tensorboard=false", "trainer.progress_bar=false",
        "data.prompts_per_step=8", "rollout.n=4", "rollout.max_new_tokens=4",
        "algo.ppo_mini_batch_size=32", "algo.micro_batch_size_per_gpu=4", *extra])
    validate(cfg, world_size=world)
    ctx = groups.init_model_parallel(tp=1, pp=1, seed=cfg.trainer.seed)
    trainer = Trainer(cfg, ctx)
    trainer.rollout.generate = _fake_generate(trainer)
    captured = {}
    compute = trainer.compute_advantages

    def spy(batch):
        batch, m = compute(batch)
        captured["advantages"] = batch.advantages.clone()
        captured["returns"] = batch.returns.clone()
        return batch, m

    trainer.compute_advantages = spy
    handed = []  # the forward-only passes that got host work (reward.score_in_pass)
    for name, engine in (("actor", trainer.actor), ("ref", trainer.ref),
                         ("critic", trainer.critic)):
        if engine is not None:
            for method in ("compute_logprobs", "compute_values"):
                def wrapped(*a, _f=getattr(engine, method), _n=name, host_work=None, **kw):
                    if host_work is not None:
                        handed.append(_n)
                    return _f(*a, host_work=host_work, **kw)
                setattr(engine, method, wrapped)
    metrics = trainer.train_step()
    weights = {name: p.detach().clone() for name, p in trainer.actor.module.named_parameters()}
    return {"metrics": metrics, "weights": weights, "step_lengths": trainer.step_lengths,
            "reward_thread": trainer.rollout._pool is not None, "handed": handed,
            "has_ref": trainer.ref is not None,
            "in_pass_s": metrics.get("perf/reward_in_pass_s"), **captured}


DYNAMIC_BSZ = ("algo.use_dynamic_bsz=true", "algo.max_tokens_per_micro_batch_per_gpu=80",
               "algo.forward_max_tokens_per_micro_batch_per_gpu=150")
# case: (algo, the DP=2 run's extra overrides); the DP=1 reference of each algo has none
CASES = {"ppo": ("ppo", ()), "grpo": ("grpo", ()), "ppo_dynamic_bsz": ("ppo", DYNAMIC_BSZ),
         "ppo_packed": ("ppo", DYNAMIC_BSZ + ("algo.pack_sequences=true",)),
         "grpo_async_reward": ("grpo", ("reward.launch_reward_fn_async=true",)),
         "grpo_in_pass_reward": ("grpo", ("reward.score_in_pass=true",)),
         "ppo_in_pass_reward": ("ppo", ("reward.score_in_pass=true",)),
         "grpo_no_kl_in_pass_reward": ("grpo_no_kl", ("reward.score_in_pass=true",))}


def steps(runs: dict, out_dir: str) -> dict:
    """{name: one_step(algo, extra)} in this one launch (each a fresh Trainer, the RNGs re-seeded by
    init_model_parallel): rank start-up is most of a launch's cost."""
    return {name: one_step(algo, f"{out_dir}/{name}", extra) for name, (algo, extra) in runs.items()}


@pytest.fixture(scope="module")
def dp_runs(tmp_path_factory):
    """The DP=1 references (one launch) and every case at DP=2 (one launch of 2 ranks)."""
    out = tmp_path_factory.mktemp("trainer_dp")
    ref = run_ranks(steps, 1, {algo: (algo, ()) for algo in OVERRIDES}, str(out / "dp1"))[0]
    dp2 = run_ranks(steps, 2, CASES, str(out / "dp2"))
    return ref, dp2


@pytest.mark.parametrize("case", list(CASES))
def test_step_at_dp2_equals_dp1(case, dp_runs):
    """ppo_dynamic_bsz: DP=2 with micro-batches by token budget in every pass (old/ref log-probs,
    values, critic and actor updates) against DP=1 with fixed micro-batches; ppo_packed: the same
    budgets, each micro-batch run as one packed row (algo.pack_sequences); grpo_async_reward: the
    rule reward scored on a worker thread while the reference pass runs (the same scores:
    critic/score/mean and the advantages); *_in_pass_reward: scored on the main thread as the
    host work of the step's first forward-only pass (the old log-probs', else the reference's;
    GRPO without KL has neither: scored before the advantages)."""
    ref, dp2 = dp_runs[0][CASES[case][0]], [rank[case] for rank in dp_runs[1]]
    # every DP rank holds its contiguous half of the global batch's rows
    for key in ("advantages", "returns"):
        width = ref[key].shape[1]  # each rank trims its own rows: pad to the global width
        got = torch.cat([torch.nn.functional.pad(d[key], (0, width - d[key].shape[1]))
                         for d in dp2])
        assert torch.allclose(got, ref[key], atol=1e-5), key
    assert ref["advantages"].abs().sum() > 0  # a real signal was compared
    assert all(d["reward_thread"] == case.endswith("async_reward") for d in dp2)
    assert not ref["reward_thread"] and not ref["handed"] and ref["in_pass_s"] is None
    for d in dp2:  # the step's first forward-only pass: old log-probs, else the reference's
        first = ("actor" if not d["metrics"]["actor/old_log_prob_skipped"] else
                 "ref" if d["has_ref"] else None)  # none: scored before the advantages
        in_pass = case.endswith("in_pass_reward") and first is not None
        assert d["handed"] == ([first] if in_pass else [])
        assert (d["in_pass_s"] is not None and d["in_pass_s"] > 0) == in_pass
    # rollout_lengths.jsonl's row of the step: every row of the global batch, on every rank
    assert len(ref["step_lengths"]) == 32 and all(d["step_lengths"] == ref["step_lengths"]
                                                  for d in dp2)
    keys = [k for k in ref["metrics"] if k.split("/")[0] in ("actor", "critic")
            and "lr" not in k]
    assert any("grad_norm" in k for k in keys) and any("loss" in k for k in keys)
    for k in keys:
        for r in range(2):
            assert dp2[r]["metrics"][k] == pytest.approx(ref["metrics"][k], rel=1e-4, abs=1e-6), k
    # Adam's first step moves each weight by lr * g / (|g| + eps) (lr 1e-5, eps 1e-8): ~lr * sign(g)
    # wherever |g| >> eps, so it amplifies rounding only for the few weights whose gradient is
    # itself at the 1e-8 level (the packed path rounds attention differently: one element of 16k
    # moved 2.3e-6 = 0.23 lr apart). Up to lr / 2 apart then; a wrong gradient sign is 2 lr apart,
    # and the gradient's size is checked by grad_norm above.
    for name, w in ref["weights"].items():
        for r in range(2):
            assert torch.allclose(dp2[r]["weights"][name], w, atol=5e-6, rtol=1e-5), name
