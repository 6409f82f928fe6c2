"""A megatron dist-checkpoint save that streams each tensor from the GPU to its file, one at a time.

megatron-core's own torch_dist writer (0.16 and 0.19) first copies every GPU tensor of the state to host
memory, then hands the copies to forked writer processes: a save needs host memory for the whole GPU state
on top of everything already on the host. For a 7B on one GPU with half of Adam on the host that is ~60 GiB
more, the difference between fitting a 125 GiB node and not. This strategy builds the same checkpoint (the
same translation of megatron's sharded state to torch.distributed.checkpoint, the same planner, so
megatron's loader reads it unchanged) and writes it with torch's FileSystemWriter, which copies a tensor to
the host only as it writes it. A writer thread that fails (a full disk) does not print its traceback: the save
fails, and the caller says why in one line.
"""

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)


class StreamingSave(TorchDistSaveShardedStrategy):
    """torch_dist format, version 1 (what ``metadata.json`` records), written tensor by tensor."""

    def __init__(self) -> None:
        super().__init__("torch_dist", 1)  # megatron 0.16 has no defaults for these

    def save(self, sharded_state_dict: dict, checkpoint_dir: str | Path) -> None:
        by_key, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
        # Two files a rank, written by two threads, as megatron 0.16's writer does.
        with _kept_thread_errors() as errors:
            dcp.save(
                mcore_to_pyt_state_dict(by_key, False),
                storage_writer=dcp.FileSystemWriter(str(checkpoint_dir), thread_count=2),
                planner=MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False),
            )
        if errors:  # a writer thread failed and the save did not notice: never a silent loss
            raise errors[0]


@contextmanager
def _kept_thread_errors(wait_s: float = 30.0) -> Iterator[list[BaseException]]:
    """The exceptions of threads started in the block (torch's file writers), kept instead of printed: a full disk
    fails the save (CheckpointSaveError, one line) rather than printing a traceback per writer thread. A save that
    fails does not wait for its writers: they are given ``wait_s`` to end here, before the hook goes."""
    errors: list[BaseException] = []
    before, previous = set(threading.enumerate()), threading.excepthook

    def keep(args: threading.ExceptHookArgs) -> None:
        if args.thread in before:
            previous(args)
        else:
            errors.append(args.exc_value)

    threading.excepthook = keep
    try:
        yield errors
    except BaseException as e:  # torch's CheckpointException is a BaseException
        deadline = time.monotonic() + (0 if isinstance(e, KeyboardInterrupt | SystemExit) else wait_s)
        for thread in set(threading.enumerate()) - before:
            thread.join(max(0.0, deadline - time.monotonic()))
        raise
    finally:
        threading.excepthook = previous
