"""Qwen3 parity with transformers on CPU (2 gloo ranks): logits per layout, export, generation.

A random-init transformers `Qwen3ForCausalLM` (q/k norms, head_dim 32 != hidden / heads = 16), tied
as Qwen3-0.6B / 1.7B and untied as Qwen3-8B, saved as a Hugging Face checkpoint; then for each
layout (TP=1, TP=2, PP=2) our GPTModel loads it (`load_hf_weights`, each rank its shard) and runs
the same tokens: the table records max |our logit - transformers' logit| (fp32, eager attention)
and whether the weights, gathered from the shards and exported (`save_hf_checkpoint`), are
bit-identical to the checkpoint's. Last, the in-place generator (rollout/decoder.py, torch path,
TP_g = 1) decodes greedily and its tokens are compared with transformers' `generate`.
JSON (machine, versions, command, results) to --out:

  torchrun --nproc_per_node 2 --master_port 29517 benchmarks/qwen3_parity.py \
      --out benchmarks/results/qwen3_parity_cpu.json

About half a minute on 2 CPU cores (OMP_NUM_THREADS=1). tests/unit/test_hf.py and
tests/dist/test_hf_parallel.py assert the same properties on a smaller model.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hybridflow.models.build import build_model  # noqa: E402
from hybridflow.models.hf import (hf_to_megatron_state_dict, load_hf_weights,  # noqa: E402
                                  read_hf_config, save_hf_checkpoint)
from hybridflow.parallel import groups  # noqa: E402
from hybridflow.parallel import param_rules as pr  # noqa: E402
from run_record import command, machine, versions, write_json  # noqa: E402

LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}


def make_checkpoint(out_dir: str, *, tied: bool, args) -> None:
    """A random Qwen3 in `out_dir`, weights drawn larger than transformers' init (std 0.2, norms
    1 +- 0.1) so a mis-mapped tensor shows in the logits."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(hidden_size=args.hidden, intermediate_size=args.ffn,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                      vocab_size=args.vocab, tie_word_embeddings=tied, max_position_embeddings=512,
                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    save_random(Qwen3ForCausalLM(cfg).eval(), out_dir, seed=args.seed)


def save_random(model, out_dir: str, *, seed: int) -> None:
    """`model` with weights drawn from N(0, 0.2) (norms 1 + N(0, 0.1)), saved as safetensors."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.2 * noise)
    model.save_pretrained(out_dir, safe_serialization=True)


def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                dtype=torch.float32).eval()


def tensors(d: str) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(os.listdir(d)) if f.endswith(".safetensors")
            for k, v in load_file(os.path.join(d, f)).items()}


def forward(model, ids, ctx, *, tp: int, pp: int):
    """Logits (B, S, V_pad) on every rank of the last stage (vocab shards gathered); None before."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    pos = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        if pp == 1:
            local = model(ids, pos, attention_mask=None)
            parts = [torch.empty_like(local) for _ in range(tp)]
            dist.all_gather(parts, local.contiguous(), group=ctx.tp_group)
            return torch.cat(parts, -1)

        def step(data_iterator, m):
            out = m(*next(data_iterator), attention_mask=None)
            return out, lambda o: (o.sum() * 0.0, {"logits": o.detach()})

        store = get_forward_backward_func()(
            forward_step_func=step, data_iterator=iter([(ids, pos)]), model=[model],
            num_microbatches=1, seq_length=ids.shape[1], micro_batch_size=ids.shape[0],
            forward_only=True)
        return store[0]["logits"] if store else None


def gather_full(model, ctx, *, num_layers: int) -> dict:
    """Full tensors under global names from this rank's TP / PP shards, on every rank."""
    out = {}
    for name, t in model.named_parameters():
        t = t.detach().contiguous()
        if ctx.tp_size > 1 and pr.param_rule(name) != pr.REPLICATED:
            parts = [torch.empty_like(t) for _ in range(ctx.tp_size)]
            dist.all_gather(parts, t, group=ctx.tp_group)
            t = pr.merge_shards(name, parts)
        out[pr.global_name(name, pp_rank=ctx.train.pp, num_layers=num_layers,
                           pp_size=ctx.pp_size)] = t
    if ctx.pp_size > 1:
        objs = [None] * ctx.pp_size
        dist.all_gather_object(objs, out, group=ctx.pp_group)
        out = {k: v for d in objs for k, v in d.items()}
    return out


