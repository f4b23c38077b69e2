"""Export a hybridflow checkpoint to a Hugging Face model directory.

    python -m hybridflow.export <checkpoint> <out_dir> [--role actor] [--step N] [--dtype bfloat16]
                                [--merged [--base PATH]]

`<checkpoint>` is a checkpoint root (its `latest` step, or `--step N`) or one `step_<N>` directory.
The role's full weights are read from its dist checkpoint in this one process, whatever TP/PP/DP
saved it (`hybridflow.checkpoint.load_full_state_dict`), and written by
`hybridflow.models.hf.save_hf_checkpoint`: safetensors, config.json, generation_config.json and the
tokenizer files saved with the checkpoint, so `transformers.AutoModelForCausalLM.from_pretrained`
loads the result. Scalar heads (critic, reward) have no Hugging Face form and are refused.
A role trained with LoRA (actor.lora) is written as a PEFT adapter directory (adapter_config.json,
adapter_model.safetensors) that `peft.PeftModel.from_pretrained` loads onto the base model, or with
`--merged` as the full model with the adapters merged into its weights. A LoRA checkpoint holds
only the adapters (checkpoint/base.py): `--merged` then reads the base from the source the run
recorded (model.hf_path / model.gguf_path) or from `--base PATH` (an HF directory or a .gguf
file), checks its fingerprint against the recorded one, and refuses a base that differs or is not
available (a random-init base is never on disk).

Nothing is lost on bad input: `<out_dir>` may not be, hold or lie inside the checkpoint root or
step (compared as real paths), nor be a file or a folder of other files (hf_save says what is
replaced); it is written beside itself and renamed into place, so a failure (a full disk) leaves
no partial output. A checkpoint file that is truncated or corrupt is named. Errors a user can
cause print one line, `hybridflow export: error: ...` (hybridflow.cli), and exit with code 2.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Optional

from hybridflow import cli

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


def check_outside(out_dir: str, checkpoint: str, ckpt: str) -> None:
    """`out_dir` is not the checkpoint root (`checkpoint`, or the step dir `ckpt`'s parent when
    that has a `latest` file) nor the step dir, and neither holds nor lies inside them."""
    parent = os.path.dirname(os.path.normpath(ckpt))
    roots = [parent] if os.path.isfile(os.path.join(parent, "latest")) else []
    out = os.path.realpath(out_dir)
    for src in map(os.path.realpath, [*roots, checkpoint, ckpt]):
        if out == src or out.startswith(src + os.sep) or src.startswith(out + os.sep):
            raise ValueError(f"{out_dir}: the output folder overlaps the checkpoint {src} (it is, "
                             "holds or lies inside it); expected a folder outside it")


def export(checkpoint: str, out_dir: str, *, role: str = "actor", step: Optional[int] = None,
           dtype: Optional[str] = None, merged: bool = False, base: Optional[str] = None) -> str:
    """Write the Hugging Face directory `out_dir`; return the step dir it came from. A role
    trained with LoRA adapters is written as a PEFT adapter directory, or with `merged` as the
    full model with the adapters merged into its weights (models/hf_save.py)."""
    ckpt = resolve_step_dir(checkpoint, step)
    check_outside(out_dir, checkpoint, ckpt)
    role_dir = os.path.join(ckpt, role)
    if not os.path.isdir(role_dir):
        raise FileNotFoundError(f"checkpoint {ckpt} has no role {role!r} (no {role_dir})")
    import torch

    from hybridflow.models.hf_save import check_replaceable, save_hf_checkpoint

    from hybridflow.models.hf_names import megatron_to_hf_state_dict
    from hybridflow.models.hf_save import merge_into_hf, save_peft_adapter, split_adapters

    if base is not None and not merged:
        raise ValueError("--base is the base model to merge the adapters into: it needs --merged")
    full_sd, cfg = _read_weights(ckpt, role)
    full_sd, adapter_sd = split_adapters(full_sd)
    lora = None
    if adapter_sd:
        lora_path = os.path.join(ckpt, f"lora_config_{role}.json")
        if not os.path.isfile(lora_path):
            raise FileNotFoundError(f"checkpoint {ckpt} holds LoRA adapters for {role!r} but no "
                                    f"{lora_path} (their rank and alpha)")
        with open(lora_path, encoding="utf-8") as f:
            lora = json.load(f)
    elif merged:
        raise ValueError(f"--merged: checkpoint {ckpt} has no LoRA adapters for {role!r}")
    if lora is not None and not merged:
        save_peft_adapter(out_dir, adapter_sd, lora=lora, base_model=lora.get("base_model", ""))
        return ckpt
    check_replaceable(out_dir)
    if lora is not None:
        hf_sd = (_read_base(ckpt, lora, base) if lora.get("adapter_only")
                 else megatron_to_hf_state_dict(full_sd, cfg))
        full_sd = merge_into_hf(hf_sd, adapter_sd, lora=lora)
    if dtype is not None:
        full_sd = {k: v.to(getattr(torch, dtype)) for k, v in full_sd.items()}
    tokenizer = os.path.join(ckpt, "tokenizer")
    save_hf_checkpoint(out_dir, full_sd, cfg,
                       tokenizer_dir=tokenizer if os.path.isdir(tokenizer) else None)
    return ckpt


def _read_base(ckpt: str, lora: dict, path: Optional[str]) -> dict:
    """HF-named tensors of the base an adapter-only checkpoint trained on: from `path` (--base)
    or its recorded source, whose fingerprint must be the recorded one."""
    from hybridflow.checkpoint.base import describe, gguf_fingerprint, hf_fingerprint

    saved = lora.get("base", {})
    if path is None:
        path = saved.get("hf_path") or saved.get("gguf_path")
        if path is None:
            raise ValueError(f"--merged: checkpoint {ckpt} holds only LoRA adapters and its base "
                             f"was not read from disk ({describe(saved)}); pass --base PATH (an "
                             "HF directory or a .gguf file of that model)")
    if saved.get("gguf_path") == path:
        from hybridflow.models.gguf_file import resolve_gguf_path

        path = resolve_gguf_path(path)
    if os.path.isdir(path):
        fingerprint = hf_fingerprint(path)
    elif os.path.isfile(path):
        fingerprint = gguf_fingerprint(path)
    else:
        raise FileNotFoundError(f"--merged: base model {path} of checkpoint {ckpt} is not "
                                "available (it holds only LoRA adapters); pass --base PATH")
    if saved.get("fingerprint") not in (None, fingerprint):
        raise ValueError(f"--merged: base {path} (fingerprint {fingerprint[:16]}) is not the one "
                         f"the adapters of {ckpt} trained on: {describe(saved)}")
    if os.path.isfile(path):
        from hybridflow.models.gguf import read_gguf

        return read_gguf(path)[1]
    import glob

    from safetensors.torch import load_file

    out = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        out.update(load_file(f))
    if not out:
        raise FileNotFoundError(f"--merged: base model {path} has no *.safetensors files")
    return out


def _read_weights(ckpt: str, role: str):
    from hybridflow.checkpoint import load_full_state_dict, unreadable

    with unreadable.named(ckpt, role):
        return load_full_state_dict(ckpt, role=role)


@cli.tool("export")
def main(argv: Optional[list] = None) -> int:
    parser = cli.ArgumentParser(prog="python -m hybridflow.export",
                                description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="checkpoint root or a step_<N> directory")
    parser.add_argument("out_dir", help="Hugging Face directory to write (a model folder there is "
                                        "replaced)")
    parser.add_argument("--role", default="actor")
    parser.add_argument("--step", type=int, default=None, help="default: the latest")
    parser.add_argument("--dtype", choices=_DTYPES, default=None, help="default: as saved")
    parser.add_argument("--merged", action="store_true",
                        help="LoRA: write the full model with the adapters merged in (default: "
                             "a PEFT adapter directory)")
    parser.add_argument("--base", default=None,
                        help="with --merged, for a checkpoint that holds only LoRA adapters: the "
                             "base model (HF directory or .gguf file; default: the recorded "
                             "model.hf_path / model.gguf_path)")
    args = parser.parse_args(argv)
    ckpt = export(args.checkpoint, args.out_dir, role=args.role, step=args.step, dtype=args.dtype,
                  merged=args.merged, base=args.base)
    print(f"exported {args.role} of {ckpt} to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
