"""Rule rewards: built-in math/format rules, user functions by spec, strict batch scoring."""

import sys
import types

import pytest

from hybridflow.reward import RewardError, compute_rule_rewards, get_reward_fn, register_reward
from hybridflow.reward import rules
from hybridflow.reward.rules import extract_answer


@pytest.mark.parametrize("response, truth, score", [
    ("She sold 48 + 24 = 72 clips.\n#### 72", "72", 1.0),
    ("#### 1,234.", "1234", 1.0),
    ("#### $42.0", "42", 1.0),
    ("#### **42**", 42, 1.0),
    ("so the answer is #### 41\nthen more text 42", "42", 0.0),
    ("The answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("first \\boxed{3} then \\boxed{{x}^{2}+1}", "{x}^{2}+1", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", 1.0),
    ("it is 10 then 12.50 dollars", "12.5", 1.0),
    ("It is 3,000 apples.", "3000", 1.0),
    ("I think 7", "8", 0.0),
    ("no answer here", "8", 0.0),
    ("\\boxed{2", "2", 1.0),  # unbalanced box: falls back to the last number
    ("#### 5", ["4", "5"], 1.0),
])
def test_math_exact(response, truth, score):
    assert get_reward_fn("math_exact")("q", response, truth, None) == score


def verl_gsm8k_compute_score(solution_str, ground_truth):
    """verl/utils/reward_score/gsm8k.py (method="strict", format_score=0, score=1), verbatim logic."""
    import re

    if len(solution_str) > 300:
        solution_str = solution_str[-300:]
    solutions = re.findall("#### (\\-?[0-9\\.\\,]+)", solution_str)
    if len(solutions) == 0:
        return 0
    final_answer = solutions[-1].replace(",", "").replace("$", "")
    return 1.0 if final_answer == ground_truth else 0


# (response, ground truth, math_exact, gsm8k_strict)
GSM8K_CASES = [
    ("She sold 48 + 24 = 72 clips.\n#### 72", "72", 1.0, 1.0),
    ("#### 1,234", "1234", 1.0, 1.0),  # commas
    ("#### 1,234.", "1234", 1.0, 0.0),  # trailing period: strict keeps it in the number
    ("so 12 + 6 = 18.\n#### 18.", "18", 1.0, 0.0),
    ("#### -5", "-5", 1.0, 1.0),  # negative
    ("#### - 5", "-5", 1.0, 0.0),  # strict needs the sign on the number
    ("#### $18", "18", 1.0, 0.0),  # strict: "$" right after "#### " is no number
    ("#### 18.0", "18", 1.0, 0.0),  # decimals: lenient compares numbers, strict strings
    ("#### 18.50", "18.5", 1.0, 0.0),
    ("####18", "18", 1.0, 0.0),  # strict needs the space
    ("The answer is 18.", "18", 1.0, 0.0),  # no ####: lenient takes the last number
    ("The answer is \\boxed{18}", "18", 1.0, 0.0),
    ("#### 17\nwait, no: #### 18", "18", 1.0, 1.0),  # the last ####
    ("#### 18\nwait, no: #### 17", "18", 0.0, 0.0),
    ("#### 18\n" + "filler " * 50, "18", 1.0, 0.0),  # verl reads only the last 300 characters
    ("no answer here", "18", 0.0, 0.0),
]


@pytest.mark.parametrize("response, truth, lenient, strict", GSM8K_CASES)
def test_gsm8k_rules(response, truth, lenient, strict):
    assert get_reward_fn("math_exact")("q", response, truth, None) == lenient
    assert get_reward_fn("gsm8k_strict")("q", response, truth, None) == strict
    assert strict == verl_gsm8k_compute_score(response, truth)  # the reference agrees with the table


def test_gsm8k_strict_list_ground_truth():
    assert get_reward_fn("gsm8k_strict")("q", "#### 5", ["4", "5"], None) == 1.0
    assert get_reward_fn("gsm8k_strict")("q", "#### 6", ["4", "5"], None) == 0.0


def test_extract_answer_order():
    assert extract_answer("\\boxed{1} #### 2") == "2"
    assert extract_answer("3 \\boxed{1} 4") == "1"
    assert extract_answer("nothing") is None


def test_format_and_math_with_format():
    fmt, mwf = get_reward_fn("format"), get_reward_fn("math_with_format")
    assert fmt("q", "#### 5", "5", None) == 1.0 and fmt("q", "5", "5", None) == 0.0
    assert mwf("q", "#### 5", "5", None) == 1.0
    assert mwf("q", "#### 6", "5", None) == 0.1
    assert mwf("q", "6", "5", None) == 0.0
    assert mwf("q", "\\boxed{5}", "5", None) == 1.0


def test_default_dispatches_on_data_source():
    fn = get_reward_fn("default")
    scores, extra = compute_rule_rewards(fn, prompts=["q", "q"], responses=["#### 5", "#### 5"],
                                         ground_truths=["5", "6"], extra_infos=[None, {"split": "test"}],
                                         indices=[10, 11], data_sources=["openai/gsm8k", "lighteval/MATH"])
    assert scores == [1.0, 0.0] and extra == {}
    with pytest.raises(RewardError, match=r"data index 3.*no rule for data_source 'mystery'.*openai/gsm8k"):
        compute_rule_rewards(fn, prompts=["q"], responses=["#### 5"], ground_truths=["5"], extra_infos=[None],
                             indices=[3], data_sources=["mystery"])


