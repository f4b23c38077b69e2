"""Train/gen layout arithmetic (hybridflow.parallel.layout) and the pure reshard plan."""

import pytest
import torch

from hybridflow.parallel import param_rules as pr
from hybridflow.parallel.layout import Layout
from hybridflow.parallel.reshard_plan import ParamMeta, build_plan

LAYOUTS = [  # (world, tp_t, pp_t, tp_g)
    (1, 1, 1, 1), (2, 2, 1, 1), (4, 4, 1, 2), (4, 2, 1, 1), (4, 2, 2, 1), (4, 2, 2, 2),
    (8, 8, 1, 2), (8, 4, 2, 2), (8, 2, 2, 1), (8, 4, 1, 1), (8, 2, 1, 2), (8, 1, 2, 1), (8, 2, 4, 1),
]


def _is_partition(lists, world):
    flat = sorted(r for lst in lists for r in lst)
    return flat == list(range(world))


@pytest.mark.parametrize("world,tp_t,pp_t,tp_g", LAYOUTS)
def test_coordinates_are_bijections(world, tp_t, pp_t, tp_g):
    lay = Layout(world_size=world, tp_t=tp_t, pp_t=pp_t, tp_g=tp_g)
    assert lay.dp_t * tp_t * pp_t == world and lay.dp_g * tp_g == world
    for r in range(world):
        c = lay.train_coord(r)
        assert lay.train_rank(tp=c.tp, pp=c.pp, dp=c.dp) == r
        # Megatron order tp-cp-ep-dp-pp: TP fastest, PP slowest
        assert r == c.tp + tp_t * (c.dp + lay.dp_t * c.pp)
        g = lay.gen_coord(r)
        assert g.tp == c.tp // lay.micro_dp
        assert lay.gen_rank(tp=g.tp, dp=g.dp) == r
    assert len({lay.gen_coord(r) for r in range(world)}) == world


@pytest.mark.parametrize("world,tp_t,pp_t,tp_g", LAYOUTS)
def test_groups(world, tp_t, pp_t, tp_g):
    lay = Layout(world_size=world, tp_t=tp_t, pp_t=pp_t, tp_g=tp_g)
    m = lay.micro_dp
    micro = lay.micro_dp_groups()
    assert _is_partition(micro, world) and all(len(g) == m for g in micro)
    for g in micro:
        cs = [lay.train_coord(r) for r in g]
        assert g == sorted(g)
        assert len({(c.pp, c.dp) for c in cs}) == 1  # inside one training TP group
        k = cs[0].tp // m
        assert [c.tp for c in cs] == lay.train_shards_of_gen_shard(k)  # consecutive, group rank = j
        assert {lay.gen_coord(r).tp for r in g} == {k}
    pp_groups = lay.pp_gather_groups()
    if pp_t == 1:
        assert pp_groups == []
    else:
        assert _is_partition(pp_groups, world)
        for g in pp_groups:
            cs = [lay.train_coord(r) for r in g]
            assert [c.pp for c in cs] == list(range(pp_t))  # group rank = stage
            assert len({(c.tp, c.dp) for c in cs}) == 1
    gen_tp = lay.gen_tp_groups()
    assert _is_partition(gen_tp, world) and all(len(g) == tp_g for g in gen_tp)
    for g in gen_tp:
        assert [lay.gen_coord(r).tp for r in g] == list(range(tp_g))  # group rank = gen tp rank
        assert len({lay.gen_coord(r).dp for r in g}) == 1
        # one gen replica's shards come from all training TP ranks of one (pp, dp)
        srcs = sorted(t for k in range(tp_g) for t in lay.train_shards_of_gen_shard(k))
        assert srcs == list(range(tp_t))


def test_world8_example():
    lay = Layout(world_size=8, tp_t=4, pp_t=2, tp_g=2)
    assert lay.micro_dp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.pp_gather_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.gen_tp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.train_shards_of_gen_shard(1) == [2, 3]


