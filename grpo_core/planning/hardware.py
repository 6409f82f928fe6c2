"""What the machine multiplies fast, read before a model is built: the value ``dtype: auto`` takes."""

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
