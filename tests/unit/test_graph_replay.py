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
from tests.ragged import ragged_batch

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


# --- packed micro-batches: the engine's side (shape, static documents, growth) --------------------
PACK_P = [5, 3, 4, 2, 5, 1, 4, 3]
PACK_R = [9, 2, 6, 1, 3, 7, 2, 5]
BUDGET = 32


def _ragged(short: bool = False) -> RolloutBatch:
    """Rows of varied lengths; `short`: 16 rows of 2-3 tokens (micro-batches of more rows, more
    documents than the first capture holds)."""
    if short:
        return ragged_batch([1, 2] * 8, [1] * 16, seed=1)
    return ragged_batch(PACK_P, PACK_R, seed=1)


def _packed_steps(ctx, fake: bool, monkeypatch, batches=None,
                  min_fill: float = ParallelConfig.train_graphs_min_fill, kernel: str = "varlen"):
    """Two updates (ragged rows, then one-token responses: more documents per micro-batch) as
    packed token-budget micro-batches; `fake`: the engine's packed-graph path with a stand-in
    capture whose "replay" runs the eager layer on flex documents rebuilt from the capture's
    static cu_seqlens (what the varlen kernel would read), counted for calls carrying that object;
    the eager layers' varlen calls (micro-batches that do not replay) run on flex the same way.
    `kernel`: the run's packed kernel; with fa4 the graphs still capture varlen, which runs beside
    it, and the micro-batches that do not replay run fa4 (here on flex too)."""
    from hybridflow import engine as E
    from hybridflow.models.attention import packed_documents
    from tests.dist.parity_util import fill_deterministic

    captures, replays = [], []

    def fake_graph_layers(model, *, micro_batch_size, seq_len, docs=None):
        assert docs is not None and micro_batch_size == 1
        captures.append((seq_len, docs.cu_seqlens.numel() - 1, docs.max_seqlen))
        for layer in model.decoder.layers:
            eager = layer.forward

            def forward(hidden_states, attention_mask=None, eager=eager, **kw):
                if attention_mask is docs:
                    assert hidden_states.shape[0] == seq_len
                    replays.append(1)
                if getattr(attention_mask, "kernel", None) in ("varlen", "fa4"):  # CUDA: on flex
                    m = attention_mask
                    lens = m.cu_seqlens.diff().long()
                    ids = torch.repeat_interleave(torch.arange(lens.numel()), lens)
                    attention_mask = packed_documents(ids, m.cu_seqlens, m.max_seqlen,
                                                      kernel="flex")
                return eager(hidden_states, attention_mask=attention_mask, **kw)

            layer.forward = forward

    eng = E.Engine(role="actor", model_cfg=MODEL, ctx=ctx,
                   parallel=ParallelConfig(train_graphs_min_fill=min_fill),
                   precision="fp32", optim=OptimConfig(lr=1e-3), total_updates=2)
    fill_deterministic(eng.module, num_layers=MODEL.num_layers)
    eng.optimizer.reload_model_params()
    if fake:
        monkeypatch.setattr(E, "graph_layers", fake_graph_layers)
        eng._want_graphs = eng._fit_packed = True
        eng.packed_kernel()
        eng._packed_kernel = kernel  # what a GPU picks; the stand-in replays on flex
        monkeypatch.setattr(E, "varlen_unsupported", lambda *a: None)  # as beside fa4 on sm_90
    out = []
    for batch in batches or (_ragged(), _ragged(short=True)):
        loss_fn = actor_objective(AlgoConfig(), num_tokens=int(batch.response_mask.sum()),
                                  num_seqs=batch.batch_size)
        m = eng.train_step(batch, loss_fn, micro_batch_size=2, max_tokens=BUDGET, pack=True)
        out.append((m, {n: p.detach().clone() for n, p in eng.module.named_parameters()},
                    eng._graph_shape))
    return out, captures, len(replays)


@pytest.mark.parametrize("kernel", ["varlen", "fa4"])
def test_packed_replay_path_matches_eager(ctx, monkeypatch, kernel):
    eager, _, _ = _packed_steps(ctx, False, monkeypatch)
    graphed, captures, replays = _packed_steps(ctx, True, monkeypatch, kernel=kernel)
    # captured at the budget, then again with more documents for the short rows
    assert len(captures) == 2 and captures[0][0] == captures[1][0] == BUDGET
    assert captures[1][1] > captures[0][1]
    assert graphed[0][2].length == BUDGET and graphed[1][2].documents == captures[1][1]
    # every packed micro-batch replays; the short rows' micro-batch of equal rows runs unpacked
    assert [m["graphed_micro_batch_frac"] for m, _, _ in graphed] == [1.0, 0.5]
    assert replays > 0 and replays % MODEL.num_layers == 0
    for (m_e, w_e, _), (m_g, w_g, _) in zip(eager, graphed):
        for k, v in m_e.items():
            assert m_g[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
        for n, w in w_e.items():
            torch.testing.assert_close(w_g[n], w, rtol=1e-5, atol=1e-6, msg=n)


def test_a_small_last_micro_batch_runs_eager(ctx, monkeypatch):
    """A packed micro-batch under parallel.train_graphs_min_fill of the budget (the pass's last:
    two rows, 6 of 32 tokens) is not padded to the captured shape: it runs the eager layers while
    the others replay (at 0 it replays too), and the update equals the eager one."""
    batch = [ragged_batch(PACK_P + [2, 1], PACK_R + [2, 2], seed=1)]
    eager, _, _ = _packed_steps(ctx, False, monkeypatch, batches=batch)
    graphed, captures, replays = _packed_steps(ctx, True, monkeypatch, batches=batch)
    assert 6 < ParallelConfig.train_graphs_min_fill * BUDGET and len(captures) == 1
    assert graphed[0][0]["graphed_micro_batch_frac"] == pytest.approx(2 / 3)
    assert replays == 2 * MODEL.num_layers  # two micro-batches' forward through the layers
    (m_e, w_e, _), (m_g, w_g, _) = eager[0], graphed[0]
    for k, v in m_e.items():
        assert m_g[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    for n, w in w_e.items():  # (Adam scales the few near-zero gradients' rounding up to ~1e-5)
        torch.testing.assert_close(w_g[n], w, rtol=1e-5, atol=5e-5, msg=n)
    padded, _, _ = _packed_steps(ctx, True, monkeypatch, batches=batch, min_fill=0.0)
    assert padded[0][0]["graphed_micro_batch_frac"] == 1.0
