"""GPU utilisation and memory over a step, by phase: NVML sampled from a background thread.

The loop's phase timer sets ``GpuSampler.phase``; each sample (every ``interval`` seconds) records the
utilisation and used memory of this node's GPUs under the phase current at that moment. Rank 0 samples
every GPU its node's ranks use, so no collective is needed; other nodes are not sampled. Without a GPU
or NVML the sampler says why once and records nothing.
"""

import logging
import threading
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass
class Sample:
    phase: str | None
    util: list[float]  # percent of the interval a kernel ran, per GPU
    memory_gib: list[float]  # used, per GPU (every process's, as nvidia-smi shows it)


def gpu_metrics(samples: list[Sample]) -> dict[str, float]:
    """``gpu/util_<phase>`` (mean percent over the phase's samples and the GPUs) and the peak used memory."""
    by_phase: dict[str, list[float]] = {}
    for s in samples:
        if s.phase is not None:
            by_phase.setdefault(s.phase, []).extend(s.util)
    metrics = {f"gpu/util_{phase}": sum(u) / len(u) for phase, u in by_phase.items() if u}
    if samples:
        metrics["gpu/memory_used_gib_max"] = max(max(s.memory_gib, default=0.0) for s in samples)
    return metrics


class GpuSampler:
    def __init__(self, num_gpus: int, interval: float = 0.1):
        self.phase: str | None = None
        self.problem: str | None = None
        self._samples: list[Sample] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._handles = self._open(num_gpus)
        if self.problem:
            logger.info("GPU utilisation: %s; gpu/* metrics are not logged", self.problem)
            return
        self._thread = threading.Thread(target=self._run, args=(interval,), name="gpu-sampler", daemon=True)
        self._thread.start()

    def _open(self, num_gpus: int) -> list:
        if not torch.cuda.is_available():
            self.problem = "no GPU (torch sees no CUDA device)"
            return []
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as e:  # ImportError, or NVMLError without a driver
            self.problem = f"no GPU utilisation (NVML unavailable: {e})"
            return []
        self._nvml = pynvml
        return [_handle(pynvml, i) for i in range(min(num_gpus, torch.cuda.device_count()))]

    def _run(self, interval: float) -> None:
        nvml = self._nvml
        while not self._stop.wait(interval):
            phase = self.phase
            try:
                util = [float(nvml.nvmlDeviceGetUtilizationRates(h).gpu) for h in self._handles]
                memory = [nvml.nvmlDeviceGetMemoryInfo(h).used / 2**30 for h in self._handles]
            except Exception as e:  # a GPU fell off the bus: stop sampling, keep training
                logger.warning("GPU sampling stopped: %s", e)
                return
            with self._lock:
                self._samples.append(Sample(phase, util, memory))

    def take(self) -> list[Sample]:
        """The samples since the last call."""
        with self._lock:
            samples, self._samples = self._samples, []
        return samples

    def close(self) -> None:
        self._stop.set()


def _handle(pynvml, index: int):
    """NVML's handle of torch's device ``index`` (by UUID, since CUDA_VISIBLE_DEVICES renumbers devices)."""
    try:
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    except Exception:
        return pynvml.nvmlDeviceGetHandleByIndex(index)
