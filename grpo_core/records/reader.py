"""What every record shares: the base model (strict types, a size limit), the bounded reader, and RecordError,
whose message is one line naming the file and the field."""

import functools
import json
import os
from pathlib import Path
from typing import Annotated, Any, ClassVar, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

MAX_COUNT = 1 << 40  # steps, rows, positions: far above any run, far below what would exhaust anything


class RecordError(ValueError):
    """A file read back is not what the project writes there: ``where`` (the file) and ``reason`` (the field and
    what is wrong with it). Invalid input: exit 2."""

    def __init__(self, where: str | Path, reason: str):
        super().__init__(f"{where}: {reason}")
        self.where, self.reason = str(where), reason


class Record(BaseModel):
    """A file's schema. Strict: JSON's types as they are, no coercion. Fields the project does not read are kept
    as they are (a newer writer may add some); those it reads are typed and bounded."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False, defer_build=True)  # built when used
    what: ClassVar[str] = "record"  # in messages: "unreadable trainer state"
    max_bytes: ClassVar[int] = 4 << 20  # larger files are refused unread


R = TypeVar("R", bound=Record)


def read_json(path: str | Path, record: type[R]) -> R:
    """The file at ``path`` as ``record``; RecordError when it is too large, not JSON, or not of its schema."""
    return parse_json(_bounded_read(Path(path), record), record, path)


def read_json_as_written(path: str | Path, record: type[Record]) -> dict:
    """The file at ``path`` checked as ``read_json`` checks it, then as it was written: a plain dict, numbers as
    they were (a trainer state's Hugging Face config goes on into an exported ``config.json``)."""
    data = _bounded_read(Path(path), record)
    parse_json(data, record, path)
    return json.loads(data)


def _bounded_read(path: Path, record: type[Record]) -> bytes:
    try:
        with open(path, "rb") as f:
            if (size := os.fstat(f.fileno()).st_size) > record.max_bytes:
                limit = f"{record.max_bytes / 1e6:g} MB"
                raise RecordError(path, f"{size} bytes, more than a {record.what} can be ({limit} at most)")
            data = f.read(record.max_bytes + 1)
    except OSError as e:
        raise RecordError(path, f"unreadable {record.what}: {e.strerror or e}") from None
    if len(data) > record.max_bytes:  # it grew since
        raise RecordError(path, f"more than a {record.what} can be ({record.max_bytes} bytes at most)")
    return data


def parse_json(data: str | bytes, schema: Any, where: str | Path, what: str | None = None) -> Any:
    """``data`` (JSON text) validated as ``schema`` (a Record, or any type pydantic validates)."""
    what = what or getattr(schema, "what", "record")
    try:
        return _adapter(schema).validate_json(data, strict=True)
    except ValidationError as e:
        raise RecordError(where, describe(e, what)) from None


def validate(
    value: Any, schema: Any, where: str | Path, what: str = "record", strict: bool = True, item: str = "field"
) -> Any:
    """A Python value (parsed already, or a registry's tags) validated as ``schema``; RecordError otherwise."""
    try:
        return _adapter(schema).validate_python(value, strict=strict)
    except ValidationError as e:
        raise RecordError(where, describe(e, what, item)) from None


@functools.cache
def _adapter(schema: Any) -> TypeAdapter:
    """pydantic's validator of ``schema``, built once."""
    return TypeAdapter(schema)


def describe(error: ValidationError, what: str, item: str = "field") -> str:
    """The first problem pydantic found, in words: ``field 'rows_seen': expected a list, got a string``."""
    first = error.errors(include_url=False)[0]
    kind, loc, ctx, value = first["type"], first["loc"], first.get("ctx") or {}, first.get("input")
    if kind == "json_invalid":
        return f"unreadable {what}: not JSON ({ctx.get('error', first['msg'])})"
    steps = [part for part in loc if part != "[key]"]
    field = "".join([str(steps[0]), *map(_step, steps[1:])]) if steps else ""
    where = f"{item} '{field}'" if field else f"unreadable {what}"
    if kind == "missing":
        return f"{where}: missing"
    if kind == "extra_forbidden":
        return f"{where}: not a field it can have"
    if expected := EXPECTED.get(kind):
        return f"{where}: expected {expected}, got {shown(value) if kind.endswith('_parsing') else kind_of(value)}"
    if kind in BOUNDS:
        bound = next(iter(ctx.values()), "?")
        return f"{where}: expected {BOUNDS[kind]} {bound}, got {shown(value)}"
    if kind == "literal_error":
        return f"{where}: expected {ctx.get('expected')}, got {shown(value)}"
    if kind in ("too_long", "string_too_long"):
        unit = "characters" if kind == "string_too_long" else "items"
        return f"{where}: more than the {ctx.get('max_length')} {unit} it can have"
    message = str(ctx.get("error", first["msg"])).removeprefix("Value error, ")
    return f"{where}: {message}, got {shown(value)}"


EXPECTED = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "finite_number": "a finite number",
    "string_type": "a string",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "list_type": "a list",
    "tuple_type": "a list",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
}
BOUNDS = {
    "greater_than_equal": "at least",
    "greater_than": "more than",
    "less_than_equal": "at most",
    "less_than": "less than",
}


def _step(part: int | str) -> str:
    """One step of a field's path: ``.name``, ``[3]`` (a list's item), ``[a/b.distcp]`` (a key that is no name)."""
    return f".{part}" if isinstance(part, str) and part.replace("_", "a").isalnum() else f"[{part}]"


def kind_of(value: Any) -> str:
    """A JSON value's kind, in words."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    for types, name in ((int, "an integer"), (float, "a number"), (str, "a string"), (list, "a list")):
        if isinstance(value, types):
            return name
    return "an object" if isinstance(value, dict) else type(value).__name__


def shown(value: Any) -> str:
    """A short value as it is; a long one or a container by its kind."""
    if isinstance(value, int | float | str) and not isinstance(value, bool) and len(repr(value)) <= 60:
        return repr(value)
    return kind_of(value)


def _hex_digits(least: int, most: int | None = None):
    most = most or least
    count = f"{least}" if most == least else f"{least} to {most}"

    def check(text: str) -> str:
        if not least <= len(text) <= most or text.strip("0123456789abcdef"):
            raise ValueError(f"expected {count} lowercase hex digits")
        return text

    return AfterValidator(check)


def _relative_path(text: str) -> str:
    parts = Path(text).parts
    if not text or Path(text).is_absolute() or ".." in parts:
        raise ValueError("expected a path inside its directory (relative, no '..')")
    return text


Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Hex32 = Annotated[str, _hex_digits(32)]  # an xxh3-128 hash
Hex64 = Annotated[str, _hex_digits(64)]  # a SHA-256
Digest = Annotated[str, _hex_digits(32, 64)]  # a dataset's digest (data/lineage.py: 32), or a whole SHA-256
RowId = Annotated[str, _hex_digits(16)]  # data/prompts.py row_id
Name = Annotated[str, Field(min_length=1, max_length=4096)]  # a path, a hub id, a label
RelativePath = Annotated[str, Field(max_length=4096), AfterValidator(_relative_path)]
