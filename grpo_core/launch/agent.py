"""torchrun's agent as ``grpo train`` starts it: ``python -m grpo_core.launch.agent <torchrun's arguments>``.

It is torchrun with the project's rendezvous backend registered (``--rdzv-backend=grpo``, launch/rendezvous.py:
its stores listen on one address), and one change: when the launcher that started it dies, however it dies
(SIGKILL from a Prefect worker, the OOM killer), the agent gets SIGTERM exactly once, stops its ranks (which
save the step in flight) and exits. The kernel's parent-death signal, which the launcher arms for any command
it starts, would do it, but it comes again each time the orphan's new parent thread exits: in a container whose
init is multi-threaded, a second SIGTERM lands in the middle of torchrun's shutdown, and the agent then waits
forever on the threads that copy its ranks' output, holding the run directory. So here the parent-death signal
is disarmed and a thread sends the one SIGTERM when the launcher is gone.
"""

import ctypes
import os
import runpy
import signal
import sys
import threading
import time

from grpo_core.launch import rendezvous
from grpo_core.launch.torchrun import LAUNCHER_PID_VAR

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _stop_when_the_launcher_is_gone(launcher: int, poll_s: float = 0.2) -> None:
    while os.getppid() == launcher:
        time.sleep(poll_s)
    os.kill(os.getpid(), signal.SIGTERM)  # torchrun's handler: stop the ranks, wait for them, exit


def main() -> None:
    launcher = int(os.environ.get(LAUNCHER_PID_VAR, os.getppid()))
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, 0)
    threading.Thread(target=_stop_when_the_launcher_is_gone, args=(launcher,), daemon=True).start()
    rendezvous.register()
    sys.argv[0] = "torchrun"
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
