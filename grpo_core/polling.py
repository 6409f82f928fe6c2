"""A background poll for the length of a block: how the launcher echoes a node's log and the pipeline follows
a run's metrics file, each read once more when the block ends so that nothing written before is lost."""

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def polling(tick: Callable[[bool], None], poll_s: float, name: str) -> Iterator[None]:
    """``tick(False)`` every ``poll_s`` seconds in a thread while the block runs, then ``tick(True)`` once."""
    stop = threading.Event()

    def run() -> None:
        while True:
            last = stop.is_set()  # read before the tick, so a write just before the end is still seen
            tick(last)
            if last:
                return
            stop.wait(poll_s)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
