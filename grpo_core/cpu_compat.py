"""Let megatron-core run on a CPU-only torch (gloo), so CI exercises the same code path as the GPUs.

megatron-core assumes CUDA in many places (measured: ../shared/notes/megatron-cpu.md): tensors created
with ``device="cuda"`` or ``torch.cuda.current_device()``, CUDA RNG state in the model-parallel RNG
tracker, streams, events and ``synchronize`` in the DDP buffers, pipeline communication and
checkpointing, and ``param.type() == "torch.cuda.FloatTensor"`` assertions in the optimizer.

``apply()`` is called before megatron is imported and does nothing when a GPU is present. It enters a
process-wide ``TorchFunctionMode`` that maps CUDA devices to the CPU and stands CPU stand-ins in for the
``torch.cuda`` functions megatron calls. Nothing else in the project knows about it.
"""

import contextlib
import types

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_active_mode: TorchFunctionMode | None = None


def _is_cuda(device: object) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpu(TorchFunctionMode):
    """Rewrites every CUDA device argument to the CPU, and reports CPU float tensors under their
    CUDA type name where megatron's optimizer asserts it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.autograd.backward or func is torch.Tensor.backward:
            return _backward_in(self, func, args, kwargs)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = _CPU
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], _CPU, *args[2:])
        result = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and isinstance(result, str):
            return result.replace("torch.", "torch.cuda.", 1)
        return result


def _backward_in(mode: TorchFunctionMode, func, args: tuple, kwargs: dict) -> None:
    """Run a backward pass with ``mode`` on. torch (2.10+) sends ``backward()`` through the mode, and a mode
    is off while its handler runs, so megatron's backward functions (the reduce-scatter behind an all-gather,
    e.g. of the QKV output when TP exceeds the KV heads) would allocate on ``torch.cuda.current_device()``.
    The engine is called directly, as ``torch.autograd.backward`` does after its own dispatch check."""
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward

    if func is torch.Tensor.backward:
        names = ("gradient", "retain_graph", "create_graph", "inputs")
        given = dict(zip(names, args[1:], strict=False)) | kwargs
        tensors, grads = (args[0],), given.get("gradient")
    else:
        names = ("grad_tensors", "retain_graph", "create_graph", "grad_variables", "inputs")
        given = dict(zip(names, args[1:], strict=False)) | kwargs
        tensors, grads = args[0], given.get("grad_tensors")
        tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    inputs = given.get("inputs")
    inputs = () if inputs is None else ((inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs))
    create_graph = bool(given.get("create_graph", False))
    retain_graph = given.get("retain_graph")
    grads = _make_grads(tensors, _tensor_or_tensors_to_tuple(grads, len(tensors)), is_grads_batched=False)
    with mode:
        _engine_run_backward(
            tensors,
            grads,
            create_graph if retain_graph is None else retain_graph,
            create_graph,
            inputs,
            allow_unreachable=True,
            accumulate_grad=True,
        )


class _Stream:
    """What megatron asks of a CUDA stream, done synchronously."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event or _Event()

    def synchronize(self):
        pass


class _Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _noop(*args, **kwargs):
    return None


@contextlib.contextmanager
def current_device_is_cpu():
    """While open, ``torch.cuda.current_device()`` returns the CPU device rather than index 0, for code
    that hands it to a constructor: constructors are not torch functions, so the device mapping misses
    them (megatron's text-generation controller builds ``torch.Generator(device=current_device())``).
    Does nothing when there is a GPU."""
    if torch.cuda.is_available():
        yield
        return
    current = torch.cuda.current_device
    torch.cuda.current_device = lambda: _CPU
    try:
        yield
    finally:
        torch.cuda.current_device = current


def apply() -> bool:
    """Install the CPU stand-ins if there is no GPU. Returns True when they are active."""
    global _active_mode
    if torch.cuda.is_available():
        return False
    if _active_mode is not None:
        return True
    cuda = torch.cuda
    stream = _Stream()
    cuda.current_device = lambda: 0
    cuda.synchronize = _noop
    cuda.empty_cache = _noop
    cuda.current_stream = lambda *a, **k: stream
    cuda.default_stream = lambda *a, **k: stream
    cuda.Stream = _Stream
    cuda.Event = _Event
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.memory_stats = lambda *a, **k: {}
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.manual_seed = torch.manual_seed
    cuda.default_generators = (torch.default_generator,)
    cuda._lazy_call = lambda fn, **kwargs: fn()  # megatron's RNG tracker sets states through it
    cuda.nvtx = types.SimpleNamespace(range_push=_noop, range_pop=_noop, range=lambda *a, **k: contextlib.nullcontext())
    _active_mode = _CudaToCpu()
    _active_mode.__enter__()
    return True
