"""A profiled step's kernels, phase by phase, the most time first, each with the CPU op that launched it, then the
phase's longest idle gaps with what the host was doing in them, then the calls that made the host wait for the GPU:
what the ``profile/*_share_<phase>`` and ``profile/host_syncs_<phase>`` metrics summarise, down to the kernel (which
fusion to write next), the gap and the sync (which to move).

    python3 bench/trace_kernels.py RUN_DIR/profile/step_000003.json.gz [--top 15]

(from a run with ``trainer.profile_steps=[3]``).
"""

import argparse
from pathlib import Path

from grpo_core.diagnostics.profile import host_syncs, idle_gaps, kernel_shares, read_trace, top_kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--phases", nargs="+", default=["gen", "old_log_prob", "ref", "update", "sync"])
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--gaps", type=int, default=8, help="idle gaps listed per phase")
    args = parser.parse_args()
    try:
        events = read_trace(args.trace, args.phases, launches=True)
    except (OSError, ValueError, KeyError) as error:  # missing, not gzip, not JSON, not a chrome trace
        parser.error(f"cannot read {args.trace} as a chrome trace: {error!r}")
    shares = kernel_shares(events, args.phases)
    gaps = idle_gaps(events, args.phases, args.gaps)
    syncs = host_syncs(events, args.phases)
    for phase, rows in top_kernels(events, args.phases, args.top).items():
        print(f"\n{phase}: idle {100 * shares[f'profile/idle_share_{phase}']:.0f}% of its wall time")
        print("| ms | launches | kind | kernel | launched by |\n| --- | --- | --- | --- | --- |")
        for r in rows:
            print(f"| {r['us'] / 1e3:.1f} | {r['launches']} | {r['kind']} | {r['kernel'][:80]} | {r['launched_by']} |")
        print("\n| idle ms | at ms | host in | next kernel's launcher |\n| --- | --- | --- | --- |")
        for g in gaps.get(phase, []):
            print(f"| {g['us'] / 1e3:.2f} | {g['at_ms']:.1f} | {g['host']} | {g['then']} |")
        print("\n| host waited ms | calls | in |\n| --- | --- | --- |")
        for r in syncs.get(phase, []):
            print(f"| {r['us'] / 1e3:.2f} | {r['calls']} | {r['host']} |")


if __name__ == "__main__":
    main()
