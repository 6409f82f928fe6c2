"""What a pipeline run's evaluations read and where each is kept: one evaluation file and one set of settings for
every model (the base, the trained model, the champion), so that their per-question records pair up."""

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from grpo_core.config.schema import GRPOConfig
from grpo_core.data.lineage import dataset_digest
from grpo_core.evaluation.run import EvalSettings
from grpo_core.tracking.mlflow_run import tracking_uri
from grpo_core.tracking.registry import RegistryModel, full_model

if TYPE_CHECKING:
    from grpo_core.checks.dry_run import ResolvedRun


def evaluation_file(cfg: GRPOConfig) -> str:
    """The file every evaluation reads: ``evaluation.data_file``, else the first validation file."""
    return cfg.evaluation.data_file or cfg.data.val_files[0]


def settings_dict(settings: EvalSettings) -> dict:
    """EvalSettings as task parameters (JSON-friendly, so they hash and show in the Prefect UI)."""
    return {**asdict(settings), "k_values": list(settings.k_values)}


def eval_dir(model: RegistryModel, data_digest: str, settings: dict) -> Path:
    """Where an evaluation of this version on these data (their ``dataset_digest``) and settings (the limit among
    them) is kept: beside its local copy (not inside it, whose file listing is the evaluation's cache key), shared
    by every run that compares with it. Another evaluation set is another directory: evaluated anew, never reused."""
    key = hashlib.sha256(f"{data_digest}\0{json.dumps(settings, sort_keys=True)}".encode()).hexdigest()[:12]
    return model.path.parent / "eval" / key


@dataclass
class Evaluations:
    """The evaluations of one pipeline run: the file and settings they all read, and a directory per model
    (``dirs``: "base" and "trained", and "champion" once the champion is known)."""

    file: str
    settings: dict
    data_digest: str  # the evaluation set's: a champion's evaluation is kept per set
    dirs: dict[str, Path]

    @classmethod
    def for_run(cls, run: "ResolvedRun") -> "Evaluations":
        """The run's own directories; a registry start model's evaluation is kept with its version (evaluated once)."""
        cfg = run.config
        file, run_dir = evaluation_file(cfg), Path(cfg.trainer.default_local_dir)
        settings = settings_dict(EvalSettings.from_config(cfg))
        data_digest = dataset_digest([file])
        dirs = {"base": run_dir / "eval" / "base", "trained": run_dir / "eval" / "trained"}
        if run.start_model is not None:
            dirs["base"] = eval_dir(run.start_model, data_digest, settings)
        return cls(file, settings, data_digest, dirs)


def start_model_files(run: "ResolvedRun") -> str:
    """What the base evaluation loads: the config's model, or a registry adapter merged into its base."""
    cfg = run.config
    if run.start_model is not None and run.start_model.is_adapter:
        return str(full_model(run.start_model, tracking_uri(cfg), cfg.tracking.model_cache_dir))
    return cfg.actor_rollout_ref.model.path
