"""LoRA's settings (``actor_rollout_ref.model.lora``) and which linears they select: no megatron import, so the
CLI checks a resume point before any rank starts. The adapters themselves are in models/lora.py."""

from dataclasses import dataclass
from fnmatch import fnmatchcase

from grpo_core.config.defaults import SETTING, defaults_from, schema_default
from grpo_core.config.schema import LORA_LINEARS as LINEARS  # verl's target names; ``all-linear``: all four

INIT_METHODS = ("xavier", "kaiming", "zero")
LORA = "actor_rollout_ref.model.lora"


@dataclass(frozen=True)
@defaults_from(LORA)
class LoRASettings:
    """``actor_rollout_ref.model.lora``, its defaults the schema's: rank 0 is off. ``seed``: of the adapters' init
    (``from_config`` gives it megatron's)."""

    rank: int = SETTING
    alpha: float = SETTING
    dropout: float = SETTING
    target_modules: tuple[str, ...] = tuple(schema_default(f"{LORA}.target_modules"))
    exclude_modules: tuple[str, ...] = tuple(schema_default(f"{LORA}.exclude_modules"))
    a_init: str = schema_default(f"{LORA}.lora_A_init_method")
    b_init: str = schema_default(f"{LORA}.lora_B_init_method")
    seed: int = 0

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_config(cls, lora, seed: int = 0) -> "LoRASettings":
        """From the config tree's ``model.lora`` section."""
        return cls(
            rank=lora.rank,
            alpha=float(lora.alpha),
            dropout=lora.dropout,
            target_modules=tuple(lora.target_modules),
            exclude_modules=tuple(lora.exclude_modules),
            a_init=lora.lora_A_init_method,
            b_init=lora.lora_B_init_method,
            seed=seed,
        )

    def record(self) -> dict:
        """What a checkpoint records of them (``from_record`` rebuilds them for export and resume checks)."""
        return {
            "rank": self.rank,
            "alpha": self.alpha,
            "dropout": self.dropout,
            "target_modules": list(self.target_modules),
            "exclude_modules": list(self.exclude_modules),
            "a_init": self.a_init,
            "b_init": self.b_init,
            "seed": self.seed,
        }

    @classmethod
    def from_record(cls, record: dict) -> "LoRASettings":
        fields = dict(record)
        fields["target_modules"], fields["exclude_modules"] = (
            tuple(fields[k]) for k in ("target_modules", "exclude_modules")
        )
        return cls(**fields)

    def selects(self, name: str) -> bool:
        """Whether the linear ``name`` (its full module name) gets an adapter: it matches a target (a kind of
        linear, ``all-linear``, or a wildcard pattern on the name) and no exclusion. With exclusions and no
        targets, every linear not excluded (verl's rule)."""
        kind = name.rsplit(".", 1)[-1]
        if kind not in LINEARS:
            return False

        def hit(pattern: str) -> bool:
            return pattern in (kind, name, "all-linear") or fnmatchcase(name, pattern)

        targets = self.target_modules or (("all-linear",) if self.exclude_modules else ())
        return any(hit(p) for p in targets) and not any(hit(p) for p in self.exclude_modules)
