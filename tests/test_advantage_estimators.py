"""verl's critic-free advantage estimators beyond grpo, rloo and reinforce_plus_plus: hand-worked groups and, on
random batches, references written from each paper as plain Python loops over groups (fp64, 1e-9)."""

import math
import random
import statistics

import pytest
import torch

from grpo_core.algos import ADV_ESTIMATORS, get_adv_estimator

F64 = torch.float64
TOL = {"atol": 1e-9, "rtol": 1e-9}


def _batch(scores, lengths, width=4):
    """Outcome rewards on each row's last valid token, masks of the given lengths."""
    rows = len(scores)
    mask = torch.zeros(rows, width, dtype=F64)
    rewards = torch.zeros(rows, width, dtype=F64)
    for i, (s, n) in enumerate(zip(scores, lengths, strict=True)):
        mask[i, :n] = 1
        rewards[i, n - 1] = s
    return rewards, mask


def _per_row(adv: torch.Tensor, mask: torch.Tensor) -> list[float]:
    """The one value each row carries on its valid tokens (checked to be the same on each)."""
    out = []
    for row, m in zip(adv.tolist(), mask.tolist(), strict=True):
        values = {round(v, 12) for v, k in zip(row, m, strict=True) if k}
        assert len(values) <= 1
        out.append(next(iter(values)) if values else 0.0)
    return out


def _groups(index):
    groups: dict = {}
    for i, g in enumerate(index):
        groups.setdefault(g, []).append(i)
    return groups


def _whiten(values: list[float], weights: list[int]) -> list[float]:
    """Whitening over tokens: each row's value counted once per valid token (unbiased variance, eps 1e-8)."""
    tokens = [v for v, w in zip(values, weights, strict=True) for _ in range(w)]
    mean, var = statistics.fmean(tokens), statistics.variance(tokens)
    return [(v - mean) / math.sqrt(var + 1e-8) for v in values]


# ---------------------------------------------------------------- references from the papers


def ref_rf_baseline(scores, index, lengths):
    centred = [0.0] * len(scores)
    for rows in _groups(index).values():
        m = statistics.fmean(scores[i] for i in rows) if len(rows) > 1 else 0.0
        for i in rows:
            centred[i] = scores[i] - m
    return _whiten(centred, lengths)


def ref_passk(scores, index, norm=True, eps=1e-6):
    adv = [0.0] * len(scores)
    for rows in _groups(index).values():
        ordered = sorted(rows, key=lambda i: -scores[i])  # stable: the first seen of equal bests
        gap = scores[ordered[0]] - scores[ordered[1]]
        adv[ordered[0]] = gap / (statistics.stdev(scores[i] for i in rows) + eps) if norm else gap
    return adv


def ref_opo(scores, index, lengths):
    adv = [0.0] * len(scores)
    for rows in _groups(index).values():
        b = sum(lengths[i] * scores[i] for i in rows) / sum(lengths[i] for i in rows) if len(rows) > 1 else 0.0
        for i in rows:
            adv[i] = scores[i] - b
    return adv


def ref_gpg(scores, index, f_norm=1.0):
    alpha = len(scores) / max(1, sum(1 for s in scores if s != 0))
    adv = [0.0] * len(scores)
    for rows in _groups(index).values():
        m = statistics.fmean(scores[i] for i in rows) if len(rows) > 1 else 0.0
        for i in rows:
            adv[i] = alpha * (scores[i] - m) / f_norm
    return adv


def ref_grpo(scores, index, eps=1e-6):
    adv = [0.0] * len(scores)
    for rows in _groups(index).values():
        m, s = statistics.fmean(scores[i] for i in rows), statistics.stdev(scores[i] for i in rows)
        for i in rows:
            adv[i] = (scores[i] - m) / (s + eps)
    return adv


# ---------------------------------------------------------------- hand-worked


