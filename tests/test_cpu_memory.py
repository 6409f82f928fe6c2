import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

FREE_AND_MEASURE = """
import os, sys, torch
from grpo_core.cpu_memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def resident_mb():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20
before = resident_mb()
x = torch.ones(64 << 20)  # 256 MB, written, as a micro-batch's logits are
del x
print(resident_mb() - before)
"""


def test_a_cpu_rank_keeps_the_memory_it_frees():
    """A CPU rank's large blocks come from the heap and stay there when freed, for the next micro-batch's tensors
    (whose pages then need no fault); glibc's default maps each one afresh and unmaps it on free."""
    kept_mb = {}
    for mode in ("keep", "default"):
        run = subprocess.run([sys.executable, "-c", FREE_AND_MEASURE, mode], capture_output=True, text=True, cwd=REPO)
        assert run.returncode == 0, run.stderr
        kept_mb[mode] = int(run.stdout.split()[-1])
    assert kept_mb["keep"] >= 250 and kept_mb["default"] < 10, kept_mb
