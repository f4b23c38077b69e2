"""The multi-turn decode step as one function over static state (rollout/multi_turn_step.py), run
eagerly on CPU exactly as a CUDA graph replays it, against the eager loop it replaced
(tests/unit/multi_turn_reference.py): the same tokens, log-probs, tool masks and K/V cache, with
forced tool calls and with free sampling (which draws malformed calls and EOS on its own), over two
chunk sizes. Tools run synchronously here so both loops see every result at the same step (with a
thread pool the step a result lands at depends on timing)."""

from concurrent.futures import Future

import pytest
import torch

from hybridflow.config import MultiTurnConfig, RolloutConfig
from hybridflow.rollout.multi_turn import generate_multi_turn
from hybridflow.rollout.multi_turn_step import DecodeState
from hybridflow.rollout.options import DecodeOptions
from hybridflow.tools import load_tool_config
from hybridflow.tools.formats import ToolFormat
from hybridflow.tools.runner import ToolRunner
from tests.unit.multi_turn_reference import reference_multi_turn
from tests.unit.test_multi_turn import V, byte_tokenizer, call, make_gen, tool_config


class SyncRunner(ToolRunner):
    """Runs a turn's calls (the real tools) when submitted: the result is in at the next poll."""

    def submit(self, items):
        f = Future()
        f.set_result(self._run(items))
        return f


def runner_for(tok, kind, path, turns=3, **hold):
    """`hold`: rollout.multi_turn.append_wait_steps / append_batch_rows, append and lookahead
    (default: held results prefilled, no lookahead); the eager reference loop appends each result
    at the poll it came in (append_wait_steps=0)."""
    tools = load_tool_config(path)
    mt = MultiTurnConfig(enable=True, format=kind, max_assistant_turns=turns,
                         max_tool_response_length=24, tool_config_path=path, tool_workers=1,
                         **{"append": "prefill", "lookahead": False, **hold})
    return SyncRunner(tools, fmt=ToolFormat(kind, tokenizer=tok, tools=tools), tokenizer=tok,
                      mt=mt)


def states(gen):
    """{B: DecodeState} of the generator's multi-turn steps."""
    return {k[1]: st for k, (st, _) in gen._steps.items() if k[0] == "multi_turn"}


