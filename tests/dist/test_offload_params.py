"""actor.offload_params in the trainer (CPU, gloo): two steps with it on equal two steps with it off
bit for bit (every logged loss and metric but timings and memory, every weight of actor and
critic), at TP=1 and TP=2, together with offload_optimizer, offload_grads, trainer.offload_ref
and LoRA (then the frozen base is what moves). While the passes run, the bytes of the actor's
weights on the device are recorded: they drop in exactly the phases the cost model says
(cost/memory.py offloaded_params_bytes: the critic's passes and a reference model's; in
generation, the decoder's matrices when the rollout is quantized, the whole training shard when it
is resharded), and by the bytes it predicts (in parameters: the CPU runs fp32, the model counts
bf16)."""

import pytest
import torch

from tests.dist.launcher import run_ranks

BASE = ["experiment=demo", "trainer.sft_warmup_steps=0", "trainer.total_steps=2",
        "trainer.save_final=false", "trainer.tensorboard=false", "trainer.progress_bar=false",
        "data.prompts_per_step=4", "rollout.n=2", "rollout.max_new_tokens=4",
        "algo.ppo_mini_batch_size=8", "algo.micro_batch_size_per_gpu=4"]
# PPO with a critic, a reference model of its own (offloaded), KL loss, fp8 rollout, optimizer
# and grad offload: the actor's weights leave in generation, the ref pass and the critic's passes
PPO = ["algo=ppo", "algo.use_kl_loss=true", "algo.kl_loss_coef=0.1", "trainer.offload_ref=true",
       "rollout.quantization=fp8", "actor.offload_optimizer=true", "actor.offload_grads=true"]
# GRPO with a LoRA actor (the reference is its base) generating at TP 1 from TP 2 (a reshard)
LORA = ["algo=grpo", "algo.use_kl_loss=true", "algo.kl_loss_coef=0.1", "actor.lora.rank=4",
        "actor.lora.alpha=8", "actor_optim.lr=1e-2", "actor.offload_optimizer=true",
        "rollout.tensor_parallel_size=1"]
VOLATILE = ("timing_s/", "perf/", "gc/")


def _device_bytes(module) -> int:
    """Bytes of the storages under the module's parameters, as allocated now."""
    seen = {}
    for p in module.parameters():
        st = p.untyped_storage()
        seen[id(p)] = st.nbytes()
    return sum(seen.values())


def _run(out_dir: str, tp: int, overrides: list, offload: bool):
    from hybridflow.config import load_config
    from hybridflow.config_checks import validate
    from hybridflow.parallel import groups
    from hybridflow.rollout import generator
    from hybridflow.trainer import Trainer, offload_params_note

    cfg = load_config([*BASE, *overrides, f"trainer.output_dir={out_dir}",
                       f"parallel.tensor_parallel_size={tp}",
                       f"actor.offload_params={str(offload).lower()}"])
    validate(cfg, world_size=tp)
    ctx = groups.init_model_parallel(tp=tp, pp=1, tp_gen=cfg.rollout.tensor_parallel_size,
                                     seed=cfg.trainer.seed)
    trainer = Trainer(cfg, ctx)
    actor = trainer.actor.module
    # frozen LoRA base or the whole model: the bytes that may move (adapters never do)
    movable = [p for p in actor.parameters() if not (cfg.actor.lora.rank and p.requires_grad)]
    seen: dict[str, int] = {}

    def record(phase, fn):
        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)  # (after: the generator's decode ran inside)
            seen[phase] = min(seen.get(phase, 1 << 62), _device_bytes(actor))
            return out
        return wrapped

    def during(phase, fn):
        def wrapped(*args, **kwargs):
            seen[phase] = min(seen.get(phase, 1 << 62), _device_bytes(actor))
            return fn(*args, **kwargs)
        return wrapped

    generator.Generator.generate = during("gen", generator.Generator.generate)
    if trainer.critic is not None:
        trainer.critic.compute_values = during("values", trainer.critic.compute_values)
        trainer.critic.train_step = during("update_critic", trainer.critic.train_step)
    if "ref" in trainer.engines:
        trainer.ref.compute_logprobs = during("ref", trainer.ref.compute_logprobs)
    trainer.actor.train_step = record("update_actor", trainer.actor.train_step)
    history = trainer.train()
    roles = {role: {n: p.detach().clone() for n, p in e.module.named_parameters()}
             for role, e in trainer.engines.items()}
    return {"history": [{k: v for k, v in m.items() if not k.startswith(VOLATILE)}
                        for m in history],
            "offloaded_gb": [m.get("perf/actor_weights_offloaded_gb") for m in history],
            "weights": roles, "seen": seen, "total": _device_bytes(actor),
            "movable": sum(p.numel() * p.element_size() for p in movable),
            "note": offload_params_note(trainer)}


