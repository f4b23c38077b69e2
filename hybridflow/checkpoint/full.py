"""Full (unsharded) weights of one role straight from a checkpoint's files, in one process.

For export and inspection: no model is built and no parallel layout is needed. Megatron stores each
tensor under a global key (layers stacked on a leading axis, norm weights under TE-style fused
names, `linear_fc1` as [gate; up]); this turns them back into GPTModel parameter names with global
layer indices.
"""

from __future__ import annotations

import os

import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

from hybridflow.checkpoint.state import read_model_config
from hybridflow.config import ModelConfig

_VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


def load_full_state_dict(ckpt_step_dir: str, role: str = "actor") -> tuple[dict, ModelConfig]:
    """Full model tensors of `role` from a `step_<N>` dir, and its ModelConfig.

    Names are GPTModel parameter names with global layer indices (`decoder.layers.{i}.` over all
    pipeline stages; local-spec norm names `input_layernorm` / `pre_mlp_layernorm`); `linear_fc1` is
    [gate; up]; vocab tensors are trimmed to the true vocabulary; no `output_layer.weight` when the
    embeddings are tied; MoE experts one tensor each (`mlp.experts.local_experts.{e}.`, global
    expert index, whatever the saving EP). Starts a private 1-rank group when there is none (and ends it)."""
    role_dir = os.path.join(ckpt_step_dir, role)
    if not os.path.isdir(role_dir):
        raise FileNotFoundError(f"checkpoint {ckpt_step_dir} has no role {role!r} (no {role_dir})")
    cfg = read_model_config(ckpt_step_dir, role)
    started = not dist.is_initialized()
    if started:  # no port, no CPU shims: reading files needs only a group object
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        saved = dist_checkpointing.load_tensors_metadata(role_dir)
        request = {k: sh for k, sh in saved.items() if not k.startswith("optimizer.")}
        loaded = dist_checkpointing.load(request, role_dir, validate_access_integrity=False)
    finally:
        if started:
            dist.destroy_process_group()
    return _canonical_names({k: loaded[k] for k in request}, cfg), cfg


def _canonical_names(tensors: dict, cfg: ModelConfig) -> dict:
    # {local param prefix: checkpoint key prefix}, e.g. input_layernorm. -> linear_qkv.layer_norm_
    norm_names = get_gpt_layer_local_spec(normalization="RMSNorm").submodules \
        .sharded_state_dict_keys_map
    out = {}
    for key in sorted(tensors):
        t = tensors.pop(key)
        if key.startswith("decoder.layers."):  # (L, ...) stacked over global layers
            rest = key[len("decoder.layers."):]
            for local, ckpt in norm_names.items():
                if rest.startswith(ckpt):
                    rest = local + rest[len(ckpt):]
            for i in range(t.shape[0]):
                if rest.startswith("mlp.experts.experts."):  # MoE: (E, ...) stacked over experts
                    fc = rest[len("mlp.experts.experts."):]
                    for e in range(t.shape[1]):
                        out[f"decoder.layers.{i}.mlp.experts.local_experts.{e}.{fc}"] = \
                            t[i, e].clone()
                    continue
                out[f"decoder.layers.{i}.{rest}"] = t[i].clone()  # own storage (safetensors)
        elif key in _VOCAB_KEYS:
            out[key] = t[:cfg.vocab_size].clone()  # padding rows depend on the saving TP
        else:
            out[key] = t
    return out
