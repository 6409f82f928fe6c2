"""Checks of the algorithm: GRPO's group, the KL terms, the policy loss and its clipping, rollout correction,
dynamic sampling and the rewards, with what verl's settings do (or not) here."""

from grpo_core.algos import BYPASS_LOSS_TYPES, parse_is_threshold, parse_rs
from grpo_core.checks.report import Report, invalid_choice
from grpo_core.config.schema import GRPOConfig
from grpo_core.rewards.custom import RewardFileError, load_custom_reward


def check_algorithm(cfg: GRPOConfig, r: Report) -> None:
    actor, algo = cfg.actor_rollout_ref.actor, cfg.algorithm
    n = cfg.actor_rollout_ref.rollout.n
    if n < 2:
        r.errors.append(
            f"actor_rollout_ref.rollout.n (algorithm.group_size)={n}: GRPO compares responses within a "
            "group, so it needs at least 2 per prompt"
        )
    elif not 5 <= n <= 10:
        r.warnings.append(
            f"group size {n} is outside the guide's 5-10: fewer gives noisy baselines, more costs generation"
        )
    if actor.kl_loss_coef < 0:
        r.errors.append(f"actor_rollout_ref.actor.kl_loss_coef={actor.kl_loss_coef} must be >= 0")
    if actor.use_kl_loss and actor.kl_loss_coef == 0:
        r.warnings.append("use_kl_loss=true with kl_loss_coef=0 computes reference log-probs for nothing")
    if actor.use_kl_loss and algo.use_kl_in_reward:
        r.warnings.append("KL is both a loss (use_kl_loss) and a reward penalty (use_kl_in_reward): counted twice")
    if actor.clip_ratio <= 0:
        r.errors.append(f"actor_rollout_ref.actor.clip_ratio={actor.clip_ratio} must be > 0")
    for key in ("clip_ratio_low", "clip_ratio_high"):
        value = getattr(actor, key)
        if value is not None and value < 0:
            r.errors.append(f"actor_rollout_ref.actor.{key}={value} must be >= 0")
    if actor.loss_scale_factor is not None and actor.loss_scale_factor <= 0:
        r.errors.append(f"actor_rollout_ref.actor.loss_scale_factor={actor.loss_scale_factor} must be > 0 (or null)")
    if actor.clip_ratio_c <= 1:
        r.errors.append(f"actor_rollout_ref.actor.clip_ratio_c={actor.clip_ratio_c} must be > 1 (dual clip)")
    if actor.optim.lr <= 0:
        r.errors.append(f"actor_rollout_ref.actor.optim.lr={actor.optim.lr} must be > 0")
    if not 0 <= actor.optim.lr_warmup_steps_ratio < 1:
        r.errors.append("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio must be in [0, 1)")
    if cfg.actor_rollout_ref.rollout.mode == "async":
        r.notes.append(
            "actor_rollout_ref.rollout.mode=async: the engine is colocated with the actor and generates between "
            "training phases, as verl's hybrid engine does in either mode"
        )
    _check_overlong_buffer(cfg, r)
    _check_filter_groups(cfg, r)
    _check_estimator_and_loss(cfg, r)
    if cfg.reward_model.enable:
        r.errors.append("reward_model.enable=true: learned reward models are not supported; rule rewards only")
    if not cfg.actor_rollout_ref.hybrid_engine:
        r.errors.append(
            "actor_rollout_ref.hybrid_engine=false: the actor, reference and rollout engine always share their GPUs "
            "here (verl's GRPO trainer also requires true); separate rollout GPUs are not offered"
        )


SEQUENCE_LOSSES = {"gspo": "GSPO's objective", "sapo": "SAPO's objective (verl always)", "geo_mean": "GMPO"}
"""Losses whose objective is a mean over sequences: with another loss_agg_mode they train, but not as published."""


def _check_estimator_and_loss(cfg: GRPOConfig, r: Report) -> None:
    """The GRPO family's options: discounting only where an estimator discounts, GSPO with its aggregation,
    rollout importance weights with a positive bound."""
    algo, actor = cfg.algorithm, cfg.actor_rollout_ref.actor
    if algo.lam != 1.0:
        r.notes.append(
            f"algorithm.lam={algo.lam}: no effect here: GAE's lambda, and no estimator offered here uses GAE"
        )
    if algo.gamma != 1.0 and algo.adv_estimator != "reinforce_plus_plus":
        r.notes.append(
            f"algorithm.gamma={algo.gamma}: no effect with adv_estimator={algo.adv_estimator} "
            "(only reinforce_plus_plus discounts its returns)"
        )
    if not 0 <= algo.gamma <= 1:
        r.errors.append(f"algorithm.gamma={algo.gamma} must be in [0, 1]")
    mode, loss = actor.loss_agg_mode, actor.policy_loss
    if loss.loss_mode in SEQUENCE_LOSSES and mode != "seq-mean-token-mean":
        r.warnings.append(
            f"policy_loss.loss_mode={loss.loss_mode} with loss_agg_mode={mode}: {SEQUENCE_LOSSES[loss.loss_mode]} "
            "averages each sequence's tokens then the sequences; set "
            "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"
        )
    prefix = "actor_rollout_ref.actor.policy_loss"
    if loss.loss_mode == "dro" and (loss.dro_beta is None or loss.dro_beta <= 0):
        r.errors.append(f"{prefix}.dro_beta={loss.dro_beta}: loss_mode=dro needs a beta > 0 (verl has no default)")
    for key in ("clip_cov_ratio", "kl_cov_ratio"):
        if getattr(loss, key) <= 0:
            r.errors.append(f"{prefix}.{key}={getattr(loss, key)} must be > 0")
    if loss.clip_cov_lb >= loss.clip_cov_ub:
        r.errors.append(f"{prefix}.clip_cov_lb={loss.clip_cov_lb} must be < clip_cov_ub={loss.clip_cov_ub}")
    for key in ("tau_pos", "tau_neg"):
        if getattr(actor, key) <= 0:
            r.errors.append(f"actor_rollout_ref.actor.{key}={getattr(actor, key)} must be > 0 (SAPO's temperature)")
    _check_rollout_correction(cfg, r)


