"""Export a hybridflow checkpoint to a Hugging Face model directory.

    python -m hybridflow.export <checkpoint> <out_dir> [--role actor] [--step N] [--dtype bfloat16]

`<checkpoint>` is a checkpoint root (its `latest` step, or `--step N`) or one `step_<N>` directory.
The role's full weights are read from its dist checkpoint in this one process, whatever TP/PP/DP
saved it (`hybridflow.checkpoint.load_full_state_dict`), and written by
`hybridflow.models.hf.save_hf_checkpoint`: safetensors, config.json, generation_config.json and the
tokenizer files saved with the checkpoint, so `transformers.AutoModelForCausalLM.from_pretrained`
loads the result. Scalar heads (critic, reward) have no Hugging Face form and are refused.
Errors a user can cause (no such checkpoint, step or role) print one line and exit with code 2.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Optional

_DTYPES = ("float32", "bfloat16", "float16")


def resolve_step_dir(path: str, step: Optional[int] = None) -> str:
    """The `step_<N>` directory that `path` (a root or a step dir) and `step` name."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint at {path}")
    m = re.fullmatch(r"step_(\d+)", os.path.basename(os.path.normpath(path)))
    if m:
        if step is not None and step != int(m.group(1)):
            raise ValueError(f"--step {step} contradicts the step directory {path}")
        return path
    from hybridflow.checkpoint import latest_step, step_dir

    if step is None:
        step = latest_step(path)
        if step is None:
            raise FileNotFoundError(f"no checkpoint under {path} (no `latest` file, no step_<N> dir)")
    found = step_dir(path, step)
    if not os.path.isdir(found):
        raise FileNotFoundError(f"no checkpoint at {found}")
    return found


def export(checkpoint: str, out_dir: str, *, role: str = "actor", step: Optional[int] = None,
           dtype: Optional[str] = None) -> str:
    """Write the Hugging Face directory `out_dir`; return the step dir it came from."""
    ckpt = resolve_step_dir(checkpoint, step)
    role_dir = os.path.join(ckpt, role)
    if not os.path.isdir(role_dir):
        raise FileNotFoundError(f"checkpoint {ckpt} has no role {role!r} (no {role_dir})")
    import torch

    from hybridflow.checkpoint import load_full_state_dict
    from hybridflow.models.hf import save_hf_checkpoint

    full_sd, cfg = load_full_state_dict(ckpt, role=role)
    if dtype is not None:
        full_sd = {k: v.to(getattr(torch, dtype)) for k, v in full_sd.items()}
    tokenizer = os.path.join(ckpt, "tokenizer")
    save_hf_checkpoint(out_dir, full_sd, cfg,
                       tokenizer_dir=tokenizer if os.path.isdir(tokenizer) else None)
    return ckpt


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridflow.export", description=__doc__
                                     .split("\n\n")[0])
    parser.add_argument("checkpoint", help="checkpoint root or a step_<N> directory")
    parser.add_argument("out_dir", help="Hugging Face directory to write (replaced if present)")
    parser.add_argument("--role", default="actor")
    parser.add_argument("--step", type=int, default=None, help="default: the latest")
    parser.add_argument("--dtype", choices=_DTYPES, default=None, help="default: as saved")
    args = parser.parse_args(argv)
    try:
        ckpt = export(args.checkpoint, args.out_dir, role=args.role, step=args.step,
                      dtype=args.dtype)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.role} of {ckpt} to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
