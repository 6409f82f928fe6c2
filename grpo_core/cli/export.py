"""``grpo export``: a training checkpoint as a Hugging Face model directory (or, with --peft, a PEFT adapter)."""

import argparse

from grpo_core.checkpoint.export import export_checkpoint
from grpo_core.cli.common import UserError, console


def add_parser(sub: argparse._SubParsersAction) -> None:
    export = sub.add_parser("export", help="write a training checkpoint as a Hugging Face model")
    export.add_argument("checkpoint", help="a checkpoint directory (…/step_000100)")
    export.add_argument("out_dir")
    export.add_argument(
        "--peft",
        action="store_true",
        help="a LoRA checkpoint's adapters as a PEFT adapter directory (adapter_config.json, adapter_model.safetensors)"
        " instead of the merged model",
    )
    export.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    # lazy: torch, and `grpo --help` imports this module
    from grpo_core.checkpoint.manager import CheckpointError

    try:
        out = export_checkpoint(args.checkpoint, args.out_dir, peft=args.peft)
    except CheckpointError as e:
        raise UserError(str(e)) from None
    what = "a PEFT LoRA adapter" if args.peft else "a Hugging Face model"
    console.print(f"exported {args.checkpoint} as {what}: {out}", markup=False)
    return 0
