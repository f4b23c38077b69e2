"""Rule rewards: a registry of scoring functions and the built-in math/format rules.

A reward function is called as `fn(prompt, response, ground_truth, extra_info) -> float` (or a dict
with "score" plus extra float metrics). `get_reward_fn(spec)` resolves a registered name, a
`module.path:function`, or a `/path/to/file.py:function`.

Built-ins:
- `math_exact`: 1.0 when the final answer equals the ground truth, else 0.0. The final answer is the
  text after the last `####` (GSM8K style, to the end of that line); else the content of the last
  `\\boxed{...}` (nested braces allowed); else the last number in the response. Both sides are
  normalised (whitespace, commas, `$`, markdown `*`, a trailing `.`, `\\frac{a}{b}` -> a/b) and compared
  as exact rationals when both parse as numbers ("42.0" == "42", "0.5" == "1/2"), else as strings.
  A list ground truth accepts any of its answers.
- `gsm8k_strict`: verl's GSM8K rule (verl/utils/reward_score/gsm8k.py, method "strict"), kept exact
  so numbers compare with verl's: within the last 300 characters, the last `#### <number>` (the
  number is `-?[0-9.,]+` right after "#### "), commas and `$` removed, equal as a string to the
  ground truth -> 1.0, else 0.0. So "#### 18.0" or "#### 18." is wrong for 18, and "#### $18" or
  "####18" has no answer at all; `math_exact` is the lenient reading of the same responses.
- `format`: 1.0 when the response matches `pattern` (default: `#### <something>`), else 0.0.
- `math_with_format`: 1.0 correct; 0.1 well formatted but wrong; 0.0 otherwise. A correct answer in
  another format still gets 1.0: correctness is what we optimise, the bonus only bootstraps format.
- `default`: dispatches on `extra_info["data_source"]` (filled in by `compute_rule_rewards`) to the
  rule registered for that data source, as verl's default_compute_score does.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import re
import sys
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable

_REWARDS: dict[str, Callable] = {}
_DATA_SOURCES: dict[str, str] = {}  # data_source -> registered reward name, used by `default`


def register_reward(name: str, *, data_sources: tuple[str, ...] = ()) -> Callable:
    """Decorator: register a reward function under `name` (and as `default`'s rule for `data_sources`)."""
    def wrap(fn: Callable) -> Callable:
        if name in _REWARDS:
            raise ValueError(f"reward {name!r} is already registered")
        _REWARDS[name] = fn
        for source in data_sources:
            _DATA_SOURCES[source] = name
        return fn
    return wrap


@dataclass(frozen=True)
class RewardFn:
    """A resolved reward function together with the spec it came from (for error messages)."""
    spec: str
    fn: Callable

    def __call__(self, prompt: str, response: str, ground_truth: Any, extra_info: dict | None):
        return self.fn(prompt, response, ground_truth, extra_info)


def get_reward_fn(spec: str) -> RewardFn:
    if spec in _REWARDS:
        return RewardFn(spec, _REWARDS[spec])
    if ":" not in spec:
        raise ValueError(f"reward {spec!r} is not registered (known: {', '.join(sorted(_REWARDS))}); "
                         "or give module.path:function or /path/to/file.py:function")
    target, fn_name = spec.rsplit(":", 1)
    if target.endswith(".py") or "/" in target:
        path = Path(target).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"reward {spec!r}: file {str(path)!r} does not exist")
        # a unique module name per file so two user files called reward.py do not collide
        mod_name = "hybridflow_user_reward_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
        module_spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[mod_name] = module  # so the functions pickle (worker processes)
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[mod_name]
            raise ValueError(f"reward {spec!r}: loading {str(path)!r} failed ({type(e).__name__}: {e})") from e
    else:
        try:
            module = importlib.import_module(target)
        except Exception as e:  # ImportError, or whatever the module raises while importing
            raise ValueError(f"reward {spec!r}: cannot import module {target!r} ({type(e).__name__}: {e})") from e
    fn = getattr(module, fn_name, None)
    if fn is None:
        raise ValueError(f"reward {spec!r}: {target!r} has no attribute {fn_name!r}")
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {fn_name!r} is a {type(fn).__name__}, not a function")
    return RewardFn(spec, fn)


# ---- answer extraction and comparison ----------------------------------------------------------

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
FORMAT_PATTERN = r"####\s*\S+"


def extract_answer(response: str) -> str | None:
    """The final answer of a response: `####` line, else last `\\boxed{}`, else last number."""
    if "####" in response:
        return response.rsplit("####", 1)[1].split("\n", 1)[0].strip()
    boxed = _last_boxed(response)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(response)
    return numbers[-1] if numbers else None


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unbalanced: no answer


def normalize_answer(answer: str) -> str:
    s = _FRAC.sub(r"\1/\2", str(answer).strip())
    s = s.replace(",", "").replace("$", "").replace("*", "").strip()
    return s.rstrip(".").strip()


def _as_number(s: str) -> Fraction | None:
    try:
        return Fraction(s.replace(" ", ""))
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(answer: str, ground_truth: Any) -> bool:
    if isinstance(ground_truth, (list, tuple)):
        return any(answers_match(answer, g) for g in ground_truth)
    a, g = normalize_answer(answer), normalize_answer(str(ground_truth))
    na, ng = _as_number(a), _as_number(g)
    if na is not None and ng is not None:
        return na == ng
    return a == g


# ---- built-in rules ----------------------------------------------------------------------------

@register_reward("math_exact", data_sources=("gsm8k", "openai/gsm8k", "math", "lighteval/MATH",
                                             "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"))
def math_exact(prompt: str, response: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    answer = extract_answer(response)
    return 1.0 if answer is not None and answers_match(answer, ground_truth) else 0.0


_GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_GSM8K_CLIP_CHARS = 300  # verl searches only the tail: long responses, slow regexes


@register_reward("gsm8k_strict")
def gsm8k_strict(prompt: str, response: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    found = _GSM8K_STRICT.findall(response[-_GSM8K_CLIP_CHARS:])
    if not found:
        return 0.0
    answer = found[-1].replace(",", "").replace("$", "")
    truths = ground_truth if isinstance(ground_truth, (list, tuple)) else [ground_truth]
    return 1.0 if any(answer == str(t) for t in truths) else 0.0


@register_reward("format")
def format_reward(prompt: str, response: str, ground_truth: Any, extra_info: dict | None = None, *,
                  pattern: str = FORMAT_PATTERN) -> float:
    return 1.0 if re.search(pattern, response) else 0.0


@register_reward("math_with_format")
def math_with_format(prompt: str, response: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    if math_exact(prompt, response, ground_truth, extra_info):
        return 1.0
    return 0.1 if format_reward(prompt, response, ground_truth, extra_info) else 0.0


@register_reward("default")
def default(prompt: str, response: str, ground_truth: Any, extra_info: dict | None = None):
    source = (extra_info or {}).get("data_source")
    if source is None:
        raise ValueError("reward 'default' needs extra_info['data_source'] to pick a rule")
    if source not in _DATA_SOURCES:
        raise ValueError(f"reward 'default' has no rule for data_source {source!r} (known: "
                         f"{', '.join(sorted(_DATA_SOURCES))}); set reward.fn to a rule or register one "
                         "with register_reward(name, data_sources=(...))")
    return _REWARDS[_DATA_SOURCES[source]](prompt, response, ground_truth, extra_info)
