"""Saving and resuming a run: every engine's model, optimizer and LR schedule plus the trainer state
(step, sampler position, KL controller, RNG), through hybridflow.checkpoint (atomic, reshardable).
Checkpoints live in `<output_dir>/checkpoints/step_<N>`; `trainer.resume=true` continues from the
latest one (at any parallel layout)."""

from __future__ import annotations

import os


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
        return save_checkpoint(self.root, step=t.step, models=models, optimizers=optimizers,
                               schedulers=schedulers, trainer_state=t.state_dict(),
                               model_configs=configs, tokenizer_dir=tok_dir,
                               layout=t.ctx.layout)

    def maybe_resume(self) -> bool:
        if not self.trainer.cfg.trainer.resume or not os.path.isdir(self.root):
            return False
        from hybridflow.checkpoint import load_checkpoint

        models, optimizers, schedulers = self._parts()
        state = load_checkpoint(self.root, models=models, optimizers=optimizers,
                                schedulers=schedulers, layout=self.trainer.ctx.layout)
        if state is None:
            return False
        self.trainer.load_state_dict(state)
        return True
