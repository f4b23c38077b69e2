"""Entry point: `python -m hybridflow.train [hydra overrides]`, or under `torchrun`.

Composes conf/ppo.yaml with the overrides, takes the model shape from a checkpoint when
`model.hf_path` / `model.gguf_path` is set, validates everything against the world size, then
initialises process groups (NCCL with GPUs, gloo without), builds the trainer and trains.
User errors (config, data, checkpoint paths) end the program with one line on stderr and exit code 2;
`--cfg` prints the resolved config and exits.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import warnings

from hybridflow.config import Config, load_config, to_dict, validate


def resolve_model_source(cfg: Config) -> Config:
    """When the model comes from a checkpoint, its config.json / GGUF metadata defines the shape."""
    m = cfg.model
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


def _rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _fail(msg: str, *, collective: bool = True) -> int:
    """Config errors happen on every rank (rank 0 speaks); a runtime error may hit one rank only,
    so every failing rank says which it is."""
    if _rank0() or not collective:
        rank = "" if collective else f"[rank {os.environ.get('RANK', '0')}] "
        print(f"hybridflow: error: {rank}{msg}", file=sys.stderr, flush=True)
    return 2


def main(argv: list[str] | None = None) -> int:
    # megatron-core announces every optional dependency it falls back from; say it once here instead
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex).*")
    warnings.filterwarnings("ignore", message=".*full scope is deprecated.*")
    warnings.filterwarnings("ignore", category=FutureWarning)  # megatron's own API migrations
    argv = list(sys.argv[1:] if argv is None else argv)
    print_cfg = "--cfg" in argv
    argv = [a for a in argv if a != "--cfg"]
    try:
        cfg = resolve_model_source(load_config(argv))
        validate(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    except (ValueError, FileNotFoundError) as e:
        return _fail(str(e))
    if print_cfg:
        if _rank0():
            print(json.dumps(to_dict(cfg), indent=2, default=str))
        return 0

    from hybridflow.parallel import groups

    groups.init_distributed()
    try:
        ctx = groups.init_model_parallel(tp=cfg.parallel.tensor_parallel_size,
                                         pp=cfg.parallel.pipeline_parallel_size,
                                         tp_gen=cfg.rollout.tensor_parallel_size,
                                         seed=cfg.trainer.seed)
        from hybridflow.trainer import Trainer

        Trainer(cfg, ctx).train()
    except (ValueError, FileNotFoundError) as e:
        return _fail(str(e), collective=int(os.environ.get("WORLD_SIZE", "1")) == 1)
    finally:
        groups.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
