"""Run by tests/unit/test_sample_rows.py in a fresh interpreter with TRITON_INTERPRET=1 (Triton's
CPU interpreter reads the variable when the kernels are defined): kernels/sample.sample_rows's
Triton kernels against log_softmax, torch.argmax and their PyTorch twin ("kernels"), and
generation with rollout.kernel_options.fused_sampler ("generation"; a scratch directory as the
second argument). Prints one JSON object of results. The interpreter runs a program in ~20 ms, so
the cases keep to a few hundred programs; the many-draw statistics run on the twin
(tests/unit/test_sample_rows.py), whose Philox words and tokens are checked equal here."""

import json
import os
import sys
import warnings

assert os.environ.get("TRITON_INTERPRET") == "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
warnings.simplefilter("ignore", RuntimeWarning)  # numpy's -inf - -inf in masked lanes

import torch  # noqa: E402

from hybridflow.kernels import sample as ks  # noqa: E402


def _lp_ref(x, tokens, inv_temp):
    return torch.log_softmax(x.float() * inv_temp, -1).gather(1, tokens[:, None]).squeeze(1)


def logprob_cases():
    """Log-probs (and the logsumexp under them) against torch.log_softmax, bf16 and fp32 logits,
    one row and several, a vocabulary of one chunk and of three (the last partial), two tile
    sizes; the kernel's tokens equal the twin's (the same uniforms; the two sums' fp32 roundings
    differ by far less than these rows' gaps), each call advances the counter by 1."""
    out = []
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for B, V, chunk, block in [(1, 37, 8192, 1024), (5, 2500, 1024, 256)]:
            x = (torch.randn(B, V, generator=g) * 4).to(dtype)
            inv_temp = 1 / 0.7
            state, twin_state = ks.new_rng_state(11, "cpu"), ks.new_rng_state(11, "cpu")
            tok, lp = ks.sample_rows(x, inv_temp, state, impl="triton", chunk=chunk, block=block)
            ttok, tlp = ks.sample_rows(x, inv_temp, twin_state, impl="torch")
            tok2, no_lp = ks.sample_rows(x, inv_temp, state, impl="triton", chunk=chunk,
                                         block=block, need_logprobs=False)
            out.append({"dtype": str(dtype), "B": B, "V": V, "nchunk": -(-V // chunk),
                        "lp_err": (lp - _lp_ref(x, tok, inv_temp)).abs().max().item(),
                        "twin_lp_err": (tlp - _lp_ref(x, ttok, inv_temp)).abs().max().item(),
                        "tokens_equal_twin": bool(torch.equal(tok, ttok)),
                        "in_range": bool(((tok >= 0) & (tok < V)).all()),
                        "dtypes": [str(tok.dtype), str(lp.dtype)], "no_lp": no_lp is None,
                        "tokens2_in_range": bool(((tok2 >= 0) & (tok2 < V)).all()),
                        "counter": state.tolist(), "twin_counter": twin_state.tolist()})
    return out


def strided_cases():
    """Rows of a padded vocabulary (a (B, V) view of (B, V + 7) logits, row stride V + 7): the
    kernel reads only the view's ids; equals the twin on a contiguous copy."""
    g = torch.Generator().manual_seed(2)
    full = torch.randn(3, 300 + 7, generator=g).to(torch.bfloat16)
    full[:, 300:] = 100.0  # padded ids: would win every draw if read
    x = full[:, :300]
    tok, lp = ks.sample_rows(x, 1.0, ks.new_rng_state(4, "cpu"), impl="triton")
    ttok, tlp = ks.sample_rows(x.contiguous(), 1.0, ks.new_rng_state(4, "cpu"), impl="torch")
    return {"tokens_equal": bool(torch.equal(tok, ttok)), "max_token": int(tok.max()),
            "lp_err": (lp - tlp).abs().max().item()}


def replace_cases():
    """`replace`: the given rows emit the given token and its log-prob (read back from the logits),
    the others the draw (the twin's)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 300, generator=g).to(torch.bfloat16)
    where = torch.tensor([True, False, True, False])
    given = torch.tensor([7, 0, 299, 0])
    state, twin_state = ks.new_rng_state(5, "cpu"), ks.new_rng_state(5, "cpu")
    tok, lp = ks.sample_rows(x, 2.0, state, replace=(where, given), impl="triton")
    ttok, _ = ks.sample_rows(x, 2.0, twin_state, impl="torch")
    return {"given_rows": tok[where].tolist(), "drawn_equal": bool(torch.equal(tok[~where],
                                                                              ttok[~where])),
            "lp_err": (lp - _lp_ref(x, tok, 2.0)).abs().max().item()}


def stream_cases():
    """The counter: consecutive calls draw differently, a fresh state at the same seed repeats the
    first call, another seed differs; the kernel's tokens equal the twin's at every counter value
    (V = 8 rows of known probabilities: what the twin's chi-square tests)."""
    p = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02])
    x = p.log()[None].expand(32, 8).contiguous()
    calls, twin = [], []
    state, twin_state = ks.new_rng_state(2024, "cpu"), ks.new_rng_state(2024, "cpu")
    for _ in range(3):
        calls.append(ks.sample_rows(x, 1.25, state, impl="triton", need_logprobs=False)[0])
        twin.append(ks.sample_rows(x, 1.25, twin_state, impl="torch", need_logprobs=False)[0])
    again = ks.sample_rows(x, 1.25, ks.new_rng_state(2024, "cpu"), impl="triton")[0]
    other = ks.sample_rows(x, 1.25, ks.new_rng_state(2025, "cpu"), impl="triton")[0]
    return {"calls_differ": [int((calls[0] != c).sum()) for c in calls[1:]],
            "rows_distinct": len(set(calls[0].tolist())),
            "repeat_equal": bool(torch.equal(again, calls[0])),
            "other_seed_differs": int((other != calls[0]).sum()),
            "twin_equal": [bool(torch.equal(a, b)) for a, b in zip(calls, twin)],
            "counter": state.tolist()}