def test_passk_gives_only_each_groups_best_the_gap_to_the_second():
    # group a: 1, 0.25, 0 -> best row 0, gap 0.75; std (unbiased) of (1, .25, 0) = 0.5204165 -> 1.4411534
    # group b: 0.5, 0.5 -> the first 0.5 is best, gap 0 -> all zero
    rewards, mask = _batch([1.0, 0.25, 0.0, 0.5, 0.5], [2, 3, 4, 1, 2])
    adv, _ = get_adv_estimator("grpo_passk")(rewards, mask, index=list("aaabb"))
    assert _per_row(adv, mask) == pytest.approx([0.75 / (statistics.stdev([1, 0.25, 0]) + 1e-6), 0, 0, 0, 0], abs=1e-9)
    adv, _ = get_adv_estimator("grpo_passk")(rewards, mask, index=list("aaabb"), norm_adv_by_std_in_grpo=False)
    assert _per_row(adv, mask) == pytest.approx([0.75, 0, 0, 0, 0], abs=1e-12)
    with pytest.raises(ValueError, match="at least 2 responses"):
        get_adv_estimator("grpo_passk")(rewards, mask, index=list("aaabc"))


def test_opo_baseline_is_the_length_weighted_mean():
    # group: scores 1, 0 with lengths 1, 3: b = (1 * 1 + 3 * 0) / 4 = 0.25 -> advantages 0.75, -0.25
    # (the plain mean would be 0.5); a group of one keeps its score
    rewards, mask = _batch([1.0, 0.0, 0.7], [1, 3, 2])
    adv, ret = get_adv_estimator("opo")(rewards, mask, index=[0, 0, 1])
    assert _per_row(adv, mask) == pytest.approx([0.75, -0.25, 0.7], abs=1e-12)
    assert torch.equal(adv, ret) and torch.all(adv[mask == 0] == 0)


def test_gpg_scales_by_the_share_of_rewarded_responses():
    # scores 1, 0, 0, 0 in one group: alpha = 4 / 1 nonzero = 4; mean 0.25 -> 4 * (0.75, -0.25, -0.25, -0.25)
    rewards, mask = _batch([1.0, 0.0, 0.0, 0.0], [4, 4, 4, 4])
    adv, _ = get_adv_estimator("gpg")(rewards, mask, index=[0, 0, 0, 0])
    assert _per_row(adv, mask) == pytest.approx([3.0, -1.0, -1.0, -1.0], abs=1e-12)


def test_reinforce_plus_plus_baseline_centres_by_group_then_whitens_the_batch():
    # group means: a (1, 0) 0.5 -> 0.5, -0.5; b (1, 1) 1 -> 0, 0; lengths 1, 1, 1, 1 -> tokens 0.5, -0.5, 0, 0
    # mean 0, unbiased var = 0.5 / 3 -> 0.5 / sqrt(1/6 + 1e-8)
    rewards, mask = _batch([1.0, 0.0, 1.0, 1.0], [1, 1, 1, 1])
    adv, _ = get_adv_estimator("reinforce_plus_plus_baseline")(rewards, mask, index=list("aabb"))
    z = 0.5 / math.sqrt(1 / 6 + 1e-8)
    assert _per_row(adv, mask) == pytest.approx([z, -z, 0, 0], abs=1e-9)


def test_the_vectorized_names_agree_with_the_loops_and_rloo_vectorized_zeroes_a_singleton():
    rewards, mask = _batch([1.0, 0.0, 0.5, 0.25, 0.9], [1, 2, 3, 4, 2])
    index = [0, 0, 1, 1, 2]  # group 2 is a singleton
    for name in ("grpo", "rloo"):
        loop, _ = get_adv_estimator(name)(rewards, mask, index=index)
        vec, _ = get_adv_estimator(f"{name}_vectorized")(rewards, mask, index=index)
        torch.testing.assert_close(vec[:4], loop[:4], **TOL)
    assert torch.all(get_adv_estimator("rloo_vectorized")(rewards, mask, index=index)[0][4] == 0)


