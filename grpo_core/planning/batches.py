"""The settings that size each pass's micro-batches, read from a config: a token budget or a micro-batch size,
per section (the update, and the old and reference log-prob passes), and the responses a micro-batch holds.

One table (``BATCH_KEYS``) serves the config check, the memory estimate and its remedies, and the advice after an
out-of-memory error or a low-utilisation step.
"""

from typing import NamedTuple

from grpo_core.config.schema import GRPOConfig

_LOG_PROB_BATCH = ("log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu", "log_prob_micro_batch_size_per_gpu")
BATCH_KEYS = {  # section of actor_rollout_ref -> (switch to token budgets, token budget, micro-batch size)
    "actor": ("use_dynamic_bsz", "ppo_max_token_len_per_gpu", "ppo_micro_batch_size_per_gpu"),
    "rollout": _LOG_PROB_BATCH,
    "ref": _LOG_PROB_BATCH,
}


class BatchSetting(NamedTuple):
    """The setting that sizes one pass's micro-batches: a token budget, or a micro-batch size."""

    key: str
    section: object
    attr: str
    value: int
    smallest: int  # one sequence: its tokens for a budget, 1 for a size

    def holding(self, sequences: int) -> int:
        """The value for micro-batches of ``sequences`` whole sequences."""
        return sequences * self.smallest


def batch_setting(cfg: GRPOConfig, name: str) -> BatchSetting:
    """What sizes the micro-batches of section ``name`` (actor: the update; rollout, ref: their log-prob passes): its
    token budget, or its micro-batch size (null: the actor's)."""
    section, (switch, budget, micro) = getattr(cfg.actor_rollout_ref, name), BATCH_KEYS[name]
    by_tokens = bool(getattr(section, switch))
    attr = budget if by_tokens else micro
    value = getattr(section, attr) or cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu
    smallest = cfg.data.max_prompt_length + cfg.data.max_response_length if by_tokens else 1
    return BatchSetting(f"actor_rollout_ref.{name}.{attr}", section, attr, value, smallest)


def batch_settings(cfg: GRPOConfig, phase: str) -> list[BatchSetting]:
    """The settings that size the memory model's ``phase`` (update, log_prob; generation has none)."""
    arr = cfg.actor_rollout_ref
    names = {"update": ["actor"], "log_prob": ["rollout"]}.get(phase, [])
    if phase == "log_prob" and (arr.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward):
        names.append("ref")
    return [batch_setting(cfg, name) for name in names]


def update_micro_batch(cfg: GRPOConfig) -> int:
    """Responses per update forward/backward: the setting, or what the token budget holds with dynamic batches."""
    actor = cfg.actor_rollout_ref.actor
    if actor.use_dynamic_bsz:
        return max(actor.ppo_max_token_len_per_gpu // (cfg.data.max_prompt_length + cfg.data.max_response_length), 1)
    return actor.ppo_micro_batch_size_per_gpu


def log_prob_micro_batch(cfg: GRPOConfig) -> int:
    """Responses per forward of the larger log-prob pass (old or reference): what its token budget holds with
    log_prob_use_dynamic_bsz, else its micro-batch size (null: ppo_micro_batch_size_per_gpu, as the actor)."""
    seq_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    arr = cfg.actor_rollout_ref
    passes = [arr.rollout] + ([arr.ref] if arr.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward else [])
    sizes = [
        max(p.log_prob_max_token_len_per_gpu // seq_len, 1)
        if p.log_prob_use_dynamic_bsz
        else p.log_prob_micro_batch_size_per_gpu or arr.actor.ppo_micro_batch_size_per_gpu
        for p in passes
    ]
    return max(sizes)
