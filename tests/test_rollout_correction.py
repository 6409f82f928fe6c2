"""verl's rollout correction beyond truncated IS: "lower_upper" thresholds (IcePop), batch normalisation, rejection
sampling by each of verl's options, bypass mode's loss and the rollout_corr/* metrics, worked by hand (fp64)."""

import math

import pytest
import torch

from grpo_core.algos import (
    ROLLOUT_RS_OPTIONS,
    get_policy_loss,
    parse_is_threshold,
    parse_rs,
    rollout_corr_metrics,
    rollout_is_weights,
    rollout_rejection_mask,
)

F64 = torch.float64
TOL = {"atol": 1e-12, "rtol": 1e-12}


def _rows():
    """old - rollout log-ratios: row 0 (0.5, -1, 0 | masked), row 1 (0.1, 0.2 | masked x2), row 2 empty."""
    rollout = torch.zeros(3, 4, dtype=F64)
    old = torch.tensor([[0.5, -1.0, 0.0, 9.0], [0.1, 0.2, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=F64)
    return old, rollout, mask


def test_threshold_syntaxes():
    assert parse_is_threshold(2.0) == (2.0, None)
    assert parse_is_threshold(3) == (3.0, None)
    assert parse_is_threshold("1.5") == (1.5, None)
    assert parse_is_threshold("0.5_5.0") == (5.0, 0.5)
    for bad in ("5_0.5", "x", 0, "0_1", True):
        with pytest.raises(ValueError, match="rollout_is_threshold="):
            parse_is_threshold(bad)


def test_icepop_zeroes_weights_outside_the_window():
    # token ratios e^0.5 = 1.6487, e^-1 = 0.3679, 1 | e^0.1, e^0.2; window [0.5, 1.5]: 1.6487 and 0.3679 -> 0
    old, rollout, mask = _rows()
    w = rollout_is_weights(old, rollout, mask, "token", "0.5_1.5")
    expected = torch.tensor([[0, 0, 1, 0], [math.exp(0.1), math.exp(0.2), 0, 0], [0, 0, 0, 0]], dtype=F64)
    torch.testing.assert_close(w, expected, **TOL)


def test_batch_normalisation_makes_the_weights_average_one():
    # token level, truncation at 2: weights 1.6487, 0.3679, 1, 1.1052, 1.2214 (5 valid): divided by their mean
    old, rollout, mask = _rows()
    raw = rollout_is_weights(old, rollout, mask, "token", 2.0)
    w = rollout_is_weights(old, rollout, mask, "token", 2.0, batch_normalize=True)
    mean = raw.sum() / 5
    torch.testing.assert_close(w, raw / mean, **TOL)
    torch.testing.assert_close(w.sum() / 5, torch.tensor(1.0, dtype=F64), **TOL)
    # sequence level: row weights e^-0.5 and e^0.3 (the empty row does not count): mean over the two rows
    w = rollout_is_weights(old, rollout, mask, "sequence", 2.0, batch_normalize=True)
    m = (math.exp(-0.5) + math.exp(0.3)) / 2
    torch.testing.assert_close(w[0, 0], torch.tensor(math.exp(-0.5) / m, dtype=F64), **TOL)
    torch.testing.assert_close(w[1, 1], torch.tensor(math.exp(0.3) / m, dtype=F64), **TOL)
    assert w[2].abs().sum() == 0 and w[0, 3] == 0


def test_rejection_by_token_and_by_sequence():
    old, rollout, mask = _rows()
    # token_k1 window on -l (the log of pi_rollout / pi_old) in [log 0.5, log 1.5] = [-0.693, 0.405]:
    # -l = -0.5, 1, 0 | -0.1, -0.2: token (0, 1) (-l = 1 > 0.405) is dropped
    kept, m = rollout_rejection_mask(old, rollout, mask, "token_k1", "0.5_1.5")
    torch.testing.assert_close(kept, mask * torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]], dtype=F64))
    assert m["rollout_rs_token_k1_masked_fraction"] == pytest.approx(1 / 5)
    assert m["rollout_rs_token_k1_seq_masked_fraction"] == pytest.approx(1 / 2)  # of the non-empty rows
    assert m["rollout_rs_token_k1_mean"] == pytest.approx((-0.5 + 1 + 0 - 0.1 - 0.2) / 5, abs=1e-12)  # -l, valid tokens
    assert (m["rollout_rs_token_k1_max"], m["rollout_rs_token_k1_min"]) == pytest.approx((1.0, -0.5))
    # seq_mean_k2: mean of l^2 / 2: row 0 (0.125 + 0.5 + 0) / 3 = 0.2083, row 1 (0.005 + 0.02) / 2 = 0.0125;
    # upper 0.1 drops all of row 0
    kept, m = rollout_rejection_mask(old, rollout, mask, "seq_mean_k2", 0.1)
    assert kept[0].sum() == 0 and torch.equal(kept[1], mask[1])
    seq_k2 = [(0.125 + 0.5) / 3, (0.005 + 0.02) / 2]  # the statistic per non-empty response (row 2 is empty)
    assert m["rollout_rs_seq_mean_k2_mean"] == pytest.approx(sum(seq_k2) / 2, abs=1e-12)
    assert (m["rollout_rs_seq_mean_k2_max"], m["rollout_rs_seq_mean_k2_min"]) == pytest.approx(seq_k2)
    assert m["rollout_rs_seq_mean_k2_std"] == pytest.approx((seq_k2[0] - seq_k2[1]) / 2, abs=1e-12)
    assert m["rollout_rs_masked_fraction"] == pytest.approx(3 / 5)
    # seq_max_k3 (e^l - 1 - l): row 0 max over e^0.5 - 1.5 = 0.1487, e^-1 = 0.3679, 0 -> 0.3679; row 1 max
    # e^0.2 - 1.2 = 0.0214; seq_sum_k1: -(sum l) = 0.5 and -0.3, window one number 2 -> [0.5, 2] in ratio:
    # log window [-0.693, 0.693] keeps both. Both options at once (one threshold each): 0.2 drops row 0
    kept, m = rollout_rejection_mask(old, rollout, mask, "seq_max_k3,seq_sum_k1", "0.2,2")
    assert kept[0].sum() == 0 and torch.equal(kept[1], mask[1])
    assert m["rollout_rs_seq_sum_k1_masked_fraction"] == 0
    # seq_sum_k3 keeps what its sum allows: row 0 sum 0.5166 > 0.5 dropped; row 1 0.0052 + 0.0214 kept
    kept, _ = rollout_rejection_mask(old, rollout, mask, "seq_sum_k3", "0.5")
    assert kept[0].sum() == 0 and kept[1].sum() == 2


