"""Hugging Face (Llama, Qwen2, Qwen3, Mistral) checkpoints <-> Megatron GPTModel weights, at any TP x PP.

Name and layout map (HF `model.layers.{i}.` -> Megatron `decoder.layers.{i}.`):
  embed_tokens / lm_head      -> embedding.word_embeddings / output_layer (vocab rows, zero-padded
                                 to `padded_vocab_size(vocab, tp)`; no output_layer when tied)
  q_proj, k_proj, v_proj      -> self_attention.linear_qkv, packed per query group g:
                                 [q heads of g; k_g; v_g] (weights and Qwen2 biases)
  q_norm, k_norm (Qwen3)      -> self_attention.q_layernorm, k_layernorm ((head_dim,), whole on
                                 every TP rank)
  o_proj                      -> self_attention.linear_proj
  gate_proj, up_proj          -> mlp.linear_fc1 = [gate; up] (per TP shard: [gate_r; up_r])
  down_proj                   -> mlp.linear_fc2
  Qwen3-MoE: mlp.gate         -> mlp.router ((experts, hidden), whole on every rank)
  mlp.experts.<e>.{gate,up}_proj, down_proj -> expert e's linear_fc1 = [gate; up] / linear_fc2
                                 (per expert TP shard as the dense MLP's; expert e on EP rank
                                 e // (experts / EP) as its local expert e % (experts / EP))
  input_layernorm, post_attention_layernorm, norm -> input_layernorm, pre_mlp_layernorm,
                                 decoder.final_layernorm
  score (ForSequenceClassification, 1 label) -> output_layer.linear (critic/reward value head)

One routine (`_param_shard`) computes any parameter's TP shard from a "source" of HF tensors; the
full-tensor conversion is the same routine at TP rank 0 of 1. `load_hf_weights` gives it a source
over memory-mapped safetensors files, so each rank reads only its own PP stage's tensors and, via
`get_slice`, only its TP rows/columns: q/k/v rows of its query groups, gate/up rows of its shard,
its vocab rows, its columns of o_proj/down_proj. Every model parameter must be filled; a missing
tensor or a wrong shape raises a `ValueError` naming the file and the tensor.
Critic/reward models skip the LM head (their scalar head stays freshly initialised) unless the
checkpoint is a 1-label `*ForSequenceClassification` reward model, whose `score.weight` is loaded
(bias 0). The name maps and the Megatron -> HF rename of full tensors live in `hf_names.py`, saving
an HF directory in `hf_save.py`; this module re-exports both.
"""

from __future__ import annotations

import os
from collections import defaultdict
from contextlib import ExitStack
from typing import Mapping

import torch

from hybridflow.config import ModelConfig
from hybridflow.models.build import padded_vocab_size
from hybridflow.models.hf_config import check_tokenizer_vocab, load_json, read_hf_config
from hybridflow.models.hf_names import (LAYER_HF, TE_ALIASES, dims, expert_suffix,
                                        megatron_param_names, megatron_to_hf_state_dict)
from hybridflow.models.hf_save import save_hf_checkpoint
from hybridflow.models.lora import is_adapter_name
from hybridflow.parallel import param_rules as pr

__all__ = ["read_hf_config", "hf_to_megatron_state_dict", "megatron_to_hf_state_dict",
           "load_hf_weights", "load_hf_state_dict", "save_hf_checkpoint", "megatron_param_names"]


class _DictSource:
    """HF tensors held in memory (a state dict)."""

    def __init__(self, sd: Mapping[str, torch.Tensor], where: str = "HF state dict"):
        self.sd, self.where_all = sd, where
        self.read_numel: dict[str, int] = defaultdict(int)

    def has(self, name: str) -> bool:
        return name in self.sd

    def where(self, name: str) -> str:
        return self.where_all

    def shape(self, name: str) -> tuple:
        return tuple(self.sd[name].shape)

    def slice(self, name: str):
        return self.sd[name]


class _SafetensorsSource(_DictSource):
    """HF tensors in `model.safetensors` or shards listed by `model.safetensors.index.json`,
    opened lazily and memory-mapped: only sliced rows/columns are read."""

    def __init__(self, hf_dir: str, stack: ExitStack):
        from safetensors import safe_open

        self._open, self._stack, self._handles = safe_open, stack, {}
        self.read_numel = defaultdict(int)
        index, single = (os.path.join(hf_dir, f) for f in ("model.safetensors.index.json",
                                                            "model.safetensors"))
        if os.path.isfile(index):
            wmap = load_json(index).get("weight_map")
            if not isinstance(wmap, dict):
                raise ValueError(f"{index}: no weight_map")
            self.where_all = index
            self.file_of = {k: os.path.join(hf_dir, v) for k, v in wmap.items()}
        elif os.path.isfile(single):
            self.where_all = single
            self.file_of = {k: single for k in self._handle(single).keys()}
        else:
            raise FileNotFoundError(f"{hf_dir} has neither model.safetensors nor "
                                    "model.safetensors.index.json (only safetensors are read)")

    def _handle(self, path: str):
        if path not in self._handles:
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path} (listed in {self.where_all}) does not exist")
            self._handles[path] = self._stack.enter_context(self._open(path, framework="pt"))
        return self._handles[path]

    def has(self, name: str) -> bool:
        return name in self.file_of

    def where(self, name: str) -> str:
        return self.file_of.get(name, self.where_all)

    def shape(self, name: str) -> tuple:
        return tuple(self.slice(name).get_shape())

    def slice(self, name: str):
        return self._handle(self.file_of[name]).get_slice(name)


