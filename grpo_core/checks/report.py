"""What the checks of a config find: errors, warnings and notes, with the layout and memory estimate computed on
the way; and the one message every check gives for a value outside its choices."""

from dataclasses import dataclass, field

from grpo_core.config.verl_keys import REFUSED_VALUES
from grpo_core.planning.layout import ParallelLayout
from grpo_core.planning.memory import MemoryEstimate


@dataclass
class Report:
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # how verl keys given are taken here (no effect, or a different one)
    layout: ParallelLayout | None = None
    memory: MemoryEstimate | None = None


def invalid_choice(key: str, value, valid) -> str:
    """One line; a value that selects one of verl's features not offered here names that feature."""
    feature = REFUSED_VALUES.get((key, value))
    if feature is not None:
        return f"{key}={value}: not offered here: {feature}; valid: {list(valid)}"
    return f"{key}={value!r} is not valid; valid: {list(valid)}"