def test_register_reward_and_duplicate(monkeypatch):
    monkeypatch.setattr(rules, "_REWARDS", dict(rules._REWARDS))  # keep the global registry clean
    monkeypatch.setattr(rules, "_DATA_SOURCES", dict(rules._DATA_SOURCES))

    @register_reward("test_len_reward", data_sources=("test/len",))
    def _len(prompt, response, ground_truth, extra_info):
        return {"score": float(len(response)), "chars": len(response)}

    scores, extra = compute_rule_rewards(get_reward_fn("default"), prompts=["q"], responses=["abc"],
                                         ground_truths=[None], extra_infos=[None], indices=[0],
                                         data_sources=["test/len"])
    assert scores == [3.0] and extra == {"chars": [3.0]}
    with pytest.raises(ValueError, match="already registered"):
        register_reward("test_len_reward")(_len)


def test_user_fn_from_module_and_file(tmp_path, monkeypatch):
    mod = types.ModuleType("my_rewards_mod")
    mod.score = lambda prompt, response, gt, info: 1.0 if response == gt else 0.0
    mod.not_fn = 3
    monkeypatch.setitem(sys.modules, "my_rewards_mod", mod)
    fn = get_reward_fn("my_rewards_mod:score")
    assert fn.spec == "my_rewards_mod:score" and fn("p", "a", "a", None) == 1.0

    f = tmp_path / "reward.py"
    f.write_text("def compute(prompt, response, ground_truth, extra_info):\n    return len(response) == 2\n")
    fn = get_reward_fn(f"{f}:compute")
    scores, _ = compute_rule_rewards(fn, prompts=["p", "p"], responses=["ab", "abc"], ground_truths=[0, 0],
                                     extra_infos=[None, None], indices=[0, 1])
    assert scores == [1.0, 0.0]  # bool is accepted as 1/0

    with pytest.raises(FileNotFoundError, match="missing.py"):
        get_reward_fn(f"{tmp_path}/missing.py:compute")
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        get_reward_fn(f"{f}:nope")
    with pytest.raises(ValueError, match="not a function"):
        get_reward_fn("my_rewards_mod:not_fn")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        get_reward_fn("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="not registered.*math_exact"):
        get_reward_fn("mathexact")


def boom(prompt, response, ground_truth, extra_info):
    if response == "bad":
        raise KeyError("answer")
    return 1.0


@pytest.mark.parametrize("value, match", [
    (None, "returned NoneType"), ("1.0", "returned str"), (float("nan"), "finite"), ({"acc": 1.0}, "without 'score'"),
    ({"score": 1.0, "x": "y"}, "value of 'x'"),
])
def test_bad_returns_raise_reward_error(value, match):
    with pytest.raises(RewardError, match=f"data index 42.*{match}"):
        compute_rule_rewards(lambda *a: value, prompts=["p"], responses=["r"], ground_truths=["g"],
                             extra_infos=[None], indices=[42])


def test_raising_user_fn_names_index_and_spec(tmp_path):
    f = tmp_path / "r.py"
    f.write_text("def f(prompt, response, ground_truth, extra_info):\n"
                 "    if response == 'bad':\n        raise KeyError('answer')\n    return 1.0\n")
    fn = get_reward_fn(f"{f}:f")
    with pytest.raises(RewardError) as e:
        compute_rule_rewards(fn, prompts=["p", "p"], responses=["ok", "bad"], ground_truths=["g", "g"],
                             extra_infos=[None, None], indices=[100, 205])
    msg = str(e.value)
    assert "data index 205" in msg and f"{f}:f" in msg and "KeyError" in msg and "answer" in msg
    assert isinstance(e.value, ValueError)
    with pytest.raises(RewardError, match="'boom' on data index 7 raised KeyError"):
        compute_rule_rewards(boom, prompts=["p"], responses=["bad"], ground_truths=["g"], extra_infos=[None],
                             indices=[7])


def test_inconsistent_extras_and_length_mismatch():
    outs = iter([{"score": 1.0, "a": 1.0}, {"score": 1.0, "b": 1.0}])
    with pytest.raises(RewardError, match="data index 1.*same keys"):
        compute_rule_rewards(lambda *a: next(outs), prompts=["p"] * 2, responses=["r"] * 2, ground_truths=["g"] * 2,
                             extra_infos=[None] * 2, indices=[0, 1])
    with pytest.raises(ValueError, match="2 responses"):
        compute_rule_rewards(boom, prompts=["p"], responses=["r", "r"], ground_truths=["g"] * 2,
                             extra_infos=[None] * 2, indices=[0, 1])


def test_paired_comparison_by_hand():
    from hybridflow.validation import paired_comparison

    r = paired_comparison([1, 1, 1, 0, 0, 1], [1, 0, 0, 0, 1, 1])
    assert (r["only_a"], r["only_b"], r["n"]) == (2, 1, 6)
    assert r["accuracy_a"] == 4 / 6 and r["accuracy_b"] == 3 / 6
    assert r["mcnemar_p"] == 1.0  # 2 vs 1 discordant: 2 x P(X <= 1 | 3, 1/2) = 1
    lopsided = paired_comparison([1] * 10 + [0] * 5, [0] * 10 + [0] * 5)
    assert lopsided["only_a"] == 10 and lopsided["mcnemar_p"] == pytest.approx(2 / 2 ** 10)
    assert paired_comparison([1, 0], [1, 0])["mcnemar_p"] == 1.0  # no discordant problem
    with pytest.raises(ValueError, match="equally long"):
        paired_comparison([1], [1, 0])
