"""The multi-turn decode step on the single-turn step's fused layers (decode_kernels=triton):
the RoPE + K/V write + attention kernel with a cache column per row (kernels/rope_attention.py and
its twins), decoder.decode_step with per-row columns and marks, the step's scratch column for rows
that are not fed, and whole multi-turn rollouts against the torch path. The Triton parts run
through Triton's CPU interpreter in a fresh process (tests/unit/multi_turn_fused_check.py); the
PyTorch twins also run here directly."""

import pytest
import torch

from hybridflow.kernels import rope_attention as fused
from hybridflow.rollout import decoder
from hybridflow.rollout.kv_cache import KVCache
from hybridflow.rollout.options import DecodeOptions
from hybridflow.rollout.sampling import sample
from tests.unit.test_multi_turn import make_gen
from tests.unit.triton_interp import run_check


def _check(section: str, tmp) -> dict:
    return run_check("multi_turn_fused_check.py", section, tmp, timeout=900)


@pytest.fixture(scope="module")
def kernels_checked(tmp_path_factory):
    return _check("kernels", tmp_path_factory.mktemp("mt_fused"))


def test_rope_attention_with_a_column_per_row(kernels_checked):
    """cur (B,) all equal: the (1,) path's output, cache and key_valid, bit for bit (kernel and
    twin); distinct columns: the kernel equals the twin, the twin each row alone through the (1,)
    twin; each row's K/V lands in its own column only; a (B,) mark_valid marks only its rows.
    With `finished` (own columns): each row reads only cur[b] - positions[b] .. cur[b] - 1 (every
    other column NaN poisons nothing), bit-equal to the kernel over those columns; a finished row
    reads none."""
    for case in kernels_checked["rope_attention"]:
        assert case["own_rows_bit_equal"] and case["own_finished_finite"], case
        assert case["same_as_shared"] == {"triton": True, "torch": True}, case
        assert case["attn_err"] < 1e-5 and case["cache_err"] < 1e-5, case
        assert case["twin_vs_loop"] < 1e-6, case
        assert case["only_own_columns"] and case["marked_rows_only"], case


def test_decode_step_fused_with_a_column_per_row(kernels_checked):
    """decoder.decode_step, cur (B,) and `mark` (some rows not marked): the fused layers give the
    torch path's logits and K/V; both mark exactly the marked rows' columns."""
    c = kernels_checked["decoder"]
    assert c["logits_err"] < 1e-5 * max(1.0, c["logits_scale"]), c
    assert c["k_err"] < 1e-5 and c["v_err"] < 1e-5, c
    assert c["valid_torch"] and c["valid_triton"], c


def test_a_non_ready_rows_scratch_write_never_becomes_valid(kernels_checked):
    """multi_turn_step.decode_step on the fused layers, whole cache and a window: rows not fed
    write into the window's last column, which stays invalid (two steps); fed rows write at and
    mark their own column; only they advance."""
    for kv_len, c in kernels_checked["scratch"].items():
        assert all(c.values()), (kv_len, c)


@pytest.mark.slow
def test_multi_turn_rollout_triton_equals_torch(tmp_path):
    """generate_multi_turn, decode_kernels triton vs torch (forced tool calls then greedy; KV
    windows, emulated CUDA graphs, with and without compaction; and the triton run feeding tool
    results through the decode step, also on an fp8 KV cache): the same tokens and tool masks,
    log-probs to rounding, the same valid columns and K/V there."""
    out = _check("rollout", tmp_path)
    for name, c in out.items():
        assert c["tokens_equal"] and c["tool_mask_equal"], (name, c)
        # (lookahead feeds a stopped row once more: one more valid column it never reads)
        assert c["valid_equal"] or name == "fed_ahead", (name, c)
        assert c["tool_tokens"] > 0 and c["tokens"] > 100, (name, c)
        assert c["logprob_err"] < 1e-4, (name, c)
        if "fed" not in name:  # (fed: a longer budget, a decode step per result token)
            assert c["steps"][0] == c["steps"][1] and c["kv_columns_mean"][0] < 128, (name, c)
    assert out["windows"]["kv_err"] < 1e-4, out
    assert out["fp8_fed"]["fp8"] and not out["fed"]["fp8"], out
    for name in ("fed", "fed_ahead", "fp8_fed"):  # fed_ahead: launched one step ahead (lookahead)
        assert out[name]["kv_err"] < 1e-4, out
        assert out[name]["append_calls"][1] == 0 < out[name]["append_calls"][0], out
        assert out[name]["fed_tool_tokens"] > 0, out
    assert out["compaction"]["compactions"][0] == out["compaction"]["compactions"][1] >= 1, out


@pytest.mark.slow
def test_multi_turn_rollout_triton_at_tp2(tmp_path):
    """TP_g = 2 (2 gloo ranks, one query group each): the fused step's tokens, tool masks and
    log-probs are the torch step's on both ranks."""
    ranks = _check("tp2", tmp_path)
    assert len(ranks) == 2
    for c in ranks:
        assert c["tokens_equal"] and c["tool_mask_equal"], c
        assert c["tool_tokens"] > 0 and c["tokens"] > 100 and c["logprob_err"] < 1e-4, c


