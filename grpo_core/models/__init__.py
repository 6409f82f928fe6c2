"""Model descriptions: shapes read from Hugging Face configs (and, with the actor, megatron builders)."""

from grpo_core.models.shape import ModelShape, ModelShapeError, load_model_shape

__all__ = ["ModelShape", "ModelShapeError", "load_model_shape"]
