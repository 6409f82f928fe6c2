"""How long verifying a checkpoint's manifest takes: GB of shard files written, hashed into a manifest, and
verified (sizes + xxh3-128 of every file, several files at a time), as `grpo verify` and every load do.

    python bench/checkpoint_verify.py --gb 15 --files 8 [--dir /tmp/verify_bench]

The files are in the page cache right after being written, so this is the hashing rate; a cold read is
bounded by the disk instead. Prints one line per phase.
"""

import argparse
import os
import shutil
import time
from pathlib import Path

from grpo_core.checkpoint import manifest


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=15.0)
    parser.add_argument("--files", type=int, default=8, help="shard files (megatron writes a few per rank)")
    parser.add_argument("--dir", default="/tmp/verify_bench")
    args = parser.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    block = os.urandom(64 << 20)
    per_file = int(args.gb * 1e9 / args.files) // len(block) + 1
    for i in range(args.files):
        with open(root / f"__{i}_0.distcp", "wb") as f:
            for _ in range(per_file):
                f.write(block)
    size = sum(p.stat().st_size for p in root.iterdir()) / 1e9
    start = time.perf_counter()
    manifest.write_manifest(root)
    print(f"manifest of {size:.1f} GB in {args.files} files: {time.perf_counter() - start:.2f} s")
    for threads in sorted({1, manifest.THREADS}):
        manifest.THREADS = threads
        start = time.perf_counter()
        listed = manifest.read_manifest(root)["files"]
        hashes = manifest._hash_all(root, list(listed))
        assert all(hashes[name] == entry["hash"] for name, entry in listed.items())
        seconds = time.perf_counter() - start
        print(f"verify, {threads} thread(s): {seconds:.2f} s, {size / seconds:.2f} GB/s")
    shutil.rmtree(root)


if __name__ == "__main__":
    main()
