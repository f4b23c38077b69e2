"""Entry point: `python -m hybridflow.train [hydra overrides]`, or under `torchrun`.

Composes conf/ppo.yaml with the overrides, takes the model shape from a checkpoint when
`model.hf_path` / `model.gguf_path` is set, validates everything against the world size, then
checks that the output directory is writable, initialises process groups (NCCL with GPUs, gloo
without; every collective waits trainer.collective_timeout_s for a peer), builds the trainer and
trains. User errors (config, data, checkpoint, storage) end the program with one line on stderr,
`hybridflow train: error: ...` (every tool's prefix, hybridflow.cli), printed by every rank that
finds them, and exit code 2; a dead or silent peer and CUDA OOM end it with `rank R: stage S: ...`
and exit code 1 (hybridflow.watchdog says how).
`--cfg` prints the resolved config and exits.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import warnings

from hybridflow import watchdog
from hybridflow.config import Config, load_config, to_dict
from hybridflow.config_checks import check_one_model_source, validate


def resolve_model_source(cfg: Config) -> Config:
    """When the model comes from a checkpoint, its config.json / GGUF metadata defines the shape."""
    m = cfg.model
    check_one_model_source(m)  # before either file is read
    if m.hf_path is not None:
        from hybridflow.models.hf import read_hf_config

        shape = read_hf_config(m.hf_path)
    elif m.gguf_path is not None:
        from hybridflow.models.gguf import read_gguf_config

        shape = read_gguf_config(m.gguf_path)
    else:
        return cfg
    shape = dataclasses.replace(shape, hf_path=m.hf_path, gguf_path=m.gguf_path,
                                attention_backend=m.attention_backend)
    return dataclasses.replace(cfg, model=shape)


def main(argv: list[str] | None = None) -> int:
    # megatron-core announces every optional dependency it falls back from; say it once here instead
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex).*")
    warnings.filterwarnings("ignore", message=".*full scope is deprecated.*")
    warnings.filterwarnings("ignore", category=FutureWarning)  # megatron's own API migrations
    argv = list(sys.argv[1:] if argv is None else argv)
    print_cfg = "--cfg" in argv
    argv = [a for a in argv if a != "--cfg"]
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = resolve_model_source(load_config(argv))
        validate(cfg, world_size=world)
        if not print_cfg:
            from hybridflow.run_state import check_output_dir  # (imports torch: after validation)

            check_output_dir(cfg.trainer.output_dir, rank=rank)
    except (ValueError, OSError) as e:  # the same on every rank: each prints it, without its rank
        return watchdog.user_error(str(e), rank=rank, world_size=world, shared=False)
    if print_cfg:
        if rank == 0:
            print(json.dumps(to_dict(cfg), indent=2, default=str))
        return 0

    from hybridflow.parallel import groups

    if world > 1:
        watchdog.watch_sigterm(rank=rank)  # before the process group's threads start
    timeout_minutes = cfg.trainer.collective_timeout_s / 60
    groups.init_distributed(timeout_minutes=timeout_minutes)
    try:
        with watchdog.stage("startup"):
            ctx = groups.init_model_parallel(tp=cfg.parallel.tensor_parallel_size,
                                             pp=cfg.parallel.pipeline_parallel_size,
                                             tp_gen=cfg.rollout.tensor_parallel_size,
                                             ep=cfg.parallel.expert_parallel_size,
                                             etp=cfg.parallel.expert_tensor_parallel_size,
                                             seed=cfg.trainer.seed,
                                             timeout_minutes=timeout_minutes)
            from hybridflow.trainer import Trainer

            trainer = Trainer(cfg, ctx)
        with watchdog.stage("train"):
            trainer.train()
    except (ValueError, OSError) as e:
        code = watchdog.user_error(" ".join(str(e).split()), rank=rank, world_size=world,
                                   shared=True)
        if world > 1:
            watchdog.exit_now(code)  # peers may be inside a collective: no teardown
        return code
    except Exception as e:
        line = watchdog.failure_line(e, rank=rank)
        if line is None:
            raise
        watchdog.die(line, 1)
    finally:
        groups.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
