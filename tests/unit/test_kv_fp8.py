"""rollout.kv_cache_dtype=fp8 on CPU (PyTorch path; the Triton kernels under the interpreter:
tests/unit/test_decode_kernels.py): the per-token, per-KV-head E4M3 round trip within its bound,
a KV cache of codes + scales written by the prefill and the decode steps where the bf16 cache is
written (the values within the bound, only the written columns touched), teacher-forced decode
logits equal to the exact cache's with each K/V rounded as written, compaction and windows
carrying the scales (greedy equal with and without them, under emulated graphs), the config keys
and what they turn on (multi-turn: tests/unit/test_multi_turn.py)."""

import dataclasses

import pytest
import torch

from hybridflow.config import load_config
from hybridflow.config_auto import resolve_auto
from hybridflow.config_checks import validate
from hybridflow.kernels.kv_fp8 import FP8_MAX, KV_FP8, Fp8KV, dequantize_kv, quantize_kv
from hybridflow.kernels.layer_ops import write_column
from hybridflow.rollout import decoder
from hybridflow.rollout.kv_cache import KVCache
from tests.unit.test_compaction import random_prompts, uneven_stops
from tests.unit.test_rollout import CFG, PROMPTS, make, opts, polled, rc


def bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 rounding error of x under `scale`: half a step of 3 mantissa bits (2^-4 relative) in
    the normal range, half the subnormal spacing (2^-10 of the scale) below it."""
    return torch.maximum(x.abs() * 2.0 ** -4, scale[..., None] * 2.0 ** -10) * (1 + 1e-6)


def test_round_trip_within_the_e4m3_bound():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 50, 64, generator=g) * torch.logspace(-3, 3, 50)[None, None, :, None]
    x[0, 0, 0] = 0.0  # an all-zero head: scale 1, codes 0
    x[1, 1, 3, 5] = 1e4  # an outlier sets its own token's scale only
    codes, scale = quantize_kv(x)
    assert codes.dtype == KV_FP8 and scale.dtype == torch.float32 and scale.shape == x.shape[:-1]
    back = dequantize_kv(Fp8KV(codes, scale), torch.float32)
    assert ((back - x).abs() <= bound(x, scale)).all()
    assert scale[0, 0, 0] == 1 and (codes[0, 0, 0].float() == 0).all()
    # every head's largest value lands on +-448: the full range is used, nothing clips
    assert torch.allclose(codes.float().abs().amax(-1)[scale != 1], torch.tensor(FP8_MAX))
    assert abs(back[1, 1, 3, 5] - 1e4) < 1e-2 and (back[1, 1, 2] - x[1, 1, 2]).abs().max() < 1e-2
    # bf16 input: the same codes as its fp32 values
    xb = x.bfloat16()
    assert torch.equal(quantize_kv(xb)[0].view(torch.uint8),
                       quantize_kv(xb.float())[0].view(torch.uint8))


def test_fp8_views_and_column_writes():
    cache = KVCache(num_layers=2, rows=3, groups=2, length=16, head_dim=8, dtype=torch.float32,
                    device=torch.device("cpu"), fp8=True)
    assert cache.fp8 and cache.nbytes == 2 * (2 * 3 * 2 * 16 * 8 * 1 + 2 * 3 * 2 * 16 * 4)
    kc, _ = cache.layer(1, 3, 1)  # rows 1..2 of layer 1
    assert kc.shape == (2, 2, 16, 8) and kc[:, :, :5].shape == (2, 2, 5, 8)
    with pytest.raises(IndexError, match="leading 3"):
        kc[0, 0, 0, 0]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 2, 1, 8, generator=g)
    write_column(kc, torch.tensor([4]), x)  # one column for every row
    per_row = torch.randn(2, 2, 1, 8, generator=g)
    write_column(kc, torch.tensor([6, 9]), per_row)  # a column per row
    codes, scale = quantize_kv(x)
    assert torch.equal(kc.codes[:, :, 4:5].view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(kc.scale[:, :, 4:5], scale)
    assert torch.equal(kc.scale[0, :, 6], quantize_kv(per_row[0, :, 0])[1])
    assert torch.equal(kc.scale[1, :, 9], quantize_kv(per_row[1, :, 0])[1])
    written = (cache.k.scale != 1).nonzero()[:, [0, 1, 3]].unique(dim=0).tolist()
    assert written == [[1, 1, 4], [1, 1, 6], [1, 2, 4], [1, 2, 9]]
    # gather_rows moves codes and scales alike
    before = [t.clone() for t in (cache.k.codes, cache.k.scale)]
    cache.gather_rows(torch.tensor([2, 0]), columns=16)
    assert torch.equal(cache.k.scale[:, 0], before[1][:, 2])
    assert torch.equal(cache.k.codes[:, 1].view(torch.uint8), before[0][:, 0].view(torch.uint8))


def _prefill_and_decode(gen, prompt, tokens, *, fp8: bool):
    """Logits of the prefill's last position and of each teacher-forced decode step."""
    w, P, S = gen.w, len(prompt), len(tokens)
    cos, sin = decoder.rope_tables(w.inv_freq, 64, dtype=torch.float32, device="cpu")
    cache = KVCache(num_layers=w.dims.num_layers, rows=1, groups=w.dims.groups, length=64,
                    head_dim=w.dims.head_dim, dtype=torch.float32, device=torch.device("cpu"),
                    fp8=fp8)
    ids = torch.tensor([prompt])
    out = [decoder.forward(w, ids, torch.arange(P)[None], torch.ones_like(ids).bool(),
                           cos_tab=cos, sin_tab=sin, cache=cache, last_only=True)[0]]
    valid = torch.zeros(1, 64, dtype=torch.bool)
    valid[0, :P] = True
    for s in range(S):
        out.append(decoder.decode_step(w, torch.tensor([tokens[s]]), torch.tensor([P + s]),
                                       torch.tensor([P + s]), valid, cache=cache, cos_tab=cos,
                                       sin_tab=sin)[0].float())
    return torch.stack(out), cache


