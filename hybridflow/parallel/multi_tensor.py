"""Megatron's optimizer helpers without apex or transformer-engine, without a host read per tensor.

Where neither is installed Megatron takes `megatron.core.utils`' local fallbacks for the optimizer:
- `local_multi_tensor_l2_norm` (the gradient norm before clipping) takes each tensor's norm and
  builds a host tensor from the list: a device-to-host copy and a wait for the GPU per tensor
  (about 170 per step for a Qwen2-0.5B actor), while the GPU idles between them;
- `local_multi_tensor_scale` (clipping, and the fp32 main parameters copied into the model's bf16
  ones after every step) runs `dst.copy_(src * scale)`: two kernels and a temporary the size of the
  tensor, per tensor.

`l2_norm` and `scale` keep their contracts with torch's multi-tensor (foreach) kernels: the norms in
fp32 and their norm on the device (Megatron reads the total once, after its all-reduce); the scale
in place where source and destination are the same tensors (clipping), a multi-tensor copy at scale
1 (the main parameters into the model's) and a multiply then copy otherwise. `install()` puts them
in place of the fallbacks only; apex's or transformer-engine's kernels, where Megatron found them,
stay.
"""

from __future__ import annotations

import torch
from megatron.core import utils as mcore_utils
from megatron.core.optimizer import clip_grads
from megatron.core.optimizer import optimizer as mcore_optimizer


def l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """amp_C.multi_tensor_l2norm's contract: ((1,) fp32 norm of all tensors of tensor_lists[0],
    their (n,) fp32 norms if `per_tensor` else None), on the tensors' device, no host read."""
    tensors = tensor_lists[0]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=noop_flag.device), None
    norms = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32))
    total = torch.linalg.vector_norm(norms).reshape(1)
    return total, (norms if per_tensor else None)


def scale(chunk_size, noop_flag, tensor_lists, factor):
    """amp_C.multi_tensor_scale's contract: tensor_lists[1][i] = tensor_lists[0][i] * factor in
    the destination's dtype (the fallback's: no overflow flag is set)."""
    src, dst = tensor_lists
    if not dst:
        return
    if all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, factor)
    elif factor == 1.0:
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, factor))


def install() -> None:
    """Process-wide and idempotent: `l2_norm` / `scale` wherever Megatron bound its local fallbacks."""
    if clip_grads.l2_norm_impl is mcore_utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = l2_norm
    for module in (clip_grads, mcore_optimizer):
        if module.multi_tensor_scale_impl is mcore_utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = scale
