"""Where a profiled step's time went, read from its chrome trace: communication against compute, and on
GPUs the phase's idle time and its kernel time by kind.

The loop marks each phase with ``torch.profiler.record_function(phase)``, so a phase is a
``user_annotation`` span of the trace. Within it:
- GPU traces: the share of kernel-busy time during which an NCCL kernel runs;
- CPU traces (gloo): the share of the phase's wall time during which a collective (a ``gloo:``,
  ``nccl:`` or ``c10d::`` op, or ``record_param_comms``) is in flight on any thread.
Overlapping spans count once. The share includes waiting for slower peers, as the kernels do.

``kernel_shares`` says what bounds a slow GPU phase: the share of its wall time with no kernel or copy
running (launch overheads, host work, syncs), and how its kernel time splits between GEMMs, attention,
collectives, copies and the rest (element-wise kernels, reductions, the optimizer); ``top_kernels`` goes
down to the kernels themselves, each with the CPU op that launched it, and ``idle_gaps`` to the longest idle
stretches with what the host was doing in them, and ``host_syncs`` to the calls that made the host wait for the
GPU, each with the CPU ops it was called from (``bench/trace_kernels.py`` prints all three).
"""

import gzip
import json
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

COMM_MARKERS = ("nccl", "gloo:", "c10d::", "record_param_comms")
# A kernel's kind from its name, first match wins (cutlass's attention kernels are attention, not GEMMs);
# a copy or memset event (its own trace category) is "copy", any other kernel "other".
KERNEL_KINDS = {
    "comm": ("nccl",),
    "attention": ("flash", "fmha", "attention", "sdpa", "cudnn"),
    "gemm": ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul"),
}
COPY_CATEGORIES = ("gpu_memcpy", "gpu_memset")
# Runtime calls that block the host until the GPU has caught up: ``.item()``, ``.cpu()`` and ``bool(t)`` end in
# a stream synchronize, a pageable copy is a plain cudaMemcpy, and the allocator's cudaFree (a retry after a
# failed allocation, ``empty_cache``) waits for the whole device.
SYNC_CALLS = frozenset(
    ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaFree", "cudaFreeHost")
)

SCAN_BACK = 5000  # CPU ops looked back through for a launch's enclosing ones (a phase holds ~10^5)
Spans = list[list[float]]  # sorted, disjoint [start, end] in microseconds


def is_comm(name: str) -> bool:
    lower = name.lower()
    return any(marker in lower for marker in COMM_MARKERS)


def read_trace(path: Path, phases: Iterable[str], launches: bool = False) -> list[dict]:
    """The events of a chrome trace (``.json`` or ``.json.gz``) that the shares read: phase spans, kernels,
    collectives; with ``launches``, also the CPU ops and runtime calls ``top_kernels`` names launchers by. The
    rest is dropped while parsing (a profiled generation phase can be a gigabyte of JSON)."""
    phases = set(phases)
    launch_categories = ("cpu_op", "cuda_runtime") if launches else ()

    def keep(obj: dict) -> dict | None:
        if "ph" not in obj:  # an event's args, or the file's header
            return obj
        cat, name = obj.get("cat"), str(obj.get("name", ""))
        busy = cat == "kernel" or cat in COPY_CATEGORIES
        wanted = busy or (cat == "user_annotation" and name in phases) or is_comm(name) or cat in launch_categories
        wanted = wanted or (cat == "cuda_runtime" and name in SYNC_CALLS)
        return obj if wanted else None

    with (gzip.open if str(path).endswith(".gz") else open)(path, "rt") as f:
        trace = json.load(f, object_hook=keep)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e is not None]


def comm_shares(events: list[dict], phases: Iterable[str]) -> dict[str, float]:
    """``profile/comm_share_<phase>`` for each phase found in the trace, and ``profile/comm_share`` over all."""
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e and "name" in e]
    kernels = [e for e in spans if e.get("cat") == "kernel"]
    if kernels:
        busy: Spans | None = _merge(_span(e) for e in kernels)
        comm = _merge(_span(e) for e in kernels if "nccl" in e["name"].lower())
    else:
        busy = None  # a CPU is busy for the whole phase
        comm = _merge(_span(e) for e in spans if e.get("cat") != "kernel" and is_comm(e["name"]))
    metrics, all_windows = {}, []
    for phase in phases:
        windows = _windows(spans, phase)
        if windows:
            all_windows += windows
            metrics[f"profile/comm_share_{phase}"] = _share(comm, busy, windows)
    if all_windows:
        metrics["profile/comm_share"] = _share(comm, busy, _merge(all_windows))
    return metrics