def test_gdpo_normalises_each_component_in_its_group_then_whitens():
    # two components over one group of two: format (1, 0) and accuracy (0.5, 0.25), each GRPO-normalised in the
    # group: (+-0.5) / (std 0.7071 + eps) and (+-0.125) / (std 0.1768 + eps), both ~ +-0.7071; summed with
    # weights 1 and 2: +-c, c ~ 2.1213; whitened over 2 tokens a row: mean 0, unbiased var = 4 c^2 / 3
    # -> +-c / sqrt(4 c^2 / 3 + 1e-8) ~ +-0.8660254 (the accuracy's small scale counts as much as the format's)
    fmt, mask = _batch([1.0, 0.0], [2, 2])
    acc, _ = _batch([0.5, 0.25], [2, 2])
    adv, _ = get_adv_estimator("gdpo")(fmt, mask, index=[0, 0], reward_components=[fmt, acc], reward_weights=[1, 2])
    c = (0.5 / (statistics.stdev([1.0, 0.0]) + 1e-6)) + 2 * (0.125 / (statistics.stdev([0.5, 0.25]) + 1e-6))
    z = c / math.sqrt(4 * c * c / 3 + 1e-8)
    assert _per_row(adv, mask) == pytest.approx([z, -z], abs=1e-9)
    # without components it is GRPO then batch whitening
    one, _ = get_adv_estimator("gdpo")(fmt, mask, index=[0, 0])
    grpo, _ = get_adv_estimator("grpo")(fmt, mask, index=[0, 0])
    g = _per_row(grpo, mask)
    assert _per_row(one, mask) == pytest.approx(_whiten(g, [2, 2]), abs=1e-9)
    with pytest.raises(ValueError, match="2 reward weights for 1"):
        get_adv_estimator("gdpo")(fmt, mask, index=[0, 0], reward_weights=[1, 2])


def test_remax_subtracts_the_greedy_responses_score_from_each_tokens_return():
    """Two prompts, two samples each; greedy answers scored 0.5 and 1. Outcome rewards 1, 0 | 1, 0.25 on the last
    tokens, and a KL-in-reward-like -0.1 on row 0's first token: its return there is 1 - 0.1 = 0.9."""
    rewards, mask = _batch([1.0, 0.0, 1.0, 0.25], [3, 2, 1, 4])
    rewards[0, 0] = -0.1
    baselines = torch.tensor([0.5, 0.5, 1.0, 1.0], dtype=F64)
    adv, returns = get_adv_estimator("remax")(rewards, mask, index=[0, 0, 1, 1], reward_baselines=baselines)
    expected = torch.tensor(
        [[0.4, 0.5, 0.5, 0.0], [-0.5, -0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [-0.75, -0.75, -0.75, -0.75]], dtype=F64
    )
    torch.testing.assert_close(adv, expected, **TOL)
    torch.testing.assert_close(returns[0], torch.tensor([0.9, 1.0, 1.0, 0.0], dtype=F64), **TOL)
    with pytest.raises(ValueError, match="greedy response"):
        get_adv_estimator("remax")(rewards, mask, index=[0, 0, 1, 1])


# ---------------------------------------------------------------- random batches against the references


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_estimators_match_their_paper_references_on_random_batches(seed):
    rng = random.Random(seed)
    n_groups, group = 4, 5
    index = [f"p{g}" for g in range(n_groups) for _ in range(group)]
    rng.shuffle(index)
    scores = [rng.choice([0.0, 0.0, 0.1, 1.0]) + rng.random() * 0.01 for _ in index]
    lengths = [rng.randint(1, 6) for _ in index]
    rewards, mask = _batch(scores, lengths, width=6)
    cases = {
        "reinforce_plus_plus_baseline": ref_rf_baseline(scores, index, lengths),
        "grpo_passk": ref_passk(scores, index),
        "opo": ref_opo(scores, index, lengths),
        "gpg": ref_gpg(scores, index),
        "grpo_vectorized": ref_grpo(scores, index),
        "gdpo": _whiten(ref_grpo(scores, index), lengths),
    }
    for name, expected in cases.items():
        adv, _ = get_adv_estimator(name)(rewards, mask, index=index, norm_adv_by_std_in_grpo=True, gamma=1.0)
        assert _per_row(adv, mask) == pytest.approx(expected, abs=1e-9, rel=1e-9), name
        assert torch.all(adv[mask == 0] == 0), name


def test_the_registry_holds_every_one_of_verls_critic_free_estimators():
    verl = {
        "grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
        "gdpo", "grpo_passk", "opo", "gpg", "remax",
    }  # fmt: skip
    assert set(ADV_ESTIMATORS) == verl