def _read(src, name: str, expect: tuple, *, rows=None, cols=None, needed_for: str) -> torch.Tensor:
    """Rows [a, b) or columns [a, b) (or all) of HF tensor `name`, after checking its full shape."""
    if not src.has(name):
        raise ValueError(f"{src.where(name)}: tensor {name!r} not found "
                         f"(needed for Megatron parameter {needed_for})")
    found = src.shape(name)
    if found != tuple(expect):
        raise ValueError(f"{src.where(name)}: tensor {name!r} has shape {list(found)}, expected "
                         f"{list(expect)} from the model config")
    sl = src.slice(name)
    t = sl[rows[0]:rows[1]] if rows else sl[:, cols[0]:cols[1]] if cols else sl[:]
    src.read_numel[name] += t.numel()
    return t


def _param_shard(gname: str, src, cfg: ModelConfig, *, tp_rank: int, tp_size: int,
                 vpad: int) -> torch.Tensor | None:
    """This TP rank's shard of Megatron parameter `gname` (global layer index) from HF tensors."""
    H, F, V = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size
    hd, hpg = dims(cfg)
    G, heads = cfg.num_query_groups, cfg.num_attention_heads
    rd = lambda n, shape, **kw: _read(src, n, shape, needed_for=gname, **kw)  # noqa: E731
    if gname in ("embedding.word_embeddings.weight", "output_layer.weight"):
        lm = gname == "output_layer.weight" and not cfg.tie_word_embeddings
        per = vpad // tp_size
        a = min(tp_rank * per, V)
        b = max(a, min((tp_rank + 1) * per, V))
        name = "lm_head.weight" if lm else "model.embed_tokens.weight"
        part = rd(name, (V, H), rows=(a, b))
        out = part.new_zeros(per, H)  # padded vocab rows stay zero
        out[: part.shape[0]] = part
        return out
    if gname == "decoder.final_layernorm.weight":
        return rd("model.norm.weight", (H,))
    if gname.startswith("output_layer.linear."):  # value head: only from a 1-label reward model
        if not (cfg.hf_architecture or "").endswith("ForSequenceClassification"):
            return None
        w = rd("score.weight", (1, H))
        return w if gname.endswith("weight") else w.new_zeros(1)
    layer = pr.layer_index(gname)
    if layer is None:
        raise ValueError(f"no Hugging Face tensor maps to Megatron parameter {gname!r}")
    suffix = gname.split(f"decoder.layers.{layer}.", 1)[1]
    suffix = TE_ALIASES.get(suffix, suffix)
    p = f"model.layers.{layer}."
    if suffix in ("input_layernorm.weight", "pre_mlp_layernorm.weight"):
        return rd(p + LAYER_HF[suffix], (H,))
    if suffix in ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"):
        return rd(p + LAYER_HF[suffix], (hd,))  # one weight shared by every head: replicated
    if suffix == "self_attention.linear_proj.weight":  # row parallel: split columns
        per = heads * hd // tp_size
        return rd(p + "self_attn.o_proj.weight", (H, heads * hd),
                  cols=(tp_rank * per, (tp_rank + 1) * per))
    if suffix == "mlp.router.weight":
        return rd(p + "mlp.gate.weight", (cfg.moe.num_experts, H))
    expert = expert_suffix(suffix)
    if expert is not None:  # tp_rank / tp_size: the expert TP group's
        q, Fe = p + f"mlp.experts.{expert[0]}.", cfg.moe.moe_ffn_hidden_size
        per = Fe // tp_size
        r = (tp_rank * per, (tp_rank + 1) * per)
        if expert[1] == "linear_fc2":
            return rd(q + "down_proj.weight", (H, Fe), cols=r)
        return torch.cat([rd(q + "gate_proj.weight", (Fe, H), rows=r),
                          rd(q + "up_proj.weight", (Fe, H), rows=r)], 0)
    if suffix == "mlp.linear_fc2.weight":
        per = F // tp_size
        return rd(p + "mlp.down_proj.weight", (H, F), cols=(tp_rank * per, (tp_rank + 1) * per))
    if suffix == "mlp.linear_fc1.weight":  # [gate_r; up_r]
        per = F // tp_size
        r = (tp_rank * per, (tp_rank + 1) * per)
        return torch.cat([rd(p + "mlp.gate_proj.weight", (F, H), rows=r),
                          rd(p + "mlp.up_proj.weight", (F, H), rows=r)], 0)
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        gl = G // tp_size  # this rank's query groups g0 .. g0+gl-1, contiguous in q, k and v
        g0 = tp_rank * gl
        rest = (H,) if kind == "weight" else ()
        q = rd(p + f"self_attn.q_proj.{kind}", (heads * hd, *rest),
               rows=(g0 * hpg * hd, (g0 + gl) * hpg * hd))
        k, v = (rd(p + f"self_attn.{n}_proj.{kind}", (G * hd, *rest),
                   rows=(g0 * hd, (g0 + gl) * hd)) for n in "kv")
        packed = torch.cat([q.reshape(gl, hpg * hd, *rest), k.reshape(gl, hd, *rest),
                            v.reshape(gl, hd, *rest)], 1)  # (gl, (hpg + 2) * hd, ...)
        return packed.reshape(gl * (hpg + 2) * hd, *rest)
    raise ValueError(f"no Hugging Face tensor maps to Megatron parameter {gname!r}")


