"""``grpo keys``: every config key a verl user may give, in its class: a setting (type, default, help), another
spelling, no effect here, or not offered."""

import argparse
import json

from grpo_core.config import iter_settings, verl_keys
from grpo_core.config.load import ALIASES, PREFIX_ALIASES, SPLIT_ALIASES


def add_parser(sub: argparse._SubParsersAction) -> None:
    keys = sub.add_parser(
        "keys", help="every config key, verl's too: a setting (type, default, help) or why it has none"
    )
    keys.add_argument("prefix", nargs="?", default="", help="only keys starting with this")
    keys.set_defaults(func=cmd_keys)


def cmd_keys(args: argparse.Namespace) -> int:
    """Every key a verl user may give, in its class: a setting, another spelling, no effect here, or not offered."""
    lines = []
    for key, f in iter_settings():
        default = f.default_factory() if callable(f.default_factory) else f.default
        kind = f.type.__name__ if isinstance(f.type, type) else str(f.type).replace("typing.", "")
        choices = f" {list(f.metadata['choices'])}" if f.metadata.get("choices") else ""
        lines.append((key, f"{key} ({kind}) = {default!r}: {f.metadata['help']}{choices}"))
    aliases = {**ALIASES, **{p + "*": c + "*" for p, c in PREFIX_ALIASES.items()}}
    aliases |= {k: " and ".join(v) for k, v in SPLIT_ALIASES.items()}
    lines += [(alias, f"{alias} [alias]: another spelling of {target}") for alias, target in aliases.items()]
    for e in verl_keys.IGNORED_AND_REFUSED:
        if e.refused:
            off = f" (accepted with no effect when {' or '.join(json.dumps(v) for v in e.off)})" if e.off else ""
            lines.append((e.pattern, f"{e.pattern} [not offered]: {e.reason}{off}"))
        else:
            lines.append((e.pattern, f"{e.pattern} [no effect]: {e.reason}"))
    for (key, value), feature in verl_keys.REFUSED_VALUES.items():
        lines.append((key, f"{key}={value} [not offered]: {feature}"))
    for key, line in lines:
        if key.startswith(args.prefix):
            print(line)
    return 0
