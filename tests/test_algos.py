"""Tests for grpo_core.algos; expected values are worked out by hand in the comments."""

import math

import numpy as np
import pytest
import torch

from grpo_core.algos import (
    ADV_ESTIMATORS,
    KL_PENALTY_TYPES,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    agg_denominator,
    agg_loss,
    compute_grpo_outcome_advantage,
    compute_policy_loss,
    compute_policy_loss_gspo,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_rloo_outcome_advantage,
    draw_again,
    filter_metric_values,
    get_adv_estimator,
    get_policy_loss,
    groups_with_spread,
    kl_penalty,
    register_adv_estimator,
    register_policy_loss,
    rollout_is_metrics,
    rollout_is_weights,
    trainable_groups,
)

EPS = 1e-6
VERL_LOSSES = (
    "vanilla", "gspo", "sapo", "cispo", "geo_mean", "gpg", "clip_cov", "kl_cov", "dppo_tv", "dppo_kl", "dro",
    "bypass_mode",
)  # fmt: skip


def _last_token_rewards(scores: list[float], width: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards placed on each row's last token (outcome reward), full mask."""
    rewards = torch.zeros(len(scores), width)
    rewards[:, -1] = torch.tensor(scores)
    return rewards, torch.ones(len(scores), width)


# ---------------------------------------------------------------- GRPO advantage


def test_grpo_group_of_four():
    # scores [1,0,0,1]: mean 0.5, deviations ±0.5, unbiased var = 4*0.25/3 = 1/3, std = 0.5773503
    # advantage = ±0.5 / (0.5773503 + 1e-6) = ±0.8660239 (±sqrt(3)/2 up to eps)
    rewards, mask = _last_token_rewards([1.0, 0.0, 0.0, 1.0])
    adv, ret = compute_grpo_outcome_advantage(rewards, mask, [7, 7, 7, 7])
    expected = 0.5 / (math.sqrt(1 / 3) + EPS)
    torch.testing.assert_close(adv[:, 0], torch.tensor([expected, -expected, -expected, expected]))
    assert torch.equal(adv, ret)
    assert torch.equal(adv, adv[:, :1].expand_as(adv))  # the scalar is broadcast over every token


def test_grpo_singleton_group_uses_mean_zero_std_one():
    # a lone row: (3 - 0) / (1 + 1e-6) = 2.999997
    rewards, mask = _last_token_rewards([3.0])
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, ["only"])
    torch.testing.assert_close(adv, torch.full((1, 3), 3.0 / (1 + EPS)))


def test_grpo_dr_grpo_skips_std():
    # scores [1,0,0,1], mean 0.5 -> advantages ±0.5, no std division
    rewards, mask = _last_token_rewards([1.0, 0.0, 0.0, 1.0])
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, [0, 0, 0, 0], norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_grpo_interleaved_string_ids():
    # group "a" = rows 0,2,3 with scores [1,2,6]: mean 3, devs [-2,-1,3], sum sq 14, var 14/2 = 7,
    #   std 2.6457513 -> [-0.7559289, -0.3779645, 1.1338934]
    # group "b" = rows 1,4 with scores [0,4]: mean 2, devs [-2,2], var 8/1 = 8, std 2.8284271
    #   -> [-0.7071068, 0.7071068]
    rewards, mask = _last_token_rewards([1.0, 0.0, 2.0, 6.0, 4.0])
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, np.array(["a", "b", "a", "a", "b"]))
    sa, sb = math.sqrt(7) + EPS, math.sqrt(8) + EPS
    expected = torch.tensor([-2 / sa, -2 / sb, -1 / sa, 3 / sa, 2 / sb])
    torch.testing.assert_close(adv[:, 0], expected)


