"""PPO with a LoRA critic (critic.lora), end to end on the CPU demo task (one rank): the critic's
adapters and its value head are all that change in it; its checkpoint holds those (and their Adam
state), not the frozen base; a run resumed from a checkpoint ends with the weights of one that was
not (actor and critic)."""

import json
import os

import torch

from tests.dist.launcher import run_ranks


def _run(out_dir: str, total_steps: int, save_final: bool):
    from hybridflow.config import load_config
    from hybridflow.config_checks import validate
    from hybridflow.parallel import groups
    from hybridflow.trainer import Trainer

    cfg = load_config([
        "experiment=demo", "algo=ppo", "critic.lora.rank=4", "critic.lora.alpha=8",
        "critic_optim.lr=1e-2", f"trainer.output_dir={out_dir}", "trainer.sft_warmup_steps=0",
        f"trainer.total_steps={total_steps}", f"trainer.save_final={str(save_final).lower()}",
        "trainer.tensorboard=false", "trainer.progress_bar=false", "data.prompts_per_step=4",
        "rollout.n=2", "rollout.max_new_tokens=4", "algo.ppo_mini_batch_size=8",
        "algo.micro_batch_size_per_gpu=4"])
    validate(cfg, world_size=1)
    ctx = groups.init_model_parallel(tp=1, pp=1, seed=cfg.trainer.seed)
    trainer = Trainer(cfg, ctx)
    snap = {role: {n: p.detach().clone() for n, p in e.module.named_parameters()}
            for role, e in trainer.engines.items()}
    history = trainer.train()
    end = {role: {n: p.detach().clone() for n, p in e.module.named_parameters()}
           for role, e in trainer.engines.items()}
    return {"start": snap, "end": end, "history": history,
            "trainable": sorted(n for n, p in trainer.critic.module.named_parameters()
                                if p.requires_grad)}


def test_ppo_lora_critic_end_to_end_and_resume(tmp_path):
    full = run_ranks(_run, 1, str(tmp_path / "full"), 3, False)[0]
    trainable = set(full["trainable"])
    head = {"output_layer.linear.weight", "output_layer.linear.bias"}
    assert head <= trainable and all(".lora." in n for n in trainable - head)
    assert all("critic/vf_loss" in m for m in full["history"])
    start, end = full["start"]["critic"], full["end"]["critic"]
    changed = {n for n in start if not torch.equal(start[n], end[n])}
    assert changed <= trainable and head <= changed  # only adapters and the head moved
    assert any(".lora.B." in n for n in changed)
    resumed_dir = str(tmp_path / "resumed")
    first = run_ranks(_run, 1, resumed_dir, 2, True)[0]
    _check_adapter_only(os.path.join(resumed_dir, "checkpoints", "step_2"))
    second = run_ranks(_run, 1, resumed_dir, 3, False)[0]
    for role in ("actor", "critic"):
        for n, t in first["end"][role].items():
            assert torch.equal(second["start"][role][n], t), (role, n)
        for n, t in full["end"][role].items():
            assert torch.equal(second["end"][role][n], t), (role, n)


def _check_adapter_only(step: str):
    """The critic dir holds its adapters and value head (and their Adam state) only."""
    from megatron.core import dist_checkpointing

    with open(os.path.join(step, "lora_config_critic.json")) as f:
        lora = json.load(f)
    assert lora["adapter_only"] and lora["rank"] == 4 and lora["base"]["source"] == "random"
    assert not os.path.exists(os.path.join(step, "lora_config_actor.json"))
    keys = list(dist_checkpointing.load_tensors_metadata(os.path.join(step, "critic")))
    model = [k for k in keys if not k.startswith("optimizer.")]
    assert {k for k in model if ".lora." not in k} == {"output_layer.linear.weight",
                                                       "output_layer.linear.bias"}, model[:5]
    assert any(".lora." in k for k in model)
    assert any(k.startswith("optimizer.") for k in keys)  # their Adam state
