"""Qwen3-MoE parity with transformers on CPU (2 gloo ranks): logits and gradients per layout, export.

A random-init transformers `Qwen3MoeForCausalLM` (8 experts, top-2 renormalised, q/k norms, untied)
saved as a Hugging Face checkpoint; for each layout our GPTModel (megatron-core MoELayer,
SequentialMLP experts, alltoall dispatcher) loads it (`load_hf_weights`, each rank its TP / EP
shard) and runs a training forward and backward of L = sum(logits * W) (W fixed random) over the
same tokens as transformers does; the table records max |logit diff| and max |grad diff| over every
parameter (gathered to full tensors, Megatron names) and whether the weights, gathered and exported
(`save_hf_checkpoint`), are bit-identical to the checkpoint's. Layouts (2 ranks):
  ep1:      TP=1, EP=1 (DP=2: each rank half the rows, gradients summed over DP)
  ep2:      TP=1, EP=2 (each rank 4 experts; tokens of both ranks all-to-all to their experts)
  tp2:      TP=2 + sequence parallel, expert TP=2 (each expert's fc1 / fc2 split as the dense MLP)
  tp2_ep2:  TP=2 + SP, EP=2 over the TP ranks, expert TP=1 (each rank 4 whole experts)
The load-balancing loss is off here (transformers' model adds none without output_router_logits).
JSON (machine, versions, command, results) to --out:

  torchrun --nproc_per_node 2 --master_port 29518 benchmarks/qwen3_moe_parity.py \
      --out benchmarks/results/qwen3_moe_parity_cpu.json

About a minute on 2 CPU cores (OMP_NUM_THREADS=1); tests/dist/test_moe.py runs it smaller.
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
from run_record import command, machine, versions, write_json  # noqa: E402, F401
from qwen3_parity import save_random, tensors  # noqa: E402

LAYOUTS = {"ep1": dict(tp=1, ep=1, etp=1), "ep2": dict(tp=1, ep=2, etp=1),
           "tp2": dict(tp=2, ep=1, etp=2), "tp2_ep2": dict(tp=2, ep=2, etp=1)}


def make_checkpoint(out_dir: str, args) -> None:
    """Weights drawn larger than transformers' init (std 0.2, norms 1 +- 0.1) so a mis-mapped
    tensor shows in the logits."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                         vocab_size=args.vocab, tie_word_embeddings=False,
                         max_position_embeddings=512, num_experts=args.experts,
                         num_experts_per_tok=args.top_k, moe_intermediate_size=args.expert_ffn,
                         norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    save_random(Qwen3MoeForCausalLM(cfg).eval(), out_dir, seed=args.seed)


