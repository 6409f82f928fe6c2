"""Where a run's numbers go: the terminal (progress bar + one line per step), a local JSON-lines file that
is always written, and MLflow when ``trainer.logger`` names it. Only rank 0 has an enabled tracker."""

import json
import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

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


class Tracker:
    def __init__(self, cfg, enabled: bool = True):
        self.enabled = enabled
        self.sinks = set(cfg.trainer.logger)
        self.console = Console(stderr=True)
        self.run_dir = Path(cfg.trainer.default_local_dir)
        self._mlflow = None
        self._last: dict[str, float] = {}
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.run_dir / METRICS_FILE, "a")  # noqa: SIM115  (closed in close())
        if "mlflow" in self.sinks:
            import mlflow

            mlflow.set_experiment(cfg.trainer.project_name)
            nested = mlflow.active_run() is not None  # inside a pipeline's run: a child run
            self._mlflow = mlflow.start_run(run_name=cfg.trainer.experiment_name, nested=nested)

    def log_params(self, params: dict) -> None:
        if self._mlflow is not None:
            import mlflow

            mlflow.log_params({k: str(v)[:6000] for k, v in params.items()})

    def log(self, metrics: dict[str, float], step: int) -> None:
        if not self.enabled:
            return
        self._last = metrics
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        if "console" in self.sinks:
            self.console.print(f"step {step}: {_headline(metrics)}", markup=False, highlight=False)
        if self._mlflow is not None:
            import mlflow

            mlflow.log_metrics(metrics, step=step)

    def progress(self, steps: Iterable[int], total: int, start: int = 0) -> Iterator[int]:
        """Iterate ``steps`` under a progress bar (rank 0, a terminal) that shows the latest headline."""
        if not self.enabled:
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
        if self._mlflow is not None:
            import mlflow

            mlflow.end_run()


def _headline(metrics: dict) -> str:
    return "  ".join(f"{k.split('/')[-1]}={metrics[k]:.4g}" for k in HEADLINE if k in metrics)
