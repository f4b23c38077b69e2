import pytest
import torch


def pytest_collection_modifyitems(config, items):
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
