"""Models from the MLflow registry: ``models:/NAME@ALIAS`` and ``models:/NAME/VERSION`` as a model path.

A URI is resolved once, before anything launches, to one version; that version's files are downloaded once
into a cache directory keyed by it (tracking server, name, version and source), and the run then reads that
local directory. Every rank, retry and evaluation sees the same weights even if the alias moves meanwhile,
and the pipeline's keys (which contain the path) change exactly when the version does.

Every copy served is checked before each use (served.py): the version's files against the digest recorded at
registration (a copy that fails is downloaded again, once, then refused), a LoRA version's merged model against
what its merge wrote (merged again when it fails).
"""

import hashlib
import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from grpo_core.models.adapter import is_adapter_dir, merge_adapter, read_adapter
from grpo_core.records.tags import read_version_tags
from grpo_core.tracking import served
from grpo_core.tracking.mlflow_run import quick_http

logger = logging.getLogger(__name__)
URI_PREFIX = "models:/"
MODEL_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/@]+)|/(?P<version>[0-9]+))/?$")
DEFAULT_CACHE = Path("~/.cache/grpo/models")
CACHE_VAR = "GRPO_MODEL_CACHE"
MISSING_CODES = ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND", "INVALID_PARAMETER_VALUE")


class RegistryError(ValueError):
    """The URI names no model version (malformed, no such model, alias or version): the user's input, exit 2."""


class RegistryUnreachable(ConnectionError):
    """The tracking server did not answer: not the input's fault (exit 1, worth a retry)."""


def is_model_uri(path: str | None) -> bool:
    return bool(path) and str(path).startswith(URI_PREFIX)


def parse_model_uri(uri: str) -> tuple[str, str | None, str | None]:
    """``models:/NAME@ALIAS`` -> (NAME, ALIAS, None); ``models:/NAME/VERSION`` -> (NAME, None, VERSION)."""
    match = MODEL_URI.match(uri)
    if match is None:
        raise RegistryError(f"{uri}: not a registry model URI; write models:/NAME@ALIAS or models:/NAME/VERSION")
    return match["name"], match["alias"], match["version"]


@dataclass(frozen=True)
class RegistryModel:
    uri: str  # as given
    name: str
    version: str
    source: str  # the artifact location the version was registered from
    run_id: str | None
    path: Path  # the local copy
    tags: dict[str, str] = field(default_factory=dict, compare=False)  # the version's (what judged it: promotion.py)

    @property
    def is_adapter(self) -> bool:
        """A LoRA run's version: a PEFT adapter directory whose base its ``ADAPTER_BASE_TAG`` names."""
        return is_adapter_dir(self.path)

    @property
    def canonical(self) -> str:
        """The version itself (what an alias pointed to when it was resolved)."""
        return f"models:/{self.name}/{self.version}"

    def describe(self) -> str:
        pinned = "" if self.uri == self.canonical else f" = {self.canonical}"
        return f"{self.uri}{pinned} (local copy {self.path})"


def cache_root(configured: str | None = None) -> Path:
    """``tracking.model_cache_dir``, else ``$GRPO_MODEL_CACHE``, else ~/.cache/grpo/models."""
    return Path(configured or os.environ.get(CACHE_VAR) or DEFAULT_CACHE).expanduser()


def version_dir(root: Path, tracking_uri: str, name: str, version: str, source: str) -> Path:
    """One directory per registered version; the hash keeps two servers' ``NAME/1`` apart."""
    digest = hashlib.sha256("\0".join([tracking_uri, name, version, source]).encode()).hexdigest()[:12]
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)
    return root / safe / f"v{version}-{digest}"


