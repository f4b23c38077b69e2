"""Multi-turn generation at TP_g=2 equals TP_g=1 (gloo, CPU): only the group's rank 0 runs the tools
and broadcasts which results are in and what they are at each poll, so both ranks append the same
tokens at the same steps (polling each its own thread pool would let the ranks see a result at
different steps and run different collectives); results held for a joint append
(rollout.multi_turn.append_wait_steps) are held alike on both ranks, and results fed through the
decode step (rollout.multi_turn.append=decode) are fed alike, also one step ahead
(rollout.multi_turn.lookahead)."""

import torch

from tests.dist.launcher import run_ranks


def _ranks_fn(tmp):
    import pathlib

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from hybridflow.parallel import groups, param_rules
    from hybridflow.rollout import Generator, multi_turn
    from tests.unit.test_multi_turn import CFG, V, byte_tokenizer, call, params, run, tool_config
    from tests.unit.test_multi_turn_append import PolledRunner, polled_wait

    tmp = pathlib.Path(tmp) / f"rank{dist.get_rank()}"
    tmp.mkdir(parents=True)
    tok = byte_tokenizer(tmp)
    full = params(CFG)
    end = tok.encode("<|im_end|>")
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
               for q in ("6*7?", "Two: 2+3 then 5*5", "plain", "8-1, later")]
    # forced calls, then greedy decoding to the end of the budget or EOS: a sampled row's draws
    # depend on the decode step at which its tool result landed (the thread pool's timing), so
    # two runs compare token for token only when greedy
    forced = [tok.encode(call("6*7")), tok.encode(call("2+3")) + tok.encode(call("5*5")),
              tok.encode("no call") + end, tok.encode("abcd" + call("8-1"))]
    cfg_path = tool_config(tmp, "calculator")
    ref = Generator(model_cfg=CFG, params=full, tp_group=None, device="cpu", dtype=torch.float32,
                    true_vocab_size=V)
    # results that come in a fixed number of polls after their calls (rank 0's tools): appended
    # at once at TP_g=1, held up to 8 steps at TP_g=2 (the ranks decide alike on the broadcasts)
    multi_turn.wait = polled_wait
    hold = dict(runner_cls=PolledRunner, append_batch_rows=64)
    (tp1, m1), _ = run(ref, tok, "hermes", cfg_path, prompts, forced, max_new=200,
                       temperature=0.0, append_wait_steps=0, **hold)
    groups.init_model_parallel(tp=2, pp=1, seed=0)
    group = ps.get_tensor_model_parallel_group()
    shards = {n: param_rules.shard_tensor(n, t, tp_rank=dist.get_rank(group), tp_size=2)
              .contiguous() for n, t in full.items()}
    gen2 = Generator(model_cfg=CFG, params=shards, tp_group=group, device="cpu",
                     dtype=torch.float32, true_vocab_size=V)
    (tp2, m), _ = run(gen2, tok, "hermes", cfg_path, prompts, forced, max_new=200,
                     temperature=0.0, append_wait_steps=8, **hold)
    # the results fed through the decode step instead (rollout.multi_turn.append=decode)
    (fed, m_fed), _ = run(gen2, tok, "hermes", cfg_path, prompts, forced, max_new=200,
                          temperature=0.0, append="decode", **hold)
    # and each step launched before the previous one's tokens are read (lookahead)
    (ahead, m_ahead), _ = run(gen2, tok, "hermes", cfg_path, prompts, forced, max_new=200,
                              temperature=0.0, append="decode", lookahead=True, **hold)
    return {"tp1": tp1, "tp2": tp2, "metrics": m, "metrics_tp1": m1, "fed": fed,
            "metrics_fed": m_fed, "ahead": ahead, "metrics_ahead": m_ahead}


def test_multi_turn_tp2_equals_tp1(tmp_path):
    r0, r1 = run_ranks(_ranks_fn, 2, str(tmp_path))
    for r in (r0, r1):
        tp1 = r["tp1"]
        for tp2 in (r["tp2"], r["fed"], r["ahead"]):
            assert torch.equal(tp1.response_ids, tp2.response_ids)
            assert torch.equal(tp1.tool_mask, tp2.tool_mask)
            assert torch.allclose(tp1.rollout_logprobs, tp2.rollout_logprobs, atol=1e-4, rtol=0)
        assert r["metrics_fed"]["multi_turn/append_calls"] == 0
        assert r["metrics_fed"]["multi_turn/fed_tool_tokens"] > 0
        assert r["metrics_ahead"]["multi_turn/lookahead_dropped"] > 0
    assert r0["metrics"]["tool_calls/mean"] == r1["metrics"]["tool_calls/mean"] >= 1.0
    calls = r0["metrics"]["multi_turn/append_calls"]  # the same extend calls on both ranks
    assert r1["metrics"]["multi_turn/append_calls"] == calls
    assert calls < r0["metrics_tp1"]["multi_turn/append_calls"], (calls, r0["metrics_tp1"])
    assert torch.equal(r0["tp2"].response_ids, r1["tp2"].response_ids)
