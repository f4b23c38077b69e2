"""parallel.train_cuda_graphs through the real Engine (Megatron DDP, optimizer, the trainer's actor
objective) on a GPU: the graphed layers give the eager run's loss metrics, gradients and updated
weights, step after step (the graphs replay on new inputs and new weights), while micro-batches of
another shape and masked (left-padded) ones run the eager layers, as the metric says; and the
weight gradients go into DDP's main_grad inside the graphs: no static copy of them stays allocated
(make_graphed_callables' static gradient outputs, measured beside them, are one)."""

import gc

import pytest
import torch

from hybridflow.algo.objectives import actor_objective
from hybridflow.config import AlgoConfig, ModelConfig, OptimConfig, ParallelConfig
from hybridflow.data.batch import RolloutBatch
from hybridflow.models import graphs as layer_graphs
from tests.ragged import ragged_batch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

MODEL = ModelConfig(num_layers=3, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=4,
                    num_query_groups=2, vocab_size=100, add_qkv_bias=True)
ALGO = AlgoConfig(loss_agg_mode="token-mean", entropy_coeff=0.01, use_kl_loss=True,
                  kl_loss_type="k3", kl_loss_coef=0.1)
ROWS, MICRO, P, R = 10, 4, 6, 10  # micro-batches of 4, 4 and 2 rows: the last one runs eager


@pytest.fixture(scope="module")
def ctx(single_rank_ctx):
    return single_rank_ctx


def _batch(seed: int, *, left_pad: bool = False) -> RolloutBatch:
    """Forced lengths (no padding: no attention mask), or every other prompt left-padded."""
    g = torch.Generator().manual_seed(seed)
    prompt_mask = torch.ones(ROWS, P, dtype=torch.long)
    if left_pad:
        prompt_mask[::2, :2] = 0
    response_mask = torch.ones(ROWS, R, dtype=torch.long)
    return RolloutBatch(
        prompt_ids=torch.randint(1, 100, (ROWS, P), generator=g) * prompt_mask,
        prompt_mask=prompt_mask, response_ids=torch.randint(1, 100, (ROWS, R), generator=g),
        response_mask=response_mask, group_ids=torch.arange(ROWS) // 2,
        indices=torch.arange(ROWS),
        old_logprobs=-4.6 + 0.1 * torch.randn(ROWS, R, generator=g),
        ref_logprobs=-4.6 + 0.1 * torch.randn(ROWS, R, generator=g),
        advantages=torch.randn(ROWS, 1, generator=g) * response_mask)


def _run(ctx, precision: str, graphs: bool, batches, *, fusion: bool = True,
         model: ModelConfig = MODEL) -> list[dict]:
    from hybridflow.engine import Engine
    from tests.dist.parity_util import fill_deterministic

    # an earlier run's Engine sits in reference cycles (DDP hooks, wrapped methods): collected in
    # the middle of this run's step it would make the memory this step leaves look smaller
    gc.collect()
    torch.cuda.empty_cache()
    eng = Engine(role="actor", model_cfg=model, ctx=ctx, precision=precision,
                 parallel=ParallelConfig(train_cuda_graphs=graphs,
                                         gradient_accumulation_fusion=fusion),
                 optim=OptimConfig(lr=1e-3, clip_grad=1.0), total_updates=len(batches))
    fill_deterministic(eng.module, num_layers=model.num_layers)
    eng.optimizer.reload_model_params()  # bf16: the fp32 main params follow the filled weights
    out = []
    for batch in batches:
        loss_fn = actor_objective(ALGO, num_tokens=int(batch.response_mask.sum()), num_seqs=ROWS)
        held = torch.cuda.memory_allocated()
        m = eng.train_step(batch, loss_fn, micro_batch_size=MICRO, temperature=0.7,
                           need_entropy=True)
        out.append({"metrics": m, "weights": {n: p.detach().float().clone()
                                              for n, p in eng.module.named_parameters()},
                    "step_allocated": torch.cuda.memory_allocated() - held})
    return out


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_graphed_updates_match_eager(ctx, precision):
    batches = [_batch(0), _batch(1), _batch(2, left_pad=True), _batch(3)]
    eager = _run(ctx, precision, False, batches)
    graphed = _run(ctx, precision, True, batches)
    # 2 of the 3 micro-batches have the captured (P + R, 4) shape; the left-padded batch: none
    assert [r["metrics"]["graphed_micro_batch_frac"] for r in graphed] == [2 / 3, 2 / 3, 0, 2 / 3]
    assert "graphed_micro_batch_frac" not in eager[0]["metrics"]
    # bf16: Adam's first steps move a weight by ~lr whatever its gradient's size, so a gradient
    # near 0 that rounds the other way moves it by up to 2 x lr
    tol = dict(rtol=1e-5, atol=1e-6) if precision == "fp32" else dict(rtol=2e-2, atol=2.5e-3)
    for step, (g, e) in enumerate(zip(graphed, eager)):
        for key, value in e["metrics"].items():
            torch.testing.assert_close(torch.tensor(g["metrics"][key]), torch.tensor(value),
                                       **tol, msg=f"step {step}: {key}")
        assert e["metrics"]["grad_norm"] > 0
        for name, w in e["weights"].items():
            torch.testing.assert_close(g["weights"][name], w, **tol, msg=f"step {step}: {name}")
    # the weights moved: the graphs replayed on the updated parameters, not on stale copies
    first, last = eager[0]["weights"], eager[-1]["weights"]
    assert any(not torch.equal(first[n], last[n]) for n in first)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_graphs_hold_no_weight_gradients(ctx, precision):
    """What the first graphed step leaves allocated, against the same capture by
    make_graphed_callables, whose static weight-gradient outputs stay allocated for the run: the
    in-graph version holds one copy of the layers' weights less."""
    # layers of 30 MiB each in bf16: what new capture streams' cuBLAS workspaces add to one run or
    # the other (up to ~80 MiB measured) stays well under the difference looked for
    big = ModelConfig(num_layers=8, hidden_size=1024, ffn_hidden_size=4096, num_attention_heads=8,
                      num_query_groups=2, vocab_size=100, add_qkv_bias=True)
    batches = [_batch(0)]
    in_graph = _run(ctx, precision, True, batches, model=big)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(layer_graphs, "_capture_into_main_grad", lambda calls, samples, params, n:
                   torch.cuda.make_graphed_callables(calls, samples, num_warmup_iters=n))
        # (whose captured backward returns every weight gradient: no fused accumulation)
        held = _run(ctx, precision, True, batches, fusion=False, model=big)
    layer_bytes = sum(p.numel() for n, p in in_graph[0]["weights"].items() if ".layers." in n) * (
        4 if precision == "fp32" else 2)
    saved = held[0]["step_allocated"] - in_graph[0]["step_allocated"]
    assert 0.5 * layer_bytes < saved < 1.5 * layer_bytes, (saved, layer_bytes)


