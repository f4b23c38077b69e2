"""Row compaction (hybridflow/rollout/compaction.py) on CPU: the compaction step itself (state, KV
rows and row map land where the stable live-first order says), the bucket choice, and whole
generations with very uneven stop lengths, compaction on against off (the existing path)."""

import dataclasses

import pytest
import torch

from hybridflow.rollout import compaction
from hybridflow.rollout.generator import _Buffers
from hybridflow.rollout.kv_cache import KVCache
from tests.unit.test_rollout import CFG, make, polled, rc


def random_prompts(num: int, *, vocab: int, seed: int = 1) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(1, 9, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(num)]


def uneven_stops(free: torch.Tensor, long_rows: list, vocab: int) -> list:
    """Stop ids that the `long_rows` of a free (never stopping) greedy run never produce: those rows
    run to max_new_tokens, the others stop at their first such id (most within a few steps)."""
    used = set(free[long_rows].flatten().tolist())
    return [t for t in range(vocab) if t not in used]


def test_target_bucket_halves_or_waits():
    for targets in ([1, 2, 4, 8, 16, 24], [16, 32, 64, 128, 256, 384], [1, 2, 3]):
        for current in sorted(set(targets + [5, 7, 24, 384])):
            for live in range(current + 1):
                got = compaction.target_bucket(live, current, targets)
                cap_step = [t for t in targets if t < current and current & (current - 1)
                            and t == 1 << (current.bit_length() - 1)]
                fits = [t for t in targets if max(live, 1) <= t <= current // 2
                        or (t in cap_step and t >= max(live, 1))]
                if not fits:
                    assert got is None, (targets, current, live)
                else:  # the smallest bucket holding every live row, at most half the current
                    # (or, from a cap that is not a power of two, the power of two below it)
                    assert got == min(fits), (targets, current, live)
    assert compaction.target_bucket(1000, 1536, [512, 1024, 1536]) == 1024  # a third saved
    assert compaction.target_bucket(1025, 1536, [512, 1024, 1536]) is None
    assert compaction.target_bucket(600, 1024, [512, 1024, 1536]) is None  # under half: waits
    assert compaction.target_bucket(500, 1536, [512, 1024, 1536]) == 512
    assert compaction.ladder([1, 2, 4, 8, 16, 32, 48], graphed=True, min_graphed=16) == [16, 32, 48]
    assert compaction.ladder([1, 2, 4], graphed=False, min_graphed=16) == [1, 2, 4]


def test_compact_moves_state_kv_rows_and_row_map():
    g = torch.Generator().manual_seed(0)
    T, R, B = 16, 6, 6  # cache length, max new tokens, chunk rows (bucket 8: rows 6, 7 padding)
    src, dst = (_Buffers(n, T, R, [0], "cpu") for n in (8, 4))
    for b in (src, dst):
        b.tokens.random_(0, 50, generator=g)
        b.positions.random_(0, 50, generator=g)
        b.key_valid.copy_(torch.rand(b.key_valid.shape, generator=g) < 0.5)
        b.out_tokens.random_(0, 50, generator=g)
        b.out_logprobs.copy_(torch.rand(b.out_logprobs.shape, generator=g))
    src.cur.fill_(9)
    src.step.fill_(3)
    src.finished.copy_(torch.tensor([1, 0, 1, 1, 0, 0, 1, 1], dtype=torch.bool))
    cache = KVCache(num_layers=2, rows=8, groups=2, length=T, head_dim=3, dtype=torch.float32,
                    device="cpu")
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    k0, v0 = cache.k.clone(), cache.v.clone()
    state0 = {n: getattr(src, n).clone() for n in ("tokens", "positions", "finished", "key_valid",
                                                   "out_tokens", "out_logprobs")}
    row_map = torch.arange(8).clamp(max=B)

    new_map = compaction.compact(src, dst, cache, row_map, columns=9)

    live = [i for i in range(8) if not state0["finished"][i]]
    order = (live + [i for i in range(8) if state0["finished"][i]])[:4]  # stable, live first
    assert order == [1, 4, 5, 0]
    assert new_map.tolist() == [min(i, B) for i in order]
    for name, t in state0.items():
        assert torch.equal(getattr(dst, name), t[order]), name
    assert int(dst.cur) == 9 and int(dst.step) == 3
    for new, old in ((cache.k, k0), (cache.v, v0)):
        assert torch.equal(new[:, :4, :, :9], old[:, order, :, :9])  # written columns moved
        assert torch.equal(new[:, :4, :, 9:], old[:, :4, :, 9:])  # unwritten ones left alone
        assert torch.equal(new[:, 4:], old[:, 4:])  # rows beyond the new bucket untouched

    tokens, logprobs = torch.full((B + 1, R), -1), torch.zeros(B + 1, R)
    compaction.flush(dst, new_map, tokens, logprobs)
    for r, chunk_row in enumerate(new_map.tolist()):
        assert torch.equal(tokens[chunk_row], dst.out_tokens[r])
        assert torch.equal(logprobs[chunk_row], dst.out_logprobs[r])
    assert (tokens[[2, 3]] == -1).all()  # rows not in the map are not written


