"""The CUDA caching allocator's calls into the driver, step by step.

A warm step reuses the blocks it cached: ``cudaMalloc`` runs again only when a request fits no cached block,
and when even that fails the allocator frees every cached block (a device-wide synchronisation per
``cudaFree``) and retries. An update's peak followed by generation's different shapes can do this, costing
seconds no phase's FLOPs explain (``perf/cuda_mallocs``, ``perf/cuda_frees``, ``perf/alloc_retries``).
"""

import torch

STATS = {
    "perf/cuda_mallocs": "num_device_alloc",
    "perf/cuda_frees": "num_device_free",
    "perf/alloc_retries": "num_alloc_retries",
}


def _totals() -> dict[str, int]:
    stats = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
    return {metric: stats.get(key, 0) for metric, key in STATS.items()}


class AllocatorCalls:
    def __init__(self) -> None:
        self._last = _totals()

    def take(self) -> dict[str, float]:
        """The allocator's device allocations, frees and retries since the last call (none on CPUs)."""
        now = _totals()
        metrics = {metric: float(now[metric] - self._last[metric]) for metric in STATS}
        self._last = now
        return metrics
