"""Move parameters or gradient buffers to host memory between phases, and back.

Megatron keeps parameters and gradients as views into large flat buffers. Freeing a buffer's device
storage (``untyped_storage().resize_(0)``) releases the memory while every view stays valid, so the
model, the DDP hooks and the optimizer keep their references; bringing it back re-grows the storage
and copies the host copy in. The generation phase uses the freed memory for the KV cache.
"""

import torch


def _storages(tensors) -> list[torch.Tensor]:
    """One tensor per distinct underlying storage (a flat buffer shared by many views counts once)."""
    seen: dict[int, torch.Tensor] = {}
    for t in tensors:
        if t is not None and t.untyped_storage().size() > 0:
            seen.setdefault(t.untyped_storage().data_ptr(), t)
    return list(seen.values())


class HostOffloader:
    """Holds the host copies of what was offloaded; ``offload`` and ``reload`` return bytes freed / moved.

    ``frozen`` (the reference model): the tensors never change, so the pinned host copy made at the first
    offload stays valid and later offloads only free the device storage. Copying and pinning 15 GB afresh
    each step cost a 7B reference pass ~10 s on an H200 (BENCHMARKS.md)."""

    def __init__(self, frozen: bool = False) -> None:
        self.frozen = frozen
        self._copies: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] = []
        self.offloaded = False

    def offload(self, tensors) -> int:
        if self.offloaded:
            return 0
        if not self._copies:
            for t in _storages(tensors):
                storage = t.untyped_storage()
                host = torch.UntypedStorage(storage.size(), device="cpu")
                host.copy_(storage)
                if torch.cuda.is_available():
                    host = host.pin_memory()
                self._copies.append((storage, host))
        freed = 0
        for storage, _ in self._copies:
            freed += storage.size()
            storage.resize_(0)
        self.offloaded = True
        return freed

    def reload(self) -> int:
        if not self.offloaded:
            return 0
        moved = 0
        for storage, host in self._copies:
            storage.resize_(host.size())
            storage.copy_(host)
            moved += host.size()
        self.offloaded = False
        if not self.frozen:
            self._copies.clear()
        return moved


def parameters(model_chunks) -> list[torch.Tensor]:
    return [p.data for chunk in model_chunks for p in chunk.parameters()]


def gradient_buffers(model_chunks) -> list[torch.Tensor]:
    """Megatron's fp32 ``main_grad`` buffers (one flat buffer per dtype behind the views)."""
    return [getattr(p, "main_grad", None) for chunk in model_chunks for p in chunk.parameters()]


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """What the optimizer keeps on the compute device that only the update reads: the distributed
    optimizer's fp32 master shards of 16-bit parameters (megatron's hybrid CPU optimizer leaves them on the
    GPU) and the Adam states stepped there (all without CPU offload; with it, the share kept on the GPU).
    States a CPU step keeps in host memory already are left alone."""
    here = "cuda" if torch.cuda.is_available() else "cpu"
    found = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        found += [t for group in getattr(opt, "shard_fp32_from_float16_groups", []) for t in group]
        for state in getattr(getattr(opt, "optimizer", None), "state", {}).values():
            found += [v for v in state.values() if isinstance(v, torch.Tensor) and v.device.type == here]
    return found