def test_teacher_forced_logits_are_the_rounded_caches():
    """The same tokens through the fp8 cache and through the exact cache with every K/V rounded as
    it is written (E4M3 round trip, the prefill still attending exactly): the same logits, step for
    step; the prefill's equal the exact cache's, every later step's differ; the prompt's stored K/V
    are the exact cache's within the E4M3 bound, column for column, and the decode columns the
    emulation's."""
    from hybridflow.kernels import layer_ops

    gen = make()
    prompt, tokens = PROMPTS[1], [3, 17, 8, 8, 21, 2, 30, 11, 5, 9, 14, 1]
    exact, ce = _prefill_and_decode(gen, prompt, tokens, fp8=False)
    rounded, cq = _prefill_and_decode(gen, prompt, tokens, fp8=True)

    def round_trip(x):
        return dequantize_kv(Fp8KV(*quantize_kv(x)), x.dtype)

    write_columns, write_column = decoder.write_columns, layer_ops.write_column
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decoder, "write_columns",
                   lambda part, x, start=0: write_columns(part, round_trip(x), start))
        mp.setattr(layer_ops, "write_column",
                   lambda cache, cur, x: write_column(cache, cur, round_trip(x)))
        emulated, cr = _prefill_and_decode(gen, prompt, tokens, fp8=False)
    assert torch.allclose(rounded, emulated, atol=1e-5, rtol=0)
    assert torch.equal(exact[0], rounded[0])
    assert ((exact[1:] - rounded[1:]).abs().amax(-1) > 0).all()
    P, T = len(prompt), len(prompt) + len(tokens)
    for side, ref, rt in ((cq.k, ce.k, cr.k), (cq.v, ce.v, cr.v)):
        got = dequantize_kv(side, torch.float32)
        x = ref[:, :, :, :P]  # the prompt's K/V: computed alike, stored rounded
        assert ((got[:, :, :, :P] - x).abs() <= bound(x, side.scale[:, :, :, :P])).all()
        assert torch.allclose(got[:, :, :, :T], rt[:, :, :, :T], atol=1e-5, rtol=0)
        assert (got[:, :, :, T:] == 0).all()  # nothing past the written columns


def test_compaction_windows_and_graph_buckets_carry_the_scales():
    """Greedy with the fp8 cache: compaction (rows gathered with their scales), attention windows
    and emulated graph buckets give the plain fp8 run's tokens."""
    gen, R = make(), 40
    prompts = random_prompts(16, vocab=CFG.vocab_size)
    base = rc(max_new_tokens=R, kv_cache_dtype="fp8")
    free = polled(gen, 2)(prompts, cfg=base, eos_id=-1, pad_id=0, seed=0)
    stops = uneven_stops(free.response_ids, [0, 5, 11], CFG.vocab_size)
    cfg = dataclasses.replace(base, stop_token_ids=stops[1:], max_batch_size=12)
    plain = gen.generate(prompts, cfg=cfg, eos_id=stops[0], pad_id=0, seed=0,
                         options=opts(cfg, check_every=2))
    on = dataclasses.replace(cfg, compact_finished_rows=True, decode_kv_window=64)
    got = gen.generate(prompts, cfg=on, eos_id=stops[0], pad_id=0, seed=0,
                       options=opts(on, check_every=2, emulate_graphs=True, min_graphed_bucket=1))
    assert gen.stats["compactions"] >= 1 and gen._cache.fp8
    assert torch.equal(got.response_ids, plain.response_ids)
    assert torch.equal(got.response_mask, plain.response_mask)
    assert torch.allclose(got.rollout_logprobs, plain.rollout_logprobs, atol=1e-5, rtol=0)
    # the cache's kind follows the call: an exact call replaces it
    gen.generate(prompts[:2], cfg=rc(max_new_tokens=4), eos_id=-1, pad_id=0, seed=0)
    assert not gen._cache.fp8


def _config(*overrides):
    return load_config(["experiment=demo", *overrides])


