"""Stopping a run between two steps with its work saved: what SIGTERM and SIGUSR1 ask of every rank.

SIGTERM comes from ``grpo train``'s own launcher (on Ctrl-C, SIGTERM to it, or ``launch.timeout_s``), from
Slurm at its time limit or on ``scancel``, from ``timeout`` or Kubernetes. SIGUSR1 is what Slurm sends ahead
of the time limit when asked (``sbatch --signal=USR1@SECONDS``), to every process of the job: torchrun's agent
ignores it (launch/torchrun.py), ``grpo train``'s launcher and the ranks take it as a stop. Killed mid-step, a run loses
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


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Between ``install()`` and ``restore()``, SIGTERM or SIGUSR1 sets ``signum``; ``agreed()`` is the same on
    every rank."""

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict = {}

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            self._previous = {sig: signal.signal(sig, self._ask) for sig in STOP_SIGNALS}

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _ask(self, signum: int, frame) -> None:
        if not self.signum:
            logger.warning("%s: stopping after this step, once it is saved", signal.Signals(signum).name)
        self.signum = signum

    def agreed(self) -> str | None:
        """The name of the stop signal any rank has received (None: none)."""
        flag = torch.tensor([self.signum], dtype=torch.int32, device=device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return signal.Signals(int(flag.item())).name if flag.item() else None
