"""In-place generation on the training ranks: functional decoder over the gen-layout params dict,
static KV cache, sampling, CUDA-graph decode on GPU. Entry point: `Generator`."""

from hybridflow.rollout.engine import GenerationOutput, Generator

__all__ = ["Generator", "GenerationOutput"]