@pytest.mark.parametrize("kv_window", [0, 64], ids=["whole_cache", "windows"])
@pytest.mark.parametrize("mode", ["forced", "sampled"])
def test_graph_ready_loop_equals_the_eager_loop(tmp_path, mode, kv_window):
    """kv_window 64: each step attends over the first multiple of 64 columns that holds every
    row's next column (a step per window, picked by the host), the same tokens and K/V."""
    tok = byte_tokenizer(tmp_path)
    end = tok.encode("<|im_end|>")
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
               for q in ("6*7?", "Hi there", "2+3 then 5*5", "x", "a longer question here")]
    forced = [tok.encode(call("6*7")) + tok.encode("It is 42") + end,
              tok.encode('<tool_call>{"name": calculator}</tool_call>ok') + end,
              tok.encode(call("2+3")) + tok.encode(call("5*5")) + tok.encode("25") + end,
              tok.encode("no tools") + end,
              tok.encode(call("1+1") + call("2+2") + call("3+3")) + end]  # past the turn limit
    if mode == "sampled":  # calls, then whatever the model draws; one row draws from the start
        forced = [f[:len(tok.encode(call("6*7")))] for f in forced[:4]] + [[]]
    path = tool_config(tmp_path, "calculator")
    cfg = RolloutConfig(n=1, max_new_tokens=240 if mode == "forced" else 96, temperature=1.0,
                        return_logprobs=True, max_batch_size=3)  # chunks of 3 and 2 rows
    opts = DecodeOptions(kernels="torch", prefill_tokens=64, kv_window=kv_window)
    outs = []
    for fn in (reference_multi_turn, generate_multi_turn):
        gen = make_gen()
        # one cache for the whole call: the eager loop sized it per chunk, and a later chunk's
        # longer prompt grew it, which re-created the generator's RNG unseeded (the new loop
        # sizes it once, before seeding)
        gen._ensure_cache(rows=3, length=384)
        outs.append((fn(gen, prompts, cfg=cfg,
                        runner=runner_for(tok, "hermes", path, append_wait_steps=0),
                        eos_id=tok.eos_id, pad_id=tok.pad_id, seed=5, options=opts,
                        forced=forced), gen))
    ((ref, ref_m, ref_valid), ref_gen), ((new, new_m), new_gen) = outs
    assert torch.equal(new.response_ids, ref.response_ids)
    assert torch.equal(new.response_mask, ref.response_mask)
    assert torch.equal(new.tool_mask, ref.tool_mask)
    assert ref.tool_mask.any() and new_m["tool_calls/mean"] > 0
    torch.testing.assert_close(new.rollout_logprobs, ref.rollout_logprobs, rtol=1e-5, atol=1e-5)
    for k in ref_m:
        if "timing" not in k:
            assert new_m[k] == pytest.approx(ref_m[k], rel=1e-6), k
    T = new_gen._cache.length
    assert (new_m["multi_turn/kv_columns_mean"] < T) == bool(kv_window)
    if mode == "forced":  # the turn limit ended the last row at its second call
        assert new_m["num_turns/max"] == 3
    # the last chunk's cache: every column the eager loop wrote is there, the same K/V; the new
    # loop also fed a finished row's last token (at most one more column per row)
    kv_ref, st = ref_valid[-1], states(new_gen)[2]
    assert (st.key_valid & kv_ref).eq(kv_ref).all()
    assert ((st.key_valid & ~kv_ref).sum(1) <= 1).all()
    for b in range(2):
        cols = kv_ref[b].nonzero()[:, 0]
        for cache_ref, cache_new in ((ref_gen._cache.k, new_gen._cache.k),
                                     (ref_gen._cache.v, new_gen._cache.v)):
            torch.testing.assert_close(cache_new[:, b, :, cols], cache_ref[:, b, :, cols],
                                       rtol=1e-5, atol=1e-5)


def test_step_state_is_static_across_calls(tmp_path):
    """The step reads and writes the same tensors every call (what a captured graph needs): a
    second call reuses the chunk's state in place and gives the same rollout for the same seed,
    also when a later chunk's prompt is longer (the cache is sized once, before seeding)."""
    tok = byte_tokenizer(tmp_path)
    end = tok.encode("<|im_end|>")
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
               for q in ("q", "a much longer question than the first")]
    runner = runner_for(tok, "hermes", tool_config(tmp_path, "calculator"))
    gen = make_gen()
    cfg = RolloutConfig(n=2, max_new_tokens=40, temperature=1.0, return_logprobs=True,
                        max_batch_size=2)
    run = lambda: generate_multi_turn(gen, prompts, cfg=cfg, runner=runner,  # noqa: E731
                                      eos_id=tok.eos_id, pad_id=tok.pad_id, seed=1,
                                      forced=[tok.encode(call("1+2")), end, [], end])
    first, _ = run()
    (st,) = states(gen).values()
    ptrs = [t.data_ptr() for t in st.tensors()]
    second, _ = run()
    assert states(gen) == {2: st} and [t.data_ptr() for t in st.tensors()] == ptrs
    assert torch.equal(first.response_ids, second.response_ids)
    assert torch.equal(first.rollout_logprobs, second.rollout_logprobs)
    assert int(st.col[0]) > int(st.col[1])  # rows advance their own columns (row 1 stopped)


