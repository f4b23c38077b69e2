"""kernels/sample.sample_rows compiled on a GPU (rollout.kernel_options.fused_sampler): log-probs
against log_softmax and the PyTorch twin at Qwen's 151,936-id vocabulary in bf16, tokens equal to
the twin's (the same uniforms; fp32 rounding of the kernel's chunk sums and the twin's one running
sum may put a draw on the other side of a boundary), the draws' distribution by chi-square tests
(8 known probabilities; and the vocabulary's 19 chunks, each with its softmax mass), draws that
differ on every CUDA-graph replay and repeat after re-seeding, programmatic dependent launch
changing no bit, and the generator under CUDA graphs with the option: reproducible under its
seed, log-probs those of the torch path's teacher forcing.
The speed is measured by benchmarks/bench_sampler.py, not here."""

import pytest
import torch

from hybridflow.config import ModelConfig, RolloutConfig
from hybridflow.kernels import layer_ops as kern
from hybridflow.kernels import sample as ks
from hybridflow.rollout import Generator
from hybridflow.rollout.options import DecodeOptions

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
if not kern.HAVE_TRITON:
    pytest.skip("needs triton", allow_module_level=True)

V = 151936
P8 = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02])


def _logits(B, dtype=torch.bfloat16, seed=0, scale=4.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(B, V, generator=g, device="cuda") * scale).to(dtype)


def _chi2(tokens, probs):
    counts = torch.bincount(tokens, minlength=len(probs)).double().cpu()
    expected = probs.double().cpu() * tokens.numel()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B", [1, 64, 512])
