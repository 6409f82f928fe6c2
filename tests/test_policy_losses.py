"""verl's policy losses beyond vanilla and GSPO, each against a reference written from its paper's formula as plain
Python over lists (slow and obvious), on hand-worked small cases and random ones in fp64 (1e-9); the gradients a loss
stops (CISPO's weight, DPPO's truncated ratio, clip_cov's and kl_cov's selections); and the micro-batch invariance
of every loss whose value is a sum over tokens or sequences, in every aggregation mode."""

import math

import pytest
import torch

from grpo_core.algos import LOSS_AGG_MODES, POLICY_LOSSES, agg_denominator, get_policy_loss

F64 = torch.float64
TOL = {"atol": 1e-9, "rtol": 1e-9}


def _t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def _random(seed: int, rows: int = 5, width: int = 7) -> tuple[torch.Tensor, ...]:
    """Old and new log-probs of probabilities in (0.02, 0.98), ratios around 1 (some far), one advantage per row
    (some rows negative), masks of different lengths and one empty row."""
    g = torch.Generator().manual_seed(seed)
    old = torch.rand(rows, width, generator=g, dtype=F64).mul(0.96).add(0.02).log()
    new = (old + torch.randn(rows, width, generator=g, dtype=F64) * 0.3).clamp(max=-0.01)
    adv = torch.randn(rows, 1, generator=g, dtype=F64).expand(rows, width).clone()
    mask = torch.ones(rows, width, dtype=F64)
    for i in range(rows):
        mask[i, width - i :] = 0
    mask[-1] = 0  # an empty row
    return old, new, adv, mask


def _mean_over_tokens(per_token, mask) -> float:
    """token-mean of a list-of-lists under the mask (the references' aggregation)."""
    total = sum(v for row, m in zip(per_token, mask.tolist(), strict=True) for v, k in zip(row, m, strict=True) if k)
    return total / max(1, int(mask.sum()))


def _seq_mean_token_mean(per_token, mask) -> float:
    rows = [[v for v, k in zip(row, m, strict=True) if k] for row, m in zip(per_token, mask.tolist(), strict=True)]
    means = [sum(r) / len(r) for r in rows if r]
    return sum(means) / max(1, len(means))


def _cells(*tensors):
    """Zip rows then tokens of same-shaped tensors into nested lists of tuples."""
    lists = [t.tolist() for t in tensors]
    return [list(zip(*rows, strict=True)) for rows in zip(*lists, strict=True)]


# ---------------------------------------------------------------- references from the papers


def ref_sapo(old, new, adv, tau_pos=1.0, tau_neg=1.05):
    """SAPO eq.: f(r) = sigma(tau (r - 1)) 4 / tau, tau by the advantage's sign; loss -f(r) A."""

    def token(o, n, a):
        r = math.exp(n - o)
        tau = tau_pos if a > 0 else tau_neg
        return -a * 4 / tau / (1 + math.exp(-tau * (r - 1)))

    return [[token(*c) for c in row] for row in _cells(old, new, adv)]


def ref_cispo(old, new, adv, low=0.2, high=0.2):
    """CISPO eq.: J = sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi; loss -J."""
    return [[-min(max(math.exp(n - o), 1 - low), 1 + high) * a * n for o, n, a in row] for row in _cells(old, new, adv)]


def ref_gmpo(old, new, adv, mask, low=0.2, high=0.2):
    """GMPO eq. (sequence-level advantage): loss_i = -A_i prod_t (clipped r_t)^(1/|o_i|), each token's log-ratio
    clipped to [-low, high] only where that lowers the objective (PPO's pessimism per sign of A)."""
    losses = []
    for row, m in zip(_cells(old, new, adv), mask.tolist(), strict=True):
        tokens = [c for c, k in zip(row, m, strict=True) if k]
        if not tokens:
            losses.append(None)
            continue
        a = sum(c[2] for c in tokens) / len(tokens)
        logs = []
        for o, n, _ in tokens:
            lr, clipped = n - o, min(max(n - o, -low), high)
            logs.append(min(lr, clipped) if a > 0 else max(lr, clipped) if a < 0 else 0.0)
        losses.append(-a * math.exp(sum(logs) / len(logs)))
    return losses


