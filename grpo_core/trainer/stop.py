"""Stopping a run between two steps with its work saved: what SIGTERM asks of every rank.

SIGTERM comes from ``grpo train``'s own launcher (on Ctrl-C, SIGTERM to it, or ``launch.timeout_s``), from
Slurm at its time limit or on ``scancel``, from ``timeout`` or Kubernetes. Killed mid-step, a run loses
everything since its last checkpoint; here the signal only raises a flag, the step in flight finishes, and
after each step the ranks take the largest flag (one all-reduce), so all of them stop after the same step
and save it the way a last step is saved.
"""

import logging
import signal
import threading

import torch
import torch.distributed as dist

from grpo_core.actor.parallel import device

logger = logging.getLogger(__name__)


class StopRequest:
    """Between ``install()`` and ``restore()``, SIGTERM sets ``signum``; ``agreed()`` is the same on every rank."""

    def __init__(self) -> None:
        self.signum = 0
        self._previous = None

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            self._previous = signal.signal(signal.SIGTERM, self._ask)

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _ask(self, signum: int, frame) -> None:
        if not self.signum:
            logger.warning("%s: stopping after this step, once it is saved", signal.Signals(signum).name)
        self.signum = signum

    def agreed(self) -> str | None:
        """The name of the stop signal any rank has received (None: none)."""
        flag = torch.tensor([self.signum], dtype=torch.int32, device=device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return signal.Signals(int(flag.item())).name if flag.item() else None
