"""Stand-in for the trainer under torchrun (gloo, CPU), used by tests/test_launch.py and tests/test_slurm.py.

Each rank joins the process group from torchrun's environment, runs ``--steps`` all_reduces of its
rank + 1 (one "step" each, ``--step-seconds`` apart, printing a line per step as a heartbeat) and writes
``rank{R}.json`` into ``--out``. Failure modes for the launcher's tests: ``--fail-rank R`` makes rank R
exit with ``--exit-code`` at ``--fail-step``; ``--hang-rank R`` makes rank R sleep silently there.
Every rank writes ``pid-rank{R}`` first, so a test can kill one of them from outside. With ``--orphan``
each rank also starts a ``sleep`` in a session of its own and writes its pid to ``orphan-rank{R}``: like
megatron's checkpoint writer, a process the launcher has to find and kill although no group kill reaches it.
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--step-seconds", type=float, default=0.0)
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--exit-code", type=int, default=7)
    parser.add_argument("--fail-step", type=int, default=0)
    parser.add_argument("--hang-rank", type=int, default=-1)
    parser.add_argument("--orphan", action="store_true")
    args = parser.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"pid-rank{rank}").write_text(str(os.getpid()))
    if args.orphan:
        orphan = subprocess.Popen(["sleep", "600"], start_new_session=True)
        (args.out / f"orphan-rank{rank}").write_text(str(orphan.pid))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))

    total = torch.zeros(1)
    for step in range(args.steps):
        if step == args.fail_step and rank == args.fail_rank:
            print(f"rank {rank}: failing on purpose with exit code {args.exit_code}", file=sys.stderr, flush=True)
            os._exit(args.exit_code)
        if step == args.fail_step and rank == args.hang_rank:
            time.sleep(3600)
        value = torch.tensor([float(rank + 1)])
        dist.all_reduce(value)
        total += value
        print(f"rank {rank}/{world} step {step} allreduce_sum={value.item()}", flush=True)
        time.sleep(args.step_seconds)

    result = {
        "rank": rank,
        "world_size": world,
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "allreduce_sum": total.item(),
        "env_marker": os.environ.get("GRPO_TEST_MARKER"),
    }
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