def ref_dppo(old, new, adv, kind, low=0.2, high=0.2, c=20.0):
    """DPPO-Binary: update a token only inside the divergence trust region (TV: |pi - pi_old|; KL: binary KL),
    with the side that moves pi against its advantage always allowed in KL; loss -A sg(min(r, c)) log pi."""

    def token(o, n, a):
        p, q = math.exp(o), math.exp(n)
        if kind == "tv":
            inside = q - p <= high if a > 0 else q - p >= -low
        else:
            kl = p * (o - n) + (1 - p) * math.log((1 - p + 1e-8) / (1 - q + 1e-8))
            inside = (kl <= high or q <= p) if a > 0 else (kl <= low or q >= p)
        return -a * min(math.exp(n - o), c) * n if inside else 0.0

    return [[token(*cell) for cell in row] for row in _cells(old, new, adv)]


def ref_dro(old, new, adv, beta):
    return [[-(n * a - 0.5 * beta * (n - o) ** 2) for o, n, a in row] for row in _cells(old, new, adv)]


def ref_gpg(old, new, adv):
    return [[-a * n for _, n, a in row] for row in _cells(old, new, adv)]


def ref_ppo(old, new, adv, low=0.2, high=0.2):
    return [
        [max(-a * math.exp(n - o), -a * min(max(math.exp(n - o), 1 - low), 1 + high)) for o, n, a in row]
        for row in _cells(old, new, adv)
    ]


# ---------------------------------------------------------------- hand-worked cases


def test_sapo_gate_by_hand():
    # r = 1 (log-ratio 0), A = +2: sigma(0) * 4 / 1 = 2 -> loss -4; gradient d/dlogp = -A * 4 sigma'(0) r = -2
    # r = e^0.5 = 1.6487213, A = -1, tau 1.05: sigma(1.05 * 0.6487213) * 4 / 1.05 = 0.6633270 * 3.8095238
    #   = 2.5269600 -> loss +2.5269600
    # seq-mean-token-mean of one row: (-4 + 2.5269600) / 2 = -0.7365200
    new = _t([[0.0, 0.5]]).requires_grad_()
    old, adv, mask = _t([[0.0, 0.0]]), _t([[2.0, -1.0]]), _t([[1.0, 1.0]])
    loss, metrics = get_policy_loss("sapo")(old, new, adv, mask)
    s = 1 / (1 + math.exp(-1.05 * (math.exp(0.5) - 1)))
    torch.testing.assert_close(loss, _t((-4 + s * 4 / 1.05) / 2), **TOL)
    loss.backward()
    # on-policy the gate's slope is 1: token 0's gradient is the policy gradient -A / 2 tokens = -1
    torch.testing.assert_close(new.grad[0, 0], _t(-1.0), **TOL)
    assert metrics["pg_clipfrac"] == 0


def test_cispo_keeps_the_gradient_of_clipped_tokens_through_log_pi_only():
    # token 0: r = e^0.5 = 1.6487 > 1.2 clipped to 1.2, A = +1: loss -1.2 * 0.5 = -0.6, gradient -1.2 (PPO: 0)
    # token 1: r = e^-0.1 = 0.9048 inside, A = -2, log pi = -0.1: loss 0.9048 * 2 * -0.1 = -0.18097;
    #   gradient = -sg(r) A = +1.8097 (the weight is detached: no r * log pi term)
    # token-mean: (-0.6 - 0.1809675) / 2
    new = _t([[0.5, -0.1]]).requires_grad_()
    old, adv, mask = _t([[0.0, 0.0]]), _t([[1.0, -2.0]]), _t([[1.0, 1.0]])
    loss, metrics = get_policy_loss("cispo")(old, new, adv, mask)
    torch.testing.assert_close(loss, _t((-0.6 - math.exp(-0.1) * 2 * 0.1) / 2), **TOL)
    loss.backward()
    torch.testing.assert_close(new.grad, _t([[-1.2 / 2, 2 * math.exp(-0.1) / 2]]), **TOL)
    torch.testing.assert_close(metrics["pg_clipfrac"], _t(0.5), **TOL)