def test_config_keys():
    with pytest.raises(ValueError, match="rollout.kv_cache_dtype='bf16' is not one of"):
        validate(_config("rollout.kv_cache_dtype=bf16"), world_size=1)
    # multi-turn on the fp8 cache: refused until its GPU check agrees (the rollouts themselves
    # run on CPU: tests/unit/test_multi_turn.py, tests/unit/test_multi_turn_fused.py)
    with pytest.raises(ValueError, match="rollout.kv_cache_dtype=fp8 does not run with "
                                         "rollout.multi_turn.enable=true yet"):
        validate(_config("rollout.kv_cache_dtype=fp8", "rollout.multi_turn.enable=true",
                         "rollout.multi_turn.tool_config_path=calculator.yaml"), world_size=1)
    validate(_config("rollout.kv_cache_dtype=fp8", "rollout.quantization=fp8"), world_size=1)
    # like a quantized rollout: the rollout log-probs and TIS on, with a line that says so
    cfg, notes = resolve_auto(_config("rollout.kv_cache_dtype=fp8"), device_type="cpu")
    assert cfg.rollout.return_logprobs and cfg.algo.tis_imp_ratio_cap == 2.0
    assert any("(rollout.kv_cache_dtype=fp8)" in n for n in notes)
    # validation: the exact cache unless trainer.val_quantized
    from types import SimpleNamespace

    from hybridflow.validation import Validator

    ctx = SimpleNamespace(train=SimpleNamespace(dp=0), dp_size=1)
    for extra, want in (([], "auto"), (["trainer.val_quantized=true"], "fp8")):
        v = Validator(_config("rollout.kv_cache_dtype=fp8", *extra), ctx, rollout=None, dataset=[])
        assert v.gen_cfg.kv_cache_dtype == want


def test_cost_model_holds_the_fp8_cache_bytes_and_reads_at_bf16s_cost():
    """flops.kv_bytes_per_token: hd + 4 bytes per KV head and side (fp8 codes + scale) against
    2 hd; the generation wave's cache scales with it, while the decode's read term stays bf16's
    (measured: generation no faster on the fp8 cache), and the passes are unchanged; the config
    key reaches the workload."""
    from hybridflow.cost import Calibration
    from hybridflow.cost.calibrate import parse_record
    from hybridflow.cost.flops import kv_bytes_per_token
    from hybridflow.cost.from_config import workload_fields
    from hybridflow.cost.memory import memory_for
    from hybridflow.cost.timing import stage_terms
    from tests.unit.test_cost import TINY_WORK

    runs = {}
    for kv in ("auto", "fp8"):
        r = parse_record({"config": {"model": "qwen2_1_5b", "gpu": "H200", "num_gpus": 1,
                                     "layout": {"tp": 1}, **TINY_WORK, "kv_cache_dtype": kv}})
        runs[kv] = (r, stage_terms(r.shape, r.gpu, r.plan, r.workload, Calibration()))
    shape = runs["auto"][0].shape
    ratio = (shape.head_dim + 4) / (2 * shape.head_dim)
    assert kv_bytes_per_token(shape, fp8=True) == pytest.approx(
        ratio * kv_bytes_per_token(shape))
    read = {k: t["gen"].x["inv_decode_bw_eff"] for k, (_, t) in runs.items()}
    assert read["auto"] == read["fp8"] > 0
    for stage in ("update_actor", "ref"):
        assert runs["auto"][1][stage].x == runs["fp8"][1][stage].x
    mem = {k: memory_for(r.shape, r.gpu, r.plan, r.workload, Calibration())
           for k, (r, _) in runs.items()}
    assert mem["fp8"].phases_gib["gen"]["kv_cache"] == pytest.approx(
        ratio * mem["auto"].phases_gib["gen"]["kv_cache"])
    fields = workload_fields(_config("rollout.kv_cache_dtype=fp8"), decode_kernels="triton")
    assert fields["kv_cache_dtype"] == "fp8"


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_a_calls_planned_cache_bytes_bound_the_cache_it_allocates(kv):
    """Generator.cache_bytes_for (what the rollout stage checks before building validation's
    generator beside a kept one): at least the bytes of the cache a fresh generator's call
    allocates (graphed buckets emulated, compaction and windows on), and within one column block
    and one row bucket of it; kv_cache_nbytes is what KVCache.nbytes reports."""
    prompts = random_prompts(10, vocab=CFG.vocab_size)
    cfg = rc(max_new_tokens=20, kv_cache_dtype=kv, max_batch_size=8, compact_finished_rows=True,
             decode_kv_window=64)
    gen = make()
    planned = gen.cache_bytes_for([len(p) for p in prompts], cfg)
    gen.generate(prompts, cfg=cfg, eos_id=-1, pad_id=0, seed=0,
                 options=opts(cfg, emulate_graphs=True, min_graphed_bucket=1))
    assert gen._cache.fp8 == (kv == "fp8")
    assert gen.kv_cache_bytes <= planned <= 2 * gen.kv_cache_bytes
    from hybridflow.rollout.kv_cache import kv_cache_nbytes

    c = gen._cache
    assert kv_cache_nbytes(num_layers=CFG.num_layers, rows=c.rows, groups=CFG.num_query_groups,
                           length=c.length, head_dim=CFG.head_dim, dtype=torch.float32,
                           fp8=c.fp8) == c.nbytes
