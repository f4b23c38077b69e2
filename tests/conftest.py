"""Test tiers (docs/testing.md): `bash launch/test.sh` runs the tests not marked `slow`,
`bash launch/test.sh --all` runs them all; `gpu` tests skip where there is no CUDA device."""

import pytest
import torch

# Slow-tier tests marked here rather than by a `@pytest.mark.slow` of their own: a file's tests, all
# of them or those that use the named fixture (the file's fast tests stay in the default tier).
SLOW = (
    ("tests/unit/test_decode_kernels.py", "checked"),  # every kernel through Triton's interpreter
    ("tests/unit/test_quantized_rollout.py", "interpreted"),  # the quantized GEMMs, interpreted
    ("tests/dist/test_bench_scripts.py", None),  # each benchmark script end to end, in subprocesses
)


@pytest.hookimpl(tryfirst=True)  # before `-m "not slow"` deselects
def pytest_collection_modifyitems(config, items):
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        if any(path == file and (fixture is None or fixture in item.fixturenames) for file, fixture in SLOW):
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def single_rank_ctx():
    """An in-process 1-rank world (gloo on CPU, NCCL on a GPU) with TP = PP = 1, torn down after the
    module; the RANK / WORLD_SIZE / LOCAL_RANK that init_distributed puts into os.environ are taken
    out again, or later subprocesses (TRL's accelerate) would take themselves for torchrun ranks."""
    import os

    from hybridflow.parallel import groups

    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    saved = {k: os.environ.get(k) for k in keys}
    groups.init_distributed()
    try:
        yield groups.init_model_parallel(tp=1, pp=1, seed=0)
    finally:
        groups.destroy()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
