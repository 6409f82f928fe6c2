"""``grpo prepare``: GSM8K (from the hub, a local directory or the embedded copy) as verl-style parquet."""

import argparse

from grpo_core.cli.common import UserError, console


def add_parser(sub: argparse._SubParsersAction) -> None:
    prepare = sub.add_parser("prepare", help="write GSM8K as verl-style parquet")
    prepare.add_argument("--source", default="openai/gsm8k", help="hub id, local directory, or 'embedded'")
    prepare.add_argument("--output", default="data/gsm8k", help="output directory")
    prepare.add_argument("--force", action="store_true", help="rewrite even if the input is unchanged")
    prepare.set_defaults(func=cmd_prepare)


def cmd_prepare(args: argparse.Namespace) -> int:
    # lazy: pyarrow and numpy, a quarter second of `grpo --help`, which imports this module
    from grpo_core.data.gsm8k import DataError, prepare_gsm8k

    try:
        result = prepare_gsm8k(args.source, args.output, force=args.force)
    except DataError as e:
        raise UserError(str(e)) from None
    state = "unchanged input, kept" if result.reused else "written"
    for split, rows in result.rows.items():
        skipped = result.skipped.get(split, 0)
        console.print(f"{split}: {rows} rows ({skipped} skipped: no final answer)", markup=False)
    console.print(f"{state}: {result.output_dir}", markup=False)
    return 0