def test_a_prompt_is_prefilled_once_for_its_samples(tmp_path):
    """rollout.n copies of a prompt share one prefill (its K/V copied to their rows): the same
    rollout as the copies given as separate prompts."""
    tok = byte_tokenizer(tmp_path)
    end = tok.encode("<|im_end|>")
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
               for q in ("a question", "another, longer question")]
    runner = runner_for(tok, "hermes", tool_config(tmp_path, "calculator"))
    forced = [tok.encode(call("1+2")), end, [], [], tok.encode(call("2*3")), []]
    outs = []
    for ps, n in ((prompts, 3), ([p for p in prompts for _ in range(3)], 1)):
        gen = make_gen()
        cfg = RolloutConfig(n=n, max_new_tokens=96, temperature=1.0, return_logprobs=True,
                            max_batch_size=4)  # chunks of 4 and 2 rows: one cuts a group
        outs.append(generate_multi_turn(gen, ps, cfg=cfg, runner=runner, eos_id=tok.eos_id,
                                        pad_id=tok.pad_id, seed=2, forced=forced)[0])
    shared, separate = outs
    assert torch.equal(shared.response_ids, separate.response_ids)
    assert torch.equal(shared.tool_mask, separate.tool_mask) and shared.tool_mask.any()
    torch.testing.assert_close(shared.rollout_logprobs, separate.rollout_logprobs, rtol=1e-5,
                               atol=1e-5)
    assert shared.group_ids.tolist() == [0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("kv_window", [0, 64], ids=["whole_cache", "windows"])
def test_compaction_keeps_greedy_rollouts(tmp_path, kv_window):
    """rollout.compact_finished_rows: as rows finish, the rows still decoding or waiting for a
    tool move into a smaller state (three times here: 6 rows, a cap that is not a power of two,
    to 4, then on; two rows run to the end); greedy tokens, tool
    results and log-probs are those of the run without it (log-probs to the batch-size rounding
    of a matmul), for fewer row-steps; sampled runs stay seeded-reproducible."""
    tok = byte_tokenizer(tmp_path)
    end = tok.encode("<|im_end|>")
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "q"}]))
    runner = runner_for(tok, "hermes", tool_config(tmp_path, "calculator"))
    forced = [end, tok.encode("ab") + end, tok.encode(call("2+2")) + tok.encode("x") + end,
              tok.encode("abcdef") + end, tok.encode(call("3*3")), []]
    outs = []
    for compact, temperature in ((False, 0.0), (True, 0.0), (True, 1.0), (True, 1.0)):
        gen = make_gen()
        cfg = RolloutConfig(n=6, max_new_tokens=120, temperature=temperature,
                            return_logprobs=True)
        outs.append(generate_multi_turn(
            gen, [prompt], cfg=cfg, runner=runner, eos_id=tok.eos_id, pad_id=tok.pad_id, seed=4,
            forced=forced, options=DecodeOptions(kernels="torch", kv_window=kv_window,
                                                 compact_finished_rows=compact)))
    (plain, m_plain), (packed, m_packed), (s1, m1), (s2, _) = outs
    assert torch.equal(packed.response_ids, plain.response_ids)
    assert torch.equal(packed.tool_mask, plain.tool_mask) and plain.tool_mask[2].any()
    torch.testing.assert_close(packed.rollout_logprobs, plain.rollout_logprobs, rtol=1e-5,
                               atol=1e-5)
    assert m_plain["multi_turn/compactions"] == 0 and m_packed["multi_turn/compactions"] == 3
    assert m_packed["multi_turn/decode_row_steps"] < m_plain["multi_turn/decode_row_steps"] / 2
    assert m_packed["multi_turn/decode_steps"] == m_plain["multi_turn/decode_steps"]
    assert torch.equal(s1.response_ids, s2.response_ids) and m1["multi_turn/compactions"] >= 1
    assert torch.equal(s1.rollout_logprobs, s2.rollout_logprobs)