@pytest.mark.parametrize("kwargs", [dict(world_size=4, tp_t=2, pp_t=1, tp_g=4),
                                    dict(world_size=4, tp_t=4, pp_t=1, tp_g=3),
                                    dict(world_size=6, tp_t=4, pp_t=1, tp_g=2),
                                    dict(world_size=4, tp_t=2, pp_t=1, tp_g=0)])
def test_invalid_layouts(kwargs):
    with pytest.raises(ValueError):
        Layout(**kwargs)


def _stage_metas(*, pp, tp, layers=4, h=32, ffn=64, heads=8, qg=4, vocab=32, tied=False):
    hd = h // heads
    out = []
    for s in range(pp):
        metas = []
        if s == 0:
            metas.append(("embedding.word_embeddings.weight", (vocab // tp, h)))
        for i in range(layers // pp):
            p = f"decoder.layers.{i}."
            metas += [(p + "input_layernorm.weight", (h,)),
                      (p + "self_attention.linear_proj.weight", (h, heads * hd // tp)),
                      (p + "self_attention.linear_qkv.weight", ((heads + 2 * qg) * hd // tp, h)),
                      (p + "pre_mlp_layernorm.weight", (h,)),
                      (p + "mlp.linear_fc1.weight", (2 * ffn // tp, h)),
                      (p + "mlp.linear_fc2.weight", (h, ffn // tp))]
        if s == pp - 1:
            metas.append(("decoder.final_layernorm.weight", (h,)))
            if not tied or pp > 1:
                metas.append(("output_layer.weight", (vocab // tp, h)))
        out.append([ParamMeta(n, shape, torch.float32) for n, shape in metas])
    return out


@pytest.mark.parametrize("tp_t,pp_t,tp_g,tied", [(4, 1, 2, False), (2, 1, 1, True), (2, 2, 1, False),
                                                  (2, 2, 2, True), (2, 1, 2, False)])
def test_plan_covers_every_gen_weight_once(tp_t, pp_t, tp_g, tied):
    lay = Layout(world_size=tp_t * pp_t, tp_t=tp_t, pp_t=pp_t, tp_g=tp_g)
    stages = _stage_metas(pp=pp_t, tp=tp_t, tied=tied)
    plan = build_plan(stages, layout=lay, num_layers=4, num_query_groups=4, tied=tied,
                      bucket_numel=600)
    full = _stage_metas(pp=1, tp=tp_g, tied=tied)[0]  # what a PP=1 TP_g model holds
    assert plan.names == [p.name for p in full]
    shapes = {p.name: p.shape for p in full}
    views = [v for b in plan.buckets for slot in b.views for v in slot]
    assert sorted([g for g, _ in plan.aliases] + [v.name for v in views]) == sorted(shapes)
    for v in views:
        shape = v.stored_shape[::-1] if v.transposed else v.stored_shape
        assert tuple(shape) == shapes[v.name], v.name
    gen_numel = sum(pr_numel(shapes[v.name]) for v in views)
    assert plan.buffer_numel() == gen_numel  # no scratch, no padding at these shapes
    if pp_t == 1 and tp_g == tp_t:
        assert plan.buckets == [] and len(plan.aliases) == len(full)


def pr_numel(shape):
    return int(torch.Size(shape).numel())


def test_plan_rejects_split_query_groups():
    lay = Layout(world_size=4, tp_t=4, pp_t=1, tp_g=2)
    stages = _stage_metas(pp=1, tp=4)
    # pretend the model has 2 query groups over TP=4: a shard would hold half a group
    with pytest.raises(ValueError, match="query groups"):
        build_plan(stages, layout=lay, num_layers=4, num_query_groups=2, tied=False,
                   bucket_numel=10**6)
    assert pr.param_rule("decoder.layers.0.mlp.linear_fc1.weight") == pr.GATED_FC1