def hf_reference(path: str, ids, weight):
    """transformers' logits and gradients of sum(logits * weight), gradients under Megatron's
    global names (the in-memory fused expert tensors split per expert first)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                 dtype=torch.float32)
    model.train()
    logits = model(ids).logits
    (logits * weight).sum().backward()
    grads = {}
    for name, p in model.named_parameters():
        if name.endswith("mlp.experts.gate_up_proj"):
            pre = name[:-len("gate_up_proj")]
            for e, t in enumerate(p.grad):
                grads[f"{pre}{e}.gate_proj.weight"], grads[f"{pre}{e}.up_proj.weight"] = t.chunk(2)
        elif name.endswith("mlp.experts.down_proj"):
            pre = name[:-len("down_proj")]
            for e, t in enumerate(p.grad):
                grads[f"{pre}{e}.down_proj.weight"] = t
        else:
            grads[name] = p.grad
    cfg = read_hf_config(path)
    return logits.detach(), hf_to_megatron_state_dict(grads, cfg)


def _tp_summed(name: str, p) -> bool:
    """Replicated parameters whose gradient each TP rank holds only a part of (SP-tagged norms and
    router, the q/k norms of its own heads): finalize_model_grads sums them over TP."""
    return pr.param_rule(name) == pr.REPLICATED and (
        getattr(p, "sequence_parallel", False) or "q_layernorm" in name or "k_layernorm" in name)


def gather_full(model, ctx, cfg, *, grads: bool) -> dict:
    """Full tensors (weights or gradients) under global names (global experts), on every rank."""
    pgs, out = ctx.pgs, {}
    coords = ctx.expert_coords
    for name, p in model.named_parameters():
        t = (p.grad if grads else p).detach().contiguous().clone()
        expert = pr.expert_index(name) is not None
        group = pgs.expt_tp if expert else ctx.tp_group
        size = dist.get_world_size(group)
        dp_group = pgs.expt_dp if expert else ctx.dp_group  # expert DP: DP x TP / (EP x ETP)
        if grads and dist.get_world_size(dp_group) > 1:
            dist.all_reduce(t, group=dp_group)  # each DP rank ran its own rows
        if grads and size > 1 and _tp_summed(name, p):
            dist.all_reduce(t, group=group)
        if size > 1 and pr.param_rule(name) != pr.REPLICATED:
            parts = [torch.empty_like(t) for _ in range(size)]
            dist.all_gather(parts, t, group=group)
            t = pr.merge_shards(name, parts)
        if expert:
            name = pr.global_expert_name(name, ep_rank=coords["ep_rank"],
                                         num_experts=cfg.moe.num_experts,
                                         ep_size=coords["ep_size"])
        out[name] = t
    if coords["ep_size"] > 1:
        objs = [None] * coords["ep_size"]
        dist.all_gather_object(objs, out, group=ctx.ep_group)
        out = {k: v for d in objs for k, v in d.items()}
    return out


def layout_row(path: str, ids, weight, ref_logits, ref_grads, *, layout: str, tmp: str) -> dict:
    lay = LAYOUTS[layout]
    ctx = groups.init_model_parallel(tp=lay["tp"], pp=1, seed=0, ep=lay["ep"], etp=lay["etp"])
    cfg = read_hf_config(path)
    cfg.moe.aux_loss_coeff = 0.0
    model = build_model(cfg, role="actor", ctx=ctx, sequence_parallel=lay["tp"] > 1)
    load_hf_weights(model, path, cfg, tp_rank=ctx.train.tp, tp_size=lay["tp"], pp_rank=0,
                    pp_size=1, **ctx.expert_coords)
    model.train()
    rows = ids.chunk(ctx.dp_size)[ctx.train.dp]  # DP ranks: their own rows
    w = weight.chunk(ctx.dp_size)[ctx.train.dp]
    pos = torch.arange(rows.shape[1]).expand_as(rows)
    local = model(rows, pos, attention_mask=None)  # (b, S, V_pad / TP)
    parts = [torch.empty_like(local) for _ in range(ctx.tp_size)]
    dist.all_gather(parts, local.detach().contiguous(), group=ctx.tp_group)
    logits = torch.cat(parts, -1)[..., :cfg.vocab_size]
    vshard = local.shape[-1]
    w_pad = torch.nn.functional.pad(w, (0, vshard * ctx.tp_size - cfg.vocab_size))
    (local * w_pad[..., ctx.train.tp * vshard:(ctx.train.tp + 1) * vshard]).sum().backward()
    if ctx.dp_size > 1:
        all_rows = [torch.empty_like(logits) for _ in range(ctx.dp_size)]
        dist.all_gather(all_rows, logits.contiguous(), group=ctx.dp_group)
        logits = torch.cat(all_rows, 0)
    grads = gather_full(model, ctx, cfg, grads=True)
    assert grads.keys() == ref_grads.keys(), sorted(set(grads) ^ set(ref_grads))
    grad_diff = max((grads[k][:ref_grads[k].shape[0]] - ref_grads[k]).abs().max().item()
                    if k.startswith(("embedding", "output_layer"))
                    else (grads[k] - ref_grads[k]).abs().max().item() for k in ref_grads)
    full = gather_full(model, ctx, cfg, grads=False)
    identical = None
    if dist.get_rank() == 0:
        out = os.path.join(tmp, f"export_{layout}")
        save_hf_checkpoint(out, full, cfg)
        exported, original = tensors(out), tensors(path)
        identical = exported.keys() == original.keys() and all(
            torch.equal(exported[k], original[k]) for k in original)
    dist.barrier()
    return {"layout": layout, **lay, "sequence_parallel": lay["tp"] > 1, "dp": ctx.dp_size,
            "max_abs_logit_diff": (logits - ref_logits).abs().max().item(),
            "max_abs_logit": ref_logits.abs().max().item(),
            "max_abs_grad_diff": grad_diff,
            "max_abs_grad": max(g.abs().max().item() for g in ref_grads.values()),
            "export_bit_identical": identical}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-ffn", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    groups.init_distributed()
    if dist.get_world_size() != 2:
        raise ValueError(f"run on 2 ranks (torchrun --nproc_per_node 2), got "
                         f"{dist.get_world_size()}")
    tmp = [tempfile.mkdtemp(prefix="qwen3_moe_parity_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(tmp, src=0)
    tmp = tmp[0]
    path = os.path.join(tmp, "qwen3_moe")
    if dist.get_rank() == 0:
        make_checkpoint(path, args)
    dist.barrier()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (2, args.seq), generator=g)
    weight = torch.randn(2, args.seq, args.vocab, generator=g)
    ref_logits, ref_grads = hf_reference(path, ids, weight)
    rows = [layout_row(path, ids, weight, ref_logits, ref_grads, layout=lay, tmp=tmp)
            for lay in args.layouts.split(",")]
    record = {}
    if dist.get_rank() == 0:
        shape = {k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads", "head_dim",
                                              "experts", "top_k", "expert_ffn", "vocab", "seq",
                                              "seed")}
        record = {
            "what": "Qwen3-MoE (random init, fp32) through hybridflow (megatron-core MoELayer) vs "
                    "transformers' Qwen3MoeForCausalLM: logits and gradients of sum(logits * W)",
            "machine": machine(), "versions": versions("transformers", "megatron-core"),
            "command": "torchrun --nproc_per_node 2 " + " ".join(sys.argv), "shape": shape,
            "layouts": rows}
        write_json(args.out, record)
        print("\n".join(f"{r['layout']:8s}: max |logit diff| {r['max_abs_logit_diff']:.2e} "
                        f"(|logit| <= {r['max_abs_logit']:.1f}), max |grad diff| "
                        f"{r['max_abs_grad_diff']:.2e} (|grad| <= {r['max_abs_grad']:.1f}), export "
                        f"bit-identical {r['export_bit_identical']}" for r in rows))
        shutil.rmtree(tmp)
    groups.destroy()
    return record


if __name__ == "__main__":
    main()