def kernel_kind(event: dict) -> str:
    """The kind of a kernel or copy event: comm, attention, gemm, copy or other (see ``KERNEL_KINDS``)."""
    if event.get("cat") in COPY_CATEGORIES:
        return "copy"
    name = str(event.get("name", "")).lower()
    return next((kind for kind, markers in KERNEL_KINDS.items() if any(m in name for m in markers)), "other")


def kernel_shares(events: list[dict], phases: Iterable[str]) -> dict[str, float]:
    """Per phase found in a GPU trace: ``profile/idle_share_<phase>`` (its wall time with no kernel or copy
    running) and ``profile/<kind>_time_share_<phase>`` (a kind's kernel time over all kernel time in it, so the
    kinds sum to 1 even where streams overlap). Nothing for a CPU trace."""
    busy_events = [e for e in events if e.get("cat") == "kernel" or e.get("cat") in COPY_CATEGORIES]
    if not busy_events:
        return {}
    busy = _merge(_span(e) for e in busy_events)
    metrics = {}
    for phase in phases:
        windows = _windows(events, phase)
        if not windows:
            continue
        metrics[f"profile/idle_share_{phase}"] = 1 - _overlap(busy, windows) / _length(windows)
        by_kind = dict.fromkeys((*KERNEL_KINDS, "copy", "other"), 0.0)
        for event in busy_events:
            by_kind[kernel_kind(event)] += _overlap(_merge([_span(event)]), windows)
        total = sum(by_kind.values())
        for kind, seconds in by_kind.items():
            metrics[f"profile/{kind}_time_share_{phase}"] = seconds / total if total else 0.0
    return metrics


class _CpuOps:
    """The trace's CPU ops by thread, to say which ones enclose a moment (a kernel's launch, an idle gap)."""

    def __init__(self, events: list[dict]) -> None:
        self.runtime = {e["args"]["correlation"]: e for e in events if e.get("cat") == "cuda_runtime" and "args" in e}
        self.ops: dict[int, list[dict]] = defaultdict(list)
        for op in sorted((e for e in events if e.get("cat") == "cpu_op" and "dur" in e), key=lambda e: e["ts"]):
            self.ops[op["tid"]].append(op)
        self.starts = {tid: [op["ts"] for op in thread] for tid, thread in self.ops.items()}

    def launch(self, kernel: dict) -> dict | None:
        """The runtime call that launched ``kernel`` (None without a correlation id, e.g. a CUDA graph's replay)."""
        return self.runtime.get(kernel.get("args", {}).get("correlation"))

    def around(self, tid: int, ts: float, depth: int = 3) -> str:
        """The innermost ``depth`` ops of thread ``tid`` running at ``ts``, innermost first."""
        thread, found = self.ops.get(tid, []), []
        last = bisect_right(self.starts.get(tid, []), ts)
        for i in range(last - 1, max(last - SCAN_BACK, 0) - 1, -1):
            if thread[i]["ts"] + thread[i]["dur"] >= ts:
                found.append(thread[i]["name"])
                if len(found) == depth:
                    break
        return " < ".join(found)

    def launcher(self, kernel: dict) -> str:
        call = self.launch(kernel)
        return "" if call is None else self.around(call["tid"], call["ts"])


def _busy(events: list[dict]) -> list[dict]:
    return [e for e in events if (e.get("cat") == "kernel" or e.get("cat") in COPY_CATEGORIES) and "dur" in e]


def top_kernels(events: list[dict], phases: Iterable[str], top: int = 15) -> dict[str, list[dict]]:
    """Per phase found in the trace, the kernels and copies that start in it, grouped by name, the most time
    first: ``kernel``, ``kind``, ``launches``, ``us`` (their total), and ``launched_by``, the innermost CPU ops
    around the first one's launch (joined through the trace's correlation ids; "" where the trace has none,
    e.g. a CUDA graph's replay). A fused or element-wise kernel's name rarely says which line of the model it
    comes from."""
    cpu, busy = _CpuOps(events), _busy(events)
    tables = {}
    for phase in phases:
        windows = _windows(events, phase)
        if not windows:
            continue
        groups: dict[str, dict] = {}
        for event in busy:
            if any(a <= float(event["ts"]) < b for a, b in windows):
                group = groups.setdefault(
                    event["name"], {"kernel": event["name"], "kind": kernel_kind(event), "launches": 0, "us": 0.0}
                )
                group["launches"] += 1
                group["us"] += float(event["dur"])
                if "launched_by" not in group:
                    group["launched_by"] = cpu.launcher(event)
        tables[phase] = sorted(groups.values(), key=lambda g: -g["us"])[:top]
    return tables


