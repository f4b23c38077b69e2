"""The plumbing of models/graphs.py's main_grad path on CPU, with stand-ins for the CUDA graphs
(each "replay" re-runs the captured layer call eagerly into the same static tensors): the replaying
autograd function and `_layer_backward` (weight gradients added into DDP's main_grad, the input
gradient returned) give the eager Engine's update exactly, with Megatron DDP's hooks firing for the
other parameters only. The captures themselves need a GPU (tests/gpu/test_train_graphs_gpu.py)."""

import pytest
import torch

from hybridflow.algo.objectives import actor_objective
from hybridflow.config import AlgoConfig, ModelConfig, OptimConfig, ParallelConfig
from hybridflow.data.batch import RolloutBatch

MODEL = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                    num_query_groups=2, vocab_size=50, add_qkv_bias=True)
B, P, R = 4, 5, 6


class _Eager:
    """A CUDAGraph stand-in: replay() runs `fn`."""

    def __init__(self):
        self.fn = None

    def replay(self):
        self.fn()


def _fake_graphs(layer, shape):
    from hybridflow.models import graphs as G

    call = G._LayerCall(layer)
    params = tuple(p for p in layer.parameters() if p.requires_grad)
    x = torch.zeros(shape, requires_grad=True)
    g = G._LayerGraphs.__new__(G._LayerGraphs)
    g.x, g.rotary, g.fwd, g.bwd = x, None, _Eager(), _Eager()
    g.anchor = torch.zeros((), requires_grad=True)
    g.out, g.grad_out, g.grad_in = torch.zeros(shape), torch.zeros(shape), torch.zeros(shape)
    live = {}

    def fwd():  # as captured: with grad, g.x the leaf (an autograd.Function's forward has none)
        with torch.enable_grad():
            live["out"] = call(g.x, g.rotary)
        g.out.copy_(live["out"].detach())

    def bwd():
        g.grad_in.copy_(G._layer_backward(live.pop("out"), g.x, params, g.grad_out))

    g.fwd.fn, g.bwd.fn = fwd, bwd

    def forward(hidden_states, attention_mask=None, rotary_pos_emb=None, **kwargs):
        # what models.graphs._dispatch routes to the graphs (it also checks hidden_states.is_cuda)
        assert attention_mask is None and tuple(hidden_states.shape) == shape
        if g.rotary is None:
            g.rotary = rotary_pos_emb.clone()
        return g(hidden_states, rotary_pos_emb), kwargs.get("context")

    return forward


@pytest.fixture(scope="module")
def ctx(single_rank_ctx):
    return single_rank_ctx


def _step(ctx, fake: bool, lora_rank: int = 0):
    from hybridflow.config import LoRAConfig
    from hybridflow.engine import Engine
    from tests.dist.parity_util import fill_deterministic

    eng = Engine(role="actor", model_cfg=MODEL, ctx=ctx, parallel=ParallelConfig(), precision="fp32",
                 optim=OptimConfig(lr=1e-3),
                 lora=LoRAConfig(rank=lora_rank, alpha=2.0 * lora_rank) if lora_rank else None)
    fill_deterministic(eng.module, num_layers=MODEL.num_layers)
    eng.optimizer.reload_model_params()
    fired = []
    if fake:
        shape = (P + R, B, MODEL.hidden_size)
        for layer in eng.module.decoder.layers:
            layer.forward = _fake_graphs(layer, shape)
        # which parameters' DDP hooks fire: the layers' must not (their grads are in main_grad)
        names = {p: n for n, p in eng.module.named_parameters()}
        for p in eng.module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda q: fired.append(names[q]))
    g = torch.Generator().manual_seed(0)
    ones = torch.ones(B, P, dtype=torch.long)
    batch = RolloutBatch(prompt_ids=torch.randint(1, 50, (B, P), generator=g), prompt_mask=ones,
                         response_ids=torch.randint(1, 50, (B, R), generator=g),
                         response_mask=torch.ones(B, R, dtype=torch.long),
                         group_ids=torch.arange(B) // 2, indices=torch.arange(B),
                         old_logprobs=torch.full((B, R), -3.9), advantages=torch.randn(B, 1, generator=g))
    m = eng.train_step(batch, actor_objective(AlgoConfig(), num_tokens=B * R, num_seqs=B),
                       micro_batch_size=B)
    return m, {n: p.detach().clone() for n, p in eng.module.named_parameters()}, fired


@pytest.mark.parametrize("lora_rank", [0, 4], ids=["full", "lora"])
def test_replay_path_matches_eager(ctx, lora_rank):
    """LoRA: the embedding is frozen, so the first layer's input needs no gradient; the replay
    node must still be recorded (its `anchor` input) or no backward runs and nothing trains."""
    m_e, w_e, _ = _step(ctx, fake=False, lora_rank=lora_rank)
    m_g, w_g, fired = _step(ctx, fake=True, lora_rank=lora_rank)
    assert not any(".layers." in n for n in fired)
    assert bool(fired) == (not lora_rank)  # LoRA: only adapters train, all inside the layers
    assert m_e["grad_norm"] > 0
    for k, v in m_e.items():
        assert m_g[k] == pytest.approx(v, rel=1e-6, abs=1e-9), k
    for n, w in w_e.items():
        torch.testing.assert_close(w_g[n], w, rtol=1e-6, atol=1e-7, msg=n)
