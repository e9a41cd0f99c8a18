"""Answer extraction, math-verify equivalence and the math reward classes (hand-written cases)."""

from __future__ import annotations

import threading

import pytest

from logra_lightning.errors import ConfigError
from logra_lightning.rewards.base import safe_rewards
from logra_lightning.rewards.math import (
    ExtractedMatchReward,
    MathVerifyReward,
    answers_match,
    extract_answer,
    extract_boxed,
    has_answer_format,
    math_verify_score,
)

# (completion, extracted answer)
EXTRACTION_CASES = [
    (r"so the total is \boxed{42}.", "42"),
    (r"hence \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{\sqrt{2}}{2}"),
    (r"first \boxed{3}, no wait, \boxed{5}", "5"),  # several boxes: the last one
    (r"\fbox{7}", "7"),
    (r"the result is \boxed 5", "5"),
    (r"#### 3" + "\n" + r"\boxed{4}", "4"),  # a box beats ####
    ("4 bags of 300 is 1,200 ...\n#### 1,234", "1,234"),
    ("so he pays\n#### $18.", "18"),
    ("3 and 4 make 7\n#### 7\n#### 8", "8"),
    ("The answer is 42.", "42"),
    ("The final answer is $\\frac{3}{4}$. I hope it is correct.", r"\frac{3}{4}"),
    ("**Answer:** 12", "12"),
    ("Answer: 3.5 cm", "3.5 cm"),
    ("I think the answer is Monday.", "Monday"),
    ("I get 3, then 4, then 10 apples", "10"),  # last-number fallback
    ("it cools to -5 degrees", "-5"),
    ("each costs 2.50 dollars.", "2.50"),
    ("she sold 1/2 of them", "1/2"),
    ("a total of 12,000 people", "12,000"),
    ("I don't know", None),
    ("", None),
    (r"so it is \boxed{\frac{3}{4}", None),  # cut off inside the box: no answer, not "4"
]


@pytest.mark.parametrize(("completion", "expected"), EXTRACTION_CASES)
def test_extract_answer(completion, expected):
    assert extract_answer(completion) == expected


def test_extract_answer_without_last_number_fallback():
    assert extract_answer("it is 10", last_number_fallback=False) is None
    assert extract_answer("#### 10", last_number_fallback=False) == "10"


def test_extract_boxed_balances_nested_braces_and_skips_open_box():
    text = r"\boxed{\frac{a^{2}}{b}} and \boxed{} and \boxed{x"
    assert extract_boxed(text) == [r"\frac{a^{2}}{b}", ""]


# (completion, reference, reward with MathVerifyReward())
EQUIVALENCE_CASES = [
    # fractions and decimals
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{\dfrac{1}{2}}", r"\frac12", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{1/2}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\tfrac{3}{4}}", "0.75", 1.0),
    (r"\boxed{\frac{1}{3}}", "0.333", 0.0),  # a rounded decimal is not the fraction
    (r"\boxed{2.0}", "2", 1.0),
    (r"\boxed{2.00001}", "2", 0.0),
    # signs
    (r"\boxed{-3}", "-3", 1.0),
    (r"\boxed{3}", "-3", 0.0),
    (r"\boxed{-\frac{1}{2}}", r"\frac{-1}{2}", 1.0),
    ("it drops to -7 degrees", "-7", 1.0),
    # GSM8K style, money, thousands separators
    ("#### 18", "18", 1.0),
    ("#### 1,000", "1000", 1.0),
    ("#### $18.00", "18", 1.0),
    (r"\boxed{\$5.00}", "5", 1.0),
    (r"\boxed{1{,}000}", "1000", 1.0),
    # units and degrees
    (r"\boxed{5 \text{ cm}}", "5", 1.0),
    (r"\boxed{18 \text{ dollars}}", "18", 1.0),
    ("The answer is 12 apples.", "12", 1.0),
    (r"\boxed{10^\circ}", "10", 1.0),
    # percentages
    (r"\boxed{25\%}", r"25\%", 1.0),
    (r"\boxed{50\%}", "0.5", 1.0),
    (r"\boxed{0.1}", r"10\%", 1.0),
    # radicals, pi, algebra
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", 1.0),
    (r"\boxed{\sqrt{12}}", r"2\sqrt{3}", 1.0),
    (r"\boxed{9\pi}", r"9\pi", 1.0),
    (r"\boxed{28.27}", r"9\pi", 0.0),
    (r"\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
    (r"\boxed{x=3}", "3", 1.0),
    # tuples
    (r"\boxed{(4, 3)}", "(4,3)", 1.0),
    (r"\boxed{(3, 4)}", "(4,3)", 0.0),
    # text answers
    (r"\boxed{\text{Monday}}", "Monday", 1.0),
    ("The answer is Monday.", r"\text{Monday}", 1.0),
    (r"\boxed{\text{Yes}}", "yes", 1.0),
    (r"\boxed{dynamo}", "Monday", 0.0),  # a bare word is not a product of letters
    (r"\boxed{sey}", "yes", 0.0),  # raw math-verify says E*s*y == E*s*y
    # several boxes, no answer, cut off
    (r"\boxed{3} no wait \boxed{5}", "5", 1.0),
    (r"\boxed{3} no wait \boxed{5}", "3", 0.0),
    ("I think it is 7.", "7", 1.0),
    ("no idea", "7", 0.0),
    ("", "7", 0.0),
    (r"the answer is \boxed{\frac{3}{4}", "4", 0.0),
]