def idle_gaps(events: list[dict], phases: Iterable[str], top: int = 10) -> dict[str, list[dict]]:
    """Per phase found in the trace, its longest stretches with no kernel or copy running, the longest first:
    ``at_ms`` (from the phase's start), ``us``, ``host`` (the CPU ops that the thread launching the next kernel
    was in at the gap's middle: a sync, the optimizer's host work, Python between micro-batches) and ``then`` (the
    next kernel's launcher). Where ``kernel_shares``' idle share comes from."""
    by_start = sorted(_busy(events), key=lambda e: float(e["ts"]))
    cpu, busy = _CpuOps(events), _merge(_span(e) for e in by_start)
    kernel_starts = [float(e["ts"]) for e in by_start]
    tables = {}
    for phase in phases:
        windows = _windows(events, phase)
        if not windows:
            continue
        gaps = []
        for start, end in windows:
            edges = [start] + [x for span in busy if span[1] > start and span[0] < end for x in span] + [end]
            for a, b in zip(edges[::2], edges[1::2], strict=True):
                if b > a:
                    gaps.append((b - a, a, b))
        rows = []
        for length, a, b in sorted(gaps, reverse=True)[:top]:
            nxt = bisect_right(kernel_starts, b - 1e-9)
            kernel = by_start[nxt] if nxt < len(by_start) else None
            call = cpu.launch(kernel) if kernel else None
            host = cpu.around(call["tid"], (a + b) / 2) if call else ""
            rows.append(
                {
                    "at_ms": (a - windows[0][0]) / 1e3,
                    "us": length,
                    "host": host,
                    "then": cpu.launcher(kernel) if kernel else "",
                }
            )
        tables[phase] = rows
    return tables


def host_syncs(events: list[dict], phases: Iterable[str]) -> dict[str, list[dict]]:
    """Per phase found in a GPU trace, the calls in it that made the host wait for the GPU (``SYNC_CALLS``),
    grouped by where they were made, the longest wait first: ``host`` (the call, then the innermost CPU ops
    around it where the trace has them), ``calls`` and ``us`` (the host's time in them). Each phase ends in one
    ``cudaDeviceSynchronize``, the loop's timing; any other is a sync that lets the GPU's queue run dry.
    Nothing for a CPU trace."""
    syncs = [e for e in events if e.get("cat") == "cuda_runtime" and e.get("name") in SYNC_CALLS and "dur" in e]
    if not syncs:
        return {}
    cpu, tables = _CpuOps(events), {}
    for phase in phases:
        windows = _windows(events, phase)
        if not windows:
            continue
        groups: dict[str, dict] = {}
        for call in syncs:
            if any(a <= float(call["ts"]) < b for a, b in windows):
                host = " < ".join(filter(None, (call["name"], cpu.around(call.get("tid"), float(call["ts"])))))
                group = groups.setdefault(host, {"host": host, "calls": 0, "us": 0.0})
                group["calls"] += 1
                group["us"] += float(call["dur"])
        tables[phase] = sorted(groups.values(), key=lambda g: -g["us"])
    return tables


def sync_counts(events: list[dict], phases: Iterable[str]) -> dict[str, float]:
    """``profile/host_syncs_<phase>``: how many times the host waited for the GPU in each phase (see ``host_syncs``)."""
    return {
        f"profile/host_syncs_{phase}": float(sum(g["calls"] for g in groups))
        for phase, groups in host_syncs(events, phases).items()
    }


def _windows(events: list[dict], phase: str) -> Spans:
    return _merge(
        _span(e) for e in events if e.get("cat") == "user_annotation" and e.get("name") == phase and "dur" in e
    )


def _share(comm: Spans, busy: Spans | None, windows: Spans) -> float:
    working = _overlap(busy, windows) if busy is not None else _length(windows)
    return _overlap(comm, windows) / working if working > 0 else 0.0


def _span(event: dict) -> tuple[float, float]:
    start = float(event["ts"])
    return start, start + float(event["dur"])


def _merge(spans: Iterable[tuple[float, float]]) -> Spans:
    merged: Spans = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _length(spans: Spans) -> float:
    return sum(end - start for start, end in spans)


def _overlap(a: Spans, b: Spans) -> float:
    """Total time inside both ``a`` and ``b`` (each sorted and disjoint)."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total
