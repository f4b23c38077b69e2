"""Size and time of a LoRA actor's checkpoint: adapter-only (what training writes) against the
full format (base + adapters, what it wrote before), on one device.

Builds the actor (random init from the model preset, bf16 on a GPU, fp32 on CPU) with LoRA adapters
(nonzero B, Adam state present), then saves it in both formats under a temporary directory and
loads the adapter-only one back (base fingerprint check included). Reported: bytes of each role
directory and of each whole step, seconds to save each and to load the adapter-only one, seconds of
the base fingerprint (random init: a hash of layer 0's QKV and output projection), and whether the
loaded adapters equal the saved ones.

  python benchmarks/lora_checkpoint.py --model qwen2_7b --rank 16 \\
      --out benchmarks/results/lora_checkpoint_h200.json                             # one H200
  python benchmarks/lora_checkpoint.py --model tiny --rank 4 --out /tmp/lora_ckpt.json  # CPU smoke
"""

import argparse
import dataclasses
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, ROOT)
from run_record import command, machine, versions, write_json  # noqa: E402


def _bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2_7b", help="a model= preset (random init)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default="all-linear", help="comma-separated PEFT names")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import torch

    from hybridflow.checkpoint import load_checkpoint, save_checkpoint
    from hybridflow.checkpoint.base import base_identity
    from hybridflow.config import LoRAConfig, OptimConfig, ParallelConfig, load_config
    from hybridflow.engine import Engine
    from hybridflow.models.lora import adapters
    from hybridflow.parallel import groups

    model_cfg = load_config([f"model={args.model}"]).model
    lora = LoRAConfig(rank=args.rank, alpha=2.0 * args.rank, target_modules=args.targets.split(","))
    precision = "bf16" if torch.cuda.is_available() else "fp32"
    groups.init_distributed()
    ctx = groups.init_model_parallel(tp=1, pp=1, seed=1)
    eng = Engine(role="actor", model_cfg=model_cfg, ctx=ctx, parallel=ParallelConfig(),
                 precision=precision, optim=OptimConfig(), lora=lora, seed=1)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, a in adapters(eng.module):
            for b in a.B.values():
                b.copy_(0.01 * torch.randn(b.shape, generator=g))
    eng.optimizer.reload_model_params()
    _sync()
    t0 = time.perf_counter()
    ident = base_identity(model_cfg, eng.module, seed=1)
    fingerprint_s = time.perf_counter() - t0
    lora_dict = {**dataclasses.asdict(lora), "base_model": ""}
    saved = {n: p.detach().cpu().clone() for n, p in eng.module.named_parameters()
             if p.requires_grad}
    res = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as work:
        for fmt, only in (("adapter_only", True), ("full", False)):
            root = os.path.join(work, fmt)
            _sync()
            t0 = time.perf_counter()
            save_checkpoint(root, step=1, models={"actor": [eng.model]},
                            optimizers={"actor": eng.optimizer}, model_configs={"actor": model_cfg},
                            adapter_configs={"actor": {**lora_dict, "adapter_only": only,
                                                       "base": ident}})
            res[fmt] = {"save_s": round(time.perf_counter() - t0, 3),
                        "role_dir_bytes": _bytes(os.path.join(root, "step_1", "actor")),
                        "step_bytes": _bytes(os.path.join(root, "step_1"))}
            print(f"{fmt}: {res[fmt]}", flush=True)
        with torch.no_grad():
            for p in saved:
                dict(eng.module.named_parameters())[p].zero_()
        t0 = time.perf_counter()
        load_checkpoint(os.path.join(work, "adapter_only"), models={"actor": [eng.model]},
                        optimizers={"actor": eng.optimizer}, model_configs={"actor": model_cfg},
                        base_identities={"actor": ident})
        _sync()
        res["adapter_only"]["load_s"] = round(time.perf_counter() - t0, 3)
    params = dict(eng.module.named_parameters())
    exact = all(torch.equal(params[n].detach().cpu(), t) for n, t in saved.items())
    n_adapter = sum(t.numel() for t in saved.values())
    n_base = sum(p.numel() for p in params.values()) - n_adapter
    record = {"benchmark": "LoRA checkpoint: adapter-only vs full format",
              "workload": {"model": args.model, "precision": precision, "lora_rank": args.rank,
                           "targets": args.targets, "adapter_params": n_adapter,
                           "base_params": n_base},
              "fingerprint_s": round(fingerprint_s, 3), "adapters_restored_exactly": exact,
              "size_ratio_full_over_adapter_only": round(
                  res["full"]["step_bytes"] / res["adapter_only"]["step_bytes"], 1),
              "machine": machine(), "versions": versions("megatron-core"), "command": command(),
              **res}
    print(f"full / adapter-only step bytes: {record['size_ratio_full_over_adapter_only']}x, "
          f"adapters restored exactly: {exact}", flush=True)
    if args.out:
        write_json(args.out, record)
    return record


if __name__ == "__main__":
    main()