def _describe_failure(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__


def lookup_version(client, uri: str, server: str):
    """The registry's ModelVersion that ``uri`` names now (``server``: the tracking URI, for messages)."""
    from mlflow.exceptions import MlflowException

    name, alias, version = parse_model_uri(uri)
    try:
        if alias is not None:
            return client.get_model_version_by_alias(name, alias)
        return client.get_model_version(name, version)
    except MlflowException as e:
        if e.error_code in MISSING_CODES:
            what = f"alias {alias!r}" if alias is not None else f"version {version}"
            raise RegistryError(f"{uri}: registered model {name!r} has no {what} ({_describe_failure(e)})") from None
        raise RegistryUnreachable(f"{uri}: MLflow at {server}: {_describe_failure(e)}") from None
    except Exception as e:  # noqa: BLE001  (connection refused, timeouts: all one message)
        raise RegistryUnreachable(f"{uri}: MLflow at {server}: {_describe_failure(e)}") from None


def champion_uri(client, server: str, name: str, alias: str = "champion") -> str | None:
    """``models:/NAME@champion`` when that alias exists, else None (no such model or alias yet)."""
    uri = f"{URI_PREFIX}{name}@{alias}"
    try:
        lookup_version(client, uri, server)
    except RegistryError:
        return None
    return uri


def fetch_model(uri: str, tracking_uri: str, cache_dir: str | None = None) -> RegistryModel:
    """Resolve ``uri`` to its version and return it with a local copy, downloaded unless already cached, and checked
    against the digest recorded at registration: a copy that does not match is downloaded again, once (one warning
    naming the files that differed), then refused."""
    quick_http()
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri, registry_uri=tracking_uri)
    found = lookup_version(client, uri, tracking_uri)
    read_version_tags(f"{uri} (version {found.version})", found.tags)  # the tags read back are typed: one line if not
    home = version_dir(cache_root(cache_dir), tracking_uri, found.name, str(found.version), found.source)
    local = home / "model"
    first = None  # the files of a copy that did not match
    for _ in range(2):
        if not _model_files(local):
            _download(client, uri, found, tracking_uri, local)
        if (unlike := check_provenance(uri, found, local)) is None:
            break
        first = unlike if first is None else first
        served.discard(local)
    else:
        raise RegistryError(
            f"{uri}: the files of version {found.version} ({found.source}) are not those it was registered with "
            f"({MODEL_DIGEST_TAG} {found.tags[MODEL_DIGEST_TAG][:16]}…, these {served.digest_of(unlike)[:16]}…), "
            "and a fresh download is not either: changed in the artifact store; refused"
        )
    if first is not None:
        logger.warning("warning: %s: the local copy %s was not the files version %s was registered with (%s); "
                       "downloaded it again", uri, local, found.version,
                       served.changed_files(first, served.file_digests(local)))  # fmt: skip
    return RegistryModel(uri, found.name, str(found.version), found.source, found.run_id, local, dict(found.tags or {}))


