"""parallel.mlp_kernel=quack: the dense decoder layers' gated MLP as quack-kernels' fused one.

Megatron's MLP runs fc1 as one GEMM, the SwiGLU as a kernel of its own over fc1's output (the
compiled one of `parallel.fused_elementwise`), then fc2; its backward reads fc1's output again for
the SwiGLU's derivative. quack-kernels (`quack.mlp.mlp_func`; the CuTe-DSL GEMMs flash-attn-4
depends on, installed with it) puts the SwiGLU in fc1's GEMM epilogue, and in the backward its
derivative in the epilogue of the GEMM that makes fc2's input gradient, which also gives back the
SwiGLU's output for fc2's weight gradient: two element-wise passes over the widest activation fewer
per layer and micro-batch, and fc1's output is the one activation of the MLP kept for backward.
`concat_layout=True` reads fc1's weight as Megatron stores it: [gate; up] rows. `tuned=False`:
each GEMM's tile configuration from quack's heuristic, not its autotuner, whose cache is keyed by
the operands' shapes: packed micro-batches have a new token count nearly every time, and each would
be tuned anew.

Weight gradients come back in each weight's `.grad` (bf16) and DDP's hook adds them into the fp32
`main_grad` (Megatron's path without gradient_accumulation_fusion). What it needs (config_checks
refuses the rest with the key): CUDA with bf16 weights, TP = 1, dense layers (MoE experts keep
their own), no LoRA adapters on the MLP (they wrap the linears this bypasses), no CUDA graphs of
the update's layers. Off until measured (benchmarks/bench_layer_kernels.py, gsm8k_variants.py
quack_mlp)."""
from __future__ import annotations

import functools
import types
from typing import Callable, Optional

from megatron.core.transformer.mlp import MLP

KEY = "parallel.mlp_kernel=quack"


@functools.cache
def quack_mlp_func() -> Callable:
    try:
        from quack.mlp import mlp_func
    except Exception as e:  # noqa: BLE001 - any import failure: not usable here
        raise ValueError(f"{KEY} needs quack-kernels, which flash-attn-4 installs (pip install "
                         f"'hybridflow[gpu]'); importing quack.mlp failed: "
                         f"{type(e).__name__}: {e}") from e
    return mlp_func


def _forward(self: MLP, hidden_states, per_token_scale=None, **kwargs):
    if per_token_scale is not None:
        raise ValueError(f"{KEY}: a per-token scale (MoE experts' MLPs) is not supported")
    shape = hidden_states.shape
    out = self._quack_mlp_func(hidden_states.reshape(-1, shape[-1]), self.linear_fc1.weight,
                               self.linear_fc2.weight, "swiglu", concat_layout=True, tuned=False)
    return out.view(*shape[:-1], out.shape[-1]), None


def use_quack_mlp(model, mlp_func: Optional[Callable] = None) -> int:
    """Route every dense layer's MLP of `model` (a GPTModel; Megatron's `MLP`) through quack's fused
    gated MLP; returns how many. `mlp_func`: the function called in its place (default
    quack.mlp.mlp_func, loaded here: a clear error where it is missing)."""
    fn = mlp_func or quack_mlp_func()
    count = 0
    for layer in model.decoder.layers:
        module = layer.mlp
        if type(module) is not MLP:  # a MoE layer's (router and experts) keeps its own
            continue
        if module.config.tensor_model_parallel_size != 1:
            raise ValueError(f"{KEY} needs parallel.tensor_parallel_size=1 (got "
                             f"{module.config.tensor_model_parallel_size})")
        if not (module.config.gated_linear_unit and module.linear_fc1.weight.ndim == 2):
            raise ValueError(f"{KEY} runs the gated (SwiGLU) MLP only")
        module._quack_mlp_func = fn
        module.forward = types.MethodType(_forward, module)
        count += 1
    return count