def edge_cases():
    """A temperature so low the logits decide (torch.argmax's ids); -inf logits in scattered ids
    and over a whole chunk (never drawn, finite log-probs equal to log_softmax); no rows."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 2500, generator=g) * 3
    state = ks.new_rng_state(9, "cpu")
    cold, _ = ks.sample_rows(x, 1e4, state, impl="triton", chunk=1024, block=256)
    masked = x.clone()
    masked[:, 1024:2048] = float("-inf")
    masked[:, ::3] = float("-inf")
    masked[2, :] = float("-inf")
    masked[2, 2000] = 0.5  # a row with one finite logit: that id, log-prob 0
    tok, lp = ks.sample_rows(masked, 1.0, state, impl="triton", chunk=1024, block=256)
    finite = torch.isfinite(masked.gather(1, tok[:, None]).squeeze(1))
    empty_tok, empty_lp = ks.sample_rows(torch.zeros(0, 50), 1.0, state, impl="triton")
    return {"cold_is_argmax": bool(torch.equal(cold, x.argmax(-1))),
            "masked_drawn_finite": bool(finite.all()), "row2_token": int(tok[2]),
            "lp_finite": bool(torch.isfinite(lp).all()), "lp_err":
            (lp - _lp_ref(masked, tok, 1.0)).abs().max().item(),
            "empty": [list(empty_tok.shape), list(empty_lp.shape)], "counter": state.tolist()}


def generation_cases():
    """Generator with decode_kernels=triton and fused_sampler (the prefill's draw and every decode
    step's by the kernel), temperature 1: the same seed repeats the tokens and log-probs, another
    seed gives other tokens, each response token's log-prob is log_softmax of a full forward over
    the prompt and the response so far (the teacher-forced recompute), and the padded vocabulary
    ids (huge logits) are never drawn. Also with emulated graphs and compaction."""
    from hybridflow.rollout import decoder
    from tests.unit.decode_kernels_check import CFG16  # head_dim 16: the kernels' smallest
    from tests.unit.test_rollout import PROMPTS, make, polled, rc

    gen = make(CFG16)
    cfg = rc(n=2, temperature=1.0, max_new_tokens=8, decode_kernels="triton")
    cfg.kernel_options.fused_sampler = True
    run = polled(gen, 4)
    a = run(PROMPTS, cfg=cfg, eos_id=5, pad_id=0, seed=7)
    b = run(PROMPTS, cfg=cfg, eos_id=5, pad_id=0, seed=7)
    c = run(PROMPTS, cfg=cfg, eos_id=5, pad_id=0, seed=8)
    cos, sin = decoder.rope_tables(gen.w.inv_freq, 128, dtype=torch.float32, device="cpu")
    err = 0.0
    for r in range(a.response_ids.shape[0]):
        prompt = PROMPTS[r // 2]
        n = int(a.response_mask[r].sum())
        seq = torch.tensor([prompt + a.response_ids[r, :n].tolist()])
        lg = decoder.forward(gen.w, seq, torch.arange(seq.shape[1])[None],
                             torch.ones_like(seq).bool(), cos_tab=cos, sin_tab=sin)[0]
        ref = torch.log_softmax(lg[len(prompt) - 1:-1, :37], -1)  # true vocabulary
        ref = ref.gather(1, a.response_ids[r, :n, None]).squeeze(1)
        err = max(err, (ref - a.rollout_logprobs[r, :n]).abs().max().item())
    graphed = gen.generate(PROMPTS, cfg=cfg, eos_id=5, pad_id=0, seed=7,
                           options=polled_opts(cfg, emulate_graphs=True,
                                               compact_finished_rows=True, min_graphed_bucket=1))
    return {"repeat_equal": bool(torch.equal(a.response_ids, b.response_ids)
                                 and torch.equal(a.rollout_logprobs, b.rollout_logprobs)),
            "other_seed_differs": int((a.response_ids != c.response_ids).sum()),
            "recompute_err": err, "tokens": int(a.response_mask.sum()),
            "max_id": int(a.response_ids.max()),
            "graphed_equal": bool(torch.equal(graphed.response_ids, a.response_ids)),
            "counter": gen._rng_state.tolist()}


def polled_opts(cfg, **kw):
    from tests.unit.test_rollout import opts

    return opts(cfg, check_every=4, **kw)


def multi_turn_cases(tmp):
    """generate_multi_turn with decode_kernels=triton and fused_sampler at temperature 1, a few
    model tokens forced first (the step's sample(replace=) in the kernel): the forced tokens and
    their log-probs equal the PyTorch sampler's run (fused_sampler off), the sampled rest repeats
    under the same seed and differs under another."""
    import pathlib

    from hybridflow.config import RolloutConfig
    from hybridflow.rollout import Generator
    from hybridflow.rollout.multi_turn import generate_multi_turn
    from hybridflow.rollout.options import DecodeOptions
    from tests.unit.multi_turn_fused_check import CFG16_G1
    from tests.unit.test_multi_turn import V, byte_tokenizer, params, tool_config
    from tests.unit.test_multi_turn_step import runner_for

    tmp = pathlib.Path(tmp)
    tok = byte_tokenizer(tmp)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": "6*7?"}]))]
    forced = [tok.encode("ab"), tok.encode("xyz")]
    runner = runner_for(tok, "hermes", tool_config(tmp, "calculator"))
    cfg = RolloutConfig(n=2, max_new_tokens=10, temperature=1.0, return_logprobs=True,
                        max_batch_size=2)
    runs, counters = [], []
    for fused, seed in ((False, 3), (True, 3), (True, 3), (True, 4)):
        gen = Generator(model_cfg=CFG16_G1, params=params(CFG16_G1), tp_group=None, device="cpu",
                        dtype=torch.float32, true_vocab_size=V)
        opts = DecodeOptions(kernels="triton", prefill_tokens=64, fused_sampler=fused)
        batch, _ = generate_multi_turn(gen, prompts, cfg=cfg, runner=runner, eos_id=tok.eos_id,
                                       pad_id=tok.pad_id, seed=seed, forced=forced, options=opts)
        runs.append(batch)
        counters.append(int(gen._rng_state[1]))
    ref, a, b, c = runs
    n = [len(f) for f in forced]
    return {"forced_equal": all(a.response_ids[r, :n[r]].tolist() == forced[r] for r in range(2)),
            "forced_lp_err": max((a.rollout_logprobs[r, :n[r]] - ref.rollout_logprobs[r, :n[r]])
                                 .abs().max().item() for r in range(2)),
            "repeat_equal": bool(torch.equal(a.response_ids, b.response_ids)),
            "other_seed_differs": int((a.response_ids != c.response_ids).sum()),
            "tokens": int(a.response_mask.sum()), "counters": counters}


def masked_cases():
    """bf16 / fp32 logits, one chunk and three (the last partial), every 7th id -inf, `replace`:
    the kernel's tokens against its twin's (tokens may differ only where u falls within fp32
    rounding of a boundary: counted), log-probs against log_softmax, the counter advanced."""
    out = []
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        for B, V, chunk, block in [(1, 37, 8192, 1024), (6, 2500, 1024, 256)]:
            x = (torch.randn(B, V, generator=g) * 3).to(dtype)
            x[:, ::7] = float("-inf")  # masked ids: never drawn
            inv_temp = 1 / 0.7
            where = torch.zeros(B, dtype=torch.bool)
            where[-1] = B > 1
            given = torch.full((B,), 5, dtype=torch.long)
            state, twin_state = ks.new_rng_state(13, "cpu"), ks.new_rng_state(13, "cpu")
            tok, lp = ks.sample_rows(x, inv_temp, state, impl="triton", chunk=chunk, block=block,
                                     replace=(where, given))
            ttok, tlp = ks.sample_rows(x, inv_temp, twin_state, impl="torch",
                                       replace=(where, given))
            out.append({"dtype": str(dtype), "B": B, "nchunk": -(-V // chunk),
                        "lp_err": (lp - _lp_ref(x, tok, inv_temp)).abs().max().item(),
                        "twin_lp_err": (tlp - _lp_ref(x, ttok, inv_temp)).abs().max().item(),
                        "tokens_differ": int((tok != ttok).sum()),
                        "masked_drawn": bool((tok[~where] % 7 == 0).any()),
                        "given": tok[where].tolist(),
                        "counter": state.tolist(), "twin_counter": twin_state.tolist()})
    return out


if __name__ == "__main__":
    section = sys.argv[1]
    if section == "kernels":
        result = {"logprobs": logprob_cases(), "strided": strided_cases(),
                  "replace": replace_cases(),
                  "stream": stream_cases(), "edge": edge_cases(), "masked": masked_cases()}
    else:
        result = {"generation": generation_cases(), "multi_turn": multi_turn_cases(sys.argv[2])}
    print(json.dumps(result))