def _download(client, uri: str, found, tracking_uri: str, local: Path) -> None:
    """The version's files into ``local``, renamed into place once they are all there."""
    from mlflow.artifacts import download_artifacts

    partial = local.with_name(f"download.{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:  # where the files are: a logged model's artifacts for a ``models:/<model id>`` source
        where = client.get_model_version_download_uri(found.name, found.version)
        got = Path(download_artifacts(artifact_uri=where, dst_path=str(partial), tracking_uri=tracking_uri))
    except Exception as e:  # noqa: BLE001
        shutil.rmtree(partial, ignore_errors=True)
        raise RegistryUnreachable(f"{uri}: downloading {found.source}: {_describe_failure(e)}") from None
    if not _model_files(got):
        shutil.rmtree(partial, ignore_errors=True)
        raise RegistryError(
            f"{uri}: version {found.version} ({found.source}) holds no config.json (a model) nor "
            "adapter_config.json (a LoRA adapter)"
        )
    try:
        got.rename(local)  # atomic: a concurrent download of the same version loses the race harmlessly
    except OSError:
        if not _model_files(local):
            raise
    shutil.rmtree(partial, ignore_errors=True)


def _model_files(directory: Path) -> bool:
    """A whole model (config.json) or a LoRA adapter (adapter_config.json) is there."""
    return (directory / "config.json").is_file() or is_adapter_dir(directory)


ADAPTER_BASE_TAG = "grpo.lora.base_model"  # on a LoRA adapter's version: the model it adapts (hub id, dir, models:/)


def adapter_base(model: RegistryModel, tracking_uri: str, cache_dir: str | None = None) -> tuple[str, str]:
    """(the base's name as the adapter version records it, a path or hub id to load it from): a base that is itself a
    registry version (``models:/NAME/N``) is fetched; RegistryError when the version names no base."""
    base = model.tags.get(ADAPTER_BASE_TAG)
    if not base:
        raise RegistryError(f"{model.uri}: version {model.version} is a LoRA adapter whose tags name no base model "
                            f"({ADAPTER_BASE_TAG})")  # fmt: skip
    if is_model_uri(base):
        found = fetch_model(base, tracking_uri, cache_dir)
        if found.is_adapter:
            raise RegistryError(f"{model.uri}: its base {base} is an adapter itself, not a model")
        return base, str(found.path)
    return base, base


def full_model(model: RegistryModel, tracking_uri: str, cache_dir: str | None = None) -> Path:
    """A directory every engine loads: the version's own files, or for an adapter, its base with it merged in
    (written once, beside the local copy, with a record of what the merge wrote and from what: checked before each
    use, merged again, with one warning, when it does not match)."""
    if not model.is_adapter:
        return model.path
    merged = model.path.parent / "merged"
    inputs = {"adapter": model.tags.get(MODEL_DIGEST_TAG) or files_digest(model.path),
              "base": str(model.tags.get(ADAPTER_BASE_TAG))}  # fmt: skip
    if (problem := served.merged_problem(merged, inputs)) is None:
        return merged
    if merged.exists():
        logger.warning("warning: %s: its merged model is not what the merge wrote: %s; merging it again from the "
                       "checked adapter and base", model.uri, problem)  # fmt: skip
    from grpo_core.models.shape import model_weights_dir

    adapter = fetch_model(model.canonical, tracking_uri, cache_dir)  # checked again now, as the base is
    _, base = adapter_base(adapter, tracking_uri, cache_dir)
    build = merged.with_name(f"merged.build-{os.getpid()}")
    shutil.rmtree(build, ignore_errors=True)
    merge_adapter(model_weights_dir(base), read_adapter(adapter.path), build)
    served.seal_merged(build, inputs)
    served.publish(build, merged, inputs)
    return merged


MODEL_DIGEST_TAG = "grpo.model_sha256"  # of the registered files: what a fetch checks its copy against
CHECKPOINT_DIGEST_TAG = "grpo.checkpoint_manifest_sha256"  # of the manifest of the checkpoint they came from


def files_digest(directory: Path) -> str:
    """SHA-256 over every file under ``directory`` (its relative path, size and SHA-256). Unlike a checkpoint's
    manifest (xxh3, beside the files), this is recorded on the tracking server, out of reach of whoever can
    write the artifact store or the local cache, and it is a cryptographic hash."""
    return served.digest_of(served.file_digests(directory))


def provenance_tags(model_dir: Path, checkpoint: Path | None) -> dict[str, str]:
    """What a registered version records of where it came from (the checkpoint's manifest, when it has one)."""
    tags = {MODEL_DIGEST_TAG: files_digest(model_dir)}
    if checkpoint is not None and (manifest := checkpoint / "manifest.json").is_file():
        tags[CHECKPOINT_DIGEST_TAG] = hashlib.sha256(manifest.read_bytes()).hexdigest()
    return tags


def check_provenance(uri: str, version, local: Path) -> dict[str, str] | None:
    """None when the local copy of ``version`` is the files it was registered with, else those it holds
    (``served.file_digests``); a version registered before digests were recorded is not checked (a warning says so)."""
    recorded = (version.tags or {}).get(MODEL_DIGEST_TAG)
    if recorded is None:
        logger.warning("warning: %s: version %s records no %s; its files are not checked", uri, version.version,
                       MODEL_DIGEST_TAG)  # fmt: skip
        return None
    found = served.file_digests(local)
    return None if served.digest_of(found) == recorded else found
