"""Load a YAML config and ``key=value`` overrides into a ``GRPOConfig``.

OmegaConf does the typing and merging. This module adds what users of verl's guide expect on top:
the guide's alternative spellings (aliases), verl's keys that have no effect here (a note each) or select a
feature not offered (an error naming it; ``verl_keys.py``), "did you mean" for unknown keys, every problem
reported at once with its file and line (or the override that caused it), Hydra's ``+key=value`` rule for
adding keys to free-form sections, and Hydra's ``--config-path/--config-name``. The file itself is read as
plain YAML within limits of size, depth and alias expansion (``yaml_file.py``).
"""

import difflib
import typing
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import InterpolationResolutionError, MissingMandatoryValue, OmegaConfBaseException

from grpo_core.config import verl_keys
from grpo_core.config.hardware import native_dtype
from grpo_core.config.schema import AUTO_DTYPE, DTYPE_SECTIONS, FREE_FORM_KEYS, GRPOConfig, iter_settings
from grpo_core.config.secrets import is_secret, masked, masked_word, shown_key
from grpo_core.config.yaml_file import MAX_DEPTH, MAX_VALUE_CHARS, ConfigFileError, read_config_file

ALIASES = {
    "algorithm.group_size": "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.actor.kl_coeff": "actor_rollout_ref.actor.kl_loss_coef",
    "actor_rollout_ref.actor.gradient_clipping": "actor_rollout_ref.actor.grad_clip",
    "actor_rollout_ref.actor.optim.clip_grad": "actor_rollout_ref.actor.grad_clip",
    # verl's FSDP spellings of the LoRA settings
    "actor_rollout_ref.model.lora_rank": "actor_rollout_ref.model.lora.rank",
    "actor_rollout_ref.model.lora_alpha": "actor_rollout_ref.model.lora.alpha",
    "actor_rollout_ref.model.target_modules": "actor_rollout_ref.model.lora.target_modules",
    "actor_rollout_ref.model.exclude_modules": "actor_rollout_ref.model.lora.exclude_modules",
    "actor_rollout_ref.model.lora_adapter_path": "actor_rollout_ref.model.lora.adapter_path",
}
"""The guide's (and verl's other) spellings -> this tree's keys. Both are accepted; setting both differently in
one place is an error."""

PREFIX_ALIASES = {
    "actor_rollout_ref.actor.optimizer.": "actor_rollout_ref.actor.optim.",
    "reward_model.overlong_buffer.": "reward_model.reward_kwargs.overlong_buffer_cfg.",
}
"""Whole sections under another name: the guide writes ``actor.optimizer.lr``, verl ``actor.optim.lr``; verl's DAPO
recipe (recipe/dapo, main_dapo) ``reward_model.overlong_buffer.*``, its main trainer
``reward_model.reward_kwargs.overlong_buffer_cfg.*``."""

IMPLIED_BY_ALIAS = {
    "reward_model.overlong_buffer.": ("reward_model.reward_kwargs.max_resp_len", "${data.max_response_length}"),
}
"""What an alias section's spelling implies unless it is set: verl's DAPO recipe counts the overlong buffer back
from data.max_response_length (its reward manager is built with max_resp_len=data.max_response_length)."""

SPLIT_ALIASES = {
    "actor_rollout_ref.actor.optim.betas": (
        "actor_rollout_ref.actor.optim.adam_beta1",
        "actor_rollout_ref.actor.optim.adam_beta2",
    ),
}
"""verl's list-valued keys whose items are separate settings here."""

VERL_CONFIG_NAMES = ("ppo_megatron_trainer", "ppo_trainer")
"""``--config-name`` values of verl's own trainer configs: they mean this project's defaults."""

LOWER_UPPER_KEYS = ("rollout_is_threshold", "rollout_rs_threshold")
"""Settings whose value may be verl's ``"lower_upper"`` string: YAML 1.1 and OmegaConf read an unquoted ``0.5_2``
as the number 0.52 (``_`` as a digit separator), so for these keys the text as written is kept."""

SETTINGS = dict(iter_settings())
SECTIONS = {key.rsplit(".", i)[0] for key in SETTINGS for i in range(1, key.count(".") + 1)}


class ConfigError(Exception):
    """Every problem found in a configuration; the CLI prints them and exits with status 2."""

    def __init__(self, problems: list[str], warnings: list[str] = ()):
        super().__init__("\n".join(problems))
        self.problems = problems
        self.warnings = list(warnings)


@dataclass
class _Value:
    """One user-given setting and where it came from, for error messages."""

    key: str
    value: Any
    where: str
    add: bool = False  # given as +key=value
    override: str = ""  # the key as the override gave it: what a message about the key names, never the value


