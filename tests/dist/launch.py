"""Start a worker script under torchrun (gloo on CPU) from a test, with the output kept for failures.

The job runs in its own session and the whole session is killed when torchrun returns: a worker killed
on purpose can leave helper processes behind (megatron's checkpoint writer starts a multiprocessing
manager), and they must neither outlive the test nor keep it waiting.
"""

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def torchrun(script: str, nproc: int, *args: str, timeout: int = 900, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(REPO / "tests" / "dist" / script), *args]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=REPO, start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        out.seek(0)
        err.seek(0)
        result = subprocess.CompletedProcess(cmd, returncode, out.read(), err.read())
    if check and result.returncode != 0:
        raise AssertionError(
            f"{script} x{nproc} failed ({result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
        )
    return result