@pytest.mark.parametrize("max_batch_size,check_every", [(24, 2), (10, 2), (7, 4), (24, 16)])
def test_greedy_equal_with_and_without_compaction(max_batch_size, check_every):
    """24 distinct prompts, 40 new tokens; 3 rows never stop, most stop within a few tokens.
    max_batch_size 24: one chunk (a bucket that is no power of two); 10 and 7: several chunks."""
    gen, R = make(), 40
    generate = polled(gen, check_every)
    prompts = random_prompts(24, vocab=CFG.vocab_size)
    free = generate(prompts, cfg=rc(max_new_tokens=R), eos_id=-1, pad_id=0, seed=0)
    stops = uneven_stops(free.response_ids, [0, 5, 14], CFG.vocab_size)
    cfg = rc(max_new_tokens=R, stop_token_ids=stops[1:], max_batch_size=max_batch_size,
             compact_finished_rows=True)
    on = generate(prompts, cfg=cfg, eos_id=stops[0], pad_id=99, seed=0)
    stats = dict(gen.stats)
    off = generate(prompts, cfg=dataclasses.replace(cfg, compact_finished_rows=False),
                       eos_id=stops[0], pad_id=99, seed=0)
    lengths = on.response_mask.sum(1)
    assert (lengths == R).sum() == 3 and (lengths <= R // 4).sum() >= 12  # a long tail
    assert stats["compactions"] >= 1 and gen.stats["compactions"] == 0
    assert stats["decode_row_steps"] < stats["decode_row_steps_uncompacted"]
    assert gen.stats["decode_row_steps"] == stats["decode_row_steps_uncompacted"]
    assert torch.equal(on.response_ids, off.response_ids)
    assert torch.equal(on.response_mask, off.response_mask)
    # log-probs: equal to the BLAS's batch-size rounding (fewer than 4 rows: ~1e-6 on CPU)
    assert torch.allclose(on.rollout_logprobs, off.rollout_logprobs, atol=1e-5, rtol=0)
    assert torch.equal(on.prompt_ids, off.prompt_ids)


def test_sampling_through_compaction():
    gen, R = make(), 32
    generate = polled(gen, 2)
    prompts = random_prompts(8, vocab=CFG.vocab_size, seed=3)
    free = generate(prompts, cfg=rc(max_new_tokens=R, n=3), eos_id=-1, pad_id=0, seed=0)
    stops = uneven_stops(free.response_ids, [0, 13], CFG.vocab_size)
    # top_k=1: the sampling path (temperature 1, random draws) whose draw cannot change the token:
    # row identity and stop handling through compaction equal the uncompacted run's
    topk1 = rc(max_new_tokens=R, n=3, temperature=1.0, top_k=1, stop_token_ids=stops,
               max_batch_size=10, compact_finished_rows=True)
    a = generate(prompts, cfg=topk1, eos_id=-1, pad_id=0, seed=4)
    assert gen.stats["compactions"] >= 1
    b = generate(prompts, cfg=dataclasses.replace(topk1, compact_finished_rows=False),
                     eos_id=-1, pad_id=0, seed=4)
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.allclose(a.rollout_logprobs, b.rollout_logprobs, atol=1e-5, rtol=0)
    # real sampling: reproducible for a seed, stops and masks well-formed
    cfg = dataclasses.replace(topk1, top_k=0, top_p=0.95, stop_token_ids=stops[:4])
    s1 = generate(prompts, cfg=cfg, eos_id=-1, pad_id=99, seed=7)
    assert gen.stats["compactions"] >= 1
    s2 = generate(prompts, cfg=cfg, eos_id=-1, pad_id=99, seed=7)
    s3 = generate(prompts, cfg=cfg, eos_id=-1, pad_id=99, seed=8)
    assert torch.equal(s1.response_ids, s2.response_ids)
    assert torch.equal(s1.rollout_logprobs, s2.rollout_logprobs)
    assert not torch.equal(s1.response_ids, s3.response_ids)
    lengths = s1.response_mask.sum(1)
    assert lengths.min() < R // 4 and lengths.max() > R // 2
    for i in range(s1.batch_size):
        row, n = s1.response_ids[i].tolist(), int(lengths[i])
        hits = [j for j, t in enumerate(row) if t in stops[:4]]
        assert n == (hits[0] + 1 if hits else R)  # stops at the first stop id, else at the cap
        assert s1.response_mask[i].tolist() == [1] * n + [0] * (len(row) - n)
        assert all(t == 99 for t in row[n:]) and (s1.rollout_logprobs[i, n:] == 0).all()
        assert (s1.rollout_logprobs[i, :n] <= 0).all() and 0 <= min(row[:n])
        assert max(row[:n]) < CFG.vocab_size


def test_a_cap_that_is_not_a_power_of_two_compacts_to_the_one_below():
    """24 rows (max_batch_size 24) of which 10 run to the end: the live count never falls to half
    a bucket (8 of 16 after 24), so only the step from the cap to 16 compacts; greedy tokens are
    the uncompacted run's, for about a quarter fewer row-steps."""
    from tests.unit.test_rollout import opts

    gen, R = make(), 60
    prompts = random_prompts(24, vocab=CFG.vocab_size)
    base = rc(max_new_tokens=R, max_batch_size=24)
    free = gen.generate(prompts, cfg=base, eos_id=-1, pad_id=0, seed=0,
                        options=opts(base, check_every=2))
    stops = uneven_stops(free.response_ids, [0, 5, 11, 20], CFG.vocab_size)
    cfg = dataclasses.replace(base, stop_token_ids=stops[1:])
    plain = gen.generate(prompts, cfg=cfg, eos_id=stops[0], pad_id=0, seed=0,
                         options=opts(cfg, check_every=2))
    on = dataclasses.replace(cfg, compact_finished_rows=True)
    got = gen.generate(prompts, cfg=on, eos_id=stops[0], pad_id=0, seed=0,
                       options=opts(on, check_every=2, emulate_graphs=True, min_graphed_bucket=1))
    assert int((got.response_mask.sum(1) == R).sum()) == 10
    assert torch.equal(got.response_ids, plain.response_ids)
    assert gen.stats["compactions"] == 1
    assert gen.stats["decode_row_steps"] < 0.8 * gen.stats["decode_row_steps_uncompacted"]
