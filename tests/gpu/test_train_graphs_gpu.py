"""parallel.train_cuda_graphs through the real Engine (Megatron DDP, optimizer, the trainer's actor
objective) on a GPU: the graphed layers give the eager run's loss metrics, gradients and updated
weights, step after step (the graphs replay on new inputs and new weights), while micro-batches of
another shape and masked (left-padded) ones run the eager layers, as the metric says; and the
weight gradients go into DDP's main_grad inside the graphs: no static copy of them stays allocated."""

import pytest
import torch

from hybridflow.algo.objectives import actor_objective
from hybridflow.config import AlgoConfig, ModelConfig, OptimConfig, ParallelConfig
from hybridflow.data.batch import RolloutBatch

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


def _run(ctx, precision: str, graphs: bool, batches) -> list[dict]:
    from hybridflow.engine import Engine
    from tests.dist.parity_util import fill_deterministic

    eng = Engine(role="actor", model_cfg=MODEL, ctx=ctx, precision=precision,
                 parallel=ParallelConfig(train_cuda_graphs=graphs),
                 optim=OptimConfig(lr=1e-3, clip_grad=1.0), total_updates=len(batches))
    fill_deterministic(eng.module, num_layers=MODEL.num_layers)
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
    # what the first step left allocated (Adam's states, and with graphs their static tensors):
    # the graphs keep no copy of the layers' weight gradients (make_graphed_callables would)
    layer_bytes = sum(p.numel() for n, p in eager[0]["weights"].items() if ".layers." in n) * (
        4 if precision == "fp32" else 2)
    assert graphed[0]["step_allocated"] - eager[0]["step_allocated"] < layer_bytes / 2
    # the weights moved: the graphs replayed on the updated parameters, not on stale copies
    first, last = eager[0]["weights"], eager[-1]["weights"]
    assert any(not torch.equal(first[n], last[n]) for n in first)
