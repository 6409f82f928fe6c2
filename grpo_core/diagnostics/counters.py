"""Process-wide counters that only grow, read as what each step added: torch.compile's work and the CUDA
caching allocator's calls into the driver.

- torch.compile: the actor's fused kernels and the engine's blocks compile again when they meet a shape, stride
  or dtype their guards reject. Step 1 compiles them all; a later step that compiles pays seconds no phase's
  FLOPs explain (``perf/compiles``, ``perf/compile_s``).
- The allocator: a warm step reuses its cached blocks; ``cudaMalloc`` runs only when a request fits none, and
  when that fails the allocator frees every cached block (a device-wide synchronisation per ``cudaFree``) and
  retries (``perf/cuda_mallocs``, ``perf/cuda_frees``, ``perf/alloc_retries``).
"""

from collections.abc import Callable

import torch
from torch._dynamo import utils as dynamo

COMPILE_TIMER = "_compile.compile_inner"  # dynamo's timer around one frame's whole compilation
ALLOCATOR_STATS = {
    "perf/cuda_mallocs": "num_device_alloc",
    "perf/cuda_frees": "num_device_free",
    "perf/alloc_retries": "num_alloc_retries",
}


def compile_totals() -> dict[str, float]:
    """Graphs compiled and seconds compiling so far (dynamo's private counters: zero seconds where they moved)."""
    seconds = getattr(dynamo, "compilation_time_metrics", {}).get(COMPILE_TIMER, ())
    return {"perf/compiles": float(dynamo.counters["stats"]["unique_graphs"]), "perf/compile_s": sum(seconds)}


def allocator_totals() -> dict[str, float]:
    """The allocator's device allocations, frees and retries so far (none on CPUs)."""
    stats = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
    return {metric: float(stats.get(key, 0)) for metric, key in ALLOCATOR_STATS.items()}


class StepDeltas:
    def __init__(self, read: Callable[[], dict[str, float]]) -> None:
        self._read = read
        self._last = read()

    def take(self) -> dict[str, float]:
        """What each counter added since the last call."""
        now = self._read()
        metrics = {name: value - self._last.get(name, 0.0) for name, value in now.items()}
        self._last = now
        return metrics
