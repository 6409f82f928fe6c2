"""Move parameters or gradient buffers to host memory between phases, and back.

Megatron keeps parameters and gradients as views into large flat buffers. Freeing a buffer's device
storage (``untyped_storage().resize_(0)``) releases the memory while every view stays valid, so the
model, the DDP hooks and the optimizer keep their references; bringing it back re-grows the storage
and copies the host copy in. The generation phase uses the freed memory for the KV cache.
"""

import torch

# Pinned host memory comes from torch's caching host allocator, which rounds every request up to a power of
# two: a per-tensor copy of Qwen2.5-7B's bf16 weights (a 1.04 GiB embedding, 259 MiB MLP matrices) pins 26.8 GiB
# for 14.2. Host copies live in chunks of this power-of-two size instead; only the last chunk is rounded.
CHUNK_BYTES = 1 << 28


def _storages(tensors) -> list[torch.UntypedStorage]:
    """Each distinct underlying storage once (a flat buffer shared by many views counts once)."""
    seen: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        if t is not None and t.untyped_storage().size() > 0:
            seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage())
    return list(seen.values())


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def host_chunks(total: int) -> list[torch.Tensor]:
    """``total`` bytes of host memory (pinned where there is a GPU) as byte tensors of ``CHUNK_BYTES``, the
    last one the smallest power of two that holds the rest."""
    pin = torch.cuda.is_available()
    sizes = [CHUNK_BYTES] * (total // CHUNK_BYTES)
    if rest := total % CHUNK_BYTES:
        sizes.append(1 << (rest - 1).bit_length())
    return [torch.empty(size, dtype=torch.uint8, pin_memory=pin) for size in sizes]


class HostOffloader:
    """Holds the host copies of what was offloaded; ``offload`` and ``reload`` return bytes freed / moved.

    ``frozen`` (the reference model): the tensors never change, so the pinned host copy made at the first
    offload stays valid and later offloads only free the device storage. Copying and pinning 15 GB afresh
    each step cost a 7B reference pass ~10 s on an H200 (BENCHMARKS.md)."""

    def __init__(self, frozen: bool = False) -> None:
        self.frozen = frozen
        self._storages: list[torch.UntypedStorage] = []
        self._sizes: list[int] = []
        self._host: list[torch.Tensor] = []
        self.offloaded = False

    def _pieces(self):
        """(storage, its byte range, host chunk, offset in it): the storages laid end to end over the chunks."""
        position = 0
        for storage, size in zip(self._storages, self._sizes, strict=True):
            start = 0
            while start < size:
                chunk, offset = divmod(position, CHUNK_BYTES)
                length = min(size - start, CHUNK_BYTES - offset)
                yield storage, slice(start, start + length), self._host[chunk], slice(offset, offset + length)
                start, position = start + length, position + length

    def offload(self, tensors) -> int:
        if self.offloaded:
            return 0
        if not self._storages:
            self._storages = _storages(tensors)
            self._sizes = [storage.size() for storage in self._storages]
            self._host = host_chunks(sum(self._sizes))
            for storage, part, chunk, place in self._pieces():
                chunk[place].copy_(_bytes(storage)[part])
        for storage in self._storages:
            storage.resize_(0)
        self.offloaded = True
        return sum(self._sizes)

    def reload(self) -> int:
        if not self.offloaded:
            return 0
        for storage, size in zip(self._storages, self._sizes, strict=True):
            storage.resize_(size)
        for storage, part, chunk, place in self._pieces():
            _bytes(storage)[part].copy_(chunk[place])
        moved = sum(self._sizes)
        self.offloaded = False
        if not self.frozen:
            self._storages, self._sizes, self._host = [], [], []
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