def test_twin_with_a_column_per_row_equals_a_loop_of_rows():
    """The PyTorch twin of rope_attention (no interpreter): distinct columns per row, some rows
    marked: each row as the (1,) twin computes it alone, its K/V at its own column only."""
    g = torch.Generator().manual_seed(0)
    B, G, hpg, hd, T = 4, 2, 3, 16, 40
    qkv = torch.randn(B, G, hpg + 2, hd, generator=g)
    cos, sin = torch.randn(B, hd, generator=g), torch.randn(B, hd, generator=g)
    cache = torch.randn(2, B, G, T, hd, generator=g)
    valid = torch.rand(B, T, generator=g) < 0.5
    cur = torch.tensor([3, 39, 17, 0])
    valid[torch.arange(B), cur] = False
    mark = torch.tensor([True, False, True, False])
    kc, kv = cache.clone(), valid.clone()
    a = fused.rope_attention(qkv, cos, sin, kc[0], kc[1], cur, kv, hpg=hpg, mark_valid=mark,
                             impl="torch")
    for b in range(B):
        one = cache[:, b:b + 1].clone()
        vb = valid[b:b + 1].clone()
        ab = fused.rope_attention(qkv[b:b + 1], cos[b:b + 1], sin[b:b + 1], one[0], one[1],
                                  cur[b:b + 1], vb, hpg=hpg, mark_valid=bool(mark[b]),
                                  impl="torch")
        torch.testing.assert_close(a[b:b + 1], ab, rtol=0, atol=1e-6)
        assert torch.equal(kc[:, b], one[:, 0]) and torch.equal(kv[b], vb[0])
    changed = (kc != cache).any(-1).any(0).any(1)  # (B, T)
    assert torch.equal(changed.nonzero()[:, 1], cur)
    assert torch.equal(kv[:, cur].diagonal(), mark)


def test_decode_step_torch_with_a_column_per_row_equals_per_row_calls():
    """decoder.decode_step (torch path), cur (B,) with `mark`: each row's logits and cache as a
    one-row call at its own shared column computes them; unmarked rows keep their entry."""
    gen = make_gen()
    d = gen.w.dims
    B, T = 3, 48
    cos, sin = decoder.rope_tables(gen.w.inv_freq, T, dtype=torch.float32, device="cpu")
    new_cache = lambda rows: KVCache(num_layers=d.num_layers, rows=rows,  # noqa: E731
                                     groups=d.groups, length=T, head_dim=d.head_dim,
                                     dtype=torch.float32, device="cpu")
    cache = new_cache(B)
    torch.manual_seed(1)
    cache.k.normal_()
    cache.v.normal_()
    tokens, cur = torch.tensor([7, 100, 3]), torch.tensor([5, 30, 47])
    positions = cur - torch.tensor([0, 4, 2])  # rows with left padding sit behind their column
    valid = torch.arange(T)[None] < cur[:, None]
    mark = torch.tensor([1, 0, 1])
    kv = valid.clone()
    k0, v0 = cache.k.clone(), cache.v.clone()
    lg = decoder.decode_step(gen.w, tokens, positions, cur, kv, cache=cache, cos_tab=cos,
                             sin_tab=sin, opts=DecodeOptions(kernels="torch"), mark=mark)
    for b in range(B):
        one = new_cache(1)
        one.k.copy_(k0[:, b:b + 1])
        one.v.copy_(v0[:, b:b + 1])
        vb = valid[b:b + 1].clone()
        lb = decoder.decode_step(gen.w, tokens[b:b + 1], positions[b:b + 1], cur[b:b + 1], vb,
                                 cache=one, cos_tab=cos, sin_tab=sin,
                                 opts=DecodeOptions(kernels="torch"))
        torch.testing.assert_close(lg[b:b + 1], lb, rtol=1e-5, atol=1e-5)
        # K/V: the QKV GEMM over 3 rows against 1 (BLAS blocks by batch size: ~1.5e-6 apart on
        # some CPUs)
        torch.testing.assert_close(cache.k[:, b:b + 1], one.k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache.v[:, b:b + 1], one.v, rtol=1e-5, atol=1e-5)
        assert bool(kv[b, cur[b]]) == bool(mark[b]) and torch.equal(kv[b, :cur[b]], vb[0, :cur[b]])


def test_sample_replace_emits_the_given_tokens_and_their_logprobs():
    """sample(replace=(where, tokens)): those rows emit the given token with its log-prob under
    log_softmax(logits / T); the other rows draw as without it (the same stream)."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    where, given = torch.tensor([True, False, True, False]), torch.tensor([9, 0, 41, 0])
    a, la = sample(logits, temperature=0.7, generator=torch.Generator().manual_seed(3),
                   need_logprobs=True, replace=(where, given))
    b, lb = sample(logits, temperature=0.7, generator=torch.Generator().manual_seed(3),
                   need_logprobs=True)
    assert torch.equal(a[~where], b[~where]) and torch.equal(a[where], given[where])
    ref = torch.log_softmax(logits / 0.7, -1).gather(1, a[:, None])[:, 0]
    torch.testing.assert_close(la, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(la[~where], lb[~where])