def test_geo_mean_by_hand():
    # row 0, A = +1, log-ratios 0.3, -0.1: 0.3 clipped to 0.2 (pessimistic for A > 0), -0.1 kept
    #   ratio = exp((0.2 - 0.1) / 2) = exp(0.05); loss -exp(0.05)
    # row 1, A = -1, log-ratios -0.5, 0.1, 0 (third masked, garbage 3): -0.5 clipped to -0.2 (pessimistic for
    #   A < 0 keeps the larger), 0.1 kept: exp((-0.2 + 0.1) / 2) = exp(-0.05); loss +exp(-0.05)
    # mean over sequences: (-exp(0.05) + exp(-0.05)) / 2 = -sinh(0.05)
    old = _t([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    new = _t([[0.3, -0.1, 0.0], [-0.5, 0.1, 3.0]])
    adv = _t([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    mask = _t([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    loss, metrics = get_policy_loss("geo_mean")(old, new, adv, mask)
    torch.testing.assert_close(loss, _t(-math.sinh(0.05)), **TOL)
    torch.testing.assert_close(metrics["pg_clipfrac"], _t(0.25), **TOL)  # token (0, 0) of 4
    torch.testing.assert_close(metrics["pg_clipfrac_lower"], _t(0.25), **TOL)  # token (1, 0)


def test_dppo_tv_trust_region_by_hand():
    # token 0: pi_old 0.5 -> pi 0.8 (+0.3 > 0.2), A = +1: outside, loss 0, no gradient
    # token 1: pi_old 0.5 -> pi 0.6 (+0.1), A = +1: inside; r = 1.2: loss -1.2 log 0.6, gradient -1.2 (r detached)
    # token 2: pi_old 0.5 -> pi 0.2 (-0.3 < -0.2), A = -1: outside
    # token 3: pi_old 0.5 -> pi 0.4, A = -1: inside, r = 0.8: loss 0.8 log 0.4
    new = _t([[math.log(p) for p in (0.8, 0.6, 0.2, 0.4)]]).requires_grad_()
    old = _t([[math.log(0.5)] * 4])
    adv, mask = _t([[1.0, 1.0, -1.0, -1.0]]), torch.ones(1, 4, dtype=F64)
    loss, metrics = get_policy_loss("dppo_tv")(old, new, adv, mask)
    torch.testing.assert_close(loss, _t((-1.2 * math.log(0.6) + 0.8 * math.log(0.4)) / 4), **TOL)
    loss.backward()
    torch.testing.assert_close(new.grad, _t([[0.0, -1.2 / 4, 0.0, 0.8 / 4]]), **TOL)
    torch.testing.assert_close(metrics["pg_clipfrac"], _t(0.5), **TOL)


def test_dppo_kl_lets_a_token_move_back_and_truncates_the_ratio():
    # token 0: pi_old 0.5 -> 0.1, A = +1: pi fell (moves against A's push back inside): always updated;
    #   r = 0.2 -> loss -0.2 log 0.1
    # token 1: pi_old 0.01 -> 0.5, A = +1: binary KL = 0.01 ln(0.02) + 0.99 ln(0.99 / 0.5) = 0.6371 > 0.2: outside
    # token 2: as token 1 with clip_ratio_c = 3 irrelevant; token 3: pi_old 0.01 -> 0.05, A = -1, pi rose:
    #   always updated; r = 5 truncated at clip_ratio_c = 3: loss +3 log 0.05
    p_old, p_new = (0.5, 0.01, 0.01), (0.1, 0.5, 0.05)
    old, new = _t([[math.log(p) for p in p_old]]), _t([[math.log(p) for p in p_new]])
    adv, mask = _t([[1.0, 1.0, -1.0]]), torch.ones(1, 3, dtype=F64)
    loss, metrics = get_policy_loss("dppo_kl")(old, new, adv, mask, clip_ratio_c=3.0)
    torch.testing.assert_close(loss, _t((-0.2 * math.log(0.1) + 3 * math.log(0.05)) / 3), **TOL)
    torch.testing.assert_close(metrics["pg_clipfrac"], _t(1 / 3), **TOL)
    torch.testing.assert_close(metrics["pg_clipfrac_lower"], _t(1 / 3), **TOL)  # token 2's ratio was truncated


def test_dro_needs_its_beta_and_penalises_the_squared_log_ratio():
    # A = 2, log pi = -1, log pi_old = -1.5, beta 0.4: -(2 * -1 - 0.2 * 0.25) = 2.05; gradient -(A - beta lr) = -1.8
    new, old, adv, mask = _t([[-1.0]]).requires_grad_(), _t([[-1.5]]), _t([[2.0]]), _t([[1.0]])
    with pytest.raises(ValueError, match="dro_beta must be > 0"):
        get_policy_loss("dro")(old, new, adv, mask)
    loss, _ = get_policy_loss("dro")(old, new, adv, mask, dro_beta=0.4)
    torch.testing.assert_close(loss, _t(2.05), **TOL)
    loss.backward()
    torch.testing.assert_close(new.grad, _t([[-1.8]]), **TOL)


def test_gpg_is_the_plain_policy_gradient():
    new = _t([[-1.0, -2.0]]).requires_grad_()
    loss, metrics = get_policy_loss("gpg")(_t([[0.0, 0.0]]), new, _t([[1.0, -3.0]]), _t([[1.0, 1.0]]))
    torch.testing.assert_close(loss, _t((1.0 - 6.0) / 2), **TOL)  # (-1 * -1 + 3 * -2) / 2
    loss.backward()
    torch.testing.assert_close(new.grad, _t([[-0.5, 1.5]]), **TOL)
    torch.testing.assert_close(metrics["ppo_kl"], _t(1.5), **TOL)


def test_clip_cov_cuts_the_gradient_of_high_covariance_tokens_only():
    # on-policy (r = 1, nothing clipped by PPO). A = (2, 2, -2, -2), log pi = (-0.1, -3, -3, -0.1): means 0, -1.55
    # cov = (2 * 1.45, 2 * -1.45, -2 * -1.45, -2 * 1.45) = (2.9, -2.9, 2.9, -2.9): tokens 0 and 2 in (1, 5)
    # clip_cov_ratio 0.5 -> max(1, int(0.5 * 4)) = 2 tokens: both candidates cut
    # loss = token-mean of -A r on tokens 1, 3 = (-2 + 2) / 4 = 0; gradient -A r / 4 on 1 and 3 only
    new = _t([[-0.1, -3.0, -3.0, -0.1]]).requires_grad_()
    old, adv, mask = new.detach().clone(), _t([[2.0, 2.0, -2.0, -2.0]]), torch.ones(1, 4, dtype=F64)
    loss, metrics = get_policy_loss("clip_cov")(old, new, adv, mask, clip_cov_ratio=0.5)
    torch.testing.assert_close(loss, _t(0.0), **TOL)
    loss.backward()
    torch.testing.assert_close(new.grad, _t([[0.0, -0.5, 0.0, 0.5]]), **TOL)
    torch.testing.assert_close(metrics["pg_clipfrac"], _t(0.5), **TOL)
    # the default ratio 0.0002 still cuts one token (max(1, 0)): one of the two candidates, at random
    new.grad = None
    loss, metrics = get_policy_loss("clip_cov")(old, new, adv, mask, generator=torch.Generator().manual_seed(0))
    loss.backward()
    assert new.grad[0, 1] == -0.5 and new.grad[0, 3] == 0.5
    assert sorted(new.grad[0, [0, 2]].tolist()) in ([-0.5, 0.0], [0.0, 0.5])
    torch.testing.assert_close(metrics["pg_clipfrac"], _t(0.25), **TOL)


def test_kl_cov_penalises_the_top_covariance_tokens():
    # A = (2, 2, -2, -2), log pi = (-0.1, -3, -3, -0.5), old = log pi - (0.1, 0.1, 0.1, -0.2)
    # means: A 0, log pi -1.65; cov = (2 * 1.55, 2 * -1.35, -2 * -1.35, -2 * 1.15) = (3.1, -2.7, 2.7, -2.3)
    # kl_cov_ratio 0.5 -> 2 tokens: 0 and 2 get + 0.1 |log r| = +0.01 each
    # loss = token-mean(-A r) + 0.02 / 4; gradient on token 0: (-A r + 0.1 sign(lr)) / 4
    lr = _t([[0.1, 0.1, 0.1, -0.2]])
    new = _t([[-0.1, -3.0, -3.0, -0.5]]).requires_grad_()
    old, adv, mask = new.detach() - lr, _t([[2.0, 2.0, -2.0, -2.0]]), torch.ones(1, 4, dtype=F64)
    loss, metrics = get_policy_loss("kl_cov")(old, new, adv, mask, kl_cov_ratio=0.5)
    r = lr.exp()
    expected = (-(adv * r).sum() + 0.1 * (0.1 + 0.1)) / 4
    torch.testing.assert_close(loss, expected, **TOL)
    loss.backward()
    grad = -adv * r / 4 + _t([[0.1, 0.0, 0.1, 0.0]]) / 4
    torch.testing.assert_close(new.grad, grad, **TOL)
    torch.testing.assert_close(metrics["ppo_kl"], _t(0.5 / 4), **TOL)


# ---------------------------------------------------------------- random cases against the references


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_losses_match_their_paper_references_on_random_batches(seed):
    old, new, adv, mask = _random(seed)
    cases = {
        "sapo": (dict(tau_pos=1.0, tau_neg=1.05), _seq_mean_token_mean, ref_sapo(old, new, adv)),
        "cispo": (dict(clip_ratio_high=0.28), _mean_over_tokens, ref_cispo(old, new, adv, high=0.28)),
        "dppo_tv": (dict(clip_ratio_c=3.0), _mean_over_tokens, ref_dppo(old, new, adv, "tv", c=3.0)),
        "dppo_kl": (dict(clip_ratio=0.05), _mean_over_tokens, ref_dppo(old, new, adv, "kl", 0.05, 0.05)),
        "dro": (dict(dro_beta=0.3), _mean_over_tokens, ref_dro(old, new, adv, 0.3)),
        "gpg": ({}, _mean_over_tokens, ref_gpg(old, new, adv)),
        # clip_cov with no token in its covariance window is PPO; kl_cov with coefficient 0 is the plain surrogate
        "clip_cov": (dict(clip_cov_lb=50.0, clip_cov_ub=60.0), _mean_over_tokens, ref_ppo(old, new, adv)),
    }
    for name, (settings, aggregate, reference) in cases.items():
        loss, _ = get_policy_loss(name)(old, new, adv, mask, **settings)
        torch.testing.assert_close(loss, _t(aggregate(reference, mask)), **TOL, msg=name)
    seq = [v for v in ref_gmpo(old, new, adv, mask, 0.3, 0.3) if v is not None]
    loss, _ = get_policy_loss("geo_mean")(old, new, adv, mask, clip_ratio=0.3)
    torch.testing.assert_close(loss, _t(sum(seq) / len(seq)), **TOL)


def test_kl_cov_matches_its_reference_on_a_random_batch():
    old, new, adv, mask = _random(3)
    loss, _ = get_policy_loss("kl_cov")(old, new, adv, mask, kl_cov_ratio=0.2, ppo_kl_coef=0.7)
    valid = [(i, j) for i in range(mask.shape[0]) for j in range(mask.shape[1]) if mask[i, j]]
    a = [adv[i, j].item() for i, j in valid]
    lp = [new[i, j].item() for i, j in valid]
    ma, ml = sum(a) / len(a), sum(lp) / len(lp)
    cov = [(x - ma) * (y - ml) for x, y in zip(a, lp, strict=True)]
    top = set(sorted(range(len(cov)), key=lambda k: -cov[k])[: max(1, int(len(cov) * 0.2))])
    total = 0.0
    for k, (i, j) in enumerate(valid):
        lr = (new[i, j] - old[i, j]).item()
        total += -a[k] * math.exp(lr) + (0.7 * abs(lr) if k in top else 0.0)
    torch.testing.assert_close(loss, _t(total / len(valid)), **TOL)


# ---------------------------------------------------------------- micro-batch invariance

SPLITTABLE = {  # every loss whose value is a sum over tokens or sequences, with settings that make it work
    "vanilla": {},
    "gspo": {},
    "sapo": {},
    "cispo": {},
    "geo_mean": {},
    "gpg": {},
    "dppo_tv": {},
    "dppo_kl": {"clip_ratio": 0.05},
    "dro": {"dro_beta": 0.3},
}


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("name", sorted(SPLITTABLE))
def test_every_loss_sums_over_micro_batches_to_the_whole_batch(name, mode):
    """With the whole batch's normaliser, the micro-batches' losses and gradients add up to the whole batch's,
    however the rows are split (clip_cov and kl_cov choose their tokens per call, as verl's do: not splittable)."""
    old, new, adv, mask = _random(7, rows=6)
    new.requires_grad_()
    settings = {**SPLITTABLE[name], "loss_agg_mode": mode, "loss_scale_factor": 7.0}
    fn = get_policy_loss(name)
    whole, _ = fn(old, new, adv, mask, **settings)
    (grad_whole,) = torch.autograd.grad(whole, new)
    norm = agg_denominator(mask, mode)
    for split in [(slice(0, 3), slice(3, 6)), (slice(0, 1), slice(1, 4), slice(4, 6))]:
        parts = sum(fn(old[s], new[s], adv[s], mask[s], denominator=norm, **settings)[0] for s in split)
        torch.testing.assert_close(parts, whole, **TOL)
        (grad_parts,) = torch.autograd.grad(parts, new)
        torch.testing.assert_close(grad_parts, grad_whole, **TOL)


def test_the_registry_holds_verls_losses():
    assert set(POLICY_LOSSES) >= set(SPLITTABLE) | {"clip_cov", "kl_cov"}
