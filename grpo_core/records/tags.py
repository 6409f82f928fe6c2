"""A registry version's tags, read back: what it was registered from (digests, its base), how it was judged
(promotion, uplift, the evaluation set). MLflow's tags are strings: a number is one written as text, parsed here
once (``"+0.012000"``), and a tag that does not parse is refused in one line naming the version and the tag.

The names are those tracking/registry.py and pipeline/promotion.py write; tags of other names are kept as they are.
"""

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from grpo_core.records.reader import Digest, Hex64, Name, validate


def _interval(text: str) -> list[str]:
    """``"[-0.010000, +0.030000]"`` -> its two numbers, as text (parsed as floats next)."""
    if isinstance(text, str) and text.startswith("[") and text.endswith("]") and text.count(",") == 1:
        return [part.strip() for part in text[1:-1].split(",")]
    raise ValueError("expected [LOW, HIGH]")


Interval = Annotated[tuple[float, float], BeforeValidator(_interval)]
Questions = Annotated[int, Field(ge=0, le=1 << 40)]


class VersionTags(BaseModel):
    """The tags of a model version the project reads; values are text, parsed (numbers) and checked (digests)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, populate_by_name=False, defer_build=True)

    model_sha256: Hex64 | None = Field(None, alias="grpo.model_sha256")
    checkpoint_manifest_sha256: Hex64 | None = Field(None, alias="grpo.checkpoint_manifest_sha256")
    lora_base_model: Name | None = Field(None, alias="grpo.lora.base_model")
    base_model: Name | None = Field(None, alias="grpo.base_model")
    promotion: Literal["champion", "challenger"] | None = Field(None, alias="grpo.promotion")
    compared_with: str | None = Field(None, alias="grpo.compared_with")
    uplift: float | None = Field(None, alias="grpo.uplift")
    uplift_ci95: Interval | None = Field(None, alias="grpo.uplift_ci95")
    uplift_p_value: Annotated[float, Field(ge=0, le=1)] | None = Field(None, alias="grpo.uplift_p_value")
    questions: Questions | None = Field(None, alias="grpo.questions")
    promotion_reason: str | None = Field(None, alias="grpo.promotion_reason")
    eval_data_digest: Digest | None = Field(None, alias="grpo.eval_data_digest")
    eval_questions: Questions | None = Field(None, alias="grpo.eval.questions")
    eval_ids_sha256: Hex64 | None = Field(None, alias="grpo.eval.ids_sha256")


def read_version_tags(where: str, tags: dict[str, str] | None) -> VersionTags:
    """``tags`` of the version ``where`` names, checked; RecordError (``<where>: tag 'grpo.uplift': expected a
    number, got 'abc'``) when one the project reads does not parse."""
    return validate(dict(tags or {}), VersionTags, where, "tags", strict=False, item="tag")
