"""Synthetic tasks for the embedded CPU demo and tests: verl-format records made on the fly.

A task is a registered function `(rng, size) -> list of records`; every record has a `prompt`, a
`data_source`, `reward_model.ground_truth` (checked by the rule reward `math_exact` / `exact`) and
`extra_info.sft_response`, the reference response used by the optional supervised warm-up.
`tokenizer_corpus(records)` gives lines to train a small sentencepiece tokenizer on.

- `arith`: "a+b=" with a, b in 0..9, answer "a+b" (the reward's last-number rule reads it). Small
  enough that a 2-layer model learns it on a laptop CPU in minutes, hard enough that a short warm-up
  leaves room for RL to improve.
- `arith_chat`: the same question as a chat message, for instruct models with a chat template.
- `reverse`: "rev:abc=" -> "#### cba" over a small alphabet (longer responses, exercises GAE).
- `copy`: 120-letter prompts copied back: realistic prompt lengths for timing runs. Its length is
  `data.synthetic_length` letters; with the char tokenizer of the demo a prompt is that many tokens
  plus 8 (BOS, the word piece "▁", "copy:" and "="): 142 letters make the 150-token prompts of
  conf/experiment/scaleout_8b.yaml.

A task that takes a `length` keyword accepts `make_task(..., length=N)`; others refuse it.
"""

from __future__ import annotations

import inspect
import random

from hybridflow.registry import Registry

TASKS = Registry("synthetic task (data.synthetic)")
register_task = TASKS.register


def make_task(name: str, *, size: int, seed: int, length: int | None = None) -> list[dict]:
    """`size` records of task `name`; `length` (data.synthetic_length) only for tasks that take it."""
    fn = TASKS.lookup(name)
    if length is None:
        return fn(random.Random(seed), size)
    if "length" not in inspect.signature(fn).parameters:
        raise ValueError(f"data.synthetic_length={length}: task {name!r} has no length option "
                         "(tasks with one: " + ", ".join(
                             n for n, f in sorted(TASKS.items())
                             if "length" in inspect.signature(f).parameters) + ")")
    if length < 1:
        raise ValueError(f"data.synthetic_length={length} must be a positive number of letters")
    return fn(random.Random(seed), size, length=length)


def _record(prompt: str, answer: str, source: str, response: str | None = None) -> dict:
    return {"prompt": prompt, "data_source": source,
            "reward_model": {"ground_truth": answer, "style": "rule"},
            "extra_info": {"sft_response": response if response is not None else f"#### {answer}"}}


@register_task("arith")
def _arith(rng: random.Random, size: int) -> list[dict]:
    out = []
    for _ in range(size):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        out.append(_record(f"{a}+{b}=", str(a + b), "synthetic_arith", response=str(a + b)))
    return out


@register_task("arith_chat")
def _arith_chat(rng: random.Random, size: int) -> list[dict]:
    """`arith` as a chat message (rendered by the tokenizer's chat template): for instruct models."""
    out = []
    for r in _arith(rng, size):
        q = r["prompt"][:-1]
        r["prompt"] = [{"role": "user", "content": f"What is {q}? Reply with just the number."}]
        out.append(r)
    return out


@register_task("reverse")
def _reverse(rng: random.Random, size: int) -> list[dict]:
    out = []
    for _ in range(size):
        s = "".join(rng.choice("abcde") for _ in range(rng.randint(2, 4)))
        out.append(_record(f"rev:{s}=", s[::-1], "synthetic_reverse"))
    return out


@register_task("copy")
def _copy(rng: random.Random, size: int, length: int = 120) -> list[dict]:
    """Long prompts ("copy:<`length` letters>=" -> the letters): timing runs at realistic lengths."""
    out = []
    for _ in range(size):
        s = "".join(rng.choice("abcdefghij") for _ in range(length))
        out.append(_record(f"copy:{s}=", s, "synthetic_copy"))
    return out


def tokenizer_corpus(records: list[dict]) -> list[str]:
    def text(p):
        return p if isinstance(p, str) else " ".join(m["content"] for m in p)

    return [text(r["prompt"]) + r["extra_info"]["sft_response"] for r in records]
