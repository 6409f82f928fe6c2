"""Which config values are secrets, and how whatever writes or prints config shows them: as ``***``.

Every value under ``trainer.env`` is a secret (it is the ranks' environment, where tokens go); its names are
not. Elsewhere a value is a secret when the last part of its key reads like one (``SECRET_NAMES``), and the
password of a URL (``postgresql://user:PASSWORD@host/db``) is one under any key. ``masked`` and
``masked_word`` are what MLflow and W&B params, the resolved-config artifact, the MLflow pending file, the dry
run, the launcher's logged command lines and config errors show values through.

The ranks never get ``trainer.env`` values on their command line (``ps`` shows it to every user of the
machine): ``env_by_reference`` writes ``+trainer.env.NAME=${oc.env:NAME}`` in place of the value, and a rank
reads it from the environment its launcher exported (``trainer.env``), so its config equals the launcher's.
The same reference given to ``grpo train``/``grpo pipeline`` keeps a value off their own command line (and out
of Prefect's stored flow parameters): it is read from the environment they are started in. Any other
secret-looking value they are given (a secret-named setting, a URL with a password) reaches what they start the
same way: ``secrets_by_reference`` names it (``${oc.env:GRPO_<KEY>}``) and returns the value for the child's
environment, so no process's command line holds a secret that its starter's did not.

Simplifications: a name is judged by its words, so a secret under an innocent name (outside ``trainer.env``)
or pasted into free text is not caught; an override of a whole section above a secret
(``+trainer={env: {...}}``, ``tracking={notify_webhook_url: ...}``) or a list holding a URL with a password still
carries its values to the ranks (it is masked where shown).
"""

import re
from collections.abc import Mapping, Sequence
from typing import Any

MASK = "***"
ENV_SECTION = "trainer.env"
SECRET_SECTIONS = (ENV_SECTION,)  # every value under these keys is a secret

SECRET_NAMES = {
    # pattern, searched in the last part of a key as lower-case words framed by "_": what it catches (and not)
    r"token_$": "a name ending in token: HF_TOKEN, accessToken (not max_token_len_per_gpu, max_new_tokens)",
    r"_(api|private|access|secret|ssh|signing|encryption|client|master)_?key_": (
        "a key that opens something: WANDB_API_KEY, PRIVATE_KEY, apikey (not prompt_key, reward_fn_key)"
    ),
    r"secret": "AWS_SECRET_ACCESS_KEY, client_secret",
    r"passw(or)?d|passphrase": "DB_PASSWORD, passwd",
    r"_(o?auth|authorization|authentication)_": "AUTH_HEADER, HTTP_AUTHORIZATION, oauth (not author)",
    r"_pat_$": "a personal access token: MY_PAT, GITHUB_PAT",
    r"credential": "GOOGLE_APPLICATION_CREDENTIALS",
    r"cookie": "SESSION_COOKIE",
    r"webhook": "a webhook URL, whose path is often its token: tracking.notify_webhook_url, SLACK_WEBHOOK",
}
_SECRET_NAME = re.compile("|".join(f"(?:{pattern})" for pattern in SECRET_NAMES))
_REFERENCE = re.compile(r"\$\{oc\.env:[A-Za-z_][A-Za-z0-9_]*\}")  # a value read from the environment
# scheme://user:PASSWORD@host: the password runs to the last "@" before the host ("/" must be escaped in it)
_URL_PASSWORD = re.compile(r"(\b[a-z][a-z0-9+.-]*://[^\s:/@]*:)[^\s/]+@", re.IGNORECASE)


def _words(name: str) -> str:
    """``accessToken``, ``ACCESS-TOKEN`` -> ``_access_token_``: what the patterns are searched in."""
    split = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name)
    return "_" + re.sub(r"[^a-z0-9]+", "_", split.lower()).strip("_") + "_"


def is_secret_name(name: str) -> bool:
    """Whether a key's last part (an environment variable's name, say) reads like a secret's."""
    return bool(_SECRET_NAME.search(_words(name)))


def is_secret(key: str) -> bool:
    """Whether the value of dotted ``key`` is a secret: it is under ``SECRET_SECTIONS`` or named like one."""
    return key.startswith(tuple(s + "." for s in SECRET_SECTIONS)) or is_secret_name(key.rsplit(".", 1)[-1])


def shown_key(key: str) -> str:
    """A key as a message may name it: below a secret section, only the section's own name (``{A:x}``, no space,
    parses as the key ``A:x``, so a deeper key can hold the value)."""
    for section in SECRET_SECTIONS:
        if key.startswith(section + "."):
            return ".".join(key.split(".")[: section.count(".") + 2])
    return key


def hide_url_passwords(text: str) -> str:
    """``text`` with the password of every URL in it as ``***`` (``postgresql://user:***@host/db``)."""
    return _URL_PASSWORD.sub(rf"\g<1>{MASK}@", text)


