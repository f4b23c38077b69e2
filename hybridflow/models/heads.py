"""Scalar head for the critic and the reward model.

It replaces GPTModel's vocab-parallel `output_layer` and keeps its call signature
(`head(hidden, weight=None, runtime_gather_output=None) -> (out, bias)`), so Megatron's forward,
pipeline schedules and checkpointing work unchanged. The head is a replicated `hidden -> 1` linear in
fp32: with sequence parallelism the hidden states are first gathered over TP, so every TP rank holds
the full sequence and computes identical values (and identical head grads, so no extra all-reduce).
Output (s, b, 1) becomes (b, s, 1) in GPTModel.forward.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule


# the head's parameters in the model's state dict (a LoRA critic's checkpoints keep them: base.py)
VALUE_HEAD_PREFIX = "output_layer.linear."


class ValueHead(MegatronModule):
    def __init__(self, config, *, tp_group):
        super().__init__(config=config)
        self.tp_group = tp_group
        self.sequence_parallel = config.sequence_parallel
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.linear = torch.nn.Linear(config.hidden_size, 1, bias=True, dtype=torch.float32,
                                      device=device)
        torch.nn.init.normal_(self.linear.weight, std=config.init_method_std)
        torch.nn.init.zeros_(self.linear.bias)

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            # every TP rank computes the same full-sequence grad here: the backward must only split
            # it (tensor_parallel_output_grad=False), not sum it over TP
            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False,
                group=self.tp_group)
        # fp32 even when Float16Module has cast the module to bf16: values feed GAE and scores
        w, b = self.linear.weight.float(), self.linear.bias.float()
        return torch.nn.functional.linear(hidden_states.float(), w, b), None
