"""Rewards: rule functions (rules.py) and how a batch of responses is scored with one.

`compute_rule_rewards` calls the function once per response and checks what comes back. A function
that raises, or returns anything but a finite real number (or a dict whose "score" and other values
are finite real numbers), stops the run with a `RewardError` naming the dataset index, the reward spec
and the cause: a silent 0.0 would train the policy on a bug. `bool` is accepted as 1.0 / 0.0 (a
pass/fail check is a natural reward); numpy scalars are accepted; strings, None, tensors are not.
Extra metrics from dict returns must have the same keys for every response of the batch.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Sequence

from hybridflow.reward.rules import RewardFn, get_reward_fn, register_reward


class RewardError(ValueError):
    """A reward function failed or returned an invalid value for one response."""


def compute_rule_rewards(fn: Callable, *, prompts: Sequence[str], responses: Sequence[str],
                         ground_truths: Sequence[Any], extra_infos: Sequence[dict | None], indices: Sequence[int],
                         data_sources: Sequence[str] | None = None) -> tuple[list[float], dict[str, list[float]]]:
    """Score each response; returns (scores, extra metrics by name). `indices` are dataset indices.

    With `data_sources`, each call's `extra_info` is a copy of the record's with "data_source" added
    (the `default` rule dispatches on it); the dataset's own dicts are not modified.
    """
    n = len(responses)
    lengths = {"prompts": len(prompts), "ground_truths": len(ground_truths), "extra_infos": len(extra_infos),
               "indices": len(indices)}
    if data_sources is not None:
        lengths["data_sources"] = len(data_sources)
    bad = {k: v for k, v in lengths.items() if v != n}
    if bad:
        raise ValueError(f"compute_rule_rewards: {len(responses)} responses but {bad}")
    spec = fn.spec if isinstance(fn, RewardFn) else getattr(fn, "__qualname__", repr(fn))

    scores: list[float] = []
    extra: dict[str, list[float]] = {}
    for i in range(n):
        info = extra_infos[i]
        if data_sources is not None:
            info = {**(info or {}), "data_source": data_sources[i]}
        where = f"reward {spec!r} on data index {indices[i]}"
        try:
            value = fn(prompts[i], responses[i], ground_truths[i], info)
        except Exception as e:
            raise RewardError(f"{where} raised {type(e).__name__}: {e}") from e
        if isinstance(value, dict):
            if "score" not in value:
                raise RewardError(f"{where} returned a dict without 'score' (keys: {sorted(value)})")
            metrics = {k: _check(v, f"{where}: value of {k!r}") for k, v in value.items() if k != "score"}
            if i == 0:
                extra = {k: [] for k in metrics}
            elif set(metrics) != set(extra):
                raise RewardError(f"{where} returned extra keys {sorted(metrics)} but earlier responses "
                                  f"returned {sorted(extra)}; return the same keys every time")
            for k, v in metrics.items():
                extra[k].append(v)
            value = value["score"]
        elif extra:
            raise RewardError(f"{where} returned a bare score but earlier responses returned a dict with "
                              f"{sorted(extra)}; return the same kind every time")
        scores.append(_check(value, where))
    return scores, extra


def _check(value: Any, where: str) -> float:
    if not isinstance(value, numbers.Real):
        raise RewardError(f"{where} returned {type(value).__name__} {value!r:.80}; expected a float")
    value = float(value)
    if not math.isfinite(value):
        raise RewardError(f"{where} returned {value}; expected a finite float")
    return value


__all__ = ["RewardError", "RewardFn", "compute_rule_rewards", "get_reward_fn", "register_reward"]
