"""Tests for grpo_core.rewards: GSM8K answer extraction, scoring and the data_source lookup."""

import pytest

from grpo_core.rewards import get_reward_fn
from grpo_core.rewards.gsm8k import SEARCH_TAIL_CHARS, compute_score, extract_solution

# ---------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("So she has 18 eggs.\n#### 18", "18"),
        ("no space after the marker ####18", "18"),
        ("first try #### 12, on reflection #### 15", "15"),  # the last marker wins
        ("#### $1,234", "1234"),  # '$' and ',' are stripped
        ("the balance is #### -3", "-3"),
        ("#### 2.75", "2.75"),
        ("#### 18.00", "18.00"),  # extraction keeps the text; comparison is numeric (below)
    ],
)
def test_strict_extraction(text, expected):
    assert extract_solution(text, "strict") == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("I think 17", "17"),
        ("She had 3 apples, then 5 more, so the answer is 18.", "18"),  # sentence-final dot dropped
        ("It costs $1,234 in total", "1234"),
        ("The temperature fell to -3 degrees", "-3"),
        ("each one weighs 0.25 kg", "0.25"),
        ("#### 7 but actually 9", "9"),  # flexible ignores the marker: the last number
    ],
)
def test_flexible_extraction(text, expected):
    assert extract_solution(text, "flexible") == expected


def test_strict_needs_the_marker():
    assert extract_solution("I think 17", "strict") is None
    assert extract_solution("The answer is 18.", "strict") is None


def test_no_number_at_all():
    assert extract_solution("I have no idea.", "strict") is None
    assert extract_solution("I have no idea.", "flexible") is None


def test_only_the_tail_is_searched():
    assert SEARCH_TAIL_CHARS == 300
    filler = " and then we double-check everything" * 10  # 360 characters, no digits
    assert len(filler) >= 300 and not any(c.isdigit() for c in filler)
    text = "#### 5" + filler
    assert extract_solution(text, "strict") is None
    assert extract_solution(text, "flexible") is None

    # An answer at position 0 of a 400-character text lies outside the last 300 characters.
    text = "42" + "x" * 398
    assert len(text) == 400
    assert extract_solution(text, "flexible") is None
    assert extract_solution("#### 42" + "x" * 393, "strict") is None


def test_tail_boundary():
    # '#### 5' (6 chars) + 294 filler = 300 chars: the whole text is the tail, the marker is found.
    assert extract_solution("#### 5" + "x" * 294, "strict") == "5"
    # + 295 filler = 301 chars: the tail starts at the second '#', so '####' is cut to '###' and
    # strict finds nothing, while flexible still sees the '5'.
    text = "#### 5" + "x" * 295
    assert text[-SEARCH_TAIL_CHARS:].startswith("### 5")
    assert extract_solution(text, "strict") is None
    assert extract_solution(text, "flexible") == "5"


def test_unknown_method_raises():
    with pytest.raises(ValueError, match="unknown extraction method 'lenient'"):
        extract_solution("#### 5", "lenient")
    with pytest.raises(ValueError, match="strict"):
        compute_score("#### 5", "5", method="lenient")


# ---------------------------------------------------------------- scoring


def test_right_answer_gets_score():
    assert compute_score("#### 18", "18") == 1.0
    assert compute_score("#### 18", "18", score=2.5) == 2.5
    assert compute_score("so 18.", "18", method="flexible", score=3.0) == 3.0


@pytest.mark.parametrize(
    ("answer", "truth"),
    [("18.00", "18"), ("18", "18.0"), ("1,234", "1234"), ("$1,234", "1,234"), ("0.5", ".5"), ("-3", "-3.0")],
)
def test_answers_compare_as_numbers(answer, truth):
    assert compute_score(f"#### {answer}", truth) == 1.0


def test_wrong_sign_is_wrong():
    assert compute_score("#### -3", "3", format_score=0.1) == 0.1
    assert compute_score("#### 3", "-3", format_score=0.1) == 0.1


def test_format_score_for_found_but_wrong():
    # flexible finds '17' (an answer), which is wrong: format_score.
    assert compute_score("I think 17", "18", method="flexible", format_score=0.1) == 0.1
    # strict finds no '####' at all: 0, not format_score.
    assert compute_score("I think 17", "18", method="strict", format_score=0.1) == 0.0
    assert compute_score("#### 17", "18", method="strict", format_score=0.1) == 0.1
    # No number for flexible either: 0.
    assert compute_score("no idea", "18", method="flexible", format_score=0.1) == 0.0


def test_defaults_are_strict_and_zero_format_score():
    assert compute_score("I think 18", "18") == 0.0  # strict by default: no marker
    assert compute_score("#### 17", "18") == 0.0  # format_score defaults to 0


def test_last_marker_decides_the_score():
    assert compute_score("#### 18 ... wait, #### 20", "18") == 0.0
    assert compute_score("#### 20 ... wait, #### 18", "18") == 1.0


def test_unparsable_ground_truth_is_wrong():
    assert compute_score("#### 18", "eighteen", format_score=0.1) == 0.1


# ---------------------------------------------------------------- lookup


def test_get_reward_fn():
    assert get_reward_fn("openai/gsm8k") is compute_score
    assert get_reward_fn("gsm8k") is compute_score


def test_get_reward_fn_unknown_names_the_known():
    with pytest.raises(ValueError, match="math_dapo") as excinfo:
        get_reward_fn("math_dapo")
    assert "openai/gsm8k" in str(excinfo.value)
