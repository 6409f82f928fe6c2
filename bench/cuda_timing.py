"""What the kernel benches share (``python bench/NAME.py`` finds this module beside them): CUDA-event timing and
the copy bandwidth that a memory-bound kernel's bytes are measured against."""

import torch


def ms(fn, *args, repeats: int = 10) -> float:
    """Mean milliseconds of ``fn(*args)`` after one warm-up call."""
    fn(*args)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def copy_tbps() -> float:
    """A 1 GiB device-to-device copy's bandwidth in TB/s, reads and writes counted; printed for the record."""
    big = torch.empty(2**30, device="cuda", dtype=torch.uint8)
    tbps = 2 * big.numel() / ms(torch.clone, big) / 1e9
    print(f"copy bandwidth {tbps:.2f} TB/s")
    return tbps