def test_grpo_score_sums_tokens_and_mask_zeroes_padding():
    # row scores: 0.25+0.75 = 1.0 and 0 + 0 = 0.0 -> mean 0.5, std sqrt(0.5) = 0.7071068
    # advantages ±0.5/0.7071068 = ±0.7071058 (eps); padded positions (mask 0) must be exactly 0
    rewards = torch.tensor([[0.25, 0.75, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv, ret = compute_grpo_outcome_advantage(rewards, mask, torch.tensor([5, 5]))
    a = 0.5 / (math.sqrt(0.5) + EPS)
    torch.testing.assert_close(adv, torch.tensor([[a, a, 0.0], [-a, 0.0, 0.0]]))
    torch.testing.assert_close(ret, adv)


def test_grpo_has_no_grad_and_checks_length():
    rewards = torch.ones(2, 3, requires_grad=True)
    adv, _ = compute_grpo_outcome_advantage(rewards, torch.ones(2, 3), [0, 1])
    assert not adv.requires_grad
    with pytest.raises(ValueError, match="index"):
        compute_grpo_outcome_advantage(rewards, torch.ones(2, 3), [0, 1, 2])


def _grpo_loop_reference(rewards, mask, index, epsilon, norm):
    scores = rewards.sum(-1)
    by_group: dict = {}
    for i, gid in enumerate(index):
        by_group.setdefault(gid, []).append(i)
    out = torch.empty_like(scores)
    for rows in by_group.values():
        group_scores = scores[rows]
        if len(rows) == 1:
            mean, std = torch.tensor(0.0), torch.tensor(1.0)
        else:
            mean, std = group_scores.mean(), group_scores.std()
        out[rows] = (group_scores - mean) / (std + epsilon) if norm else group_scores - mean
    return out.unsqueeze(-1) * mask


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_vectorised_matches_loop(norm):
    gen = torch.Generator().manual_seed(0)
    batch, width = 64, 7
    rewards = torch.randn(batch, width, generator=gen, dtype=torch.float64)
    mask = (torch.rand(batch, width, generator=gen) < 0.8).double()
    index = [f"p{i}" for i in torch.randint(0, 20, (batch,), generator=gen).tolist()]  # some singletons
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=norm)
    torch.testing.assert_close(adv, _grpo_loop_reference(rewards, mask, index, EPS, norm))


def test_adv_estimator_registry():
    assert get_adv_estimator("grpo") is compute_grpo_outcome_advantage
    assert get_adv_estimator("rloo") is compute_rloo_outcome_advantage
    assert get_adv_estimator("reinforce_plus_plus") is compute_reinforce_plus_plus_outcome_advantage
    valid = r"\[.gdpo., .gpg., .grpo., .grpo_passk., "
    with pytest.raises(ValueError, match=rf"unknown adv_estimator 'x'; valid: {valid}"):
        get_adv_estimator("x")
    with pytest.raises(ValueError, match="already registered"):
        register_adv_estimator("grpo")(lambda *a: a)
    try:

        @register_adv_estimator("test_only")
        def _dummy(*args):
            return args

        assert get_adv_estimator("test_only") is _dummy
    finally:
        ADV_ESTIMATORS.pop("test_only", None)


# ---------------------------------------------------------------- RLOO and REINFORCE++


def test_rloo_subtracts_the_mean_of_the_other_responses():
    # group a, scores [1, 0, 0, 1]: row with 1 -> 1 - (0 + 0 + 1)/3 = 2/3; row with 0 -> 0 - (1 + 0 + 1)/3 = -2/3
    # group b, one response of 3: no others, it keeps its score 3
    # group c, scores [2, 5]: 2 - 5 = -3, 5 - 2 = 3
    scores = [1.0, 3.0, 0.0, 2.0, 0.0, 5.0, 1.0]
    rewards, mask = _last_token_rewards(scores)
    mask[0, 0] = 0  # a padded token: advantage 0 there, the score (on the last token) unchanged
    adv, ret = get_adv_estimator("rloo")(rewards, mask, index=list("abacaca"), norm_adv_by_std_in_grpo=True)
    expected = torch.tensor([2 / 3, 3.0, -2 / 3, -3.0, -2 / 3, 3.0, 2 / 3])
    torch.testing.assert_close(adv[:, -1], expected)
    assert adv[0, 0] == 0 and adv[0, 1] == pytest.approx(2 / 3)
    assert torch.equal(adv, ret)


def _reinforce_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Row 0: rewards [0, 0, 1], three tokens. Row 1: one token with reward 0.5, then padding holding a stray
    reward 7 that must not flow back into the response."""
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.5, 0.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    return rewards, mask


def test_reinforce_plus_plus_discounts_then_whitens_over_the_batch():
    # gamma 0.5. Row 0 returns, from the end: 1; 0 + 0.5 * 1 = 0.5; 0 + 0.5 * 0.5 = 0.25 -> [0.25, 0.5, 1]
    # Row 1: t=2 gives 7 but the running return is reset by the mask (0) at t=2 and t=1 -> [0.5, 0, 0]
    # valid returns 0.25, 0.5, 1, 0.5: mean 2.25 / 4 = 0.5625, deviations -0.3125, -0.0625, 0.4375, -0.0625,
    # squares sum 0.296875, unbiased var 0.296875 / 3 = 0.0989583, std = sqrt(0.0989583 + 1e-8) = 0.3145765
    # advantages: -0.9933992, -0.1986798, 1.3907589 | -0.1986798, 0, 0
    rewards, mask = _reinforce_batch()
    adv, ret = get_adv_estimator("reinforce_plus_plus")(rewards, mask, index=[0, 0], gamma=0.5, lam=0.95)
    torch.testing.assert_close(ret, torch.tensor([[0.25, 0.5, 1.0], [0.5, 0.0, 0.0]]))
    std = math.sqrt(0.296875 / 3 + 1e-8)
    expected = torch.tensor([[-0.3125, -0.0625, 0.4375], [-0.0625, 0.0, 0.0]]) / std
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(adv[0], torch.tensor([-0.9933992, -0.1986798, 1.3907589]))


def test_reinforce_plus_plus_gamma_defaults_to_one():
    # gamma 1: row 0 returns [1, 1, 1], row 1 [0.5]: mean 3.5 / 4 = 0.875, deviations 0.125 x3, -0.375,
    # unbiased var (3 * 0.015625 + 0.140625) / 3 = 0.0625, std 0.25 (+1e-8 inside) -> 0.5 x3, -1.5
    rewards, mask = _reinforce_batch()
    adv, _ = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, index=None)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5, 0.5], [-1.5, 0.0, 0.0]]) / math.sqrt(1 + 1e-8 / 0.0625))


# ---------------------------------------------------------------- KL penalty


def test_kl_penalty_values():
    # logp = -1, ref = -2: diff = 1 -> k1 = 1, abs = 1, k2 = 0.5*1 = 0.5
    # k3: d = ref - logp = -1, exp(-1) - (-1) - 1 = exp(-1) = 0.3678794
    # second element logp = -2, ref = -1: diff = -1 -> k1 = -1, abs = 1, k2 = 0.5
    #   k3: d = 1, exp(1) - 1 - 1 = 0.7182818
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -1.0])
    expected = {
        "k1": [1.0, -1.0],
        "abs": [1.0, 1.0],
        "k2": [0.5, 0.5],
        "k3": [math.exp(-1), math.e - 2],
    }
    aliases = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
    for name in KL_PENALTY_TYPES:
        base = name.removesuffix("+")
        want = torch.tensor(expected[aliases.get(base, base)])
        torch.testing.assert_close(kl_penalty(logp, ref, name), want)


def test_k3_clamps_at_extremes():
    # logp=0, ref=-100: d clamps to -20 -> exp(-20) + 20 - 1 ~ 19.0 -> clamped to 10
    # logp=-100, ref=0: d clamps to 20 -> exp(20) - 21 ~ 4.85e8 -> clamped to 10
    # logp=0, ref=-5: d = -5 -> exp(-5) + 5 - 1 = 4.0067379 (inside the clamp)
    # logp=ref: d = 0 -> 1 - 0 - 1 = 0
    logp = torch.tensor([0.0, -100.0, 0.0, -3.0])
    ref = torch.tensor([-100.0, 0.0, -5.0, -3.0])
    out = kl_penalty(logp, ref, "low_var_kl")
    torch.testing.assert_close(out, torch.tensor([10.0, 10.0, math.exp(-5) + 4, 0.0]))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", ["low_var_kl+", "k3+", "kl+", "k1+", "abs+"])
def test_plus_variant_has_base_value_and_k2_gradient(name):
    # k2 = 0.5 (logp - ref)^2 has gradient (logp - ref) wrt logp:
    #   logp = -1, ref = -2 -> 1   (k3's own gradient would be 1 - exp(ref - logp) = 0.6321206)
    #   logp = -3, ref = -1 -> -2  (k1's own would be 1, abs's -1, k3's 1 - e^2 = -6.389056)
    logp = torch.tensor([-1.0, -3.0], requires_grad=True)
    ref = torch.tensor([-2.0, -1.0])
    out = kl_penalty(logp, ref, name)
    torch.testing.assert_close(out, kl_penalty(logp.detach(), ref, name.removesuffix("+")))
    out.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([1.0, -2.0]))


def test_k2_plus_equals_k2_and_unknown_raises():
    logp, ref = torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -1.0])
    for name in ("k2+", "mse+"):
        torch.testing.assert_close(kl_penalty(logp, ref, name), torch.tensor([0.5, 2.0]))
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(logp, ref, "k4")


# ---------------------------------------------------------------- agg_loss

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
RAGGED = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 2.5),  # (1+2+3+4) / 4 tokens = 10/4
        ("seq-mean-token-sum", 5.0),  # row sums [6, 4] -> mean 5
        ("seq-mean-token-mean", 3.0),  # row means [6/3, 4/1] = [2, 4] -> mean 3
        ("seq-mean-token-sum-norm", 5 / 3),  # row sums [6, 4] / C (default: mask width 3) -> mean (2 + 4/3)/2
    ],
)
def test_agg_loss_modes(mode, expected):
    assert mode in LOSS_AGG_MODES
    torch.testing.assert_close(agg_loss(LOSS, RAGGED, mode), torch.tensor(expected))


def test_agg_denominator_counts_tokens_or_non_empty_rows():
    assert agg_denominator(RAGGED, "token-mean") == 4
    for mode in ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):  # not the mask width
        assert agg_denominator(RAGGED, mode) == 2
        assert agg_denominator(torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]), mode) == 1


def test_dr_grpo_divides_each_row_by_the_constant_not_by_its_length():
    # row sums [6, 4] / C=8 = [0.75, 0.5] -> mean over the 2 rows 0.625; the other modes ignore the constant
    torch.testing.assert_close(
        agg_loss(LOSS, RAGGED, "seq-mean-token-sum-norm", loss_scale_factor=8.0), torch.tensor(0.625)
    )
    torch.testing.assert_close(agg_loss(LOSS, RAGGED, "seq-mean-token-sum", loss_scale_factor=8.0), torch.tensor(5.0))
    # a wider mask (more padding columns) changes nothing once C is fixed
    wide_loss, wide_mask = torch.nn.functional.pad(LOSS, (0, 4), value=9.0), torch.nn.functional.pad(RAGGED, (0, 4))
    torch.testing.assert_close(
        agg_loss(wide_loss, wide_mask, "seq-mean-token-sum-norm", loss_scale_factor=8.0), torch.tensor(0.625)
    )


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 1.5),  # (1+2) / 2 tokens
        ("seq-mean-token-sum", 3.0),  # row sums [3, 0], only 1 non-empty row -> 3/1
        ("seq-mean-token-mean", 1.5),  # row means [3/2, 0/clamp(0)=0], 1 non-empty row -> 1.5
        ("seq-mean-token-sum-norm", 1.0),  # row sums [3, 0] / width 3, 1 non-empty row -> 1/1
    ],
)
def test_agg_loss_empty_row(mode, expected):
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(agg_loss(LOSS, mask, mode), torch.tensor(expected))
    # a fully masked batch is 0, not NaN
    assert agg_loss(LOSS, torch.zeros_like(mask), mode).item() == 0.0


def test_agg_loss_unknown_mode():
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(LOSS, RAGGED, "sum")


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_denominator_splits_into_micro_batches(mode):
    gen = torch.Generator().manual_seed(1)
    loss = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    mask = (torch.rand(6, 5, generator=gen) < 0.6).double()
    mask[:, 0] = 1
    mask[4] = 0  # an empty row inside the second micro-batch
    n_rows = int((mask.sum(-1) > 0).sum())
    assert n_rows == 5
    global_norm = mask.sum().item() if mode == "token-mean" else float(n_rows)
    assert sum(agg_denominator(mask[s], mode) for s in (slice(0, 2), slice(2, 6))) == global_norm
    for micro_batches in [(slice(0, 3), slice(3, 6)), (slice(0, 1), slice(1, 4), slice(4, 6))]:
        pieces = sum(
            agg_loss(loss[s], mask[s], mode, denominator=global_norm, loss_scale_factor=7.0) for s in micro_batches
        )
        torch.testing.assert_close(pieces, agg_loss(loss, mask, mode, loss_scale_factor=7.0))


# ---------------------------------------------------------------- compute_policy_loss


def _row(values: list[float]) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float64)


def test_policy_loss_cases_and_metrics():
    # token | ratio | A  | loss1 = -A r | loss2 = -A clip(r, .8, 1.2) | max  | dual clip (A<0, c=3)
    #   0   | 1.1   | +1 | -1.1         | -1.1                        | -1.1 | -          -> -1.1 (inside)
    #   1   | 1.5   | +1 | -1.5         | -1.2                        | -1.2 | -          -> -1.2 (clipped)
    #   2   | 0.5   | -1 |  0.5         |  0.8                        |  0.8 | min(0.8,3) ->  0.8 (clipped)
    #   3   | 10    | -1 | 10           |  1.2                        | 10   | min(10,3)  ->  3.0 (dual clip)
    #   4   | masked out (garbage values must not count)
    # token-mean: (-1.1 - 1.2 + 0.8 + 3.0) / 4 = 1.5 / 4 = 0.375
    # pg_clipfrac: loss2 > loss1 on tokens 1, 2 -> 2/4 = 0.5; pg_clipfrac_lower: token 3 -> 1/4
    # ppo_kl = mean(old - new) = -ln(1.1 * 1.5 * 0.5 * 10) / 4 = -ln(8.25) / 4 = -0.5275533
    ratios = [1.1, 1.5, 0.5, 10.0, 50.0]
    log_prob = _row([math.log(r) for r in ratios])
    old = torch.zeros_like(log_prob)
    adv = _row([1.0, 1.0, -1.0, -1.0, -7.0])
    mask = _row([1.0, 1.0, 1.0, 1.0, 0.0])
    loss, metrics = compute_policy_loss(old, log_prob, adv, mask)
    torch.testing.assert_close(loss, torch.tensor(0.375, dtype=torch.float64))
    torch.testing.assert_close(metrics["pg_clipfrac"], torch.tensor(0.5, dtype=torch.float64))
    torch.testing.assert_close(metrics["pg_clipfrac_lower"], torch.tensor(0.25, dtype=torch.float64))
    torch.testing.assert_close(metrics["ppo_kl"], torch.tensor(-math.log(8.25) / 4, dtype=torch.float64))
    assert all(m.dim() == 0 and not m.requires_grad for m in metrics.values())


def test_policy_loss_asymmetric_clip_higher():
    # low = 0.2, high = 0.28 -> clip range [0.8, 1.28]
    # token 0: r = 1.25, A = +1: 1.25 < 1.28 not clipped -> -1.25 (symmetric 0.2 would give -1.2)
    # token 1: r = 1.5,  A = +1: clipped at 1.28 -> -1.28
    # token 2: r = 0.75, A = -1: max(0.75, 0.8) -> 0.8 (low bound still 0.2)
    # seq-mean-token-sum over one row: -1.25 - 1.28 + 0.8 = -1.73; clipfrac 2/3
    log_prob = _row([math.log(1.25), math.log(1.5), math.log(0.75)])
    adv = _row([1.0, 1.0, -1.0])
    mask = torch.ones_like(adv)
    loss, metrics = compute_policy_loss(
        torch.zeros_like(log_prob),
        log_prob,
        adv,
        mask,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        loss_agg_mode="seq-mean-token-sum",
    )
    torch.testing.assert_close(loss, torch.tensor(-1.73, dtype=torch.float64))
    torch.testing.assert_close(metrics["pg_clipfrac"], torch.tensor(2 / 3, dtype=torch.float64))
    # clip_ratio alone sets both sides: token 0 is now clipped at 1.2 -> -1.2 - 1.2 + 0.8 = -1.6
    loss, _ = compute_policy_loss(
        torch.zeros_like(log_prob), log_prob, adv, mask, clip_ratio=0.2, loss_agg_mode="seq-mean-token-sum"
    )
    torch.testing.assert_close(loss, torch.tensor(-1.6, dtype=torch.float64))


def test_policy_loss_gradient():
    # token 0: old = 0, logp = 0.1, A = 2: r = exp(0.1) = 1.1051709 inside [0.8, 1.2]
    #   loss = -A r, d/dlogp = -A r = -2.2103418, token-mean over 2 tokens -> -1.1051709
    # token 1: r = exp(0.5) = 1.6487 > 1.2 with A = +1: clipped branch is constant -> gradient 0
    # token 2: masked -> gradient 0
    log_prob = _row([0.1, 0.5, 0.3]).requires_grad_()
    adv = _row([2.0, 1.0, 1.0])
    mask = _row([1.0, 1.0, 0.0])
    loss, _ = compute_policy_loss(torch.zeros_like(adv), log_prob, adv, mask)
    loss.backward()
    torch.testing.assert_close(log_prob.grad, _row([-math.exp(0.1), 0.0, 0.0]))


@pytest.mark.parametrize("clip_ratio_c", [1.0, 0.5])
def test_policy_loss_rejects_bad_dual_clip(clip_ratio_c):
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        compute_policy_loss(x, x, x, torch.ones(1, 2), clip_ratio_c=clip_ratio_c)


# ---------------------------------------------------------------- policy-loss registry and GSPO


def test_policy_loss_registry():
    assert get_policy_loss("vanilla") is compute_policy_loss
    assert get_policy_loss("gspo") is compute_policy_loss_gspo
    with pytest.raises(ValueError, match=r"unknown policy loss_mode 'x'; valid: \['bypass_mode', 'cispo', "):
        get_policy_loss("x")
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("gspo")(lambda *a: a)
    assert sorted(POLICY_LOSSES) == sorted(VERL_LOSSES)


def _gspo_rows() -> tuple[torch.Tensor, ...]:
    """Row 0: log-ratios 0.3, 0.1 (a third token masked, garbage 9), A = +1. Row 1: -0.2, 0, -0.1, A = -1."""
    log_prob = torch.tensor([[0.3, 0.1, 9.0], [-0.2, 0.0, -0.1]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    return torch.zeros_like(log_prob), log_prob, adv, mask


def test_gspo_clips_one_ratio_per_sequence():
    # row 0: s = exp((0.3 + 0.1) / 2) = exp(0.2) = 1.2214028 > 1.2, A = +1: max(-1.2214, -1.2) = -1.2 on both
    #   tokens (token-level PPO would clip token 0, ratio 1.35, but not token 1, ratio 1.105)
    # row 1: s = exp((-0.2 + 0 - 0.1) / 3) = exp(-0.1) = 0.9048374 inside [0.8, 1.2], A = -1: +0.9048374 each
    # seq-mean-token-mean: (-1.2 + 0.9048374) / 2 = -0.1475813
    # gradient: row 0 clipped (constant) -> 0; row 1 each token: -A s (1/3 tokens)(1/2 rows) = 0.9048374 / 6
    #   = 0.1508062, each token through its own log-prob (s * pi / sg(pi))
    # pg_clipfrac: the 2 tokens of row 0 of 5 valid = 0.4; ppo_kl = -(0.3 + 0.1 - 0.2 + 0 - 0.1) / 5 = -0.02
    old, log_prob, adv, mask = _gspo_rows()
    log_prob.requires_grad_()
    loss, metrics = get_policy_loss("gspo")(old, log_prob, adv, mask, loss_agg_mode="seq-mean-token-mean")
    torch.testing.assert_close(loss, torch.tensor((-1.2 + math.exp(-0.1)) / 2, dtype=torch.float64))
    loss.backward()
    g = math.exp(-0.1) / 6
    torch.testing.assert_close(log_prob.grad, torch.tensor([[0.0, 0.0, 0.0], [g, g, g]], dtype=torch.float64))
    torch.testing.assert_close(metrics["pg_clipfrac"], torch.tensor(0.4, dtype=torch.float64))
    torch.testing.assert_close(metrics["ppo_kl"], torch.tensor(-0.02, dtype=torch.float64))
    assert metrics["pg_clipfrac_lower"] == 0
    assert all(m.dim() == 0 and not m.requires_grad for m in metrics.values())


def test_gspo_clip_higher_and_the_log_ratio_clamp():
    # clip-higher 0.28: row 0's s = 1.2214 < 1.28 is no longer clipped -> -1.2214028 on both tokens
    # token-mean over 5 tokens: (2 * -1.2214028 + 3 * 0.9048374) / 5 = 0.0543536
    old, log_prob, adv, mask = _gspo_rows()
    loss, metrics = compute_policy_loss_gspo(old, log_prob, adv, mask, clip_ratio_high=0.28, loss_agg_mode="token-mean")
    expected = (2 * -math.exp(0.2) + 3 * math.exp(-0.1)) / 5
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=torch.float64))
    assert metrics["pg_clipfrac"] == 0
    # a mean log-ratio of 12 is clamped at 10: A = -1, max(e^10, 1.2) = e^10 = 22026.466 (and no dual clip)
    big = torch.full((1, 2), 12.0, dtype=torch.float64)
    loss, _ = compute_policy_loss_gspo(torch.zeros_like(big), big, -torch.ones_like(big), torch.ones_like(big))
    torch.testing.assert_close(loss, torch.tensor(math.exp(10), dtype=torch.float64))


# ---------------------------------------------------------------- rollout importance sampling


def _rollout_rows() -> tuple[torch.Tensor, ...]:
    """Row 0: old - rollout log-probs 0.5, -1, 0 (a fourth token masked). Row 1: one token 30 off."""
    old = torch.tensor([[-1.0, -2.0, -0.5, 5.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    rollout = torch.tensor([[-1.5, -1.0, -0.5, 0.0], [-30.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    return old, rollout, mask


def test_rollout_is_token_weights_are_truncated_ratios():
    # row 0: exp(0.5) = 1.6487 -> 1.5 (threshold), exp(-1) = 0.3678794, exp(0) = 1, masked -> 0
    # row 1: 30 is clamped to 20 first (exp stays finite), exp(20) -> 1.5; exp(0) = 1; masked -> 0
    old, rollout, mask = _rollout_rows()
    old.requires_grad_()
    w = rollout_is_weights(old, rollout, mask, "token", threshold=1.5)
    expected = torch.tensor([[1.5, math.exp(-1), 1.0, 0.0], [1.5, 1.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(w, expected)
    assert not w.requires_grad
    # metrics over the 5 valid tokens 1.5, 0.3679, 1, 1.5, 1: mean 5.3678794 / 5 = 1.0735759, max 1.5,
    # ESS share (sum w)^2 / (5 sum w^2) = 28.8141297 / (5 * 6.6353353) = 0.8685056, clamped 2 / 5
    m = rollout_is_metrics(w, mask, threshold=1.5)
    total, squares = 5 + math.exp(-1), 6.5 + math.exp(-2)
    assert m["rollout_is/mean"] == pytest.approx(total / 5)
    assert m["rollout_is/max"] == 1.5
    assert m["rollout_is/eff_sample_size"] == pytest.approx(total**2 / (5 * squares))
    assert m["rollout_is/eff_sample_size"] == pytest.approx(0.8685056, abs=1e-7)
    assert m["rollout_is/clamped_share"] == pytest.approx(0.4)


def test_rollout_is_sequence_weights_share_the_summed_log_ratio():
    # row 0: 0.5 - 1 + 0 = -0.5 -> exp(-0.5) = 0.6065307 on each valid token (the masked 5 - 0 does not count)
    # row 1: 30 + 0 = 30, clamped to 20, exp(20) truncated at 2 -> 2 on both tokens
    old, rollout, mask = _rollout_rows()
    w = rollout_is_weights(old, rollout, mask, "sequence", threshold=2.0)
    a = math.exp(-0.5)
    torch.testing.assert_close(w, torch.tensor([[a, a, a, 0.0], [2.0, 2.0, 0.0, 0.0]], dtype=torch.float64))
    with pytest.raises(ValueError, match="unknown rollout_is level 'geo'"):
        rollout_is_weights(old, rollout, mask, "geo")


@pytest.mark.parametrize("loss_mode", ["vanilla", "gspo"])
def test_rollout_is_weights_multiply_each_tokens_policy_loss(loss_mode):
    # the policy loss with weights w is the per-token losses times w, aggregated: check by weighting a loss whose
    # per-token values are known. old = new (ratio 1, no clipping), A = [1, -2 | 3, 1] -> token losses -A;
    # w = [2, 0.5 | 1, 0]: token-mean (-2 + 1 - 3 + 0) / 4 = -1; the gradient of a token is scaled by its w
    log_prob = torch.zeros(2, 2, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[1.0, -2.0], [3.0, 1.0]], dtype=torch.float64)
    w = torch.tensor([[2.0, 0.5], [1.0, 0.0]], dtype=torch.float64)
    loss, _ = get_policy_loss(loss_mode)(
        log_prob.detach(), log_prob, adv, torch.ones_like(adv), loss_agg_mode="token-mean", rollout_is_weights=w
    )
    torch.testing.assert_close(loss, torch.tensor(-1.0, dtype=torch.float64))
    loss.backward()
    torch.testing.assert_close(log_prob.grad, -adv * w / 4)


# ---- dynamic sampling (DAPO's filter_groups) ----------------------------------------------------------------


def test_filter_metric_values_by_hand():
    scores, shaped = [1.0, 0.5, 0.0], [0.75, 0.5, -0.25]  # the first and last penalised for length
    assert filter_metric_values("acc", scores, shaped, full_score=1.0) == [1.0, 0.0, 0.0]
    assert filter_metric_values("acc", scores, shaped, full_score=0.5) == [1.0, 1.0, 0.0]
    assert filter_metric_values("score", scores, shaped, 1.0) == scores
    assert filter_metric_values("seq_reward", scores, shaped, 1.0) == scores
    assert filter_metric_values("seq_final_reward", scores, shaped, 1.0) == shaped
    with pytest.raises(ValueError, match="valid: \\['acc'"):
        filter_metric_values("accuracy", scores, shaped, 1.0)


def test_groups_with_spread_keeps_groups_that_differ_in_first_seen_order():
    # group 3: 1, 0 differ; group 0: 1, 1 alike; group 2: 0, 0, 0 alike; group 1: 0, 0.5 differ; group 5 alone
    values = [1, 0, 1, 1, 0, 0, 0, 0.0, 0.5, 0.25]
    index = [3, 3, 0, 0, 2, 2, 2, 1, 1, 5]
    assert groups_with_spread(values, index) == [3, 1, 5]
    assert groups_with_spread([0.0] * 4, [0, 0, 1, 1]) == []
    # interleaved rows: group 0 is rows 0 and 2 (0, 0), group 1 rows 1 and 3 (1, 0)
    assert groups_with_spread([0, 1, 0, 0], [0, 1, 0, 1]) == [1]


def test_draw_again_until_enough_groups_or_the_batch_budget():
    assert draw_again(kept=3, wanted=8, drawn=1, max_num_gen_batches=0)  # 0: no limit
    assert draw_again(kept=3, wanted=8, drawn=99, max_num_gen_batches=0)
    assert draw_again(kept=3, wanted=8, drawn=2, max_num_gen_batches=3)
    assert not draw_again(kept=3, wanted=8, drawn=3, max_num_gen_batches=3)  # budget spent: train on 3
    assert not draw_again(kept=8, wanted=8, drawn=1, max_num_gen_batches=0)


def test_trainable_groups_divide_over_dp():
    assert trainable_groups(5, n=4, dp=2) == 5  # 20 rows split over 2
    assert trainable_groups(5, n=3, dp=2) == 4  # 15 rows do not; 12 do
    assert trainable_groups(7, n=1, dp=4) == 4
    assert trainable_groups(1, n=1, dp=2) == 0  # nothing divides
    assert trainable_groups(0, n=5, dp=1) == 0


def test_generation_groups_and_concat_renumber_prompts():
    from grpo_core.rollout.base import Generation

    gen = Generation(
        prompt_ids=[[10], [11], [12]],
        response_ids=[[1], [2], [3], [4], [5], [6]],
        response_log_probs=[[-0.1], [-0.2], [-0.3], [-0.4], [-0.5], [-0.6]],
        finish_reasons=["stop", "length", "stop", "stop", "length", "stop"],
        group_index=[0, 0, 1, 1, 2, 2],
    )
    picked = gen.groups([2, 0])
    assert picked.prompt_ids == [[12], [10]]
    assert picked.response_ids == [[5], [6], [1], [2]]
    assert picked.response_log_probs == [[-0.5], [-0.6], [-0.1], [-0.2]]
    assert picked.finish_reasons == ["length", "stop", "stop", "length"]
    assert picked.group_index == [0, 0, 1, 1]
    both = Generation.concat([picked, gen.groups([1])])
    assert both.prompt_ids == [[12], [10], [11]]
    assert both.response_ids == [[5], [6], [1], [2], [3], [4]]
    assert both.group_index == [0, 0, 1, 1, 2, 2]