def test_kernel_matches_log_softmax_and_twin(B, dtype):
    x = _logits(B, dtype)
    x[:, 1000:9000] = float("-inf")  # masked ids, most of chunk 0
    state, twin_state = ks.new_rng_state(3, "cuda"), ks.new_rng_state(3, "cuda")
    tok, lp = ks.sample_rows(x, 1 / 0.8, state, impl="triton")
    ttok, tlp = ks.sample_rows(x, 1 / 0.8, twin_state, impl="torch")
    ref = torch.log_softmax(x.float() / 0.8, -1).gather(1, tok[:, None]).squeeze(1)
    assert torch.allclose(lp, ref, atol=2e-5, rtol=0), (lp - ref).abs().max()
    assert ((tok < 1000) | (tok >= 9000)).all()
    # the same uniforms; the two sums' fp32 roundings may put u across a boundary (rare)
    assert int((tok != ttok).sum()) <= max(1, B // 100), (tok != ttok).sum()
    same = tok == ttok
    assert torch.allclose(lp[same], tlp[same], atol=2e-5, rtol=0)
    assert state.tolist() == twin_state.tolist() == [3, 1]


def test_replace_and_low_temperature():
    x = _logits(64)
    where = torch.arange(64, device="cuda") % 3 == 0
    given = torch.arange(64, device="cuda") * 1000
    tok, lp = ks.sample_rows(x, 1.0, ks.new_rng_state(1, "cuda"), replace=(where, given))
    assert torch.equal(tok[where], given[where])
    ref = torch.log_softmax(x.float(), -1).gather(1, tok[:, None]).squeeze(1)
    assert torch.allclose(lp, ref, atol=2e-5, rtol=0)
    # near-greedy on fp32 logits (bf16 ones tie at the top of 151,936 draws: argmax takes the
    # first of a tie, the inverse CDF any of them); rows whose top two are 1e-3 apart or more
    x32 = _logits(64, torch.float32)
    cold, _ = ks.sample_rows(x32, 1e4, ks.new_rng_state(1, "cuda"))
    top = x32.topk(2, -1).values
    clear = top[:, 0] - top[:, 1] >= 1e-3
    assert int(clear.sum()) >= 56
    assert torch.equal(cold[clear], x32.argmax(-1)[clear])


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_draws_chi_square_small_vocab(temperature):
    """4096 rows x 8 calls over 8 known probabilities (the kernel's own draws)."""
    z = P8.log().cuda()[None].expand(4096, 8).contiguous()
    state = ks.new_rng_state(2024, "cuda")
    tokens = torch.cat([ks.sample_rows(z, 1 / temperature, state, need_logprobs=False)[0]
                        for _ in range(8)])
    assert _chi2(tokens, torch.softmax(P8.log() / temperature, 0)) < 24.32  # 7 dof, p = 0.001
    if temperature != 1.0:
        assert _chi2(tokens, P8) > 250


def test_draws_chi_square_over_the_chunks():
    """The full vocabulary (19 chunks of 8192 ids): how often each chunk holds the draw, against
    its softmax mass; 512 rows x 40 calls. The logits favour some chunks so no chunk's mass is
    tiny or dominant."""
    g = torch.Generator(device="cuda").manual_seed(7)
    bias = torch.linspace(-1.0, 1.0, 19, device="cuda").repeat_interleave(8192)[:V]
    row = (torch.randn(V, generator=g, device="cuda") + bias).to(torch.bfloat16)
    x = row[None].expand(512, V).contiguous()
    mass = torch.softmax(row.float(), 0)
    chunk_of = torch.arange(V, device="cuda") // 8192
    chunk_mass = torch.zeros(19, device="cuda").index_add_(0, chunk_of, mass)
    state = ks.new_rng_state(5, "cuda")
    tokens = torch.cat([ks.sample_rows(x, 1.0, state, need_logprobs=False)[0]
                        for _ in range(40)])
    assert _chi2(tokens // 8192, chunk_mass) < 42.31  # 18 dof, p = 0.001


def test_graph_replays_draw_fresh_and_repeat_after_reseed():
    x = _logits(256)
    state = ks.new_rng_state(11, "cuda")
    out = torch.empty(256, dtype=torch.long, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out.copy_(ks.sample_rows(x, 1.0, state)[0])  # compile + warm up
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(ks.sample_rows(x, 1.0, state, pdl=True)[0])

    def replays(n):
        ks.seed_rng_state_(state, 11)
        got = []
        for _ in range(n):
            graph.replay()
            got.append(out.clone())
        return got

    first = replays(4)
    assert int(state[1]) == 4
    for a, b in zip(first, first[1:]):
        assert (a != b).float().mean().item() > 0.9
    for i, replayed in enumerate(first):  # replay i drew at counter i, as an eager call does
        at = ks.new_rng_state(11, "cuda")
        at[1] = i
        assert torch.equal(replayed, ks.sample_rows(x, 1.0, at)[0])
    assert all(torch.equal(a, b) for a, b in zip(first, replays(4)))


def test_pdl_changes_no_bit():
    x = _logits(128)
    a = ks.sample_rows(x, 1.3, ks.new_rng_state(9, "cuda"), pdl=False)
    b = ks.sample_rows(x, 1.3, ks.new_rng_state(9, "cuda"), pdl=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_generator_with_the_fused_sampler_under_graphs():
    """Graphed decode steps with fused_sampler (bf16, Triton decode layers): a second call with the
    seed repeats tokens and log-probs, another seed differs; each log-prob equals the torch
    path's teacher-forced one over the same tokens (forced through sample(replace=) is not
    available single-turn, so: log_softmax of a full forward) within bf16 rounding."""
    from hybridflow.rollout import decoder
    from tests.unit.test_compaction import random_prompts
    from tests.unit.test_rollout import random_params

    cfg_m = ModelConfig(num_layers=2, hidden_size=128, ffn_hidden_size=192, num_attention_heads=4,
                        num_query_groups=2, vocab_size=37, add_qkv_bias=True)
    gen = Generator(model_cfg=cfg_m, params=random_params(cfg_m), tp_group=None,
                    device=torch.device("cuda"), dtype=torch.float32, true_vocab_size=37)
    prompts = random_prompts(24, vocab=37)
    cfg = RolloutConfig(max_new_tokens=40, temperature=1.0, max_batch_size=16,
                        return_logprobs=True, compact_finished_rows=True)
    opts = DecodeOptions.from_config(cfg).replace(kernels="triton", fused_sampler=True,
                                                  min_graphed_bucket=1, check_every=2)
    a = gen.generate(prompts, cfg=cfg, eos_id=3, pad_id=0, seed=1, options=opts)
    b = gen.generate(prompts, cfg=cfg, eos_id=3, pad_id=0, seed=1, options=opts)
    c = gen.generate(prompts, cfg=cfg, eos_id=3, pad_id=0, seed=2, options=opts)
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.rollout_logprobs, b.rollout_logprobs)
    assert (a.response_ids != c.response_ids).any()
    cos, sin = decoder.rope_tables(gen.w.inv_freq, 256, dtype=torch.float32, device="cuda")
    for r in range(0, len(prompts), 5):
        n = int(a.response_mask[r].sum())
        seq = torch.tensor([list(prompts[r]) + a.response_ids[r, :n].tolist()], device="cuda")
        lg = decoder.forward(gen.w, seq, torch.arange(seq.shape[1], device="cuda")[None],
                             torch.ones_like(seq).bool(), cos_tab=cos, sin_tab=sin)[0]
        ref = torch.log_softmax(lg[len(prompts[r]) - 1:-1, :37].float(), -1)
        ref = ref.gather(1, a.response_ids[r, :n, None]).squeeze(1)
        assert torch.allclose(ref, a.rollout_logprobs[r, :n], atol=1e-3), r
