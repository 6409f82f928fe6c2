"""Process group and megatron parallel state from the run's layout: the only place that starts them."""

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from grpo_core.planning.layout import ParallelLayout


def init_distributed(timeout_s: float = 1800) -> None:
    """Join the torchrun job (env://): NCCL on GPUs, gloo on CPU. A single process works without torchrun."""
    if dist.is_initialized():
        return
    if "WORLD_SIZE" not in os.environ:  # a lone process (tests, `grpo export`): a private loopback rendezvous
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(_free_port())
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_model_parallel(layout: ParallelLayout, seed: int, timeout_s: float = 1800) -> None:
    """(Re)build megatron's TP/PP/CP/EP groups for ``layout`` and seed its RNG tracker."""
    init_distributed(timeout_s)
    if layout.world_size != dist.get_world_size():
        raise ValueError(f"layout expects {layout.world_size} processes, the job has {dist.get_world_size()}")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
    )
    model_parallel_cuda_manual_seed(seed)


def shutdown_distributed() -> None:
    """Megatron's groups and the process group, torn down before a rank exits (NCCL warns that resources may leak
    when a process ends with its group still up)."""
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def send(t: torch.Tensor) -> torch.Tensor:
    """``t`` on this rank's device, the copy queued behind the GPU's work: a blocking copy, or one from pageable
    host memory, waits for that work to finish, and the GPU then idles while the host launches what comes next."""
    target = device()
    if t.device == target or target.type != "cuda":
        return t.to(target)
    return t.pin_memory().to(target, non_blocking=True)