def _is_free_form(key: str) -> bool:
    parts = key.split(".")
    return any(p in FREE_FORM_KEYS for p in parts[:-1])


def _flatten(tree: Any, prefix: str = "", whole_dicts: bool = True) -> dict[str, Any]:
    """Nested mapping -> {dotted key: leaf}. Lists and scalars are leaves; with ``whole_dicts`` so are
    the values of dict-typed settings (a file may fill them freely, an override must use +key)."""
    at_setting = whole_dicts and prefix.rstrip(".") in SETTINGS
    if not isinstance(tree, dict) or at_setting:
        return {prefix.rstrip("."): tree}
    flat: dict[str, Any] = {}
    for k, v in tree.items():
        flat.update(_flatten(v, f"{prefix}{k}.", whole_dicts))
    return flat


def _as_written(key: str, value: Any, text: str) -> Any:
    """``text`` for a ``lower_upper`` setting that YAML or OmegaConf read as a number with a digit separator
    (``0.5_2`` -> 0.52), else ``value``."""
    lower_upper = key.rsplit(".", 1)[-1] in LOWER_UPPER_KEYS
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return text.strip().strip("'\"") if lower_upper and number and "_" in text else value


def _read_yaml(path: Path) -> list[_Value]:
    try:
        doc = read_config_file(path)
    except ConfigFileError as e:
        raise ConfigError([str(e)]) from None
    tree = doc.tree or {}
    if not isinstance(tree, dict):
        raise ConfigError([f"{path}: the top level must be a mapping of sections, got {type(tree).__name__}"])
    return [
        _Value(k, _as_written(k, v, doc.texts.get(k, "")), f"{path}:{doc.lines.get(k, 1)}")
        for k, v in _flatten(tree).items()
    ]


def _read_overrides(overrides: list[str]) -> tuple[list[_Value], list[str]]:
    values, problems = [], []
    for raw in overrides:
        key, sep, text = raw.partition("=")
        if not sep or not key.lstrip("+"):
            problems.append(f"override {masked_word(raw)!r}: expected key=value or +key=value")
            continue
        if len(text) > MAX_VALUE_CHARS:  # a file's limits (yaml_file.py)
            problems.append(
                f"override '{key[:80]}=…': a value of {len(text):,} characters (at most {MAX_VALUE_CHARS:,})"
            )
            continue
        if key.count(".") >= MAX_DEPTH:
            problems.append(f"override '{key[:80]}…': nested more than {MAX_DEPTH} levels deep")
            continue
        try:
            parsed = OmegaConf.to_container(OmegaConf.from_dotlist([raw.lstrip("+")]))
        except OmegaConfBaseException as e:
            problems.append(f"override {masked_word(raw)!r}: {str(e).splitlines()[0]}")
            continue
        for k, v in _flatten(parsed, whole_dicts=False).items():
            v = _as_written(k, v, text) if k == key.lstrip("+") else v  # not in a whole section given at once
            values.append(_Value(k, v, f"override {masked_word(raw)!r}", raw.startswith("+"), key))
    return values, problems


def _alias_target(key: str) -> str | None:
    if key in ALIASES:
        return ALIASES[key]
    for prefix, canonical in PREFIX_ALIASES.items():
        if key.startswith(prefix):
            return canonical + key[len(prefix) :]
    return None


def _split_aliases(values: list[_Value]) -> tuple[list[_Value], list[str]]:
    out, problems = [], []
    for v in values:
        targets = SPLIT_ALIASES.get(v.key)
        if targets is None:
            out.append(v)
        elif not isinstance(v.value, list) or len(v.value) != len(targets):
            problems.append(f"{v.where}: {v.key} must be a list of {len(targets)} values, got {v.value!r}")
        else:
            out += [_Value(t, item, v.where, v.add) for t, item in zip(targets, v.value, strict=True)]
    return out, problems


def _resolve_aliases(values: list[_Value]) -> tuple[list[_Value], list[str]]:
    """Rename other spellings to this tree's keys; within one source both spellings must agree."""
    values, problems = _split_aliases(values)
    by_key = {v.key: v for v in values}
    for alias in [k for k in by_key if _alias_target(k)]:
        canonical = _alias_target(alias)
        a = by_key.pop(alias)
        c = by_key.get(canonical)
        if c is not None and c.value != a.value:
            problems.append(
                f"{a.where}: {alias}={a.value} conflicts with {canonical}={c.value} ({c.where}); "
                "they are the same setting, give one"
            )
        by_key[canonical] = _Value(canonical, a.value, a.where, a.add, a.override)
    return list(by_key.values()), problems


