"""Run diagnostics: what the loop's phases report besides their timings.

``RunDiagnostics`` watches each phase the loop times: it tags GPU samples (rank 0, ``gpu.py``) and
profiler ranges with the phase, profiles the steps in ``trainer.profile_steps`` (trace and
communication share, ``profile.py``), explains an error raised in a phase (``advice.py``) on the
rank's stderr before letting it go on, warns once when the GPUs idle or wait on collectives, and counts the
step's hidden costs: garbage-collection pauses (``gc_pauses.py``), torch.compile's work and the CUDA
allocator's driver calls (``counters.py``). It also records each phase's entry and exit for the hang watchdog
(diagnostics/watchdog.py), which ends a job whose phase runs past ``trainer.hang_timeout_s``.
"""

import gzip
import logging
import os
import shutil
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from grpo_core.config import GRPOConfig
from grpo_core.diagnostics.advice import (
    HIGH_COMM_SHARE,
    LOW_UTILISATION,
    comm_share_advice,
    failure_advice,
    low_utilisation_advice,
)
from grpo_core.diagnostics.counters import StepDeltas, allocator_totals, compile_totals
from grpo_core.diagnostics.gc_pauses import GcPauses
from grpo_core.diagnostics.gpu import GpuSampler, gpu_metrics
from grpo_core.diagnostics.profile import comm_shares, kernel_shares, read_trace, sync_counts
from grpo_core.diagnostics.watchdog import PhaseRecorder
from grpo_core.models.shape import ModelShape
from grpo_core.planning.budget import estimate_memory
from grpo_core.planning.memory import MemoryEstimate

logger = logging.getLogger(__name__)
PROFILE_DIR = "profile"


class RunDiagnostics:
    def __init__(self, cfg: GRPOConfig, shape: ModelShape, rank: int, tracker=None):
        self.cfg, self.shape, self.rank, self.tracker = cfg, shape, rank, tracker
        self.sampler = GpuSampler(cfg.trainer.n_gpus_per_node) if rank == 0 else None
        self.gc = GcPauses()
        self.counters = [StepDeltas(compile_totals), StepDeltas(allocator_totals)]
        self._profiler: torch.profiler.profile | None = None
        self._phases: list[str] = []
        self._warned: set[str] = set()
        self._steps = 0
        self.watch = PhaseRecorder.from_env(cfg.trainer.hang_timeout_s)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Tag GPU samples and the profile with ``name``, record it for the hang watchdog; explain an error raised
        in it, then re-raise it."""
        if name not in self._phases:
            self._phases.append(name)
        if self.sampler is not None:
            self.sampler.phase = name
        try:
            with self.watch.phase(name), torch.profiler.record_function(name):
                yield
        except Exception as e:
            if advice := failure_advice(e, self.cfg, name, self.rank, self._estimate(), os.environ):
                print(advice, file=sys.stderr, flush=True)
            raise
        finally:
            if self.sampler is not None:
                self.sampler.phase = None

    def begin_step(self, step: int) -> None:
        """Start the profiler if ``step`` (as logged, from 1) is one of ``trainer.profile_steps``."""
        self.watch.begin_step(step)
        if step in self.cfg.trainer.profile_steps:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities)
            with warnings.catch_warnings():  # "clears events at the end of each cycle": one cycle is all we take
                warnings.simplefilter("ignore")
                self._profiler.start()

    def end_step(self, step: int) -> dict[str, float]:
        """This step's ``gpu/*`` and (profiled steps) ``profile/*`` metrics; rank 0 warns about them once."""
        self._steps += 1
        self.watch.end_step()
        metrics = gpu_metrics(self.sampler.take()) if self.sampler is not None else {}
        metrics |= self.gc.take()
        for counter in self.counters:
            metrics |= counter.take()
        profiled = self._profiler is not None
        if profiled:
            metrics |= self._finish_profile(step)
        if self.rank == 0:
            self._warn(metrics, utilisation=self._steps > 1 and not profiled)  # warm-up and profiler slow GPUs
        return metrics

    def close(self) -> None:
        self.gc.close()
        if self.sampler is not None:
            self.sampler.close()
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None

    def _finish_profile(self, step: int) -> dict[str, float]:
        """Stop the profiler; rank 0 writes its chrome trace (gzipped: a generation phase alone can make a
        gigabyte of JSON), logs it as an artifact and measures the comm shares."""
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        if self.rank != 0:
            return {}
        path = Path(self.cfg.trainer.default_local_dir) / PROFILE_DIR / f"step_{step:06d}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(path))
        events = read_trace(path, self._phases)
        with open(path, "rb") as raw, gzip.open(f"{path}.gz", "wb", compresslevel=1) as packed:
            shutil.copyfileobj(raw, packed)
        path.unlink()
        logger.info("profile of step %d (rank 0): %s.gz", step, path)
        if self.tracker is not None:
            self.tracker.log_artifact(f"{path}.gz", PROFILE_DIR)
        phases = self._phases
        return comm_shares(events, phases) | kernel_shares(events, phases) | sync_counts(events, phases)

    def _warn(self, metrics: dict[str, float], utilisation: bool) -> None:
        """Once per kind: generation, the training phases, collectives (not the sync: a broadcast by nature)."""
        phases = [p for p in self._phases if p != "sync"]
        low = {p: metrics[f"gpu/util_{p}"] for p in phases if metrics.get(f"gpu/util_{p}", 100) < LOW_UTILISATION}
        if utilisation:
            if "gen" in low:
                self._warn_once("util/gen", low_utilisation_advice(self.cfg, {"gen": low.pop("gen")}))
            if low:
                self._warn_once("util/train", low_utilisation_advice(self.cfg, low))
        busy = {p: metrics[f"profile/comm_share_{p}"] for p in phases if f"profile/comm_share_{p}" in metrics}
        if busy := {p: share for p, share in busy.items() if share > HIGH_COMM_SHARE}:
            self._warn_once("comm", comm_share_advice(self.cfg, busy))

    def _warn_once(self, key: str, text: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("warning: %s", text)

    def _estimate(self) -> MemoryEstimate | None:
        """The planner's per-phase memory estimate, quoted by out-of-memory advice (None if it cannot be made)."""
        try:
            return estimate_memory(self.cfg, self.shape)
        except Exception:  # advice must not hide the original error
            return None