def _predicted_params(tp: int, overrides: list, phase: str) -> float:
    """The cost model's offloaded actor parameters (bytes / 2: it counts bf16) in `phase`."""
    from hybridflow.config import load_config
    from hybridflow.cost.memory import offloaded_params_bytes
    from hybridflow.cost.workload import Workload, make_plan

    cfg = load_config([*BASE, *overrides])
    shape = cfg.model
    plan = make_plan({"tp": tp, "tp_gen": cfg.rollout.tensor_parallel_size or tp}, tp, shape)
    work = Workload(algorithm="ppo" if cfg.use_critic else "grpo", prompts_per_step=4,
                    samples_per_prompt=2, prompt_len=8, response_len=4,
                    rollout_quantization=cfg.rollout.quantization,
                    lora_rank=cfg.actor.lora.rank, offload_params=True)
    return offloaded_params_bytes(shape, plan, work, phase) / 2


def _compare(tmp_path, tp: int, overrides: list) -> list:
    on = run_ranks(_run, tp, str(tmp_path / "on"), tp, overrides, True)
    off = run_ranks(_run, tp, str(tmp_path / "off"), tp, overrides, False)
    for a, b in zip(on, off):
        assert len(a["history"]) == 2 and a["history"] == b["history"]
        for role, weights in b["weights"].items():
            for n, w in weights.items():
                assert torch.equal(a["weights"][role][n], w), (role, n)
        # without the option nothing moves
        assert all(v == b["total"] for v in b["seen"].values()), b["seen"]
    return on


def test_ppo_quantized_rollout_tp1(tmp_path):
    (res,) = _compare(tmp_path, 1, PPO)
    seen, total, elem = res["seen"], res["total"], 4  # fp32 on CPU
    assert res["note"] is None
    for phase in ("ref", "values", "update_critic"):  # everything away
        assert seen[phase] == 0, (phase, seen)
        assert (total - seen[phase]) / elem == _predicted_params(1, PPO, phase)
    # decoding: the decoder's matrices away (the fp8 generator holds its own); embedding, norms,
    # biases and LM head stay (it reads them in place)
    assert 0 < seen["gen"] < total
    assert (total - seen["gen"]) / elem == _predicted_params(1, PPO, "gen")
    assert seen["update_actor"] == total
    assert res["offloaded_gb"] == [total / 2 ** 30] * 2  # the step's metric: all of it at once


@pytest.mark.slow
def test_ppo_quantized_rollout_tp2(tmp_path):
    for res in _compare(tmp_path, 2, PPO):
        seen, total = res["seen"], res["total"]
        assert seen["values"] == seen["update_critic"] == seen["ref"] == 0
        assert (total - seen["gen"]) / 4 == _predicted_params(2, PPO, "gen")
        assert seen["update_actor"] == total


def test_lora_base_resharded_tp2(tmp_path):
    for res in _compare(tmp_path, 2, LORA):
        seen, total = res["seen"], res["total"]
        # generation reads the gathered TP 1 weights: the base leaves but for the replicated
        # norms the generator aliases; the adapters stay
        kept = total - res["movable"]
        assert kept < seen["gen"] < kept + 0.02 * total, (seen, total, kept)
        predicted = _predicted_params(2, LORA, "gen")  # the cost model: the whole shard
        assert (total - seen["gen"]) / 4 == pytest.approx(predicted, rel=0.02)
        assert seen["update_actor"] == total


def test_lora_base_quantized_rollout_tp1(tmp_path):
    """fp8 rollout of a LoRA actor: the base's matrices go to the host before the generator is
    built and are quantized one at a time from there, each with its adapter merged in (the same
    bits as merging in place: the runs with and without the option are equal)."""
    overrides = [o for o in LORA if not o.startswith("rollout.tensor_parallel_size")]
    (res,) = _compare(tmp_path, 1, overrides + ["rollout.quantization=fp8"])
    seen, total = res["seen"], res["total"]
    assert (total - seen["gen"]) / 4 == _predicted_params(1, overrides + [
        "rollout.quantization=fp8"], "gen")
    assert seen["update_actor"] == total


def test_no_saving_is_said(tmp_path):
    """GRPO without KL, rule reward, generation in place: nothing to save, a warning line."""
    res = run_ranks(_run, 1, str(tmp_path), 1, ["algo=grpo", "algo.use_kl_loss=false", "algo.use_kl_in_reward=false",
                                                "trainer.total_steps=1"], True)[0]
    assert "actor.offload_params=true saves no GPU memory" in res["note"]
