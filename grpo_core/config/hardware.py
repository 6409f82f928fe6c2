"""What this machine can do, read before a model is built: what it multiplies fast (the value ``dtype: auto``
takes) and how much memory its GPUs have (what the memory check holds a config to)."""

from functools import cache


@cache
def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (oneDNN's bf16 path: AVX-512 or AMX on x86, BF16 on Arm).
    Without it torch falls back to a reference kernel: on an AVX2-only EPYC a [4224, 64] x [64, 49152] product took
    19.5 s in bf16 against 0.77 s in float32 (BENCHMARKS.md)."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch without the probe: AVX-512 is what oneDNN's bf16 needs
        return "AVX512" in torch.backends.cpu.get_cpu_capability()


def native_dtype(device: str) -> str:
    """``dtype: auto``: bfloat16 on GPUs and on CPUs that multiply in it natively, float32 elsewhere."""
    return "bfloat16" if device != "cpu" or cpu_has_bf16_matmul() else "float32"


@cache
def local_gpu_memory_gib() -> float | None:
    """The smallest GPU's memory on this machine, from NVML as the GPU sampler reads it (a CUDA context here would
    take memory on the ranks' GPU); None without a GPU, a driver or pynvml."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            count = pynvml.nvmlDeviceGetCount()
            sizes = [pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).total for i in range(count)]
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # ImportError, or NVMLError without a driver
        return None
    return min(sizes) / 2**30 if sizes else None
