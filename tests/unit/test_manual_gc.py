"""trainer.gc_interval: automatic GC is off inside the training loop and restored after, objects alive
before the loop are frozen out of the step's collections, and the step's collection takes the young
generations except every trainer.gc_full_interval steps."""
import gc

import pytest

from hybridflow.config import load_config
from hybridflow.config_checks import validate
from hybridflow.trainer import gc_generation, manual_gc


class _Cycle:
    def __init__(self):
        self.me = self


def test_manual_gc_disables_and_restores():
    assert gc.isenabled()
    before = _Cycle()
    with manual_gc(True):
        assert not gc.isenabled()
        assert gc.get_freeze_count() > 0          # `before` and the rest of the heap are frozen
        _Cycle()                                  # unreachable cycle: only an explicit collect frees it
        assert gc.collect() >= 1
    assert gc.isenabled() and gc.get_freeze_count() == 0
    del before


def test_manual_gc_off_is_a_no_op():
    with manual_gc(False):
        assert gc.isenabled()
    assert gc.isenabled()


def test_gc_interval_config():
    assert load_config(["experiment=demo"]).trainer.gc_interval == 1
    with pytest.raises(ValueError, match="trainer.gc_interval=-1"):
        validate(load_config(["experiment=demo", "trainer.gc_interval=-1"]), world_size=1)


def test_gc_generation_schedule():
    assert [gc_generation(s, 1, 4) for s in range(6)] == [2, 1, 1, 1, 2, 1]
    assert [gc_generation(s, 2, 4) for s in range(6)] == [2, None, 1, None, 2, None]
    assert [gc_generation(s, 1, 1) for s in range(3)] == [2, 2, 2]   # every collection full
    assert gc_generation(3, 0, 1) is None                               # automatic GC


def test_young_collection_frees_the_steps_garbage_and_full_the_rest():
    with manual_gc(True):
        _Cycle()                                  # the step's garbage: young
        assert gc.collect(1) >= 1
        survivor = _Cycle()
        gc.collect(1)                             # survives a young collection: promoted to old
        del survivor                              # old cyclic garbage: young collections miss it
        assert gc.collect(1) == 0
        assert gc.collect(2) >= 1                 # the full collection frees it


def test_gc_full_interval_config():
    assert load_config(["experiment=demo"]).trainer.gc_full_interval == 50
    with pytest.raises(ValueError, match="trainer.gc_full_interval=0"):
        validate(load_config(["experiment=demo", "trainer.gc_full_interval=0"]), world_size=1)
