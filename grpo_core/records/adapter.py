"""A PEFT LoRA adapter directory read back: ``adapter_config.json`` and the tensors of
``adapter_model.safetensors``, each checked before anything uses them.

The tensors' file is checked from its header before a byte of data is read: the header's length fits the file,
every tensor's dtype is known and its bytes lie inside the file, as many as its shape says. Then their names
(peft's ``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``, both of every module), their shapes
(A is [r, in], B [out, r] with the config's r; against a base model, its weight is [out, in]), their dtype (a
float) and their values (finite). ``weight_shapes`` reads any safetensors file's names and shapes the same way.
"""

import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import AfterValidator, Field

from grpo_core.records.reader import Name, Record, RecordError, parse_json, read_json, validate

if TYPE_CHECKING:
    import torch

MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
               "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}  # fmt: skip
FLOATS = ("F64", "F32", "F16", "BF16")
ADAPTER_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")


def _plain_lora_only(feature: str):
    def check(on: bool) -> bool:
        if on:
            raise ValueError(f"{feature} is not offered here: a plain LoRA adapter is needed")
        return on

    return AfterValidator(check)


class AdapterConfig(Record):
    """What is read of peft's ``adapter_config.json``: which kind of adapter, its rank and alpha, its base."""

    what = "adapter config"
    max_bytes = 1 << 20

    peft_type: Literal["LORA"]
    use_dora: Annotated[bool, _plain_lora_only("DoRA")] = False
    use_rslora: Annotated[bool, _plain_lora_only("rsLoRA")] = False
    fan_in_fan_out: Annotated[bool, _plain_lora_only("fan_in_fan_out (transposed weights)")] = False
    r: Annotated[int, Field(ge=1, le=1 << 16)]
    lora_alpha: Annotated[float, Field(gt=0)]
    base_model_name_or_path: Name | None = None


class TensorEntry(Record):
    """One tensor of a safetensors header: its dtype, shape and where its bytes are (after the header)."""

    dtype: Literal[tuple(DTYPE_BYTES)]
    shape: Annotated[list[Annotated[int, Field(ge=0, le=1 << 40)]], Field(max_length=8)]
    data_offsets: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=2, max_length=2)]


def read_adapter_config(path: str | Path) -> AdapterConfig:
    return read_json(path, AdapterConfig)


def read_header(path: str | Path) -> dict[str, TensorEntry]:
    """A safetensors file's tensors from its header, every one inside the file; RecordError otherwise."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            length = int.from_bytes(f.read(8), "little")
            if size < 10:
                raise RecordError(path, f"not a safetensors file: {size} bytes")
            if not 2 <= length <= min(size - 8, MAX_HEADER_BYTES):
                why = f"its header's length ({length} bytes) does not fit the file ({size} bytes)"
                raise RecordError(path, f"not a safetensors file: {why}")
            header = f.read(length)
    except OSError as e:
        raise RecordError(path, f"unreadable: {e.strerror or e}") from None
    raw = parse_json(header, dict[str, object], path, "safetensors header")
    validate(raw.pop("__metadata__", None), dict[str, str] | None, path, "safetensors header")
    entries = validate(raw, dict[str, TensorEntry], path, "safetensors header")
    data = size - 8 - length
    for name, entry in entries.items():
        begin, end = entry.data_offsets
        needed = math.prod(entry.shape) * DTYPE_BYTES[entry.dtype]
        if not begin <= end <= data or end - begin != needed:
            where = f"bytes {begin}..{end} of the {data} after the header"
            raise RecordError(path, f"tensor '{name}': {where}, its {entry.dtype} {entry.shape} needs {needed}")
    return entries


def weight_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in a safetensors file, read from its checked header (no data is read)."""
    return {name: tuple(entry.shape) for name, entry in read_header(path).items()}


def read_adapter_tensors(path: str | Path, rank: int) -> dict[str, "torch.Tensor"]:
    """The tensors of ``adapter_model.safetensors`` once every check of the module docstring but the base's passed."""
    from safetensors.torch import load_file

    path = Path(path)
    entries = read_header(path)
    parts: dict[str, dict[str, TensorEntry]] = {}
    for name, entry in entries.items():
        if (match := ADAPTER_KEY.match(name)) is None:
            expected = "base_model.model.<module>.lora_A.weight or .lora_B.weight"
            raise RecordError(path, f"tensor '{name}': not a LoRA A or B weight ({expected})")
        if entry.dtype not in FLOATS:
            raise RecordError(path, f"tensor '{name}': dtype {entry.dtype}, expected a float ({', '.join(FLOATS)})")
        parts.setdefault(match["module"], {})[match["part"]] = entry
    if not parts:
        raise RecordError(path, "no tensors: an adapter of nothing")
    for module, pair in parts.items():
        if missing := {"A", "B"} - pair.keys():
            raise RecordError(path, f"module {module}: no lora_{missing.pop()}.weight beside its other half")
        a, b = pair["A"].shape, pair["B"].shape
        if len(a) != 2 or len(b) != 2 or a[0] != rank or b[1] != rank:
            expected = f"A [{rank}, in] and B [out, {rank}] (r {rank} in adapter_config.json)"
            raise RecordError(path, f"module {module}: A {a} and B {b}, expected {expected}")
    tensors = load_file(str(path))
    for name, tensor in tensors.items():
        if not tensor.isfinite().all():
            raise RecordError(path, f"tensor '{name}': holds NaN or infinite values")
    return tensors


def check_against_base(
    path: str | Path, shapes: Mapping[str, Sequence[int]], base: Mapping[str, Sequence[int]], base_name: str
) -> None:
    """RecordError unless every module the adapter (tensor ``shapes``, peft's names) adapts is a 2-D weight of
    ``base`` (its HF weights' shapes) of shape [B's rows, A's columns]."""
    for name, shape in shapes.items():
        match = ADAPTER_KEY.match(name)
        if match is None or match["part"] != "A":
            continue
        weight = f"{match['module']}.weight"
        b = shapes[name.replace(".lora_A.", ".lora_B.")]
        if weight not in base:
            raise RecordError(path, f"adapts {weight}, which the base {base_name} does not have")
        if tuple(base[weight]) != (b[0], shape[1]):
            update = f"A {list(shape)} and B {list(b)} make a {[b[0], shape[1]]} update"
            raise RecordError(
                path, f"module {match['module']}: {update}; the base {base_name} has {list(base[weight])}"
            )