PACK_PROMPTS = [7, 5, 6, 3, 7, 4, 2, 3, 5, 2, 4, 3, 6, 6, 1, 5]
PACK_RESPONSES = [40, 9, 4, 33, 6, 8, 1, 3, 2, 4, 1, 2, 17, 25, 30, 5]
BUDGET = 96  # tokens per packed micro-batch: 3-6 micro-batches of 1-12 rows


def _ragged(seed: int, short: bool = False) -> RolloutBatch:
    """Rows of varied lengths (`short`: one-token responses, so a micro-batch holds more rows,
    more documents than a capture made for the others)."""
    return ragged_batch(PACK_PROMPTS, [1] * len(PACK_PROMPTS) if short else PACK_RESPONSES,
                        seed=seed, vocab=100, logprob=-4.6)


def _run_packed(ctx, graphs: bool, batches, *, lora_rank: int = 0) -> list[dict]:
    from hybridflow.config import LoRAConfig
    from hybridflow.engine import Engine
    from tests.dist.parity_util import fill_deterministic

    eng = Engine(role="actor", model_cfg=MODEL, ctx=ctx, precision="bf16",
                 parallel=ParallelConfig(train_cuda_graphs=graphs),
                 optim=OptimConfig(lr=1e-3 if not lora_rank else 1e-2, clip_grad=1.0),
                 total_updates=len(batches), packed_attention="varlen",
                 lora=LoRAConfig(rank=lora_rank, alpha=2.0 * lora_rank) if lora_rank else None)
    fill_deterministic(eng.module, num_layers=MODEL.num_layers)
    eng.optimizer.reload_model_params()
    out = []
    for batch in batches:
        loss_fn = actor_objective(ALGO, num_tokens=int(batch.response_mask.sum()),
                                  num_seqs=batch.batch_size)
        m = eng.train_step(batch, loss_fn, micro_batch_size=4, temperature=0.7, need_entropy=True,
                           max_tokens=BUDGET, pack=True)
        out.append({"metrics": m, "shape": eng._graph_shape,
                    "weights": {n: p.detach().float().clone()
                                for n, p in eng.module.named_parameters() if p.requires_grad}})
    return out


@pytest.mark.parametrize("lora_rank", [0, 8], ids=["full", "lora"])
def test_packed_graphed_updates_match_eager(ctx, lora_rank):
    """Packed token-budget micro-batches (varlen attention) replay graphs captured at one
    PackedShape: the same metrics and weights as the eager packed run, step after step (new
    documents copied into the static cu_seqlens each micro-batch); later batches of short rows,
    more documents than the shape holds, grow it (a new capture) and still match."""
    batches = [_ragged(0), _ragged(1), _ragged(2, short=True), _ragged(3, short=True)]
    eager = _run_packed(ctx, False, batches, lora_rank=lora_rank)
    graphed = _run_packed(ctx, True, batches, lora_rank=lora_rank)
    fracs = [r["metrics"]["graphed_micro_batch_frac"] for r in graphed]
    assert all(f >= 0.75 for f in fracs), fracs
    shapes = [r["shape"] for r in graphed]
    assert shapes[0].length == BUDGET and shapes[0] == shapes[1]
    assert shapes[2].documents > shapes[1].documents and shapes[3] == shapes[2], shapes
    tol = dict(rtol=2e-2, atol=2.5e-3 if not lora_rank else 2.5e-2)
    for step, (g, e) in enumerate(zip(graphed, eager)):
        for key, value in e["metrics"].items():
            if key != "graphed_micro_batch_frac":
                torch.testing.assert_close(torch.tensor(g["metrics"][key]), torch.tensor(value),
                                           **tol, msg=f"step {step}: {key}")
        for name, w in e["weights"].items():
            torch.testing.assert_close(g["weights"][name], w, **tol, msg=f"step {step}: {name}")
        # LoRA: the embedding is frozen, so the layers' input needs no gradient; the replays
        # must still be recorded (and their backward run) for the adapters to train
        assert g["metrics"]["grad_norm"] > 0 and e["metrics"]["grad_norm"] > 0
    for run in (eager, graphed):
        first, last = run[0]["weights"], run[-1]["weights"]
        assert any(not torch.equal(first[n], last[n]) for n in first)