def test_emulated_graphs_equal_eager(tmp_path):
    """DecodeOptions.emulate_graphs: the graphed path's host side on CPU (every state size's
    steps made before the seed, with the warm-up runs a capture makes; windows; compaction into
    ladder sizes from 1 row): the eager run's tokens, tool results and log-probs."""
    tok = byte_tokenizer(tmp_path)
    end = tok.encode("<|im_end|>")
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
               for q in ("6*7?", "a longer question")]
    runner = runner_for(tok, "hermes", tool_config(tmp_path, "calculator"))
    forced = [end, tok.encode(call("2+2")) + tok.encode("x") + end, tok.encode("abc") + end,
              tok.encode(call("3*3")), [], tok.encode("de") + end]
    outs = []
    for emulate in (False, True):
        gen = make_gen()
        cfg = RolloutConfig(n=3, max_new_tokens=120, temperature=1.0, return_logprobs=True,
                            max_batch_size=4)
        opts = DecodeOptions(kernels="torch", kv_window=64, compact_finished_rows=True,
                             min_graphed_bucket=1, emulate_graphs=emulate)
        outs.append(generate_multi_turn(gen, prompts, cfg=cfg, runner=runner, eos_id=tok.eos_id,
                                        pad_id=tok.pad_id, seed=6, forced=forced,
                                        options=opts))
        fns = [fn for k, (_, f) in gen._steps.items() if k[0] == "multi_turn" for fn in f.values()]
        assert all(type(fn).__name__ == "WarmedStep" for fn in fns) == emulate
    (eager, m_eager), (emulated, m_emulated) = outs
    assert torch.equal(emulated.response_ids, eager.response_ids)
    assert torch.equal(emulated.tool_mask, eager.tool_mask) and eager.tool_mask.any()
    torch.testing.assert_close(emulated.rollout_logprobs, eager.rollout_logprobs, rtol=1e-5,
                               atol=1e-5)
    assert m_emulated["multi_turn/compactions"] == m_eager["multi_turn/compactions"] >= 1


def test_close_tokens(tmp_path):
    """Only tokens whose text holds the closing marker's last character can end a call: in the
    byte-level vocabulary, `>` and the specials that end with it (hermes), a backtick (code)."""
    tok = byte_tokenizer(tmp_path)
    path = tool_config(tmp_path, "calculator")
    hermes = runner_for(tok, "hermes", path).close_tokens(V)
    ids = lambda *texts: sorted(tok.encode(t)[0] for t in texts)  # noqa: E731
    assert sorted(hermes.nonzero()[0]) == ids(">", "<|im_end|>", "<|im_start|>", "<tool_call>",
                                              "</tool_call>")
    code = runner_for(tok, "code", path).close_tokens(V)
    assert sorted(code.nonzero()[0]) == ids("`")
    assert DecodeState(2, 64, V, "cpu").out.dtype == torch.float64  # token ids stay exact


def _greedy_tool_rows(tmp_path, compact: bool, variants: list, *, fill_cache: bool = False) -> list:
    """(batch, metrics) of a greedy rollout of 6 rows (2 prompts x 3; forced turns with one or
    two calculator calls) per rollout.multi_turn variant (dicts of MultiTurnConfig fields),
    emulated graphs, KV windows, compaction from 1 row when `compact`. `fill_cache`: two rows
    run to the response limit, one of them after a call, the limit set so that a row that reaches
    it ends on the cache's last column but one (prompt + response + 1 = a multiple of 64)."""
    tok = byte_tokenizer(tmp_path)
    end = tok.encode("<|im_end|>")
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
               for q in ("6*7?", "a longer question")]
    forced = [end, tok.encode(call("2+2")) + tok.encode("x") + end, tok.encode("abc") + end,
              tok.encode(call("3*3")) + tok.encode(call("1+1")) + end, [],
              tok.encode("de") + end]
    R = 150
    if fill_cache:
        forced[4:] = [tok.encode("z" * 300), tok.encode(call("2+2")) + tok.encode("y" * 300)]
        R = 127 - max(len(p) for p in prompts)
    outs = []
    for variant in variants:
        runner = runner_for(tok, "hermes", tool_config(tmp_path, "calculator"), **variant)
        cfg = RolloutConfig(n=3, max_new_tokens=R, temperature=0.0, return_logprobs=True,
                            max_batch_size=4)
        opts = DecodeOptions(kernels="torch", kv_window=64, compact_finished_rows=compact,
                             min_graphed_bucket=1, emulate_graphs=True)
        outs.append(generate_multi_turn(make_gen(), prompts, cfg=cfg, runner=runner,
                                        eos_id=tok.eos_id, pad_id=tok.pad_id, seed=6,
                                        forced=forced, options=opts))
        runner.close()
    return outs


