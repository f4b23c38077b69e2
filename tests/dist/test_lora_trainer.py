"""GRPO with a LoRA actor, end to end on the CPU demo task (one rank): generation on the merged
weights, the reference as the actor with adapters off (no ref model built), KL loss, updates; only
the adapters change, and a run resumed from a checkpoint ends with the weights of one that was not.
Its checkpoints hold the adapters, not the frozen base: resume re-creates the base from its seed."""

import json
import os

import torch

from tests.dist.launcher import run_ranks


def _run(out_dir: str, total_steps: int, save_final: bool):
    from hybridflow.config import load_config
    from hybridflow.config_checks import validate
    from hybridflow.engine import AdapterFreeReference
    from hybridflow.parallel import groups
    from hybridflow.trainer import Trainer

    cfg = load_config([
        "experiment=demo", "algo=grpo", "algo.use_kl_loss=true", "algo.kl_loss_coef=0.1",
        "actor.lora.rank=4", "actor.lora.alpha=8", "actor_optim.lr=1e-2",
        f"trainer.output_dir={out_dir}", "trainer.sft_warmup_steps=0",
        f"trainer.total_steps={total_steps}", f"trainer.save_final={str(save_final).lower()}",
        "trainer.tensorboard=false", "trainer.progress_bar=false", "data.prompts_per_step=4",
        "rollout.n=4", "rollout.max_new_tokens=4", "algo.ppo_mini_batch_size=16",
        "algo.micro_batch_size_per_gpu=8"])
    validate(cfg, world_size=1)
    ctx = groups.init_model_parallel(tp=1, pp=1, seed=cfg.trainer.seed)
    trainer = Trainer(cfg, ctx)
    start = {n: p.detach().clone() for n, p in trainer.actor.module.named_parameters()}
    history = trainer.train()
    end = {n: p.detach().clone() for n, p in trainer.actor.module.named_parameters()}
    return {"start": start, "end": end, "history": history, "roles": sorted(trainer.engines),
            "ref_is_view": isinstance(trainer.ref, AdapterFreeReference),
            "trainable": sorted(n for n, p in trainer.actor.module.named_parameters()
                                if p.requires_grad)}


def test_grpo_lora_end_to_end_and_resume(tmp_path):
    full = run_ranks(_run, 1, str(tmp_path / "full"), 3, False)[0]
    assert full["roles"] == ["actor"] and full["ref_is_view"]
    assert full["trainable"] and all(".lora." in n for n in full["trainable"])
    assert len(full["history"]) == 3
    assert all("actor/kl_loss" in m for m in full["history"])
    changed = {n for n in full["start"] if not torch.equal(full["start"][n], full["end"][n])}
    assert changed and changed <= set(full["trainable"])  # only adapters moved
    assert any(".lora.B." in n for n in changed)  # B left zero: the adapters now act
    # two steps, a checkpoint, then the third step in a new process
    resumed_dir = str(tmp_path / "resumed")
    first = run_ranks(_run, 1, resumed_dir, 2, True)[0]
    _check_adapter_only(os.path.join(resumed_dir, "checkpoints", "step_2"))
    second = run_ranks(_run, 1, resumed_dir, 3, False)[0]
    for n, t in first["end"].items():
        assert torch.equal(second["start"][n], t), n  # the checkpoint restores every tensor
    for n, t in full["end"].items():
        assert torch.equal(second["end"][n], t), n


def _check_adapter_only(step: str):
    """The actor dir holds adapter tensors only (and their Adam state); the base is identified."""
    from megatron.core import dist_checkpointing

    with open(os.path.join(step, "lora_config_actor.json")) as f:
        lora = json.load(f)
    assert lora["adapter_only"] and lora["base"]["source"] == "random"
    assert lora["base"]["seed"] == 1 and len(lora["base"]["fingerprint"]) == 64
    keys = list(dist_checkpointing.load_tensors_metadata(os.path.join(step, "actor")))
    assert keys and all(".lora." in k for k in keys), [k for k in keys if ".lora." not in k][:3]
    assert any(k.startswith("optimizer.") for k in keys)  # their Adam state