def layout_row(path: str, ids, ref, *, layout: str, tmp: str) -> dict:
    tp, pp = LAYOUTS[layout]
    ctx = groups.init_model_parallel(tp=tp, pp=pp, seed=0)
    cfg = read_hf_config(path)
    model = build_model(cfg, role="actor", ctx=ctx).eval()
    load_hf_weights(model, path, cfg, tp_rank=ctx.train.tp, tp_size=tp, pp_rank=ctx.train.pp,
                    pp_size=pp)
    logits = forward(model, ids, ctx, tp=tp, pp=pp)
    diff = None if logits is None else (logits[..., :cfg.vocab_size] - ref).abs().max().item()
    diffs = [None] * dist.get_world_size()
    dist.all_gather_object(diffs, diff)
    full = gather_full(model, ctx, num_layers=cfg.num_layers)
    out = os.path.join(tmp, f"export_{os.path.basename(path)}_{layout}")
    identical = None
    if dist.get_rank() == 0:
        save_hf_checkpoint(out, full, cfg)
        exported, original = tensors(out), tensors(path)
        identical = exported.keys() == original.keys() and all(
            torch.equal(exported[k], original[k]) for k in original)
    dist.barrier()
    return {"layout": layout, "tp": tp, "pp": pp,
            "max_abs_logit_diff": max(d for d in diffs if d is not None),
            "max_abs_logit": ref.abs().max().item(),
            "export_bit_identical": identical}


def generation_row(path: str, prompts: list, *, new_tokens: int) -> dict:
    """Our generator's greedy tokens (TP_g = 1, fp32) against transformers' generate, per prompt."""
    from hybridflow.config import RolloutConfig
    from hybridflow.rollout import Generator

    cfg = read_hf_config(path)
    gen = Generator(model_cfg=cfg, params=hf_to_megatron_state_dict(tensors(path), cfg),
                    tp_group=None, device=torch.device("cpu"), dtype=torch.float32,
                    true_vocab_size=cfg.vocab_size)
    ours = gen.generate(prompts, cfg=RolloutConfig(max_new_tokens=new_tokens, temperature=0.0),
                        eos_id=-1, pad_id=0, seed=0).response_ids
    ref = hf_model(path)
    equal = 0
    for i, p in enumerate(prompts):
        want = ref.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(p):]
        equal += int(ours[i].tolist() == want.tolist())
    return {"prompts": len(prompts), "new_tokens": new_tokens, "prompts_equal": equal}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    groups.init_distributed()
    if dist.get_world_size() != 2:
        raise ValueError(f"run on 2 ranks (torchrun --nproc_per_node 2), got "
                         f"{dist.get_world_size()}: the layouts are TP=2 and PP=2")
    tmp = [tempfile.mkdtemp(prefix="qwen3_parity_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(tmp, src=0)
    tmp = tmp[0]
    ids = torch.randint(0, args.vocab, (2, args.seq), generator=torch.Generator().manual_seed(1))
    prompts = [ids[0, :5].tolist(), ids[1, :1].tolist(), ids[1, :11].tolist()]
    rows, generation = [], {}
    for name, tied in (("tied", True), ("untied", False)):
        path = os.path.join(tmp, f"qwen3_{name}")
        if dist.get_rank() == 0:
            make_checkpoint(path, tied=tied, args=args)
        dist.barrier()
        with torch.no_grad():
            ref = hf_model(path)(ids).logits  # (B, S, V), the same on both ranks
        for layout in LAYOUTS:
            rows.append({"model": name, **layout_row(path, ids, ref, layout=layout, tmp=tmp)})
        if dist.get_rank() == 0:
            generation[name] = generation_row(path, prompts, new_tokens=args.new_tokens)
    if dist.get_rank() == 0:
        shape = {k: getattr(args, k) for k in ("hidden", "ffn", "layers", "heads", "kv_heads",
                                              "head_dim", "vocab", "seq", "seed")}
        write_json(args.out, {
            "what": "Qwen3 (random init, fp32) through hybridflow vs transformers' Qwen3ForCausalLM",
            "machine": machine(), "versions": versions("transformers", "megatron-core"),
            "command": "torchrun --nproc_per_node 2 " + " ".join(sys.argv), "shape": shape,
            "logits": rows, "generation_greedy": generation})
        print("\n".join(f"{r['model']:7s} {r['layout']}: max |logit diff| "
                        f"{r['max_abs_logit_diff']:.2e}, export bit-identical "
                        f"{r['export_bit_identical']}" for r in rows))
        print("generation:", generation)
        shutil.rmtree(tmp)
    groups.destroy()


if __name__ == "__main__":
    main()
