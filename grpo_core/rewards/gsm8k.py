"""GSM8K answer extraction and scoring.

The same two functions grade training rollouts and evaluation samples, so the reward and the reported
accuracy cannot drift apart. Semantics follow verl's ``gsm8k`` reward: only the tail of a response is
searched, ``strict`` wants the ``#### N`` marker the prompt asks for, ``flexible`` takes the last number.
"""

import re
from decimal import Decimal, InvalidOperation

from grpo_core.config.defaults import SETTING, defaults_from

SEARCH_TAIL_CHARS = 300
"""Only the last characters are searched: regexes over long rambling responses are slow, and the
answer belongs at the end."""

_NUMBER = r"-?\$?-?(?:\d[\d,]*(?:\.\d*)?|\.\d+)"
_STRICT = re.compile(r"#### ?(" + _NUMBER + ")")
_FLEXIBLE = re.compile(_NUMBER)
METHODS = ("strict", "flexible")


def _clean(number: str) -> str:
    """'$1,234.' -> '1234': drop thousands separators, currency and a sentence-final dot."""
    return number.replace(",", "").replace("$", "").rstrip(".")


def extract_solution(text: str, method: str) -> str | None:
    """The final answer in ``text`` as a plain number string, or None when there is none."""
    if method not in METHODS:
        raise ValueError(f"unknown extraction method {method!r}; valid: {list(METHODS)}")
    tail = text[-SEARCH_TAIL_CHARS:]
    pattern = _STRICT if method == "strict" else _FLEXIBLE
    for match in reversed(pattern.findall(tail)):
        answer = _clean(match)
        if answer not in ("", "-"):
            return answer
    return None


def _as_number(text: str) -> Decimal | None:
    try:
        return Decimal(_clean(text))
    except InvalidOperation:
        return None


def answers_match(answer: str, ground_truth: str) -> bool:
    """Compare as numbers, so '18.00' equals '18'; anything unparsable is simply wrong."""
    a, b = _as_number(answer), _as_number(ground_truth)
    return a is not None and b is not None and a == b


@defaults_from("reward_model")
def compute_score(
    solution_str: str,
    ground_truth: str,
    method: str = SETTING,
    format_score: float = SETTING,
    score: float = SETTING,
) -> float:
    """``score`` for a right answer, ``format_score`` for a found but wrong one, else 0 (verl's signature; the
    keywords default to the schema's ``reward_model`` settings of their names)."""
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    return score if answers_match(answer, ground_truth) else format_score
