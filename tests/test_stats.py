"""Uncertainty of accuracies and paired uplifts, against values worked by hand (z = 1.959964)."""

import pytest

from grpo_core.evaluation.stats import (
    format_rate,
    format_uplift,
    mean_difference,
    paired_uplift,
    verdict,
    wilson_interval,
)


def test_wilson_interval_hand_worked():
    # 14/20: centre (0.7 + z²/40) / (1 + z²/20) = 0.667775, half-width z·sqrt(0.0105 + z²/1600) / 1.192073 = 0.186747
    assert wilson_interval(14, 20) == pytest.approx((0.481027, 0.854523), abs=1e-6)
    # 0/10: the lower end stays at 0 and the upper is z² / (n + z²)
    assert wilson_interval(0, 10) == pytest.approx((0.0, 3.841459 / 13.841459), abs=1e-6)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_paired_uplift_newcombe_method_10_and_exact_mcnemar():
    # 20 questions: 8 both right, 6 only the trained model, 1 only the base, 5 neither
    base = [True] * 8 + [False] * 6 + [True] + [False] * 5
    trained = [True] * 8 + [True] * 6 + [False] + [False] * 5
    r = paired_uplift(base, trained)
    assert (r["both"], r["only_trained"], r["only_base"], r["neither"], r["n"]) == (8, 6, 1, 5, 20)
    assert r["uplift"] == pytest.approx(0.25)
    # Wilson: trained 14/20 (0.481027, 0.854523), base 9/20 (0.258198, 0.657915); phi = (8·5 - 6·1 - 20/2) /
    # sqrt(14·6·9·11) = 24 / 91.192 = 0.263181; delta = sqrt(0.218973² - 2·phi·0.218973·0.207915 + 0.207915²)
    # = 0.259256, epsilon = sqrt(0.154523² - 2·phi·0.154523·0.191802 + 0.191802²) = 0.212286
    assert (r["ci_low"], r["ci_high"]) == pytest.approx((-0.009256, 0.462286), abs=1e-6)
    # a gain of 6 against 1 on 20 questions is not significant: the interval holds 0 and p > 0.05
    # McNemar, exact: 7 discordant pairs, 1 against; p = 2·(C(7,0) + C(7,1)) / 2^7 = 0.125
    assert r["p_value"] == pytest.approx(0.125)


def test_paired_uplift_without_discordant_pairs():
    same = [True] * 10
    r = paired_uplift(same, same)
    assert (r["uplift"], r["p_value"]) == (0.0, 1.0)
    # a margin is empty (nobody wrong): phi = 0 and the interval is +-(p - Wilson low) = +-z²/(n + z²)
    assert (r["ci_low"], r["ci_high"]) == pytest.approx((-0.277532, 0.277532), abs=1e-6)
    empty = paired_uplift([], [])
    assert (empty["uplift"], empty["p_value"], empty["n"]) == (0.0, 1.0, 0)
    with pytest.raises(ValueError, match="differ in length"):
        paired_uplift([True], [True, False])


def _table(both: int, only_trained: int, only_base: int, neither: int) -> tuple[list[bool], list[bool]]:
    base = [True] * both + [False] * only_trained + [True] * only_base + [False] * neither
    trained = [True] * (both + only_trained) + [False] * (only_base + neither)
    return base, trained


def test_mcnemar_by_hand():
    # 10 against 2 discordant: 2 x (C(12,0) + C(12,1) + C(12,2)) / 2^12 = 158 / 4096
    assert paired_uplift(*_table(0, 10, 2, 0))["p_value"] == pytest.approx(158 / 4096)
    assert paired_uplift(*_table(0, 2, 10, 0))["p_value"] == pytest.approx(158 / 4096)
    assert paired_uplift(*_table(3, 5, 5, 3))["p_value"] == 1.0


def test_newcombe_with_an_empty_margin_by_hand():
    # 4 of 10 right after training, none before: phi = 0, so lower = 0.4 - sqrt((0.4 - 0.16818)^2 + 0.27753^2)
    # and upper = 0.4 + (Wilson(4, 10)'s upper - 0.4)
    r = paired_uplift(*_table(0, 4, 0, 6))
    assert (r["uplift"], r["ci_low"], r["ci_high"]) == pytest.approx((0.4, 0.03838, 0.68733), abs=1e-4)


def test_newcombe_is_antisymmetric_and_narrows_with_correlation():
    r = paired_uplift(*_table(30, 12, 3, 55))
    mirror = paired_uplift(*_table(30, 3, 12, 55))
    assert (mirror["uplift"], mirror["ci_low"], mirror["ci_high"]) == pytest.approx(
        (-r["uplift"], -r["ci_high"], -r["ci_low"])
    )
    assert r["uplift"] == pytest.approx(0.09) and r["ci_low"] < 0.09 < r["ci_high"]
    # the same margins (42 and 33 right of 100) with independent pairs (phi ~ 0) give a wider interval
    independent = paired_uplift(*_table(14, 28, 19, 39))
    assert independent["ci_high"] - independent["ci_low"] > r["ci_high"] - r["ci_low"]


def test_one_format_for_an_uplift_and_a_rate():
    result = {"uplift": 0.031, "ci_low": -0.012, "ci_high": 0.074, "p_value": 0.17, "n": 1319}
    assert format_uplift(result) == "+0.031 [\N{MINUS SIGN}0.012, +0.074], p = 0.17, 1,319 questions"
    assert format_uplift({**result, "p_value": 0.0004, "n": 1}) == "+0.031 [−0.012, +0.074], p < 0.001, 1 question"
    assert format_uplift({**result, "p_value": 0.0034}, unit="sample").endswith("p = 0.003, 1,319 samples")
    # 4 of 16: Wilson (0.101854, 0.494966)
    assert format_rate(4, 16) == "0.250 [0.102, 0.495], 16 questions"


def test_mean_difference_welch_by_hand():
    # 0.1 +- 0.2 (32) -> 0.3 +- 0.2 (32): se = sqrt(2 x 0.04 / 32) = 0.05, z = 4, p = 2 x sf(4) = 6.334e-5
    r = mean_difference((0.1, 0.2, 32), (0.3, 0.2, 32))
    assert (r["uplift"], r["ci_low"], r["ci_high"], r["n"]) == pytest.approx((0.2, 0.102002, 0.297998, 32), abs=1e-6)
    assert r["p_value"] == pytest.approx(6.334248e-5, rel=1e-5) and verdict(r) == "rose"
    flat = mean_difference((0.0, 0.0, 32), (0.0, 0.0, 32))  # every reward 0: nothing to learn from
    assert (flat["ci_low"], flat["ci_high"], flat["p_value"]) == (0.0, 0.0, 1.0)
    assert verdict(flat) == "no significant change (the interval holds 0)"
