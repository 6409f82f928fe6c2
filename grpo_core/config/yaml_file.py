"""A config file read as plain, bounded YAML: every way a file can be wrong is one line naming the file and line.

A config is a few kilobytes of settings, so input far beyond that is refused before it costs time or memory: the
file's size, a value's length, the nesting depth, and the number of values once aliases are expanded (a "billion
laughs" file is a few hundred bytes whose aliases expand to 10^9 values, and a file of ten thousand ``[`` nests past
Python's recursion limit). Aliases themselves are allowed: they are YAML, and a small file may reuse a value.

Only plain YAML is read (PyYAML's safe loader: mappings, lists, strings, numbers, booleans, null; a date is read as
the text it is); a tag that would build a Python object (``!!python/object``), one of another program
(``!include``), or a value no setting takes (``!!binary``, ``!!set``) is refused by name.
A key given twice in one mapping is refused: YAML's loaders keep the last one silently.
"""

from dataclasses import dataclass, field
from pathlib import Path

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode

MAX_FILE_BYTES = 256 * 1024  # verl's whole Megatron config, every key written out, is ~40 KB
MAX_VALUE_CHARS = 64 * 1024  # a path, a name, a URL: far below this
MAX_DEPTH = 32  # the deepest setting (override_config.model_config.<field>.<key>) is 6 levels down
MAX_VALUES = 10_000  # values (mappings, lists and scalars) with aliases expanded: verl's whole config has ~1,500

MERGE_TAG = "tag:yaml.org,2002:merge"


class ConfigFileError(Exception):
    """One line: why the file cannot be read as a config."""


@dataclass
class YAMLDocument:
    """The file's values, and for error messages the line of each dotted key and each scalar's text as written."""

    tree: object = None
    lines: dict[str, int] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)


class _Refused(yaml.MarkedYAMLError):
    """Well-formed YAML this module does not read (past a limit, a tag, a value its tag cannot hold): reported
    without "malformed YAML"."""


def _tag_name(tag: str) -> str:
    return tag.replace("tag:yaml.org,2002:", "!!")


def _shown(text: str, chars: int = 40) -> str:
    return repr(text if len(text) <= chars else f"{text[:chars]}…")


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing nesting past MAX_DEPTH while it composes (its composer recurses once per level)
    and giving a bad value of a known tag (``!!int "x"``, a 5,000-digit integer) the line it is on."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self.depth = 0

    def compose_node(self, parent: Node | None, index: object) -> Node:
        if self.depth >= MAX_DEPTH:
            mark = self.peek_event().start_mark
            raise _Refused(problem=f"nested more than {MAX_DEPTH} levels deep", problem_mark=mark)
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_object(self, node: Node, deep: bool = False) -> object:
        try:
            return super().construct_object(node, deep)
        except yaml.YAMLError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as e:
            # int()'s own advice (sys.set_int_max_str_digits) is not the user's to take
            reason = "not one of its values" if isinstance(e, KeyError) else str(e).split(";")[0].strip()[:160]
            problem = f"cannot read {_shown(str(node.value))} as {_tag_name(node.tag)} ({reason or type(e).__name__})"
            raise _Refused(problem=problem, problem_mark=node.start_mark) from None


PLAIN = "a config is plain YAML (mappings, lists, strings, numbers, booleans, null)"


def _refuse_unknown_tag(loader: _BoundedLoader, node: Node) -> None:
    raise _Refused(problem=f"unknown tag {_tag_name(node.tag)!r}: {PLAIN}", problem_mark=node.start_mark)


def _refuse_tag(loader: _BoundedLoader, node: Node) -> None:
    """Bytes, sets and ordered pairs: YAML's, but no setting takes them (and OmegaConf holds none of them)."""
    raise _Refused(problem=f"tag {_tag_name(node.tag)!r} is not read: {PLAIN}", problem_mark=node.start_mark)


_BoundedLoader.add_constructor(None, _refuse_unknown_tag)
for _tag in ("binary", "set", "omap", "pairs"):
    _BoundedLoader.add_constructor(f"tag:yaml.org,2002:{_tag}", _refuse_tag)
# a date (`experiment_name: 2024-06-01`) is the text as written: every setting that takes one takes a string
_BoundedLoader.add_constructor("tag:yaml.org,2002:timestamp", yaml.SafeLoader.construct_scalar)


