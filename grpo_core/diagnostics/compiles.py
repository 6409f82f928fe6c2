"""torch.compile's work step by step: graphs compiled and seconds spent compiling them.

The actor's fused kernels and the rollout engine's blocks are compiled functions; each compiles again when it
meets a shape, stride or dtype its guards reject. Step 1 compiles them all; a later step that still compiles
pays seconds that no phase's FLOPs explain (``perf/compiles``, ``perf/compile_s``).
"""

from torch._dynamo import utils as dynamo

COMPILE_TIMER = "_compile.compile_inner"  # dynamo's timer around one frame's whole compilation


def _totals() -> tuple[int, float]:
    """Graphs compiled and seconds compiling so far (dynamo's private counters: zero seconds where they moved)."""
    seconds = getattr(dynamo, "compilation_time_metrics", {}).get(COMPILE_TIMER, ())
    return dynamo.counters["stats"]["unique_graphs"], sum(seconds)


class CompileWork:
    def __init__(self) -> None:
        self._graphs, self._seconds = _totals()

    def take(self) -> dict[str, float]:
        """Graphs compiled and seconds compiling since the last call."""
        graphs, seconds = _totals()
        metrics = {"perf/compiles": float(graphs - self._graphs), "perf/compile_s": seconds - self._seconds}
        self._graphs, self._seconds = graphs, seconds
        return metrics