@pytest.mark.parametrize(("completion", "reference", "expected"), EQUIVALENCE_CASES)
def test_math_verify_reward_cases(completion, reference, expected):
    assert MathVerifyReward()(["q"], [completion], [reference]) == [expected]


def test_case_count():
    assert len(EXTRACTION_CASES) + len(EQUIVALENCE_CASES) >= 30


def test_answers_match_accepts_an_equation_on_either_side():
    # math-verify's verify(gold, pred) is asymmetric in general; "x=3" vs "3" must match both ways
    assert answers_match("3", "x=3") and answers_match("x=3", "3")


def test_format_weight_rewards_a_checkable_answer_right_or_wrong():
    reward = MathVerifyReward(format_weight=0.2)
    completions = [r"\boxed{5}", "#### 6", "it is 5", "it is 6"]
    assert reward(["q"] * 4, completions, ["5"] * 4) == pytest.approx([1.2, 0.2, 1.0, 0.0])
    assert has_answer_format("#### 6") and not has_answer_format("#### ") and not has_answer_format(r"\boxed{5")


def test_no_last_number_fallback_needs_an_explicit_answer():
    reward = MathVerifyReward(last_number_fallback=False)
    assert reward(["q", "q"], ["it is 5", "#### 5"], ["5", "5"]) == [0.0, 1.0]


def test_math_verify_score_matches_the_class():
    assert math_verify_score(r"\boxed{\frac{6}{8}}", "0.75", format_weight=0.5) == 1.5


def test_reward_works_off_the_main_thread():
    # math-verify's signal-based timeout only works in the main thread; we must not fail elsewhere
    out = []
    worker = threading.Thread(target=lambda: out.append(MathVerifyReward()(["q"], [r"\boxed{\frac{2}{4}}"], ["0.5"])))
    worker.start()
    worker.join(timeout=60)
    assert out == [[1.0]]


def test_reward_errors_name_the_problem():
    reward = MathVerifyReward()
    with pytest.raises(ValueError, match="2 completions but 1 reference answers"):
        reward(["q", "q"], ["1", "2"], ["1"])
    with pytest.raises(TypeError, match="must be str, got NoneType"):
        reward(["q"], [None], ["1"])
    with pytest.raises(ValueError, match="empty reference answer"):
        reward(["q"], ["1"], ["  "])


def test_a_bad_sample_costs_only_that_sample_through_safe_rewards():
    rewards, errors, first = safe_rewards(MathVerifyReward(), ["q", "q"], [r"\boxed{4}", "4"], ["4", ""])
    assert rewards == [1.0, 0.0] and errors == 1 and "empty reference answer" in first


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"format_weight": -0.1}, "format_weight=-0.1"),
        ({"format_weight": float("nan")}, "format_weight=nan"),
        ({"timeout_seconds": 0}, "timeout_seconds=0"),
    ],
)
def test_math_verify_reward_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        MathVerifyReward(**kwargs)


@pytest.mark.parametrize(
    ("completion", "reference", "expected"),
    [
        ("#### 1,000", "1000", 1.0),
        ("The answer is $1000.00.", "1000", 1.0),
        ("The answer is $999.", "1000", 0.0),
        (r"\boxed{1000 \text{ dollars}}", "1000", 1.0),
        (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
        (r"\boxed{-\dfrac{3}{4}}", "-0.75", 1.0),
        (r"\boxed{50\%}", "50", 1.0),
        (r"\boxed{\text{Monday}}", "monday", 1.0),
        ("so 2+2 is 4", "5", 0.0),
        ("nothing", "5", 0.0),
    ],
)
def test_extracted_match_reward(completion, reference, expected):
    assert ExtractedMatchReward()(["q"], [completion], [reference]) == [expected]


def test_extracted_match_reward_format_weight_and_errors():
    assert ExtractedMatchReward(format_weight=0.5)(["q", "q"], ["#### 3", "3"], ["3", "3"]) == [1.5, 1.0]
    with pytest.raises(ConfigError, match="rel_tol=-1"):
        ExtractedMatchReward(rel_tol=-1)
    with pytest.raises(ValueError, match="1 completions but 2 reference answers"):
        ExtractedMatchReward()(["q"], ["3"], ["3", "4"])
