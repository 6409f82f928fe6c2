"""Configuration: the typed tree (schema), loading with overrides (load) and cross-field checks (validate)."""

from grpo_core.config.load import ALIASES, ConfigError, load_config, to_flat_dict, to_yaml
from grpo_core.config.schema import GRPOConfig, iter_settings

__all__ = ["ALIASES", "ConfigError", "GRPOConfig", "iter_settings", "load_config", "to_flat_dict", "to_yaml"]
