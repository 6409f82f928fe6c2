"""Time the interpreter spends in garbage collection, step by step.

A full collection walks every tracked object, and a trainer holds millions (megatron's and the engines'
modules, the libraries' own): 0.4 s a walk on a CPU core, taken at whatever moment allocations trip it,
often mid-generation. The loop freezes what exists after set-up (``gc.freeze``) so that only a step's own
objects are walked; ``perf/gc_s`` and ``perf/gc_full`` show what remains.
"""

import gc
import time


class GcPauses:
    def __init__(self) -> None:
        self.seconds, self.full = 0.0, 0
        self._start: float | None = None
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self.full += info["generation"] == 2
            self._start = None

    def take(self) -> dict[str, float]:
        """Seconds in collections and the number of full ones since the last call."""
        metrics = {"perf/gc_s": self.seconds, "perf/gc_full": float(self.full)}
        self.seconds, self.full = 0.0, 0
        return metrics

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
