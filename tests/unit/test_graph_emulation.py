"""The graphed decode path's host side on CPU (DecodeOptions.emulate_graphs): chunks padded to their
batch buckets, every compaction-ladder bucket's step made up front and warmed up on its buffers as
GraphedStep warms a step before capturing it, then called eagerly where a GPU replays the graph.
Every index the steps use (the recorded experts' response column, the output columns, the cache
column, rows beyond the real batch, compaction's row maps) is then checked by CPU ops, which raise
where a GPU kernel asserts on the device. Greedy runs equal the plain eager path's: tokens, masks
and the recorded expert ids bit for bit, log-probs to a matmul's batch-size rounding."""

import dataclasses

import pytest
import torch

from hybridflow.config import ModelConfig
from hybridflow.model_config import MoEConfig
from hybridflow.rollout import Generator
from hybridflow.rollout.cuda_graph import WarmedStep
from tests.unit.test_rollout import PROMPTS, make, opts, random_params, rc

MOE = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                  num_query_groups=2, vocab_size=37, add_qkv_bias=True,
                  moe=MoEConfig(num_experts=8, top_k=2, moe_ffn_hidden_size=16))


def moe_generator(cfg: ModelConfig = MOE, seed: int = 0) -> Generator:
    """A random MoE generator (Megatron's expert names) on CPU, fp32."""
    p = random_params(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    D, E, F = cfg.hidden_size, cfg.moe.num_experts, cfg.moe.moe_ffn_hidden_size
    for i in range(cfg.num_layers):
        q = f"decoder.layers.{i}.mlp."
        del p[q + "linear_fc1.weight"], p[q + "linear_fc2.weight"]
        p[q + "router.weight"] = torch.randn(E, D, generator=g)
        for e in range(E):
            p[f"{q}experts.local_experts.{e}.linear_fc1.weight"] = 0.3 * torch.randn(2 * F, D,
                                                                                      generator=g)
            p[f"{q}experts.local_experts.{e}.linear_fc2.weight"] = 0.3 * torch.randn(D, F,
                                                                                      generator=g)
    return Generator(model_cfg=cfg, params=p, tp_group=None, device=torch.device("cpu"),
                     dtype=torch.float32, true_vocab_size=cfg.vocab_size)


def _assert_same(a, b, names):
    for name in names:
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    torch.testing.assert_close(a.rollout_logprobs, b.rollout_logprobs, rtol=0, atol=1e-4)


def _well_formed(batch, num_experts: int):
    """-1 exactly where nothing was fed (prompt padding, each response's last token and after),
    k distinct ids in [0, E) elsewhere."""
    B, P = batch.batch_size, batch.prompt_len
    fed = batch.token_mask().clone()
    fed[torch.arange(B), P + batch.response_mask.sum(1) - 1] = 0
    e = batch.experts()
    assert torch.equal((e >= 0).all(-1).all(-1).long(), fed)
    assert bool((e[~fed.bool()] == -1).all())
    ids = e[fed.bool()]
    assert bool((ids < num_experts).all()) and bool((ids[..., 0] != ids[..., 1]).all())


def test_moe_recording_under_emulated_graphs_equals_eager():
    """8 rows in chunks of 5 (bucket 5) and 3 (bucket 4: one padded row), ladder buckets 1, 2, 4
    warmed up front, two attention windows per bucket, rows stopping at different steps (greedy,
    an EOS some rows reach): the emulated graphed run records what the eager run records."""
    gen = moe_generator()
    cfg = rc(n=2, max_new_tokens=60, max_batch_size=5)  # prompts <= 7 + 60: windows 64 and 128
    first = gen.generate(PROMPTS, cfg=cfg, eos_id=-1, pad_id=0, seed=1)
    eos = int(first.response_ids[0, 3])  # some rows produce it early, others later or never
    kw = dict(kv_window=64, compact_finished_rows=True, check_every=2, min_graphed_bucket=1)
    eager, graphed = (gen.generate(PROMPTS, cfg=cfg, eos_id=eos, pad_id=0, seed=1,
                                   record_experts=True,
                                   options=opts(cfg, emulate_graphs=emulate, **kw))
                      for emulate in (False, True))
    buckets = {k[0] for k, (_, fns) in gen._steps.items()
               if all(isinstance(f, WarmedStep) for f in fns.values())}
    assert buckets == {5, 4, 2, 1}  # the chunks' buckets and the ladder below them
    assert gen.stats["compactions"] > 0 and len(set(graphed.response_mask.sum(1).tolist())) > 1
    _assert_same(graphed, eager, ("response_ids", "response_mask", "prompt_experts",
                                  "response_experts"))
    _well_formed(graphed, MOE.moe.num_experts)
    # the same steps again: their buffers now hold the last run's state (no warm-up this time)
    again = gen.generate(PROMPTS, cfg=cfg, eos_id=eos, pad_id=0, seed=1, record_experts=True,
                         options=opts(cfg, emulate_graphs=True, **kw))
    _assert_same(again, graphed, ("response_ids", "prompt_experts", "response_experts"))


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_moe_recording_short_budget_many_windows(temperature):
    """A long prompt and 2-3 new tokens over three windows per bucket: warm-ups of later windows
    must not carry the response column past the budget (max_new_tokens)."""
    gen = moe_generator()
    prompts = [list(range(1, 31)) * 4 + [5, 6], [7, 8, 9]]  # 122 tokens: cache 128 + R -> 192
    for R in (2, 3):
        cfg = rc(n=2, max_new_tokens=R, max_batch_size=3, temperature=temperature)
        runs = [gen.generate(prompts, cfg=cfg, eos_id=-1, pad_id=0, seed=3, record_experts=True,
                             options=opts(cfg, emulate_graphs=emulate, kv_window=64))
                for emulate in (False, True)]
        _well_formed(runs[1], MOE.moe.num_experts)
        if temperature == 0.0:  # sampled: the draw of a padded bucket consumes more randomness
            _assert_same(runs[1], runs[0], ("response_ids", "prompt_experts", "response_experts"))


def test_dense_short_budget_many_windows():
    """The dense model's steps under the same warm-ups: its output columns stay in range too."""
    gen = make()
    prompts = [list(range(1, 31)) * 4 + [5, 6], [7, 8, 9], [4]]
    for R in (2, 3):
        cfg = rc(n=1, max_new_tokens=R, max_batch_size=3)
        eager, graphed = (gen.generate(prompts, cfg=cfg, eos_id=-1, pad_id=0, seed=3,
                                       options=opts(cfg, emulate_graphs=emulate, kv_window=64))
                          for emulate in (False, True))
        _assert_same(graphed, eager, ("response_ids", "response_mask"))


def test_emulation_is_a_cpu_switch_only():
    """Without emulate_graphs the CPU path never pads to buckets nor warms up (plain functions)."""
    gen = make()
    cfg = rc(n=1, max_new_tokens=4, max_batch_size=4)
    gen.generate(PROMPTS[:3], cfg=cfg, eos_id=-1, pad_id=0, seed=0, options=opts(cfg))
    ((k, (_, fns)),) = gen._steps.items()
    assert k[0] == 3 and not any(isinstance(f, WarmedStep) for f in fns.values())
    assert dataclasses.replace(opts(cfg), emulate_graphs=True) != opts(cfg)  # keys the steps


def test_replay_hook_takes_the_own_choice_for_any_id_out_of_range():
    """megatron-core's top-k routing with our replay hook: a token whose record holds -1 or an id
    >= E in any of its k slots (not only the first) routes by its own top-k (those ids would index
    the scores: a device assert on a GPU); well-formed records are replayed exactly."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    from hybridflow.models.moe import _RouterHook

    E, k = 8, 2
    logits = torch.randn(6, E, generator=torch.Generator().manual_seed(0))
    hook = _RouterHook(0)
    hook.target = torch.tensor([[3, 5], [-1, -1], [2, -1], [7, 8], [0, 1], [6, 4]])
    _, routing = topk_routing_with_score_function(logits, k, router_replay=hook)
    hook.target = None
    _, own = topk_routing_with_score_function(logits, k, router_replay=hook)
    for row, ids in ((0, [3, 5]), (4, [0, 1]), (5, [4, 6])):
        assert routing[row].nonzero().flatten().tolist() == ids
    assert torch.equal(routing[1:4], own[1:4])
    assert int(hook.recorded) == 3


def test_graphed_step_keeps_what_its_step_closes_over(monkeypatch):
    """A capture reads the addresses of every tensor the step closes over; GraphedStep must keep
    the step (and so them) alive, or the allocator hands their blocks to later tensors while the
    graph still reads them (the speculative tail's index ramps and stop ids). The capture calls
    are stood in for on CPU; the GPU twin is tests/gpu/test_decode_kernels_gpu.py's."""
    import contextlib
    import gc
    import weakref

    from hybridflow.rollout import cuda_graph

    class Stream:
        def wait_stream(self, other):
            pass

    class Graph:
        def register_generator_state(self, generator):
            pass

        def replay(self):
            pass

    fake = dict(stream=lambda s: contextlib.nullcontext(), current_stream=lambda: Stream(),
                CUDAGraph=Graph, graph=lambda g, pool=None: contextlib.nullcontext())
    for name, value in fake.items():
        monkeypatch.setattr(torch.cuda, name, value)

    def factory():
        ramp = torch.arange(8)  # held by the step's closure only

        def step():
            ramp.add_(0)
        return step, weakref.ref(ramp)

    step, ramp = factory()
    graphed = cuda_graph.GraphedStep(step, pool=None, side=Stream(), generator=None)
    del step
    gc.collect()
    assert ramp() is not None
    del graphed
    gc.collect()
    assert ramp() is None
