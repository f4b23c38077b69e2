"""trainer.gc_interval: automatic GC is off inside the training loop and restored after, and objects
alive before the loop are frozen out of the step's collections."""
import gc

import pytest

from hybridflow.config import load_config, validate
from hybridflow.trainer import manual_gc


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
    assert load_config([]).trainer.gc_interval == 1
    with pytest.raises(ValueError, match="trainer.gc_interval=-1"):
        validate(load_config(["trainer.gc_interval=-1"]), world_size=1)
