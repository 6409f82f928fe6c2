"""Configuration, the bottom layer: the typed tree (schema), loading with overrides (load), the schema's defaults for
code fed from it (defaults), verl's keys, secrets and what this machine can do (hardware). It imports nothing else
of grpo_core; the cross-field checks live above what they check, in grpo_core/checks/."""

from grpo_core.config.load import ALIASES, ConfigError, load_config, to_flat_dict, to_yaml
from grpo_core.config.schema import GRPOConfig, iter_settings

__all__ = ["ALIASES", "ConfigError", "GRPOConfig", "iter_settings", "load_config", "to_flat_dict", "to_yaml"]
