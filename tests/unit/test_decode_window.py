"""rollout.decode_kv_window on CPU: decode steps attend over the shortest window of cache columns
that holds every written slot, with the same output as attending over the whole cache."""

import pytest
import torch

from hybridflow.config import load_config
from hybridflow.config_checks import validate
from hybridflow.rollout import decoder, generator
from tests.unit.test_rollout import PROMPTS, assert_same_rows, make, polled, rc


def test_windows_and_their_choice():
    assert generator.kv_windows(192, 0) == [None]
    assert generator.kv_windows(192, 256) == [None]  # one window: the whole cache, unsliced
    assert generator.kv_windows(192, 64) == [64, 128, 192]
    assert generator.kv_windows(200, 64) == [64, 128, 192, 200]
    fns = dict.fromkeys([64, 128, 192])
    assert [generator.window_for(fns, c) for c in (1, 64, 65, 128, 129, 192)] == \
        [64, 64, 128, 128, 192, 192]
    assert generator.window_for({None: 0}, 150) is None


def test_decode_step_on_a_window_equals_the_whole_cache():
    """A slot past the window holds garbage and is marked valid in the whole-cache run's mask
    only: the window must not see it, the whole-cache run must (so the two differ when it does)."""
    gen = make()
    gen._ensure_cache(rows=2, length=128)
    cos, sin = gen._tables
    g = torch.Generator().manual_seed(0)
    gen._cache.k.copy_(torch.randn(gen._cache.k.shape, generator=g))
    gen._cache.v.copy_(torch.randn(gen._cache.v.shape, generator=g))
    tokens, positions, cur = torch.tensor([3, 9]), torch.tensor([20, 17]), torch.tensor([20])
    valid = torch.zeros(2, 128, dtype=torch.bool)
    valid[0, :20], valid[1, 3:20] = True, True
    run = lambda kv_len, v: decoder.decode_step(  # noqa: E731
        gen.w, tokens, positions, cur, v, cache=gen._cache, cos_tab=cos, sin_tab=sin,
        kv_len=kv_len)
    whole, windowed = run(None, valid.clone()), run(64, valid.clone())
    torch.testing.assert_close(windowed, whole)
    extra = valid.clone()
    extra[:, 100] = True  # a slot beyond the window
    assert not torch.allclose(run(None, extra.clone()), whole)
    torch.testing.assert_close(run(64, extra.clone()), whole)


@pytest.mark.parametrize("temperature,compact,eos", [(0.0, False, -1), (1.0, False, -1),
                                                     (1.0, True, 5)])
def test_generate_with_windows_equals_whole_cache(temperature, compact, eos):
    """P = 7, 150 new tokens: a cache of 192 columns, windows 64 / 128 / 192 (all used without
    EOS; with EOS = 5 rows stop unevenly and compaction moves them between windows' steps)."""
    gen = make()
    generate = polled(gen, 4)
    cfg = rc(n=3, temperature=temperature, max_new_tokens=150, compact_finished_rows=compact)
    ref = generate(PROMPTS, cfg=cfg, eos_id=eos, pad_id=0, seed=7)
    assert set(gen.stats["window_steps"]) == {None}  # no window: the whole cache, unsliced
    out = generate(PROMPTS, cfg=rc(n=3, temperature=temperature, max_new_tokens=150,
                                   compact_finished_rows=compact, decode_kv_window=64),
                   eos_id=eos, pad_id=0, seed=7)
    assert_same_rows(out, ref)
    used = gen.stats["window_steps"]  # a window holds the columns written so far: 7 + step
    # (with EOS the longest row decides whether the last window is reached)
    assert {64, 128} <= set(used) <= {64, 128, 192} and (eos >= 0 or 192 in used)
    assert used[64] == 64 - 7 and (eos >= 0 or used[128] == 64)
    if compact:
        assert gen.stats["compactions"] > 0


def test_window_must_be_a_multiple_of_64():
    for bad in (-64, 100):
        cfg = load_config(["experiment=demo", f"rollout.decode_kv_window={bad}"])
        with pytest.raises(ValueError, match="rollout.decode_kv_window"):
            validate(cfg, world_size=1)
    validate(load_config(["experiment=demo", "rollout.decode_kv_window=128"]), world_size=1)


def test_release_resets_every_windows_graph():
    """Each bucket holds a step per window: release() must reset all of their graphs."""
    from hybridflow.rollout.cuda_graph import GraphedStep

    class FakeGraph:
        resets = 0

        def reset(self):
            FakeGraph.resets += 1

    gen = make()
    fns = {}
    for w in (64, 128, 192):
        step = GraphedStep.__new__(GraphedStep)
        step.graph = FakeGraph()
        fns[w] = step
    gen._steps[("bucket",)] = (None, fns)
    gen.release()
    assert FakeGraph.resets == 3 and gen._steps == {}
