"""The quack GPU tests' module-level skip: no CUDA, or quack cannot run here (the reason is
models/quack_mlp.quack_unsupported's, the rule both quack options resolve by)."""

import pytest
import torch


def require_quack() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA", allow_module_level=True)
    from hybridflow.models.quack_mlp import quack_unsupported

    why = quack_unsupported(torch.device("cuda"))
    if why is not None:
        pytest.skip(why, allow_module_level=True)