def _check_rollout_correction(cfg: GRPOConfig, r: Report) -> None:
    """verl's threshold syntaxes parse, rejection sampling has thresholds, bypass mode has a known loss type; and
    the settings that do nothing as given are said to."""
    rc, prefix = cfg.algorithm.rollout_correction, "algorithm.rollout_correction"
    loss_mode = cfg.actor_rollout_ref.actor.policy_loss.loss_mode
    try:
        parse_is_threshold(rc.rollout_is_threshold)
    except ValueError as e:
        r.errors.append(f"{prefix}.{e}")
    if rc.rollout_rs is not None:
        try:
            parse_rs(rc.rollout_rs, rc.rollout_rs_threshold)
        except ValueError as e:
            r.errors.append(f"{prefix}.{e}")
    if rc.loss_type not in BYPASS_LOSS_TYPES:
        r.errors.append(invalid_choice(f"{prefix}.loss_type", rc.loss_type, BYPASS_LOSS_TYPES))
    if loss_mode == "bypass_mode" and not rc.bypass_mode:
        r.errors.append(
            "actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode: set algorithm.rollout_correction.bypass_mode="
            "true instead (it makes the engine's log-probs the old policy's, which this loss assumes)"
        )
    if rc.bypass_mode and loss_mode not in ("vanilla", "bypass_mode"):
        r.errors.append(
            f"{prefix}.bypass_mode=true replaces policy_loss.loss_mode with bypass_mode (its loss_type chooses PPO's "
            f"clip or REINFORCE); loss_mode={loss_mode} would be ignored: leave it vanilla"
        )
    if rc.rollout_is_batch_normalize and rc.rollout_is is None:
        r.notes.append(f"{prefix}.rollout_is_batch_normalize: no effect without rollout_is")
    if rc.bypass_mode and rc.loss_type == "ppo_clip" and rc.rollout_is is not None:
        r.notes.append(
            f"{prefix}.rollout_is={rc.rollout_is} with bypass_mode and loss_type=ppo_clip: no weights are applied "
            "(PPO's ratio is already pi / pi_rollout; verl does the same)"
        )


def _check_filter_groups(cfg: GRPOConfig, r: Report) -> None:
    """Dynamic sampling filters on a value the reward produces, with a non-negative budget of batches."""
    fg, prefix = cfg.algorithm.filter_groups, "algorithm.filter_groups"
    if not fg.enable:
        return
    if fg.max_num_gen_batches < 0:
        r.errors.append(f"{prefix}.max_num_gen_batches={fg.max_num_gen_batches} must be >= 0 (0: no limit)")
    if fg.metric == "acc" and cfg.custom_reward_function.path:
        r.errors.append(
            f"{prefix}.metric=acc needs a reward that reports accuracy (the built-in ones do: full score or not); "
            "custom_reward_function's reward is its score alone: set filter_groups.metric=score"
        )
    rm = cfg.reward_model
    shaped = rm.reward_manager == "dapo" and rm.reward_kwargs.overlong_buffer_cfg.enable
    if fg.metric == "seq_final_reward" and not shaped:
        r.notes.append(f"{prefix}.metric=seq_final_reward: no shaping is on, so it is the score (as metric=score)")


def _check_overlong_buffer(cfg: GRPOConfig, r: Report) -> None:
    rm = cfg.reward_model
    kwargs, buffer = rm.reward_kwargs, rm.reward_kwargs.overlong_buffer_cfg
    prefix = "reward_model.reward_kwargs"
    if not buffer.enable:
        return
    if rm.reward_manager != "dapo":
        r.warnings.append(
            f"{prefix}.overlong_buffer_cfg.enable=true does nothing with reward_manager={rm.reward_manager}"
        )
        return
    if kwargs.max_resp_len is None:
        r.errors.append(f"{prefix}.overlong_buffer_cfg.enable=true needs {prefix}.max_resp_len")
    elif not 0 < buffer.len <= kwargs.max_resp_len:
        r.errors.append(
            f"{prefix}.overlong_buffer_cfg.len={buffer.len} must be in (0, max_resp_len={kwargs.max_resp_len}]"
        )
    elif kwargs.max_resp_len - buffer.len >= cfg.data.max_response_length:
        r.warnings.append(
            f"no response is penalised: max_resp_len - overlong_buffer_cfg.len = {kwargs.max_resp_len - buffer.len} "
            f"tokens is not below data.max_response_length={cfg.data.max_response_length}"
        )


def check_custom_reward(cfg: GRPOConfig, r: Report) -> None:
    """Import the user's reward file now: a typo must not wait for the first scored rollout."""
    custom = cfg.custom_reward_function
    if not custom.path:
        return
    try:
        load_custom_reward(custom.path, custom.name)
    except RewardFileError as e:
        r.errors.append(str(e))