def hf_to_megatron_state_dict(hf_sd: Mapping[str, torch.Tensor], cfg: ModelConfig, *,
                              tp: int = 1) -> dict[str, torch.Tensor]:
    """Full (unsharded) Megatron tensors under global names; vocab padded for TP=`tp`."""
    src, vpad = _DictSource(hf_sd), padded_vocab_size(cfg.vocab_size, tp)
    return {n: _param_shard(n, src, cfg, tp_rank=0, tp_size=1, vpad=vpad)
            for n in megatron_param_names(cfg)}


def _load(model, src, cfg: ModelConfig, *, tp_rank: int, tp_size: int, pp_rank: int,
          pp_size: int, ep_rank: int = 0, ep_size: int = 1, etp_rank: int | None = None,
          etp_size: int | None = None) -> dict[str, int]:
    vpad = padded_vocab_size(cfg.vocab_size, tp_size)
    for name, param in model.named_parameters():
        if is_adapter_name(name):  # LoRA adapters start fresh (models/lora.py)
            continue
        gname = pr.global_name(name, pp_rank=pp_rank, num_layers=cfg.num_layers, pp_size=pp_size)
        t_rank, t_size = tp_rank, tp_size
        if pr.expert_index(name) is not None:  # experts: EP-local index, expert TP group
            gname = pr.global_expert_name(gname, ep_rank=ep_rank, num_experts=cfg.moe.num_experts,
                                          ep_size=ep_size)
            t_rank = tp_rank if etp_rank is None else etp_rank
            t_size = tp_size if etp_size is None else etp_size
        shard = _param_shard(gname, src, cfg, tp_rank=t_rank, tp_size=t_size, vpad=vpad)
        if shard is None:  # scalar head of a critic/reward model from a causal LM: keep it fresh
            continue
        if tuple(shard.shape) != tuple(param.shape):
            raise ValueError(f"Megatron parameter {gname} (TP rank {tp_rank} of {tp_size}) has "
                             f"shape {list(param.shape)} but the checkpoint gives "
                             f"{list(shard.shape)}: the model was built from another config")
        with torch.no_grad():
            param.data.copy_(shard)
    return dict(src.read_numel)


def _check_role(role: str, model, cfg: ModelConfig, *, where: str) -> None:
    if getattr(model, "role", role) != role:
        raise ValueError(f"role={role!r} but the model was built for role={model.role!r}")
    arch = cfg.hf_architecture or ""
    if role == "reward" and not arch.endswith("ForSequenceClassification"):
        raise ValueError(f"{where}: role=reward needs a reward model (*ForSequenceClassification "
                         f"with a 1-label score head), got architecture {arch or 'unknown'}; a "
                         "causal LM would give an untrained score head")


def load_hf_weights(model, hf_dir: str, cfg: ModelConfig, *, tp_rank: int, tp_size: int,
                    pp_rank: int, pp_size: int, role: str = "actor",
                    **ep) -> dict[str, int]:
    """Fill this rank's stage/shard of `model` from the HF checkpoint `hf_dir`, reading only what it
    needs. Returns {HF tensor name: elements read} (what this rank touched). `ep`: MoE models'
    ep_rank, ep_size, etp_rank, etp_size (default: no EP, experts split as the attention's TP)."""
    if not os.path.isdir(hf_dir):
        raise FileNotFoundError(f"Hugging Face checkpoint directory {hf_dir} does not exist")
    check_tokenizer_vocab(hf_dir, cfg.vocab_size)
    _check_role(role, model, cfg, where=os.path.join(hf_dir, "config.json"))
    with ExitStack() as stack:
        return _load(model, _SafetensorsSource(hf_dir, stack), cfg, tp_rank=tp_rank,
                     tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, **ep)


def load_hf_state_dict(model, hf_sd: Mapping[str, torch.Tensor], cfg: ModelConfig, *,
                       tp_rank: int, tp_size: int, pp_rank: int, pp_size: int,
                       role: str = "actor", where: str = "HF state dict", **ep) -> dict[str, int]:
    """`load_hf_weights` from tensors in memory (e.g. a dequantised GGUF file)."""
    _check_role(role, model, cfg, where=where)
    return _load(model, _DictSource(hf_sd, where), cfg, tp_rank=tp_rank, tp_size=tp_size,
                 pp_rank=pp_rank, pp_size=pp_size, **ep)
