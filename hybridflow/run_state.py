"""Saving and resuming a run: every engine's model, optimizer and LR schedule plus the trainer state
(step, sampler position, KL controller, RNG), through hybridflow.checkpoint (atomic, reshardable).
Checkpoints live in `<output_dir>/checkpoints/step_<N>`; `trainer.resume=true` continues from the
newest complete one (at any parallel layout) when its models are the configured ones (the saved
ModelConfigs are compared; `trainer.resume_allow_vocab_resize=true` lets the vocabulary change).
At start rank 0 repairs the checkpoint root (leftovers of crashed saves, a stale `latest`), and
every rank checks that the output directory is writable before anything is built.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from hybridflow import watchdog


def check_output_dir(output_dir: str, *, rank: int) -> None:
    """Create `output_dir` and write a probe file in it; an OSError names the key, errno and path
    (read-only, permission, disk full), before a model is built or an earlier file is touched."""
    probe = os.path.join(output_dir, f".write_probe.rank{rank}")
    try:
        os.makedirs(output_dir, exist_ok=True)
        with open(probe, "w", encoding="utf-8") as f:
            f.write("ok\n")
            f.flush()
            os.fsync(f.fileno())
        os.remove(probe)
    except OSError as e:
        if os.path.exists(probe):
            os.remove(probe)
        raise OSError(e.errno, f"trainer.output_dir={output_dir} is not writable: {e.strerror}",
                      e.filename or probe) from None


class Checkpointer:
    def __init__(self, trainer):
        self.trainer = trainer
        self.root = os.path.join(trainer.cfg.trainer.output_dir, "checkpoints")

    def _parts(self):
        engines = self.trainer.engines
        models = {role: [e.model] for role, e in engines.items() if role != "reward"}
        optimizers = {role: e.optimizer for role, e in engines.items() if e.optimizer is not None}
        schedulers = {role: e.scheduler for role, e in engines.items() if e.scheduler is not None}
        return models, optimizers, schedulers

    def save(self) -> str:
        from hybridflow.checkpoint import save_checkpoint

        models, optimizers, schedulers = self._parts()
        t = self.trainer
        tok = t.tokenizer_path  # a tokenizer dir, or a .model file (its folder holds only it)
        tok_dir = None if tok is None else (tok if os.path.isdir(tok) else os.path.dirname(tok))
        configs = {role: e.model_cfg for role, e in t.engines.items()}
        with watchdog.stage("save"):
            return save_checkpoint(self.root, step=t.step, models=models, optimizers=optimizers,
                                   schedulers=schedulers, trainer_state=t.state_dict(),
                                   model_configs=configs, tokenizer_dir=tok_dir,
                                   layout=t.ctx.layout)

    def maybe_resume(self) -> bool:
        from hybridflow.checkpoint import latest_step, load_checkpoint, recover

        if dist.get_rank() == 0:
            recover(self.root)  # before any rank looks: the newest step, no leftovers
        dist.barrier()
        cfg = self.trainer.cfg.trainer
        if not os.path.isdir(self.root):
            return False
        if not cfg.resume:
            # published steps are never rewritten: a fresh run here would silently skip its own
            # saves of every step that already exists
            found = latest_step(self.root)
            if found is not None:
                raise ValueError(f"trainer.resume=false but {self.root} already holds step_{found}: "
                                 "a new run would not overwrite those checkpoints; set "
                                 "trainer.output_dir to a new directory, remove the old one, or "
                                 "resume (trainer.resume=true)")
            return False
        models, optimizers, schedulers = self._parts()
        configs = {role: e.model_cfg for role, e in self.trainer.engines.items() if role in models}
        with watchdog.stage("resume"):
            state = load_checkpoint(self.root, models=models, optimizers=optimizers,
                                    schedulers=schedulers, model_configs=configs,
                                    allow_vocab_resize=cfg.resume_allow_vocab_resize,
                                    layout=self.trainer.ctx.layout)
        if state is None:
            return False
        self.trainer.load_state_dict(state)
        return True