def _implied(values: list[_Value]) -> list[_Value]:
    """The settings ``IMPLIED_BY_ALIAS`` gives for the aliases among ``values`` (read before aliases resolve):
    applied before every source, so any setting of them, in a file or an override, wins."""
    out = []
    for prefix, (key, value) in IMPLIED_BY_ALIAS.items():
        first = next((v for v in values if v.key.startswith(prefix)), None)
        if first is not None:
            out.append(_Value(key, value, first.where))
    return out


def _unknown_key_message(v: _Value) -> str:
    if v.key in SECTIONS:
        return f"{v.where}: '{v.key}' is a section, not a value; set its keys ({v.key}.<key>=...)"
    known = list(SETTINGS) + list(ALIASES) + verl_keys.concrete_keys()
    guesses = difflib.get_close_matches(v.key, known, n=2, cutoff=0.75)
    hint = "; did you mean " + " or ".join(f"'{g}'" for g in guesses) + "?" if guesses else ""
    where = f"override '{v.override}=…'" if v.override else v.where  # a mistyped trainer.env key: no value shown
    return f"{where}: unknown key '{v.key}'{hint}"


def _foreign(v: _Value, notes: dict[str, str]) -> str | None:
    """A verl key that is not a setting here: a problem if it selects a feature not offered, else a note."""
    entry = verl_keys.find(v.key)
    if entry is None:
        return _unknown_key_message(v)
    if entry.refuses(v.value):
        return f"{v.where}: {v.key}={masked(v.value, v.key)}: not offered here: {entry.reason}"
    if entry.refused:  # the switch of a feature not offered, set to off
        notes[v.key] = f"{v.key}={v.value}: no effect here (it would turn on a feature not offered: {entry.reason})"
    else:
        notes[v.key] = f"{v.key}: no effect here: {entry.reason}"
    return None


def _apply(cfg: Any, v: _Value, from_file: bool, notes: dict[str, str]) -> str | None:
    """Set one value on the structured config; returns a problem or None (verl keys of no effect add a note)."""
    field = SETTINGS.get(v.key)
    if field is None and (not _is_free_form(v.key) or verl_keys.find(v.key)):
        return _foreign(v, notes)
    preset = v.key.rsplit(".", 1)[-1] in verl_keys.PRESET_TRANSFORMER_KEYS and "override_transformer_config" in v.key
    if field is None and not (v.add or from_file or preset) and OmegaConf.select(cfg, v.key) is None:
        return f"{v.where}: '{v.key}' is not set yet; add new keys with +{v.key}=..."
    value = v.value
    if field is not None and typing.get_origin(field.type) is list and isinstance(value, str):
        value = [value]  # data.train_files=one.parquet, as in verl's examples
    if field is not None and _nested_items(field.type, value):
        shown = f"{shown_key(v.key)}={masked(value, v.key)!r}"
        return f"{v.where}: {shown} is not a valid {_type_name(field.type)} (an item is a list or a mapping)"
    try:
        OmegaConf.update(cfg, v.key, value, merge=True)
    except OmegaConfBaseException as e:
        expected = getattr(field, "type", "value")
        reason = "" if is_secret(v.key) else f" ({str(e).splitlines()[0]})"  # OmegaConf's reason quotes the value
        shown = f"{shown_key(v.key)}={masked(value, v.key)!r}"
        return f"{v.where}: {shown} is not a valid {_type_name(expected)}{reason}"
    return None


def _nested_items(field_type: Any, value: Any) -> bool:
    """A list or mapping inside a ``list[str]`` or ``dict[str, str]`` setting's value: OmegaConf takes
    ``train_files: [[a]]`` and ``env: {A: {B: 1}}`` as they are (and fails on them later, writing the config)."""
    origin, args = typing.get_origin(field_type), typing.get_args(field_type)
    if origin is list and isinstance(value, list):
        items = value
    elif origin is dict and isinstance(value, dict) and args[1:] != (Any,):
        items = list(value.values())
    else:
        return False
    return any(isinstance(item, list | dict) for item in items)


def _type_name(t: Any) -> str:
    return getattr(t, "__name__", None) or str(t).replace("typing.", "")


def load_config(path: str | Path | None, overrides: list[str] = ()) -> GRPOConfig:
    """Defaults <- YAML file <- overrides, typed by the schema. Raises ConfigError with every problem."""
    return load_config_with_notes(path, overrides)[0]


