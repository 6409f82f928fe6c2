"""Rollout engines: sample responses for prompts. ``build_engine`` builds one by name (``registry``)."""

from grpo_core.rollout.base import Generation, RolloutEngine, SamplingSettings, draw, to_rollout_batch
from grpo_core.rollout.registry import ENGINES, EngineRequest, build_engine

__all__ = [
    "ENGINES",
    "EngineRequest",
    "Generation",
    "RolloutEngine",
    "SamplingSettings",
    "build_engine",
    "draw",
    "to_rollout_batch",
]