def test_every_verl_option_parses_and_bad_specs_are_one_line():
    for option in ROLLOUT_RS_OPTIONS:
        parse_rs(option, "0.5_2" if option.endswith("k1") else 0.3)
    assert parse_rs("token_k1", 2.0) == {"token_k1": (0.5, 2.0)}
    for rs, threshold, message in [
        ("token_k4", 1.0, "valid options"),
        ("token_k1", None, "needs rollout_rs_threshold"),
        ("token_k2", "0.1_0.2", "one upper bound"),
        ("token_k1,token_k2", "1,2,3", "3 values for 2"),
        ("token_k1", "2_1", "ratio window"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_rs(rs, threshold)


def test_bypass_mode_reinforce_weights_the_plain_policy_gradient_and_ppo_clip_is_ppo():
    # old = the engine's log-probs; current log pi = (-1, -2), engine (-1.5, -1): ratios e^0.5, e^-1
    # reinforce, token IS truncated at 1.5: w = (1.5, e^-1); A = (1, -1): loss mean(-w A log pi)
    # = (-1.5 * 1 * -1 + e^-1 * -1 * -2 ... ) / 2 -> ((1.5) + (-2 e^-1)) / 2
    new = torch.tensor([[-1.0, -2.0]], dtype=F64).requires_grad_()
    engine, adv, mask = (
        torch.tensor([[-1.5, -1.0]], dtype=F64),
        torch.tensor([[1.0, -1.0]], dtype=F64),
        torch.ones(1, 2),
    )
    fn = get_policy_loss("bypass_mode")
    loss, _ = fn(engine, new, adv, mask, loss_type="reinforce", rollout_is="token", rollout_is_threshold=1.5)
    torch.testing.assert_close(loss, torch.tensor((1.5 - 2 * math.exp(-1)) / 2, dtype=F64), **TOL)
    loss.backward()
    torch.testing.assert_close(new.grad, torch.tensor([[-1.5 / 2, math.exp(-1) / 2]], dtype=F64), **TOL)
    ppo, _ = fn(engine, new, adv, mask)  # ppo_clip: the vanilla loss against the engine's log-probs
    vanilla, _ = get_policy_loss("vanilla")(engine, new, adv, mask)
    torch.testing.assert_close(ppo, vanilla, **TOL)
    # rejection inside the loss: token_k2 upper 0.2 drops token 1 (l^2 / 2 = 0.5) and keeps token 0 (0.125)
    loss, metrics = fn(engine, new, adv, mask, loss_type="reinforce", rollout_rs="token_k2", rollout_rs_threshold=0.2)
    torch.testing.assert_close(loss, torch.tensor(1.0 / 2, dtype=F64), **TOL)  # -1 * 1 * -1 over 2 tokens
    assert metrics["rollout_rs_masked_fraction"] == 0.5
    with pytest.raises(ValueError, match="loss_type"):
        fn(engine, new, adv, mask, loss_type="ppo")


def test_rollout_corr_metrics_by_hand():
    # valid tokens' l = 0.5, -1, 0, 0.1, 0.2; kl = mean(-l) = 0.2 / 5 = 0.04; k3 = mean(e^l - 1 - l)
    old, rollout, mask = _rows()
    w = rollout_is_weights(old, rollout, mask, "token", 1.5)
    m = rollout_corr_metrics(w, old, rollout, mask, 1.5)
    ls = [0.5, -1.0, 0.0, 0.1, 0.2]
    assert m["rollout_corr/kl"] == pytest.approx(-sum(ls) / 5, abs=1e-12)
    assert m["rollout_corr/k3_kl"] == pytest.approx(sum(math.exp(x) - 1 - x for x in ls) / 5, abs=1e-12)
    ws = [min(math.exp(x), 1.5) for x in ls]
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(sum(ws) / 5, abs=1e-12)
    assert m["rollout_corr/rollout_is_max"] == 1.5 and m["rollout_corr/rollout_is_min"] == pytest.approx(math.exp(-1))
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 5)  # e^0.5 > 1.5
    assert m["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(1 / 5)  # e^-1 < 1 / 1.5
    mean = sum(ws) / 5
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(
        1 / (sum((x / (mean + 1e-8)) ** 2 for x in ws) / 5), abs=1e-9
    )


def test_rollout_corr_sequence_and_perplexity_metrics_by_hand():
    """verl's rollout_is_seq_*, batch_norm_factor and off-policy diagnostics. The engine's log-probs are 0, so
    each response's mean old log-prob is -(its mean l): row 0 -1/6, row 1 0.15 (row 2 is empty)."""
    old, rollout, mask = _rows()
    exp = math.exp
    w = rollout_is_weights(old, rollout, mask, "token", 1.5, batch_normalize=True)
    m = rollout_corr_metrics(w, old, rollout, mask, 1.5, "token", batch_normalize=True)
    seq = [(exp(0.5) + exp(-1) + 1) / 3, (exp(0.1) + exp(0.2)) / 2]  # each row's mean token ratio
    assert m["rollout_corr/rollout_is_seq_mean"] == pytest.approx(sum(seq) / 2, abs=1e-12)
    assert m["rollout_corr/rollout_is_seq_max"] == pytest.approx(max(seq), abs=1e-12)
    assert m["rollout_corr/rollout_is_seq_std"] == pytest.approx(abs(seq[0] - seq[1]) / 2, abs=1e-12)
    assert m["rollout_corr/rollout_is_seq_max_deviation"] == pytest.approx(max(abs(s - 1) for s in seq), abs=1e-12)
    truncated = [min(exp(x), 1.5) for x in (0.5, -1.0, 0.0, 0.1, 0.2)]
    assert m["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(sum(truncated) / 5, abs=1e-12)
    diff = [1 / 6, -0.15]  # mean log p_rollout - mean log p_old, per response
    assert m["rollout_corr/training_log_ppl"] == pytest.approx(sum(diff) / 2, abs=1e-12)
    assert m["rollout_corr/training_ppl"] == pytest.approx((exp(1 / 6) + exp(-0.15)) / 2, abs=1e-12)
    assert m["rollout_corr/rollout_log_ppl"] == 0 and m["rollout_corr/rollout_ppl"] == 1
    assert m["rollout_corr/log_ppl_diff"] == pytest.approx(sum(diff) / 2, abs=1e-12)
    assert m["rollout_corr/log_ppl_abs_diff"] == pytest.approx((1 / 6 + 0.15) / 2, abs=1e-12)
    assert (m["rollout_corr/log_ppl_diff_max"], m["rollout_corr/log_ppl_diff_min"]) == pytest.approx((1 / 6, -0.15))
    assert m["rollout_corr/ppl_ratio"] == pytest.approx((exp(1 / 6) + exp(-0.15)) / 2, abs=1e-12)
    chi2_token = sum(exp(2 * x) for x in (0.5, -1.0, 0.0, 0.1, 0.2)) / 5 - 1
    assert m["rollout_corr/chi2_token"] == pytest.approx(chi2_token, abs=1e-12)
    assert m["rollout_corr/chi2_seq"] == pytest.approx((exp(-1.0) + exp(0.6)) / 2 - 1, abs=1e-12)
    # sequence level: row 0's ratio e^-0.5 is below 1 / 1.5, row 1's e^0.3 inside the window
    ws = rollout_is_weights(old, rollout, mask, "sequence", 1.5)
    s = rollout_corr_metrics(ws, old, rollout, mask, 1.5, "sequence")
    assert s["rollout_corr/rollout_is_seq_mean"] == pytest.approx((exp(-0.5) + exp(0.3)) / 2, abs=1e-12)
    assert (s["rollout_corr/rollout_is_seq_fraction_low"], s["rollout_corr/rollout_is_seq_fraction_high"]) == (0.5, 0)
    assert "rollout_corr/rollout_is_batch_norm_factor" not in s
