"""Saving and resuming a run: every engine's model, optimizer and LR schedule plus the trainer state
(step, sampler position, KL controller, RNG), through hybridflow.checkpoint (atomic, reshardable).
Checkpoints live in `<output_dir>/checkpoints/step_<N>`; `trainer.resume=true` continues from the
newest complete one (at any parallel layout) when its models are the configured ones (the saved
ModelConfigs are compared; `trainer.resume_allow_vocab_resize=true` lets the vocabulary change) and
its training data is this run's. At start rank 0 repairs the checkpoint root (leftovers of crashed
saves, a stale `latest`), and every rank checks that the output directory is writable before
anything is built.

The training data is identified by content, not by path: `data.train_files` by the sha256 of the
file (read in 1 MiB chunks) and its row count (`train_data` in trainer_state.json), so a moved file
is the same data and a file rewritten in place is not; a synthetic task by its name only (its
prompts follow from data.synthetic_size and the seed, which the sampler's own state pins). Resume
refuses other data unless `trainer.resume_allow_data_change=true`: the saved sampler position
indexes the old rows, so on other rows it would silently train on other prompts or fail over the
row count. With the override the sampler starts its saved epoch again, from its first batch, over
the new data, and one warning line says so. A checkpoint that records no data (saved before the
record) has only the sampler's row count: a different count is refused the same way, an equal one
resumes with a warning line.
"""

from __future__ import annotations

import dataclasses

import hashlib
import os
from typing import Optional

import torch.distributed as dist

from hybridflow import watchdog
from hybridflow.config import DataConfig

OVERRIDE = "trainer.resume_allow_data_change"  # accepts other training data on resume


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


def file_sha256(path: str, *, chunk_bytes: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


def train_data_record(data: DataConfig, *, num_rows: int) -> dict:
    """{"source", "num_rows"[, "sha256"]}: what trainer_state.json keeps of the training data."""
    if data.train_files is None:
        return {"source": f"synthetic:{data.synthetic}", "num_rows": num_rows}
    path = os.path.abspath(os.path.expanduser(data.train_files))
    return {"source": path, "num_rows": num_rows, "sha256": file_sha256(path)}


def _describe(record: dict) -> str:
    rows = f"{record['num_rows']} row{'' if record['num_rows'] == 1 else 's'}"
    if "sha256" not in record:
        return f"{record['source']} ({rows})"
    return f"{record['source']} ({rows}, sha256 {record['sha256'][:12]})"


def check_resume_data(saved: Optional[dict], current: dict, *, saved_sampler: dict,
                      checkpoint: str, allow_change: bool) -> tuple[bool, Optional[str]]:
    """Compare the checkpoint's data record (`saved`; None: not recorded) with this run's.

    Returns (restart_epoch, warning line or None); raises ValueError on other data without the
    override. `saved_sampler` is the checkpoint's sampler state (its row count and epoch)."""
    file_run = "sha256" in current
    key = "data.train_files" if file_run or "sha256" in (saved or {}) else "data.synthetic"
    if saved is None:
        if not file_run:
            return False, None  # synthetic data: the sampler's own checks apply
        if saved_sampler.get("num_items") == current["num_rows"]:
            return False, (f"hybridflow: warning: checkpoint {checkpoint} does not record its "
                           f"training data (saved by an older hybridflow): data.train_files="
                           f"{current['source']} ({current['num_rows']} rows) is taken to be the "
                           "data it trained on")
        old = f"{saved_sampler.get('num_items')} rows (its file is not recorded)"
    else:
        same_file = file_run and saved.get("sha256") == current["sha256"]
        same_task = not file_run and "sha256" not in saved and saved["source"] == current["source"]
        if same_file or same_task:
            return False, None
        old = _describe(saved)
    change = (f"{key} changed since checkpoint {checkpoint}: it trained on {old}, this run reads "
              f"{_describe(current)}")
    if not allow_change:
        raise ValueError(f"{change}; resume with the same data, or set {OVERRIDE}=true to train on "
                         "the new prompts (the sampler then starts its epoch again over them)")
    return True, (f"hybridflow: warning: {change}; {OVERRIDE}=true: the sampler starts epoch "
                  f"{saved_sampler.get('epoch', 0)} again over the new data")


class Checkpointer:
    def __init__(self, trainer):
        self.trainer = trainer
        self.root = os.path.join(trainer.cfg.trainer.output_dir, "checkpoints")
        self._bases: Optional[dict] = None

    def base_identities(self) -> dict:
        """role -> identity of its frozen base (LoRA roles; checkpoint/base.py), computed once
        (the base never changes; a random-init base's fingerprint is a collective)."""
        if self._bases is None:
            from hybridflow.checkpoint.base import base_identity

            t = self.trainer
            self._bases = {role: base_identity(e.model_cfg, e.module, seed=t.cfg.trainer.seed)
                           for role, e in t.engines.items() if getattr(e, "lora", None) is not None}
        return self._bases

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
        for e in t.engines.values():
            e.params_to_device()  # actor.offload_params: the weights are read here
        with watchdog.stage("save"):
            return save_checkpoint(self.root, step=t.step, models=models, optimizers=optimizers,
                                   schedulers=schedulers, trainer_state=t.state_dict(),
                                   model_configs=configs, tokenizer_dir=tok_dir,
                                   layout=t.ctx.layout,
                                   adapter_configs=adapter_configs(t, self.base_identities()))

    def maybe_resume(self) -> bool:
        from hybridflow.checkpoint import latest_step, load_checkpoint, recover, step_dir

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
        step = latest_step(self.root)
        if step is None:
            return False
        restart_epoch = self._check_data(step_dir(self.root, step))
        models, optimizers, schedulers = self._parts()
        configs = {role: e.model_cfg for role, e in self.trainer.engines.items() if role in models}
        with watchdog.stage("resume"):
            state = load_checkpoint(self.root, models=models, optimizers=optimizers,
                                    schedulers=schedulers, model_configs=configs, step=step,
                                    allow_vocab_resize=cfg.resume_allow_vocab_resize,
                                    layout=self.trainer.ctx.layout,
                                    base_identities=self.base_identities(),
                                    allow_base_change=cfg.resume_allow_base_change)
        self.trainer.load_state_dict(state, restart_epoch=restart_epoch)
        return True

    def _check_data(self, path: str) -> bool:
        """Before anything loads: the training data must be the checkpoint's, or
        trainer.resume_allow_data_change set (then True: the sampler starts its epoch again)."""
        from hybridflow.checkpoint.state import read_json

        saved = read_json(os.path.join(path, "trainer_state.json"))
        restart, line = check_resume_data(
            saved.get("train_data"), self.trainer.train_data, saved_sampler=saved.get("sampler", {}),
            checkpoint=path, allow_change=self.trainer.cfg.trainer.resume_allow_data_change)
        if line and dist.get_rank() == 0:
            print(line, flush=True)
        return restart


def adapter_configs(trainer, bases: dict) -> dict:
    """role -> LoRA settings and base model identity, for the roles trained with adapters: their
    checkpoints hold the adapters only (`bases`: role -> checkpoint.base.base_identity)."""
    out = {}
    for role, e in trainer.engines.items():
        lora = getattr(e, "lora", None)
        if lora is not None:
            m = e.model_cfg
            out[role] = {**dataclasses.asdict(lora), "base_model": m.hf_path or m.gguf_path or "",
                         "base_model_config": dataclasses.asdict(m), "adapter_only": True,
                         "base": bases[role]}
    return out
