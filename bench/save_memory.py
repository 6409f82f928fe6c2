"""Host memory of one checkpoint save, megatron's own writer against the project's streaming one, for both
optimizer formats: the actor of a Hugging Face checkpoint takes one update (so Adam has its moments), then each
save runs while a thread samples the process's resident set every 5 ms. Prints, per save, the peak above the
resident set just before it (bytes per parameter and GiB) and its seconds. On a GPU the state to save lives in
GPU memory and megatron's writer copies all of it to the host first; on CPU it is host memory already.

    python3 bench/save_memory.py HF_DIR OUT_DIR [--formats dp_reshardable] [--dtype bfloat16]
(HF_DIR: e.g. from bench/random_hf_model.py)
"""

import argparse
import shutil
import threading
import time
from pathlib import Path

import psutil
import torch
from megatron.core import dist_checkpointing

from grpo_core.actor.actor import ActorSettings, MegatronActor
from grpo_core.actor.loss import LossSettings
from grpo_core.actor.parallel import init_distributed, init_model_parallel
from grpo_core.checkpoint.stream_save import StreamingSave
from grpo_core.data.batch import RolloutBatch
from grpo_core.models.shape import load_model_shape
from grpo_core.planning.layout import ParallelLayout


class PeakRss:
    """The highest resident set seen while the block runs, above the one at its start."""

    def __enter__(self):
        self.process, self.done = psutil.Process(), threading.Event()
        self.start = self.peak = self.process.memory_info().rss
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.done.wait(0.005):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __exit__(self, *_):
        self.done.set()
        self.thread.join()
        self.above = self.peak - self.start


def one_update(actor: MegatronActor, vocab: int, rows: int = 8, length: int = 64) -> None:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, 2 * length), generator=g)
    mask = torch.ones(rows, length)
    batch = RolloutBatch(
        ids, torch.ones_like(ids), mask, advantages=torch.where(torch.arange(rows) % 2 == 0, 1.0, -1.0)[:, None] * mask
    )
    batch.old_log_probs, _ = actor.compute_log_prob(batch)
    actor.update(batch)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("hf_dir")
    p.add_argument("out")
    p.add_argument("--formats", nargs="+", default=["fully_reshardable", "dp_reshardable"])
    p.add_argument("--dtype", default="float32", help="bfloat16: the trainer's weights, with fp32 masters in Adam")
    args = p.parse_args()
    init_distributed()
    layout = ParallelLayout(world_size=1)
    init_model_parallel(layout, seed=0)
    shape = load_model_shape(args.hf_dir)
    settings = ActorSettings(
        layout=layout,
        dtype=args.dtype,
        lr=1e-5,
        mini_batch_rows=8,
        micro_batch_rows=8,
        loss=LossSettings(use_kl_loss=False),
    )
    actor = MegatronActor(shape, settings, hf_path=args.hf_dir)
    one_update(actor, shape.vocab_size)
    params = sum(p.numel() for chunk in actor.model for p in chunk.parameters())
    rows = []
    for fmt in args.formats:
        for writer, strategy in (("megatron", None), ("streaming", StreamingSave())):
            out = Path(args.out) / f"{fmt}_{writer}"
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            start = time.perf_counter()
            with PeakRss() as rss:
                dist_checkpointing.save(
                    actor.sharded_state_dict(optimizer_format=fmt), str(out), sharded_strategy=strategy
                )
            rows.append((fmt, writer, rss.above / params, rss.above / 2**30, time.perf_counter() - start))
            shutil.rmtree(out)
    print(f"{params / 1e6:.0f}M parameters on {'GPU' if torch.cuda.is_available() else 'CPU'}")
    print("| optimizer format | writer | host B/param | host GiB | save s |\n| --- | --- | --- | --- | --- |")
    for fmt, writer, per_param, gib, seconds in rows:
        print(f"| {fmt} | {writer} | {per_param:.1f} | {gib:.2f} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