def masked(value: Any, key: str = "") -> Any:
    """``value`` (of dotted ``key``) as it may be written or printed: secrets as ``***``, URL passwords hidden.
    A mapping's items are its sub-keys, so a nested tree, a flat ``{dotted key: value}`` dict and a flattened
    config (which keeps ``trainer.env`` whole) all keep their names and lose their secrets."""
    if key and is_secret(key):
        return MASK
    if isinstance(value, Mapping):
        return {k: masked(v, f"{key}.{k}" if key else str(k)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [masked(v, key) for v in value]
    if isinstance(value, str):
        return hide_url_passwords(value)
    return value


def _holds_secrets(key: str) -> bool:
    """A key whose value is, or contains, a secret section (``trainer.env``, ``trainer``)."""
    return is_secret(key) or any(s == key or s.startswith(key + ".") for s in SECRET_SECTIONS)


def masked_word(word: str) -> str:
    """One command-line word as it may be shown: an override ``[+]key=value`` (or ``--flag=value``) with a
    secret value as ``[+]key=***`` (a reference, ``${oc.env:NAME}``, is shown); URL passwords hidden in any word."""
    key, sep, value = word.partition("=")
    if sep and _holds_secrets(key.lstrip("+")) and not _REFERENCE.fullmatch(value):
        return f"{key}={MASK}"
    return hide_url_passwords(word)


def masked_command(argv: Sequence[str]) -> list[str]:
    """A command line as it may be logged or printed."""
    return [masked_word(word) for word in argv]


def env_by_reference(overrides: Sequence[str]) -> list[str]:
    """``overrides`` for a process that gets ``trainer.env`` in its environment (a rank): each one that sets a
    ``trainer.env`` value names it instead (``${oc.env:NAME}``), so no value is on its command line."""
    out = []
    for word in overrides:
        key, sep, value = word.partition("=")
        name = key.lstrip("+")
        plus = key[: len(key) - len(name)]
        if sep and name.startswith(ENV_SECTION + "."):
            out.append(f"{key}=${{oc.env:{name[len(ENV_SECTION) + 1 :]}}}")
        elif sep and name == ENV_SECTION:  # trainer.env={A: x, B: y}: one reference each
            out += [f"{plus}{ENV_SECTION}.{n}=${{oc.env:{n}}}" for n in _dict_keys(value)]
        else:
            out.append(word)
    return out


def into_environment(overrides: Sequence[str], environ: dict) -> list[str]:
    """``env_by_reference(overrides)``, with the values it leaves out set in ``environ``: this process's, for
    what it starts (the pipeline's flow, whose parameters Prefect keeps in its database, gets the references).
    A secret setting outside ``trainer.env`` (``tracking.notify_webhook_url``, or a string holding a URL with a
    password under any key) goes the same way, into ``GRPO_<KEY>`` (``GRPO_TRACKING_NOTIFY_WEBHOOK_URL``), which
    the config reads back through the reference."""
    overrides = [_by_reference(word, environ) for word in overrides]
    for word in overrides:
        key, sep, value = word.partition("=")
        name = key.lstrip("+")
        if sep and name.startswith(ENV_SECTION + ".") and not _REFERENCE.fullmatch(value):
            environ[name[len(ENV_SECTION) + 1 :]] = str(_parsed(value))
        elif sep and name == ENV_SECTION and isinstance(values := _parsed(value), dict):
            environ.update({str(k): str(v) for k, v in values.items()})
    return env_by_reference(overrides)


def secrets_by_reference(overrides: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """(``overrides`` as a child process's command line may hold them, the environment variables their
    references read): ``into_environment`` into a fresh mapping, for a launcher that passes it to the child."""
    environ: dict[str, str] = {}
    return into_environment(overrides, environ), environ


def _by_reference(word: str, environ: dict) -> str:
    """``word``, when it sets a secret outside ``trainer.env``, as a reference to the variable now holding it.
    The reference reads back a string: a URL password under an innocent key moves only in one (not in a list),
    and null stays null."""
    key, sep, value = word.partition("=")
    name = key.lstrip("+")
    if not sep or name.startswith(ENV_SECTION + ".") or _REFERENCE.fullmatch(value):
        return word
    parsed = _parsed(value)
    has_password = isinstance(parsed, str) and hide_url_passwords(parsed) != parsed
    if parsed is None or not (is_secret(name) or has_password):
        return word
    variable = "GRPO_" + re.sub(r"[^A-Za-z0-9]", "_", name).upper()
    environ[variable] = str(parsed)
    return f"{key}=${{oc.env:{variable}}}"


def _parsed(value: str) -> Any:
    """An override's value as the config reads it (quotes and all)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.from_dotlist([f"v={value}"]))["v"]


def _dict_keys(value: str) -> list[str]:
    """The keys of an override's ``{A: x, B: y}`` value (none when it is not a mapping)."""
    parsed = _parsed(value)
    return [str(k) for k in parsed] if isinstance(parsed, dict) else []
