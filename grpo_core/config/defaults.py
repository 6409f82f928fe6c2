"""The schema's defaults for code fed from the config, so a setting's default is written once: in schema.py.

Code outside the config declares a setting it takes with ``SETTING`` as its default (a function's keyword
``clip_ratio: float = SETTING``, a settings class's field ``lr: float = SETTING``) and is decorated with
``defaults_from(section, ...)``: each SETTING becomes the default of the schema's setting of the same name, in the
first of those sections that has it. A field named otherwise than its setting takes ``schema_default(key)``;
``section_values`` reads the settings of given names from a loaded config, for ``from_config`` constructors.
"""

import inspect
from collections.abc import Callable, Iterable
from dataclasses import MISSING, Field, fields, is_dataclass
from operator import attrgetter
from typing import Any, TypeVar

from grpo_core.config.schema import GRPOConfig

T = TypeVar("T")


class _Setting:
    """The placeholder default of a setting, until ``defaults_from`` puts the schema's in its place."""

    def __repr__(self) -> str:
        return "SETTING"


SETTING: Any = _Setting()


def _is_section(f: Field) -> bool:
    return f.default_factory is not MISSING and is_dataclass(f.type)


def _section_fields(path: str) -> list[Field]:
    """The fields of the section at the dotted ``path`` ("" is the whole tree)."""
    cls = GRPOConfig
    for name in filter(None, path.split(".")):
        sections = {f.name: f.type for f in fields(cls) if _is_section(f)}
        if name not in sections:
            raise KeyError(f"{path!r} is not a section of the config")
        cls = sections[name]
    return list(fields(cls))


def section_defaults(path: str) -> dict[str, Any]:
    """{name: default} of the settings directly in the section at the dotted ``path`` (not its subsections). Read
    from the schema's fields on every call: a fresh copy of a list or dict default, and nothing cached."""
    return {
        f.name: f.default if f.default is not MISSING else f.default_factory()
        for f in _section_fields(path)
        if not _is_section(f)
    }


def schema_default(key: str) -> Any:
    """The default of the setting at the dotted ``key`` (``"actor_rollout_ref.model.lora.rank"``)."""
    path, _, name = key.rpartition(".")
    defaults = section_defaults(path)
    if name not in defaults:
        raise KeyError(f"{key!r} is not a setting of the config")
    return defaults[name]


def setting_default(name: str, sections: Iterable[str]) -> Any:
    """The default of the setting ``name`` in the first of ``sections`` that has one of that name."""
    for path in sections:
        defaults = section_defaults(path)
        if name in defaults:
            return defaults[name]
    raise KeyError(f"{name!r} is a setting of none of the sections {list(sections)}")


def section_values(cfg: GRPOConfig, names: Iterable[str], sections: Iterable[str]) -> dict[str, Any]:
    """{name: value} in ``cfg`` of each of ``names`` that is a setting of one of ``sections`` (the first that has
    it); names of no setting there are left out. What a settings class's ``from_config`` copies by name."""
    wanted, found = set(names), {}
    for path in sections:
        section = attrgetter(path)(cfg)
        for f in fields(section):
            if f.name in wanted and not _is_section(f):
                found.setdefault(f.name, getattr(section, f.name))
    return found


def defaults_from(*sections: str) -> Callable[[T], T]:
    """Decorator putting the schema's defaults in place of SETTING: in a function's keyword defaults (its own, under
    wrappers such as ``torch.no_grad()``: ``inspect.signature`` then shows them), or in a class's field defaults
    (put it under ``@dataclass``). Each is the default of the setting of the same name in the first of
    ``sections`` that has one; a name of no setting there is a KeyError when the module is imported."""

    def fill(target: T) -> T:
        if isinstance(target, type):
            for name, value in list(vars(target).items()):
                if value is SETTING:
                    setattr(target, name, setting_default(name, sections))
            return target
        fn = inspect.unwrap(target)
        defaults, kwdefaults = getattr(fn, "__defaults__", None) or (), getattr(fn, "__kwdefaults__", None) or {}
        if not any(d is SETTING for d in (*defaults, *kwdefaults.values())):
            return target
        params = inspect.signature(fn, follow_wrapped=False).parameters.values()

        def default(p: inspect.Parameter) -> Any:
            return setting_default(p.name, sections) if p.default is SETTING else p.default

        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        fn.__defaults__ = tuple(default(p) for p in positional[len(positional) - len(defaults) :]) or None
        fn.__kwdefaults__ = {p.name: default(p) for p in params if p.name in kwdefaults} or None
        return target

    return fill
