"""``grpo verify``: whether a training checkpoint is whole, every file against its manifest."""

import argparse

from grpo_core.cli.common import console


def add_parser(sub: argparse._SubParsersAction) -> None:
    verify = sub.add_parser("verify", help="check that a training checkpoint is whole (its manifest's sizes, hashes)")
    verify.add_argument("checkpoint", help="a checkpoint directory (…/step_000100, or a copy under any name)")
    verify.set_defaults(func=cmd_verify)


def cmd_verify(args: argparse.Namespace) -> int:
    """Every file of a checkpoint against its manifest (or, for an older one, what can be checked)."""
    # lazy: torch, and `grpo --help` imports this module
    from grpo_core.checkpoint.manager import verify_checkpoint

    v = verify_checkpoint(args.checkpoint)
    if v.manifest:
        how = f"every file matches its manifest ({v.bytes / 1e9:.3f} GB hashed at {v.gb_per_s:.2f} GB/s)"
    else:
        how = "no manifest (written before manifests): files present, metadata and shard sizes agree"
    held = "no code in its pickled items, finite weights"
    console.print(
        f"{args.checkpoint}: intact; {v.files} files; {how}; {held}; {v.seconds + v.contents_seconds:.2f} s",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    return 0
