"""Rollout engines: sample responses for prompts. Import ``HFEngine`` from ``grpo_core.rollout.hf`` (transformers)."""

from grpo_core.rollout.base import Generation, RolloutEngine, SamplingSettings, to_rollout_batch

__all__ = ["Generation", "RolloutEngine", "SamplingSettings", "to_rollout_batch"]