def load_config_with_notes(path: str | Path | None, overrides: list[str] = ()) -> tuple[GRPOConfig, list[str]]:
    """``load_config``, and one note per verl key that was given but has no effect here."""
    problems: list[str] = []
    notes: dict[str, str] = {}
    sources: list[tuple[list[_Value], bool]] = []
    implied: list[_Value] = []
    if path is not None:
        file_values = _read_yaml(Path(path))
        implied += _implied(file_values)
        file_values, alias_problems = _resolve_aliases(file_values)
        problems += alias_problems
        sources.append((file_values, True))
    override_values, override_problems = _read_overrides(list(overrides))
    problems += override_problems
    implied += _implied(override_values)
    sources.insert(0, (implied, True))
    override_values, alias_problems = _resolve_aliases(override_values)
    problems += alias_problems
    sources.append((override_values, False))

    cfg = OmegaConf.structured(GRPOConfig)
    for values, from_file in sources:
        for v in values:
            problem = _apply(cfg, v, from_file, notes)
            if problem:
                problems.append(problem)
    if problems:
        raise ConfigError(problems)
    try:
        config = OmegaConf.to_object(cfg)
    except MissingMandatoryValue as e:  # verl's `???`: a value its config leaves to the user
        raise ConfigError([f"{e.full_key}: no value given (the config says ???); set it"]) from None
    except InterpolationResolutionError as e:  # ${oc.env:NAME} (secrets.env_by_reference) with NAME unset
        raise ConfigError([f"{e.full_key}: {str(e).splitlines()[0]}"]) from None
    problems += _normalise(config)
    if problems:
        raise ConfigError(problems)
    return config, list(notes.values())


def _normalise(cfg: GRPOConfig) -> list[str]:
    """verl's sentinel values, in this tree's terms."""
    trainer, optim = cfg.trainer, cfg.actor_rollout_ref.actor.optim
    if trainer.resume_mode == "resume_path":
        if not trainer.resume_from_path:
            return ["trainer.resume_mode=resume_path needs trainer.resume_from_path=<checkpoint directory>"]
        trainer.resume_mode = trainer.resume_from_path
    if not trainer.default_local_dir:  # verl scripts pass `trainer.default_local_dir=` for its default
        trainer.default_local_dir = f"checkpoints/{trainer.project_name}/{trainer.experiment_name}"
    actor = cfg.actor_rollout_ref.actor
    if cfg.data.seed is None:
        cfg.data.seed = 1
    if actor.ppo_micro_batch_size_per_gpu is None:
        if not actor.use_dynamic_bsz:
            return ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null: set it, or use_dynamic_bsz=true"]
        actor.ppo_micro_batch_size_per_gpu = 1  # unused: micro-batches are sized by the token budget
    for section in (cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.ref):  # verl's interpolations
        if section.log_prob_use_dynamic_bsz is None:
            section.log_prob_use_dynamic_bsz = actor.use_dynamic_bsz
        if section.log_prob_max_token_len_per_gpu is None:
            section.log_prob_max_token_len_per_gpu = actor.ppo_max_token_len_per_gpu
    if optim.total_training_steps is not None and optim.total_training_steps <= 0:
        optim.total_training_steps = None  # verl's -1: from the run's length
    for key in DTYPE_SECTIONS:
        section = attrgetter(key)(cfg)
        if section.dtype == AUTO_DTYPE:  # resolved here, so that checks, logs and checkpoints see what ran
            section.dtype = native_dtype(trainer.device)
    return []


def resolve_config_file(config: str | None, config_path: str | None, config_name: str | None) -> str | None:
    """``--config FILE``, or Hydra's ``--config-path DIR --config-name NAME``: DIR/NAME(.yaml) when that file
    exists; verl's own trainer config names mean this project's defaults (no file)."""
    if config_name is None:
        if config_path is not None:
            raise ConfigError([f"--config-path {config_path} needs --config-name NAME"])
        return config
    if config is not None:
        raise ConfigError(["give --config FILE or --config-path/--config-name, not both"])
    name = config_name.removesuffix(".yaml")
    for candidate in (Path(config_path or "."), Path.cwd() / (config_path or ".")):
        for file in (candidate / f"{name}.yaml", candidate / name):
            if file.is_file():
                return str(file)
    if name in VERL_CONFIG_NAMES:
        return None
    where = Path(config_path or ".") / f"{name}.yaml"
    raise ConfigError(
        [f"--config-name {config_name}: no config file {where} (verl's own names: {list(VERL_CONFIG_NAMES)})"]
    )


def to_yaml(cfg: GRPOConfig, mask_secrets: bool = True) -> str:
    """The tree as YAML, to show or log: secret values as ``***`` (secrets.py). ``mask_secrets=False`` for a
    config file that is to run."""
    tree = OmegaConf.to_container(OmegaConf.structured(cfg))
    return OmegaConf.to_yaml(masked(tree) if mask_secrets else tree)


def to_flat_dict(cfg: GRPOConfig) -> dict[str, Any]:
    """Dotted key -> value, e.g. for MLflow params."""
    return _flatten(OmegaConf.to_container(OmegaConf.structured(cfg)))
