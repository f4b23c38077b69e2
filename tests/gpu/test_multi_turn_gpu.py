"""Multi-turn rollouts on a GPU: the decode step as CUDA-graph replays (one per chunk size and KV
window) gives exactly the eager step's tokens and log-probs; in fp32 the tokens, log-probs and K/V
of the eager loop it replaced (tests/unit/multi_turn_reference.py); in bf16 the rows resumed after
tool calls give the log-probs of a from-scratch prefill of the whole conversation, within bf16
tolerance. With rollout.decode_kernels=triton (the single-turn step's fused layers, a model of
head_dim 16): graphed equals eager exactly, and the forced rollouts' log-probs are the torch
step's and a full prefill's within bf16 tolerance."""

import dataclasses

import pytest
import torch

from hybridflow.config import RolloutConfig
from hybridflow.rollout import Generator, decoder
from hybridflow.rollout.multi_turn import generate_multi_turn
from hybridflow.rollout.options import DecodeOptions
from tests.unit.multi_turn_reference import reference_multi_turn
from tests.unit.test_multi_turn import CFG, V, byte_tokenizer, call, params, tool_config
from tests.unit.test_multi_turn_step import runner_for, states

pytestmark = pytest.mark.gpu
CFG16 = dataclasses.replace(CFG, kv_channels=16)  # the Triton kernels' head_dim (>= 16)

QUESTIONS = ("What is 6*7?", "Two steps: 2+3 then 5*5", "no tools here", "x", "longer one here")


def _gen(dtype, cfg=CFG):
    return Generator(model_cfg=cfg, params={k: v.cuda() for k, v in params(cfg).items()},
                     tp_group=None, device="cuda", dtype=dtype, true_vocab_size=V)


def _setup(tmp_path):
    tok = byte_tokenizer(tmp_path)
    end = tok.encode("<|im_end|>")
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
               for q in QUESTIONS]
    forced = [tok.encode(call("6*7")) + tok.encode("It is 42") + end,
              tok.encode(call("2+3")) + tok.encode(call("5*5")) + tok.encode("25") + end,
              tok.encode("nothing") + end,
              tok.encode(call("1+1")),  # then free sampling
              []]
    return tok, prompts, forced, tool_config(tmp_path, "calculator")


def _run(fn, gen, tok, prompts, forced, path, kernels="torch", append="prefill",
         lookahead=False, kv_cache_dtype="auto", **opts):
    cfg = RolloutConfig(n=1, max_new_tokens=320, temperature=1.0, return_logprobs=True,
                        max_batch_size=3,  # chunks of 3 and 2 rows
                        kv_cache_dtype=kv_cache_dtype)
    # results appended at the poll they come in, as the eager reference loop does (or fed through
    # the decode step: rollout.multi_turn.append=decode)
    runner = runner_for(tok, "hermes", path, append_wait_steps=0, append=append,
                        lookahead=lookahead)
    return fn(gen, prompts, cfg=cfg, runner=runner, eos_id=tok.eos_id,
              pad_id=tok.pad_id, seed=7, forced=forced,
              options=DecodeOptions(kernels=kernels, prefill_tokens=64, **opts))


@pytest.mark.parametrize("kv_window, compact, append, lookahead", [
    (0, False, "prefill", False), (64, False, "prefill", False), (64, True, "prefill", False),
    (64, True, "decode", False), (64, True, "decode", True)],
    ids=["whole_cache", "windows", "windows_compaction", "fed", "fed_lookahead"])
def test_graphed_step_equals_eager_step(tmp_path, kv_window, compact, append, lookahead):
    """Compaction: graphs of every smaller state (min_graphed_bucket=1: these chunks are tiny).
    Lookahead: each replay is launched before the previous step's tokens are read, its control
    rows and tokens through the pinned buffers (multi_turn_step.StepCopies) in turn."""
    tok, prompts, forced, path = _setup(tmp_path)
    gen = _gen(torch.bfloat16)
    more = dict(compact_finished_rows=True, min_graphed_bucket=1) if compact else {}
    more.update(append=append, lookahead=lookahead)
    graphed, m = _run(generate_multi_turn, gen, tok, prompts, forced, path, kv_window=kv_window,
                      **more)
    assert m["tool_calls/mean"] > 0 and (m["multi_turn/compactions"] > 0) == compact
    assert all(type(fn).__name__ == "GraphedStep" for k, (_, fns) in gen._steps.items()
               if k[0] == "multi_turn" for fn in fns.values())
    eager, _ = _run(generate_multi_turn, gen, tok, prompts, forced, path, kv_window=kv_window,
                    cuda_graphs=False, **more)
    assert torch.equal(graphed.response_ids, eager.response_ids)
    assert torch.equal(graphed.tool_mask, eager.tool_mask)
    assert torch.equal(graphed.rollout_logprobs, eager.rollout_logprobs)