class _Walk:
    """One pass over the composed nodes, each shared (aliased) node once: its size and height with aliases expanded
    (memoised, so a bomb costs its few nodes, not its expansion), duplicate keys, over-long values, alias cycles;
    and the line of each key and the text of each scalar, for messages."""

    def __init__(self, path: Path):
        self.path, self.doc = path, YAMLDocument()
        self.sizes: dict[int, tuple[int, int]] = {}  # id(node) -> (values, height) with aliases expanded
        self.open: set[int] = set()

    def refuse(self, node: Node, what: str) -> ConfigFileError:
        return ConfigFileError(f"{self.path}:{node.start_mark.line + 1}: {what}")

    def visit(self, node: Node, depth: int, prefix: str) -> tuple[int, int]:
        if (done := self.sizes.get(id(node))) is not None:
            if depth + done[1] - 1 > MAX_DEPTH:
                raise self.refuse(node, f"nested more than {MAX_DEPTH} levels deep once its aliases are expanded")
            return done
        if id(node) in self.open:
            raise self.refuse(node, "an alias inside the value it names (a recursive alias); a config is a tree")
        if depth > MAX_DEPTH:
            raise self.refuse(node, f"nested more than {MAX_DEPTH} levels deep once its aliases are expanded")
        if isinstance(node, ScalarNode):
            if len(node.value) > MAX_VALUE_CHARS:
                raise self.refuse(node, f"a value of {len(node.value):,} characters (at most {MAX_VALUE_CHARS:,})")
            self.sizes[id(node)] = (1, 1)
            return 1, 1
        self.open.add(id(node))
        values, height = 1, 1
        children = self._mapping(node, prefix) if isinstance(node, MappingNode) else [(c, prefix) for c in node.value]
        for child, child_prefix in children:
            child_values, child_height = self.visit(child, depth + 1, child_prefix)
            values, height = values + child_values, max(height, child_height + 1)
            if values > MAX_VALUES:
                raise self.refuse(
                    node, f"more than {MAX_VALUES:,} values once its aliases are expanded (an alias bomb?)"
                )
        self.open.discard(id(node))
        self.sizes[id(node)] = (values, height)
        return values, height

    def _mapping(self, node: MappingNode, prefix: str) -> list[tuple[Node, str]]:
        """The mapping's keys and values to visit (with the dotted key of each value); refuses a key given twice."""
        first_line: dict[str, int] = {}
        children = []
        for key_node, value_node in node.value:
            key = f"{prefix}{key_node.value}" if isinstance(key_node, ScalarNode) else f"{prefix}?"
            line = key_node.start_mark.line + 1
            if isinstance(key_node, ScalarNode) and key_node.tag != MERGE_TAG:
                if key in first_line:
                    raise self.refuse(
                        key_node, f"duplicate key {key!r} (first on line {first_line[key]}); give each key once"
                    )
                first_line[key] = line
                self.doc.lines.setdefault(key, line)
                if isinstance(value_node, ScalarNode):
                    self.doc.texts.setdefault(key, value_node.value)
            children += [(key_node, prefix), (value_node, key + ".")]
        return children


def _read_text(path: Path) -> str:
    """The file as UTF-8 (what YAML is), at most MAX_FILE_BYTES; a file saved in another encoding (or not text at
    all) is named with the line of its first bad byte, not a UnicodeDecodeError."""
    if not path.is_file():
        raise ConfigFileError(f"{path}: {'not a file' if path.exists() else 'config file not found'}")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise ConfigFileError(f"{path}: cannot read the config file: {e.strerror or e}") from None
    if len(data) > MAX_FILE_BYTES:
        size = path.stat().st_size
        raise ConfigFileError(
            f"{path}: {size:,} bytes is too large for a config file (at most {MAX_FILE_BYTES:,}); is it the right file?"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigFileError(
            f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); save it as UTF-8"
        ) from None


def _one_line(path: Path, text: str, e: yaml.YAMLError) -> str:
    if isinstance(e, yaml.reader.ReaderError):  # a control character (NUL, ESC, ...): no mark, a two-line str
        line = text.count("\n", 0, e.position) + 1
        character = e.character if isinstance(e.character, int) else ord(e.character)
        return f"{path}:{line}: control character U+{character:04X} is not allowed in YAML (is it a text file?)"
    mark = getattr(e, "problem_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
    problem = (str(getattr(e, "problem", None) or e).splitlines() or [type(e).__name__])[0]
    if context := getattr(e, "context", None):  # "expected a single document in the stream", "while scanning ..."
        problem = f"{context}, {problem}"
    return f"{where}: {problem}" if isinstance(e, _Refused) else f"{where}: malformed YAML: {problem}"


def read_config_file(path: Path) -> YAMLDocument:
    """The file's YAML document, within this module's limits; ConfigFileError (one line) for anything else."""
    text = _read_text(path)
    try:
        loader = _BoundedLoader(text)  # its reader refuses control characters here
        try:
            node = loader.get_single_node()
            if node is None:  # an empty file (or only comments): the defaults
                return YAMLDocument(tree={})
            walk = _Walk(path)
            walk.visit(node, 1, "")
            walk.doc.tree = loader.construct_document(node)
            return walk.doc
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        raise ConfigFileError(_one_line(path, text, e)) from None
