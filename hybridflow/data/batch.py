"""RolloutBatch: the one record that flows through every stage of an RL step.

Layout: every row is [prompt (left-padded to P) | response (right-padded to R)], so all prompts end at
column P-1 and the token at column P+j is response token j. Position ids count real tokens only
(0 at each row's first prompt token). The model's output at column P+j-1 predicts response token j,
so per-token quantities (log-probs, values, rewards, advantages) are all (B, R), aligned with
`response_ids`. Fields are filled stage by stage; None means "not computed (yet)".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class RolloutBatch:
    # --- from the prompt data and the rollout ---
    prompt_ids: torch.Tensor  # (B, P) int64, left-padded with pad id
    prompt_mask: torch.Tensor  # (B, P) 0/1, 1 on real prompt tokens
    response_ids: torch.Tensor  # (B, R) int64, right-padded with pad id
    response_mask: torch.Tensor  # (B, R) 0/1, 1 up to and including EOS
    group_ids: torch.Tensor  # (B,) int64, rows sampled from the same prompt share an id
    indices: torch.Tensor  # (B,) int64, dataset index of each row's prompt
    # (B, R) log-prob of each sampled token under the generator (bf16 decode); None unless
    # rollout.return_logprobs. Compared with old_logprobs it measures the rollout/training mismatch.
    rollout_logprobs: Optional[torch.Tensor] = None
    # (B, R) 0/1, 1 on response tokens the model did not produce (tool results appended by a
    # multi-turn rollout): context for the forward, but outside the loss, KL and advantages
    # (`loss_mask`). None: every response token is the model's.
    tool_mask: Optional[torch.Tensor] = None
    # (B, P, L, k) / (B, R, L, k) int16: the k experts each of the L MoE layers' routers picked
    # for each prompt / response token in generation (actor.router_replay=R3; the training passes
    # route the tokens to them: models/moe.py); -1 where nothing was recorded (padding,
    # a response's last token, which generation never fed back). None unless recorded.
    prompt_experts: Optional[torch.Tensor] = None
    response_experts: Optional[torch.Tensor] = None
    # --- actor / reference / critic ---
    old_logprobs: Optional[torch.Tensor] = None  # (B, R) log pi_old(a_t | s_t)
    ref_logprobs: Optional[torch.Tensor] = None  # (B, R) log pi_ref(a_t | s_t)
    values: Optional[torch.Tensor] = None  # (B, R) V(s_t) from the critic
    # --- reward and advantages ---
    scores: Optional[torch.Tensor] = None  # (B,) sequence score from rules / reward model
    token_rewards: Optional[torch.Tensor] = None  # (B, R) score on the last token, minus KL if in reward
    advantages: Optional[torch.Tensor] = None  # (B, R)
    returns: Optional[torch.Tensor] = None  # (B, R)

    @property
    def batch_size(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def prompt_len(self) -> int:
        return self.prompt_ids.shape[1]

    def input_ids(self) -> torch.Tensor:  # (B, P + R)
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    def token_mask(self) -> torch.Tensor:  # (B, P + R)
        return torch.cat([self.prompt_mask, self.response_mask], dim=1)

    def position_ids(self) -> torch.Tensor:  # (B, P + R)
        return (self.token_mask().cumsum(dim=1) - 1).clamp(min=0)

    def experts(self) -> Optional[torch.Tensor]:  # (B, P + R, L, k), as input_ids
        if self.prompt_experts is None:
            return None
        return torch.cat([self.prompt_experts, self.response_experts], dim=1)

    def loss_mask(self) -> torch.Tensor:  # (B, R): the model's own response tokens
        if self.tool_mask is None:
            return self.response_mask
        return self.response_mask * (1 - self.tool_mask.to(self.response_mask.dtype))

    def _tensors(self):
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}

    def select(self, idx: torch.Tensor | slice) -> "RolloutBatch":
        return dataclasses.replace(self, **{k: v[idx] for k, v in self._tensors().items()})

    def split(self, size: int) -> list["RolloutBatch"]:
        return [self.select(slice(i, i + size)) for i in range(0, self.batch_size, size)]

    def to(self, device) -> "RolloutBatch":
        return dataclasses.replace(self, **{k: v.to(device) for k, v in self._tensors().items()})

    def padded_to(self, multiple: int) -> "RolloutBatch":
        """Right-pad the response columns so P + R is a multiple of `multiple` (sequence parallel)."""
        extra = -(self.prompt_len + self.response_ids.shape[1]) % multiple
        if extra == 0:
            return self
        out = {k: _pad_columns(v, 0, extra, _fill(k, 0)) for k, v in self._tensors().items()
               if v.dim() >= 2 and not k.startswith("prompt_")}
        return dataclasses.replace(self, **out)

    def widened(self, *, prompt_len: int, response_len: int, pad_id: int) -> "RolloutBatch":
        """Prompts left-padded to `prompt_len`, responses right-padded to `response_len` (ids with
        `pad_id`, masks and per-token values with 0, expert ids with -1)."""
        out = {}
        for k, v in self._tensors().items():
            fill = _fill(k, pad_id)
            if k.startswith("prompt_"):
                v = _pad_columns(v, prompt_len - v.shape[1], 0, fill)
            elif v.dim() >= 2:
                v = _pad_columns(v, 0, response_len - v.shape[1], fill)
            out[k] = v
        return dataclasses.replace(self, **out)

    @staticmethod
    def cat(batches: list["RolloutBatch"], *, pad_id: int) -> "RolloutBatch":
        """Rows of `batches` in order, of any widths, widened to the widest (see `widened`).
        Every batch must have the same fields set."""
        assert batches, "cat needs at least one batch"
        p = max(b.prompt_len for b in batches)
        r = max(b.response_ids.shape[1] for b in batches)
        wide = [b.widened(prompt_len=p, response_len=r, pad_id=pad_id) for b in batches]
        out = {}
        for f in dataclasses.fields(RolloutBatch):
            parts = [getattr(b, f.name) for b in wide]
            if all(t is None for t in parts):
                out[f.name] = None
                continue
            assert all(t is not None for t in parts), f"field {f.name} is set in only some batches"
            out[f.name] = torch.cat(parts)
        return RolloutBatch(**out)

    def trimmed(self) -> "RolloutBatch":
        """Drop columns that are padding in every row (common left prompt pad, right response pad)."""
        p_keep = int(self.prompt_mask.sum(1).max())
        r_keep = max(int(self.response_mask.sum(1).max()), 1)
        out = {}
        for k, v in self._tensors().items():
            if k.startswith("prompt_"):
                out[k] = v[:, v.shape[1] - p_keep:]
            elif v.dim() >= 2:
                out[k] = v[:, :r_keep]
            else:
                out[k] = v
        return dataclasses.replace(self, **out)


def _fill(name: str, pad_id: int) -> int:
    """The value padding columns of field `name` hold: the pad id for token ids, -1 for expert ids
    (nothing recorded), else 0."""
    if name in ("prompt_ids", "response_ids"):
        return pad_id
    return -1 if name.endswith("_experts") else 0


def _pad_columns(v: torch.Tensor, left: int, right: int, value: int) -> torch.Tensor:
    """`v` (B, T, ...) with `left` / `right` columns of `value` added on dim 1."""
    if left == 0 and right == 0:
        return v
    return torch.nn.functional.pad(v, (0, 0) * (v.dim() - 2) + (left, right), value=value)
