"""A reward function of the user's own, as verl's ``custom_reward_function.path`` / ``.name`` give it.

The file is imported from its path and the function is called with verl's keyword arguments:
``compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=...)``; it returns a number
or a dict whose ``"score"`` is the reward (verl keeps the other keys as extra information; they are ignored
here). Every way the file can be unusable is a ``RewardFileError`` with one line, raised by the dry run's
checks before any rank starts.
"""

import importlib.machinery
import importlib.util
import inspect
import numbers
import sys
from collections.abc import Callable
from hashlib import sha1
from pathlib import Path
from typing import Any

from grpo_core.config.defaults import SETTING, defaults_from

CALL = "(data_source, solution_str, ground_truth, extra_info=None)"
"""verl's signature, as the error messages quote it."""
_PROBE = {"data_source": "", "solution_str": "", "ground_truth": "", "extra_info": None}


class RewardFileError(Exception):
    """The custom reward file or function cannot be used; the message is one line for the user."""


@defaults_from("custom_reward_function")
def load_custom_reward(path: str, name: str = SETTING) -> Callable[..., Any]:
    """Import ``path`` and return its function ``name`` (default: the schema's ``custom_reward_function.name``),
    checked to accept verl's keyword arguments."""
    where = f"custom_reward_function.path={path}"
    file = Path(path).expanduser()
    if not file.is_file():
        raise RewardFileError(f"{where}: {'not a file' if file.exists() else 'no such file'}")
    module = _import_file(file, where)
    fn = getattr(module, name, None)
    if fn is None:
        defined = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and not k.startswith("_"))
        found = f"; it defines: {', '.join(defined)}" if defined else "; it defines no functions"
        raise RewardFileError(f"{where}: no function {name!r} (custom_reward_function.name){found}")
    if not callable(fn):
        raise RewardFileError(f"{where}: {name!r} is a {type(fn).__name__}, not a function")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a callable without an introspectable signature: trusted as it is
        return fn
    try:
        signature.bind(**_PROBE)
    except TypeError as e:
        raise RewardFileError(f"{where}: {name}{signature} cannot be called as {name}{CALL} ({e})") from None
    return fn


def _import_file(file: Path, where: str):
    """The module of ``file``, under a name of its own (two files never share a module), registered in
    ``sys.modules`` as an import would be (dataclasses and pickling look the module up there)."""
    module_name = f"grpo_custom_reward_{sha1(str(file.resolve()).encode()).hexdigest()[:12]}"
    loader = importlib.machinery.SourceFileLoader(module_name, str(file))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(module_name, loader))
    sys.modules[module_name] = module
    try:
        loader.exec_module(module)
    except BaseException as e:
        del sys.modules[module_name]
        if isinstance(e, SyntaxError):
            raise RewardFileError(f"{where}:{e.lineno}: syntax error: {e.msg}") from None
        if not isinstance(e, Exception):  # KeyboardInterrupt, SystemExit: not the file's error to report
            raise
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise RewardFileError(f"{where}: importing it raised {type(e).__name__}: {first}") from None
    return module


@defaults_from("custom_reward_function")
def as_score(value: Any, name: str = SETTING) -> float:
    """A custom function's return value as the reward: a number, or a dict's ``"score"``."""
    if isinstance(value, dict):
        if "score" not in value:
            raise RewardFileError(f"custom reward {name} returned a dict without a 'score' key: {sorted(value)}")
        value = value["score"]
    if not isinstance(value, numbers.Real):
        try:  # a 0-d tensor or array
            return float(value)
        except (TypeError, ValueError):
            raise RewardFileError(
                f"custom reward {name} returned {type(value).__name__} {value!r:.80}; expected a number "
                "or a dict with a 'score' key"
            ) from None
    return float(value)
