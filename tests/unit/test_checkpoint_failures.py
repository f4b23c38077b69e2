"""How a failed checkpoint write becomes one OSError (1-rank group in this process).

A quota error cannot be provoked on a tmpfs without quota tools, so EDQUOT is a constructed
OSError; the other cases use what torch_dist and torch's zip writer really raise on a full disk
(their texts copied from a real run on a full tmpfs, which tests/learning/ and tests/dist/ also
provoke for real): the errno in a CheckpointException's text, and the zip writer's errno-less
"unexpected pos" read as ENOSPC only when the filesystem is in fact (nearly) full.
"""

from __future__ import annotations

import errno
import os

import pytest
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from hybridflow.checkpoint import failures
from tests.tmpfs import fill, mount_tmpfs

WORKER = RuntimeError("Worker failure: [Errno 28] No space left on device")
ZIP = RuntimeError("Worker failure: [enforce fail at inline_container.cc:672] . unexpected pos "
                   "704 vs 598")


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if started:
        dist.destroy_process_group()


def _raised(exc, tmp) -> OSError | RuntimeError:
    os.makedirs(tmp, exist_ok=True)
    with failures.io_errors() as err:
        raise exc
    with pytest.raises((OSError, RuntimeError)) as info:
        failures.raise_on_any_rank(err, what="saving checkpoint step 3", cleanup=tmp)
    assert not os.path.exists(tmp)  # the partial dir is gone
    return info.value


def test_quota_and_errno_texts(tmp_path):
    e = _raised(OSError(errno.EDQUOT, "Disk quota exceeded", str(tmp_path / "s.tmp" / "x.pt")),
                str(tmp_path / "s.tmp"))
    assert e.errno == errno.EDQUOT and e.filename == str(tmp_path / "s.tmp" / "x.pt")
    assert str(e) == (f"[Errno {errno.EDQUOT}] saving checkpoint step 3: Disk quota exceeded "
                      f"(EDQUOT): '{tmp_path / 's.tmp' / 'x.pt'}'")
    e = _raised(CheckpointException("write", {0: (WORKER, None)}), str(tmp_path / "t.tmp"))
    assert isinstance(e, OSError) and e.errno == errno.ENOSPC
    assert e.filename == str(tmp_path / "t.tmp")


def test_errno_less_writer_error_is_enospc_only_on_a_full_disk(tmp_path):
    e = _raised(CheckpointException("write", {0: (ZIP, None)}), str(tmp_path / "u.tmp"))
    assert type(e) is RuntimeError and "unexpected pos" in str(e)  # plenty of space here
    assert isinstance(e.__cause__, CheckpointException)
    with mount_tmpfs(str(tmp_path / "disk"), size="256k") as disk:
        os.makedirs(os.path.join(disk, "v.tmp"))
        fill(disk)
        with failures.io_errors() as err:
            raise CheckpointException("write", {0: (ZIP, None)})
        with pytest.raises(OSError) as info:
            failures.raise_on_any_rank(err, what="saving checkpoint step 3",
                                       cleanup=os.path.join(disk, "v.tmp"))
        assert info.value.errno == errno.ENOSPC and "No space left on device" in str(info.value)


def test_no_error_is_a_barrier():
    with failures.io_errors() as err:
        pass
    assert err == [] and failures.raise_on_any_rank(err, what="x") is None
