"""Train -> gen reshard on 4 gloo ranks against an unsharded reference.

Each layout: full weights from a seed (TP=1 shapes), each rank loads its training shards with
`param_rules.shard_tensor`, `Resharder.gather()` must give every gen weight bit-identical to the gen
shard of the full weights, leave the training shards untouched, allocate exactly the gen shard (minus
aliases of training params), and the gen weights must generate the same logits as a 1-rank model:
the rollout decoder (`hybridflow.rollout.decoder`, TP_g over the gen TP group) on the gathered weights
against a small pure-torch 1-rank forward on the full weights (`_forward`), itself checked against
Megatron's own forward of the training model.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridflow.config import ModelConfig
from hybridflow.parallel import groups
from hybridflow.parallel import param_rules as pr
from hybridflow.parallel.layout import Layout
from hybridflow.parallel.reshard import Resharder
from tests.dist.launcher import run_ranks


def _cfg(tied: bool) -> ModelConfig:
    return ModelConfig(name="tiny-reshard", num_layers=4, hidden_size=64, ffn_hidden_size=128,
                       num_attention_heads=8, num_query_groups=4, vocab_size=64,
                       add_qkv_bias=True, tie_word_embeddings=tied)


def _full_state(cfg: ModelConfig, vocab: int) -> dict:
    """Unsharded weights with the names and shapes of a TP=1, PP=1 GPTModel."""
    h, f, hd = cfg.hidden_size, cfg.ffn_hidden_size, cfg.hidden_size // cfg.num_attention_heads
    qkv = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * hd
    shapes = {"embedding.word_embeddings.weight": (vocab, h)}
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,),
                       p + "self_attention.linear_proj.weight": (h, cfg.num_attention_heads * hd),
                       p + "self_attention.linear_qkv.weight": (qkv, h),
                       p + "self_attention.linear_qkv.bias": (qkv,),
                       p + "pre_mlp_layernorm.weight": (h,),
                       p + "mlp.linear_fc1.weight": (2 * f, h), p + "mlp.linear_fc2.weight": (h, f)})
    shapes["decoder.final_layernorm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["output_layer.weight"] = (vocab, h)
    gen = torch.Generator().manual_seed(1234)
    return {n: (1.0 if "layernorm" in n else 0.0) + 0.1 * torch.randn(s, generator=gen)
            for n, s in shapes.items()}


def _forward(w: dict, ids: torch.Tensor, *, cfg: ModelConfig) -> torch.Tensor:
    """Logits (B, S, V_pad) of a Llama/Qwen2 decoder (Megatron's math) from full weights `w`."""
    B, S = ids.shape
    h, heads, qg = cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups
    hd = cfg.hidden_size // cfg.num_attention_heads
    emb = w["embedding.word_embeddings.weight"]
    x = F.embedding(ids, emb)  # (B, S, h)
    inv = 1.0 / (cfg.rotary_base ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    ang = torch.arange(S, dtype=torch.float32)[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()  # (S, hd)

    def rope(t):  # (B, n, S, hd), non-interleaved (Megatron's default)
        t1, t2 = t.chunk(2, -1)
        return t * cos + torch.cat([-t2, t1], -1) * sin

    def norm(t, name):
        return F.rms_norm(t, (h,), w[name], cfg.norm_epsilon)

    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        qkv = F.linear(norm(x, p + "input_layernorm.weight"), w[p + "self_attention.linear_qkv.weight"],
                       w.get(p + "self_attention.linear_qkv.bias"))
        q, kk, v = qkv.view(B, S, qg, -1).split([heads // qg * hd, hd, hd], -1)  # grouped per query group
        q = rope(q.reshape(B, S, heads, hd).transpose(1, 2))
        kk, v = rope(kk.transpose(1, 2)), v.transpose(1, 2)  # (B, qg, S, hd)
        a = F.scaled_dot_product_attention(q, kk, v, is_causal=True, enable_gqa=True)
        x = x + F.linear(a.transpose(1, 2).reshape(B, S, heads * hd),
                         w[p + "self_attention.linear_proj.weight"])
        gate, up = F.linear(norm(x, p + "pre_mlp_layernorm.weight"),
                            w[p + "mlp.linear_fc1.weight"]).chunk(2, -1)
        x = x + F.linear(F.silu(gate) * up, w[p + "mlp.linear_fc2.weight"])
    return F.linear(norm(x, "decoder.final_layernorm.weight"), w.get("output_layer.weight", emb))


def _gen_logits(out: dict, ids: torch.Tensor, *, cfg: ModelConfig, group) -> torch.Tensor:
    """Logits (B, S, V) of the rollout decoder on the gen-layout weights `out` (TP_g over `group`)."""
    from hybridflow.rollout import decoder

    w = decoder.load_weights(cfg, out, group=group, true_vocab_size=cfg.vocab_size,
                             device=ids.device, dtype=torch.float32)
    cos, sin = decoder.rope_tables(w.inv_freq, ids.shape[1], dtype=torch.float32, device=ids.device)
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    return decoder.forward(w, ids, pos, torch.ones_like(ids, dtype=torch.bool), cos_tab=cos,
                           sin_tab=sin)


def _case(model, cfg, full, *, tp_t, pp_t, tp_g, megatron_logits=None, **options) -> dict:
    """Reshard `model` (training shards of `full` loaded) to TP_g and check it; a summary dict."""
    rank, world = dist.get_rank(), dist.get_world_size()
    lay = Layout(world_size=world, tp_t=tp_t, pp_t=pp_t, tp_g=tp_g)
    params = dict(model.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    rg = groups.new_reshard_groups(lay)
    res = Resharder(model, layout=lay, groups=rg, bucket_mb=0.02, **options)
    out = res.gather()
    k = lay.gen_coord(rank).tp
    ok = {"names": list(out) == list(full), "buckets": len(res.plan.buckets)}
    ok["bit_identical"] = all(
        out[n].shape == pr.shard_tensor(n, full[n], tp_rank=k, tp_size=tp_g).shape
        and torch.equal(out[n], pr.shard_tensor(n, full[n], tp_rank=k, tp_size=tp_g)) for n in full)
    # memory: distinct storages the gather allocated (not training params) vs the gen shard size
    param_ptrs = {p.untyped_storage().data_ptr() for p in params.values()}
    new = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in out.values()
           if t.untyped_storage().data_ptr() not in param_ptrs}
    ok["allocated"] = sum(new.values())
    ok["gen_bytes_not_aliased"] = sum(t.numel() * t.element_size() for t in out.values()
                                      if t.untyped_storage().data_ptr() not in param_ptrs)
    ok["gen_shard_bytes"] = sum(t.numel() * t.element_size() for t in out.values())
    ok["train_shard_bytes"] = sum(p.numel() * p.element_size() for p in params.values())
    ok["full_bytes"] = sum(t.numel() * t.element_size() for t in full.values())
    ok["plan_bytes"] = res.allocated_bytes()
    ok["num_aliases"] = len(res.plan.aliases)
    ids = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = _forward(full, ids, cfg=cfg)
        gen = _gen_logits(out, ids, cfg=cfg, group=rg.gen_tp)
    ok["gen_vs_1rank"] = (gen - ref[..., :cfg.vocab_size]).abs().max().item()
    if megatron_logits is not None:
        ok["megatron_vs_1rank"] = (megatron_logits - ref).abs().max().item()
    gen_only = [t for t in out.values() if t.untyped_storage().data_ptr() not in param_ptrs]
    res.release()  # frees the buffers' memory even while views of them are still referenced
    ok["released"] = all(t.untyped_storage().nbytes() == 0 for t in gen_only)
    ok["train_unchanged"] = all(torch.equal(p, before[n]) for n, p in params.items())
    out = res.gather()  # a second step works the same
    ok["second_gather_identical"] = all(
        torch.equal(out[n], pr.shard_tensor(n, full[n], tp_rank=k, tp_size=tp_g)) for n in full)
    res.release()
    return ok


def _setup(*, tp, pp, tied):
    from megatron.core import parallel_state as ps

    from hybridflow.models.build import build_model, padded_vocab_size

    ctx = groups.init_model_parallel(tp=tp, pp=pp, seed=0)
    cfg = _cfg(tied)
    model = build_model(cfg, role="actor", ctx=ctx).eval()
    full = _full_state(cfg, padded_vocab_size(cfg.vocab_size, tp))
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    with torch.no_grad():
        for n, p in model.named_parameters():
            g = pr.global_name(n, pp_rank=pp_rank, num_layers=cfg.num_layers, pp_size=pp)
            src = full["embedding.word_embeddings.weight"] if tied and g == "output_layer.weight" \
                else full[g]
            p.copy_(pr.shard_tensor(g, src, tp_rank=tp_rank, tp_size=tp))
    megatron_logits = None
    if pp == 1:
        ids = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            logits = model(ids, torch.arange(8).expand(2, 8), None)  # (B, S, V/TP) vocab-parallel
        parts = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
        megatron_logits = torch.cat(parts, -1)
    return model, cfg, full, megatron_logits


def run_all():
    """Every layout in one spawn (process start + megatron import dominate the test's time)."""
    results = {}
    model, cfg, full, meg = _setup(tp=4, pp=1, tied=False)
    results["tp4_to_tp2"] = _case(model, cfg, full, tp_t=4, pp_t=1, tp_g=2, megatron_logits=meg)
    results["tp4_to_tp4"] = _case(model, cfg, full, tp_t=4, pp_t=1, tp_g=4)
    results["tp4_to_tp1"] = _case(model, cfg, full, tp_t=4, pp_t=1, tp_g=1, coalesce=False,
                                  inplace=True)
    model, cfg, full, meg = _setup(tp=2, pp=1, tied=True)
    results["tp2dp2_to_tp1_tied"] = _case(model, cfg, full, tp_t=2, pp_t=1, tp_g=1,
                                          megatron_logits=meg)
    for tied in (False, True):
        model, cfg, full, _ = _setup(tp=2, pp=2, tied=tied)
        tag = "tied" if tied else "untied"
        results[f"pp2tp2_to_tp1_{tag}"] = _case(model, cfg, full, tp_t=2, pp_t=2, tp_g=1)
        results[f"pp2tp2_to_tp2_{tag}"] = _case(model, cfg, full, tp_t=2, pp_t=2, tp_g=2)
    return results


@pytest.fixture(scope="module")
def per_rank():
    return run_ranks(run_all, 4)


def _check(per_rank: list[dict], prefix: str):
    cases = 0
    for rank, results in enumerate(per_rank):
        for name, ok in results.items():
            if not name.startswith(prefix):
                continue
            cases += 1
            where = f"rank {rank} {name}: {ok}"
            assert ok["names"] and ok["bit_identical"] and ok["second_gather_identical"], where
            assert ok["train_unchanged"] and ok["released"], where
            assert ok["gen_vs_1rank"] < 1e-5, where
            assert ok.get("megatron_vs_1rank", 0.0) < 1e-4, where
            # the gather allocates exactly the gen shard (minus aliases of training params), no more
            assert ok["allocated"] == ok["gen_bytes_not_aliased"] == ok["plan_bytes"], where
            assert ok["allocated"] <= ok["gen_shard_bytes"], where
    assert cases


def test_tp4_to_tp2_tp4_tp1(per_rank):
    _check(per_rank, "tp4_")
    for results in per_rank:
        assert results["tp4_to_tp4"]["allocated"] == 0  # TP_g == TP_t, PP_t == 1: the params themselves
        assert results["tp4_to_tp2"]["buckets"] > 1
        assert "megatron_vs_1rank" in results["tp4_to_tp2"]


def test_tp2_dp2_to_tp1_tied(per_rank):
    _check(per_rank, "tp2dp2_")


def test_pp2_to_pp1(per_rank):
    _check(per_rank, "pp2")
    for results in per_rank:  # PP_t > 1: no aliases, every gen weight is in a gathered buffer
        r = results["pp2tp2_to_tp1_untied"]
        assert r["num_aliases"] == 0 and r["allocated"] == r["gen_shard_bytes"]
