"""Where a run's numbers go: the terminal (progress bar + one line per step), a local JSON-lines file that
is always written, MLflow when ``trainer.logger`` names it or a pipeline passes its run, TensorBoard
event files (same metric names) under ``<default_local_dir>/tensorboard/`` when it names tensorboard, and a
Weights & Biases run (same names and steps, see wandb_run.py) when it names wandb.
Only rank 0 has an enabled tracker."""

import json
import logging
import os
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from grpo_core.atomic import write_text_atomic
from grpo_core.config.secrets import hide_url_passwords
from grpo_core.tracking.follow import step_line
from grpo_core.tracking.mlflow_run import RUN_ID_VAR, MlflowRun, tracking_uri

logger = logging.getLogger(__name__)
METRICS_FILE = "metrics.jsonl"
# Shown on the progress bar and in the per-step console line, in this order, when present.
HEADLINE = (
    "reward/mean",
    "reward/accuracy",
    "val/accuracy",
    "actor/kl_loss",
    "response/length_mean",
    "timing/step",
    "perf/throughput",
)


def _keep_rows_up_to(path: Path, step: int) -> None:
    """Rewrites the file (atomically) without the rows after ``step`` and any line a kill left half-written."""
    if not path.is_file():
        return

    def kept_row(line: str) -> bool:
        try:
            return json.loads(line)["step"] <= step
        except (ValueError, KeyError, TypeError):
            return False

    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if line.endswith("\n") and kept_row(line)]
    if len(kept) < len(lines):
        write_text_atomic(path, "".join(kept))


class Tracker:
    def __init__(self, cfg, enabled: bool = True, start_step: int = 0):
        """``start_step``: the step the run resumes after (0: a fresh run). metrics.jsonl keeps the rows up to it
        and drops the rest, steps that a resumed checkpoint no longer holds or an earlier run in the same
        directory wrote, so the file is this run's history."""
        self.enabled = enabled
        self.sinks = set(cfg.trainer.logger)
        self.console = Console(stderr=True)
        self.run_dir = Path(cfg.trainer.default_local_dir)
        self._mlflow = None
        self._tensorboard = None
        self._wandb = None
        self._last: dict[str, float] = {}
        self.total: int | None = None  # steps of the run, once ``progress`` knows them
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        _keep_rows_up_to(self.run_dir / METRICS_FILE, start_step)
        self._file = open(self.run_dir / METRICS_FILE, "a")  # noqa: SIM115  (closed in close())
        uri, pending = tracking_uri(cfg), self.run_dir / "mlflow_pending.jsonl"
        if run_id := os.environ.get(RUN_ID_VAR):  # the pipeline's run
            self._mlflow = MlflowRun(uri, run_id, pending_file=pending)
        elif "mlflow" in self.sinks:
            self._mlflow = _new_run(uri, cfg.trainer, pending)
        if "tensorboard" in self.sinks:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

            self._tensorboard = SummaryWriter(str(self.run_dir / "tensorboard"))
        if "wandb" in self.sinks:
            from grpo_core.tracking.wandb_run import WandbRun

            self._wandb = WandbRun(cfg.trainer.project_name, cfg.trainer.experiment_name, self.run_dir)

    def log_params(self, params: dict) -> None:
        if self._mlflow is not None:
            self._mlflow.log_params(params)
        if self._wandb is not None:
            self._wandb.log_params(params)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if not self.enabled:
            return
        self._last = metrics
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        if "console" in self.sinks:  # the pipeline's line (follow.py): one format wherever a step is shown
            line = step_line({"step": step, **metrics}, self.total)
            self.console.print(line, markup=False, highlight=False, soft_wrap=True)
        if self._mlflow is not None:
            self._mlflow.log_metrics(metrics, step=step)
        if self._tensorboard is not None:
            for name, value in metrics.items():
                self._tensorboard.add_scalar(name, value, global_step=step)
            self._tensorboard.flush()
        if self._wandb is not None:
            self._wandb.log_metrics(metrics, step=step)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """A file of the run (a profiler trace, say) into the MLflow run, when there is one."""
        if self.enabled and self._mlflow is not None:
            self._mlflow.log_artifact(path, artifact_path)

    def progress(self, steps: Iterable[int], total: int, start: int = 0) -> Iterator[int]:
        """Iterate ``steps`` under a progress bar (rank 0, a terminal) that shows the latest headline. Off a
        terminal (a rank's output is its log file) the step lines alone: a bar there is drawn once per print, cut to
        80 columns (``grpo 1… … -…``) and a step behind."""
        self.total = total
        if not self.enabled or not self.console.is_terminal:
            yield from steps
            return
        columns = [
            TextColumn("[bold]grpo"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.description}"),
        ]
        with Progress(*columns, console=self.console, transient=False) as bar:
            task = bar.add_task("", total=total, completed=start)
            for step in steps:
                yield step
                bar.update(task, advance=1, description=_headline(self._last))

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._mlflow is not None:
            if not os.environ.get(RUN_ID_VAR):
                self._mlflow.finish()  # a pipeline's run is ended by the pipeline
            self._mlflow.close()


def _new_run(uri: str, trainer, pending: Path) -> MlflowRun:
    """A new MLflow run; a deferred one (created when the server first answers, else kept in ``pending``
    for ``grpo tracking sync``) when the server is down now: training does not wait for tracking."""
    try:
        return MlflowRun.create(uri, trainer.project_name, trainer.experiment_name, pending_file=pending)
    except Exception as e:  # noqa: BLE001  (any transport or server error)
        shown = hide_url_passwords(uri)
        logger.warning("MLflow at %s does not answer (%s); the run is sent when it does", shown, type(e).__name__)
        tags = {"mlflow.runName": trainer.experiment_name}
        return MlflowRun.deferred(uri, trainer.project_name, uuid.uuid4().hex[:16], tags, pending_file=pending)


def _headline(metrics: dict) -> str:
    return "  ".join(f"{k.split('/')[-1]}={metrics[k]:.4g}" for k in HEADLINE if k in metrics)