def test_results_fed_by_the_decode_step_equal_appended_ones(tmp_path):
    """rollout.multi_turn.append=decode: each tool result's tokens go through the (emulated)
    graphed decode step as forced tokens, one per step, with windows and compaction into ladder
    sizes from 1 row; greedy, the rollout is the one appended by `extend`: the same tokens and
    tool masks, model log-probs to rounding, no extend call, every tool token fed."""
    outs = _greedy_tool_rows(tmp_path, True, [dict(append="prefill"), dict(append="decode")])
    (app, m_app), (fed, m_fed) = outs
    assert torch.equal(fed.response_ids, app.response_ids)
    assert torch.equal(fed.tool_mask, app.tool_mask) and int(app.tool_mask.sum()) > 20
    torch.testing.assert_close(fed.rollout_logprobs, app.rollout_logprobs, rtol=1e-4, atol=1e-4)
    assert m_app["multi_turn/append_calls"] >= 1 and m_fed["multi_turn/append_calls"] == 0
    # every tool token went through a step but those of a result that filled the response
    # budget (written as the row ended: nothing decodes after it)
    trailing = 0
    for b in range(fed.response_ids.shape[0]):
        mask = fed.tool_mask[b, :int(fed.response_mask[b].sum())].tolist()
        while mask and mask[-1]:
            trailing += mask.pop()
    assert m_fed["multi_turn/fed_tool_tokens"] == int(fed.tool_mask.sum()) - trailing > 20
    assert m_fed["multi_turn/compactions"] >= 1
    assert m_fed["num_turns/mean"] == m_app["num_turns/mean"] and m_fed["num_turns/max"] >= 2


@pytest.mark.parametrize("compact", [False, True], ids=["windows", "windows_compaction"])
def test_lookahead_equals_the_step_by_step_loop(tmp_path, compact):
    """rollout.multi_turn.lookahead: each step launched before the previous one's tokens are read
    (rows that stopped or called a tool are fed once more, that token dropped and, after a call,
    taken back in the cache) gives the loop's greedy rollout: the same tokens, tool masks and
    turns, model log-probs to rounding (emulated graphs, windows, compaction from 1 row)."""
    outs = _greedy_tool_rows(tmp_path, compact, [dict(append="decode"),
                                                 dict(append="decode", lookahead=True)])
    (plain, m_plain), (ahead, m_ahead) = outs
    assert torch.equal(ahead.response_ids, plain.response_ids)
    assert torch.equal(ahead.tool_mask, plain.tool_mask) and int(plain.tool_mask.sum()) > 20
    torch.testing.assert_close(ahead.rollout_logprobs, plain.rollout_logprobs, rtol=1e-5,
                               atol=1e-5)
    assert m_ahead["num_turns/mean"] == m_plain["num_turns/mean"]
    assert m_ahead["multi_turn/fed_tool_tokens"] == m_plain["multi_turn/fed_tool_tokens"] > 0
    assert (m_ahead["multi_turn/compactions"] >= 1) == compact
    # every row's last step and every call's was run once more, its token dropped
    assert m_ahead["multi_turn/lookahead_dropped"] >= 6 and m_plain["multi_turn/lookahead_dropped"] == 0


def test_lookahead_rows_that_fill_the_cache(tmp_path):
    """Lookahead feeds a row that reached the response limit once more (its token dropped): the
    cache keeps a column for it, and the steps after it (another row still decoding after its
    tool call) run; the rollout is the loop's."""
    (plain, _), (ahead, m_ahead) = _greedy_tool_rows(
        tmp_path, False, [dict(append="decode"), dict(append="decode", lookahead=True)],
        fill_cache=True)
    R = plain.response_ids.shape[1]
    assert int((plain.response_mask.sum(1) == R).sum()) >= 2
    assert torch.equal(ahead.response_ids, plain.response_ids)
    assert torch.equal(ahead.tool_mask, plain.tool_mask)
    torch.testing.assert_close(ahead.rollout_logprobs, plain.rollout_logprobs, rtol=1e-5,
                               atol=1e-5)
    assert m_ahead["multi_turn/lookahead_dropped"] >= 6
