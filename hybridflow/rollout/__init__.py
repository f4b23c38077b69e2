"""In-place generation on the training ranks: functional decoder over the gen-layout params dict,
static KV cache, sampling, CUDA-graph decode on GPU (generator.py, entry point `Generator`), and the
trainer's rollout stage around it: reshard -> generate -> gather -> score (stage.py)."""

from hybridflow.rollout.generator import Generator

__all__ = ["Generator"]
