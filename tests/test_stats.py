"""Uncertainty of accuracies and paired uplifts, against values worked by hand (z = 1.959964)."""

import pytest

from grpo_core.evaluation.stats import paired_uplift, wilson_interval


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
