"""Where the settings the losses and estimators take get their defaults: the config schema, and nowhere else.

A loss or estimator takes each setting as a keyword named like verl's config key, declared ``name: T = SETTING``;
its registry (``register_policy_loss``, ``register_adv_estimator``) puts the schema's default of that setting in
place, found by name in SECTIONS. Callers may then omit the keyword, as with verl's functions, and
``inspect.signature`` shows the default the call uses. A default that is the loss's own (GSPO's aggregation, say)
stays a literal in its signature.
"""

from grpo_core.config.defaults import SETTING, defaults_from

SECTIONS = (
    "actor_rollout_ref.actor.policy_loss",
    "actor_rollout_ref.actor",
    "algorithm.rollout_correction",
    "algorithm",
    "reward_model.reward_kwargs.overlong_buffer_cfg",
)
"""The config sections whose settings the algorithms take by name, in the order a name is looked up."""

schema_defaults = defaults_from(*SECTIONS)
"""Decorator: a function's SETTING defaults (or a class's, under ``@dataclass``) from the schema's SECTIONS."""

__all__ = ["SECTIONS", "SETTING", "schema_defaults"]