def test_graphed_loop_equals_the_eager_loop_fp32(tmp_path):
    tok, prompts, forced, path = _setup(tmp_path)
    outs = []
    for fn in (reference_multi_turn, generate_multi_turn):
        gen = _gen(torch.float32)
        gen._ensure_cache(rows=3, length=384)  # one cache length for both (see the CPU test)
        outs.append((_run(fn, gen, tok, prompts, forced, path, kv_window=64), gen))
    ((ref, _, ref_valid), ref_gen), ((new, _), new_gen) = outs
    assert torch.equal(new.response_ids, ref.response_ids)
    assert torch.equal(new.tool_mask, ref.tool_mask)
    torch.testing.assert_close(new.rollout_logprobs, ref.rollout_logprobs, rtol=1e-4, atol=1e-4)
    kv_ref, st = ref_valid[-1], states(new_gen)[2]
    assert (st.key_valid & kv_ref).eq(kv_ref).all()
    for b in range(2):
        cols = kv_ref[b].nonzero()[:, 0]
        torch.testing.assert_close(new_gen._cache.k[:, b, :, cols], ref_gen._cache.k[:, b, :, cols],
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphed", "eager"])
def test_resumed_rows_match_a_full_prefill_bf16(tmp_path, cuda_graphs):
    tok, prompts, forced, path = _setup(tmp_path)
    gen = _gen(torch.bfloat16)
    batch, m = _run(generate_multi_turn, gen, tok, prompts[:3], forced[:3], path,
                    cuda_graphs=cuda_graphs, kv_window=64)
    assert m["tool_calls/mean"] == 1.0
    cos, sin = decoder.rope_tables(gen.w.inv_freq, 512, dtype=torch.bfloat16, device="cuda")
    for b in range(3):
        n = int(batch.response_mask[b].sum())
        resp = batch.response_ids[b, :n].tolist()
        seq = torch.tensor([prompts[b] + resp], device="cuda")
        lg = decoder.forward(gen.w, seq, torch.arange(seq.shape[1], device="cuda")[None],
                             torch.ones_like(seq).bool(), cos_tab=cos, sin_tab=sin)[0]
        ref = torch.log_softmax(lg[len(prompts[b]) - 1:-1], -1).gather(
            1, torch.tensor(resp, device="cuda")[:, None])[:, 0]
        model = ~batch.tool_mask[b, :n].bool().cuda()
        got = batch.rollout_logprobs[b, :n].cuda()
        # bf16 weights and activations: the cached and the re-prefilled paths round differently
        # (other GEMM shapes and attention kernels), by a few bf16 ulps of the logits
        torch.testing.assert_close(got[model], ref[model].float(), rtol=0.02, atol=0.1)
        assert (got[model] - ref[model].float()).abs().mean() < 0.02


def _prefill_logprobs(gen, prompt, resp):
    """log_softmax of a from-scratch prefill of prompt + resp at resp's tokens (fp32)."""
    cos, sin = decoder.rope_tables(gen.w.inv_freq, 512, dtype=gen.dtype, device="cuda")
    seq = torch.tensor([prompt + resp], device="cuda")
    lg = decoder.forward(gen.w, seq, torch.arange(seq.shape[1], device="cuda")[None],
                         torch.ones_like(seq).bool(), cos_tab=cos, sin_tab=sin)[0]
    return torch.log_softmax(lg[len(prompt) - 1:-1], -1).gather(
        1, torch.tensor(resp, device="cuda")[:, None])[:, 0].float()


def test_fused_step_bf16(tmp_path):
    """decode_kernels=triton, bf16, forced rows (every token given, so the runs compare token for
    token), KV windows and compaction: graphed == eager bit for bit; the log-probs of the model's
    tokens are the torch step's and a full prefill's within bf16 rounding; with the tool results
    fed through the graphed step (append=decode) the same rollout, log-probs within bf16 rounding;
    with every window column read (own_columns_only=false) the same bits."""
    tok, prompts, forced, path = _setup(tmp_path)
    end = tok.encode("<|im_end|>")
    forced = forced[:3] + [forced[3] + tok.encode("two") + end, tok.encode("plain") + end]
    more = dict(kv_window=64, compact_finished_rows=True, min_graphed_bucket=1)
    gen = _gen(torch.bfloat16, CFG16)
    runs = {name: _run(generate_multi_turn, gen, tok, prompts, forced, path, kernels=k,
                       cuda_graphs=g, **more)
            for name, k, g in (("fused", "triton", True), ("fused_eager", "triton", False),
                               ("torch", "torch", True))}
    # every column of the window read (rollout.kernel_options.own_columns_only=false): the fed
    # rows' outputs are bit for bit those of their own columns
    runs["all_columns"] = _run(generate_multi_turn, gen, tok, prompts, forced, path,
                               kernels="triton", cuda_graphs=True, own_columns_only=False, **more)
    # the results fed through the graphed fused step instead of appended by extend
    runs["fed"] = _run(generate_multi_turn, gen, tok, prompts, forced, path, kernels="triton",
                       cuda_graphs=True, append="decode", **more)
    (fused, m), (eager, _), (ref, _) = runs["fused"], runs["fused_eager"], runs["torch"]
    fed, m_fed = runs["fed"]
    assert m_fed["multi_turn/append_calls"] == 0 < m_fed["multi_turn/fed_tool_tokens"]
    # each step launched before the previous one's tokens are read (async copies to the host)
    ahead, m_ahead = _run(generate_multi_turn, gen, tok, prompts, forced, path, kernels="triton",
                          cuda_graphs=True, append="decode", lookahead=True, **more)
    assert m_ahead["multi_turn/lookahead_dropped"] > 0
    assert torch.equal(ahead.response_ids, fed.response_ids)
    assert torch.equal(ahead.tool_mask, fed.tool_mask)
    assert torch.equal(ahead.rollout_logprobs, fed.rollout_logprobs)
    assert m["tool_calls/mean"] > 0 and m["multi_turn/compactions"] > 0
    assert torch.equal(fused.response_ids, eager.response_ids)
    assert torch.equal(fused.rollout_logprobs, eager.rollout_logprobs)
    assert torch.equal(fused.response_ids, runs["all_columns"][0].response_ids)
    assert torch.equal(fused.rollout_logprobs, runs["all_columns"][0].rollout_logprobs)
    for a, b in ((fed, fused), (fused, ref)):  # the same rollout, model log-probs to bf16 rounding
        assert torch.equal(a.response_ids, b.response_ids)
        assert torch.equal(a.tool_mask, b.tool_mask)
        model = (a.response_mask * (1 - a.tool_mask)).bool()
        diff = (a.rollout_logprobs - b.rollout_logprobs)[model].abs()
        assert diff.max() < 0.1 and diff.mean() < 0.02, (diff.max(), diff.mean())
    model = (fused.response_mask * (1 - fused.tool_mask)).bool()
    for b in range(len(prompts)):
        n = int(fused.response_mask[b].sum())
        want = _prefill_logprobs(gen, prompts[b], fused.response_ids[b, :n].tolist())
        got = fused.rollout_logprobs[b, :n].cuda()
        keep = model[b, :n].cuda()
        torch.testing.assert_close(got[keep], want[keep], rtol=0.02, atol=0.1)


def test_fp8_cache_fused_step_bf16(tmp_path):
    """rollout.kv_cache_dtype=fp8, bf16, forced rows (every token given), KV windows and
    compaction: the fused step graphed == eager bit for bit; the torch step (results appended by
    extend) and the fused step with the results fed through it give the same rollout, the model's
    log-probs within bf16 rounding of the fused step's (the same rounded cache, summed in another
    order)."""
    tok, prompts, forced, path = _setup(tmp_path)
    end = tok.encode("<|im_end|>")
    forced = forced[:3] + [forced[3] + tok.encode("two") + end, tok.encode("plain") + end]
    more = dict(kv_window=64, compact_finished_rows=True, min_graphed_bucket=1,
                kv_cache_dtype="fp8")
    gen = _gen(torch.bfloat16, CFG16)
    runs = {name: _run(generate_multi_turn, gen, tok, prompts, forced, path, kernels=k,
                       cuda_graphs=g, append=append, **more)[0]
            for name, k, g, append in (("fused", "triton", True, "prefill"),
                                       ("fused_eager", "triton", False, "prefill"),
                                       ("torch", "torch", True, "prefill"),
                                       ("fed", "triton", True, "decode"))}
    assert gen._cache.fp8
    fused = runs["fused"]
    assert torch.equal(fused.response_ids, runs["fused_eager"].response_ids)
    assert torch.equal(fused.rollout_logprobs, runs["fused_eager"].rollout_logprobs)
    for name in ("torch", "fed"):
        other = runs[name]
        assert torch.equal(other.response_ids, fused.response_ids)
        assert torch.equal(other.tool_mask, fused.tool_mask)
        model = (fused.response_mask * (1 - fused.tool_mask)).bool()
        diff = (other.rollout_logprobs - fused.rollout_logprobs)[model].abs()
        assert diff.max() < 0.1 and diff.mean() < 0.02, (name, diff.max(), diff.mean())
