"""Which Hugging Face tensors each megatron-core parameter is made of, and how it is sharded.

A megatron parameter is one of five kinds of shard of its HF tensors:

- ``none``: replicated (norms, the MoE router);
- ``row``: split along dim 1 over TP (``o_proj``, ``down_proj``: megatron's row-parallel linears);
- ``vocab``: split along dim 0 over TP, the vocabulary padded to a multiple of TP with zero rows;
- ``qkv`` / ``gate_up``: several HF tensors fused along dim 0, then split along dim 0 over TP.

For the fused kinds, ``fused_pieces`` lists which rows of which HF tensor follow each other when the
TP shards are laid end to end. QKV is interleaved per query group ([q heads of group g, k_g, v_g]
for each g), so a contiguous TP split hands each rank whole groups when TP divides the KV heads.
When TP is a multiple of them, megatron still splits those rows evenly, so a rank's rows cut through
a group (e.g. 8 heads, 2 KV heads, TP=4: rank 1 holds q head 3, k_0 and v_0); its ``SelfAttention``
all-gathers the QKV output and takes its group's KV head from there. The weights hold no replica, so
loading and exporting need nothing more than the row ranges. SwiGLU's fc1 is
[gate shard; up shard] on every rank, so the pieces alternate gate/up once per TP rank. Loading a
shard intersects its row range with the pieces; exporting gathers the shards and cuts them apart.

Everything here is plain tensor bookkeeping; process groups live in bridge.py.
"""

import contextlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from grpo_core.models.shape import ModelShape

# megatron parameter name (inside decoder.layers.{i}.) -> (HF names inside model.layers.{L}., kind).
# Where the TE spec fuses a norm into the next linear, both names are listed. {e}: global expert index.
LAYER_TABLE: list[tuple[str, tuple[str, ...], str]] = [
    (r"input_layernorm\.weight", ("input_layernorm.weight",), "none"),
    (r"self_attention\.linear_qkv\.layer_norm_weight", ("input_layernorm.weight",), "none"),
    (
        r"self_attention\.linear_qkv\.weight",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "qkv",
    ),
    (
        r"self_attention\.linear_qkv\.bias",
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
        "qkv",
    ),
    (r"self_attention\.linear_proj\.weight", ("self_attn.o_proj.weight",), "row"),
    (r"self_attention\.q_layernorm\.weight", ("self_attn.q_norm.weight",), "none"),
    (r"self_attention\.k_layernorm\.weight", ("self_attn.k_norm.weight",), "none"),
    (r"pre_mlp_layernorm\.weight", ("post_attention_layernorm.weight",), "none"),
    (r"mlp\.linear_fc1\.layer_norm_weight", ("post_attention_layernorm.weight",), "none"),
    (r"mlp\.linear_fc1\.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "gate_up"),
    (r"mlp\.linear_fc2\.weight", ("mlp.down_proj.weight",), "row"),
    (r"mlp\.router\.weight", ("mlp.gate.weight",), "none"),
    (
        r"mlp\.experts\.local_experts\.(\d+)\.linear_fc1\.weight",
        ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
        "gate_up",
    ),
    (r"mlp\.experts\.local_experts\.(\d+)\.linear_fc2\.weight", ("mlp.experts.{e}.down_proj.weight",), "row"),
]

# Parameters outside the layers: megatron name -> (HF name, kind).
GLOBAL_TABLE: dict[str, tuple[str, str]] = {
    "embedding.word_embeddings.weight": ("model.embed_tokens.weight", "vocab"),
    "decoder.final_layernorm.weight": ("model.norm.weight", "none"),
    "output_layer.weight": ("lm_head.weight", "vocab"),
}

_LAYER_NAME = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


@dataclass(frozen=True)
class Mapping:
    """One megatron parameter and the HF tensors it is made of."""

    param: str  # name in model.named_parameters()
    hf: tuple[str, ...]
    kind: str  # none | row | vocab | qkv | gate_up
    expert: bool  # sharded over the expert-TP group instead of TP
    order: tuple[int, str]  # (unit, global name): the same on every rank, used to order exports
    export: bool = True  # False for the last pipeline stage's copy of tied embeddings


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of HF tensor ``name``."""

    name: str
    start: int
    stop: int


def layer_mappings(model: torch.nn.Module, shape: ModelShape, ep_rank: int, ep_size: int) -> list[Mapping]:
    """Every parameter of ``model`` (one GPTModel chunk) with its HF source; raises on a parameter we cannot map."""
    layers = model.decoder.layers if hasattr(model, "decoder") else []
    local_experts = shape.num_experts // ep_size if shape.is_moe else 0
    mappings = []
    for name, _ in model.named_parameters():
        if ".lora." in name:  # LoRA adapters (models/lora.py): merged into their linear's weight on export
            continue
        if name in GLOBAL_TABLE:
            mappings.append(_global_mapping(name, shape))
            continue
        match = _LAYER_NAME.fullmatch(name)
        if match is None:
            raise KeyError(f"no Hugging Face tensor is known for megatron parameter {name!r}")
        layer = layers[int(match.group(1))].layer_number - 1  # global index: megatron adds the PP/VP offset
        mappings.append(_layer_mapping(name, match.group(2), layer, ep_rank * local_experts))
    return mappings


def _global_mapping(name: str, shape: ModelShape) -> Mapping:
    hf, kind = GLOBAL_TABLE[name]
    unit = {"embedding": -1, "decoder": shape.num_layers, "output_layer": shape.num_layers + 1}[name.split(".")[0]]
    tied_copy = name == "output_layer.weight" and shape.tie_embeddings
    if tied_copy:  # the last stage's copy of the embedding when PP splits them
        hf = "model.embed_tokens.weight"
    return Mapping(name, (hf,), kind, expert=False, order=(unit, name), export=not tied_copy)


def _layer_mapping(name: str, local_name: str, layer: int, expert_offset: int) -> Mapping:
    for pattern, hf, kind in LAYER_TABLE:
        match = re.fullmatch(pattern, local_name)
        if match is None:
            continue
        expert = bool(match.groups())
        e = expert_offset + int(match.group(1)) if expert else None
        hf_names = tuple(f"model.layers.{layer}." + h.format(e=e) for h in hf)
        if expert:  # name experts by their global index, the same on every EP rank
            local_name = local_name[: match.start(1)] + str(e) + local_name[match.end(1) :]
        global_name = f"decoder.layers.{layer}.{local_name}"
        return Mapping(name, hf_names, kind, expert=expert, order=(layer, global_name))
    raise KeyError(f"no Hugging Face tensor is known for megatron parameter {name!r}")


# ---------------------------------------------------------------- shapes and fused layouts


def fused_pieces(m: Mapping, shape: ModelShape, rows: int, tp: int) -> list[Piece]:
    """The HF row blocks, in order, of all TP shards of a fused parameter laid end to end (``rows`` in total)."""
    if m.kind == "qkv":
        q, k, v = m.hf
        d, groups = shape.head_dim, shape.num_kv_heads
        per_group = shape.num_attention_heads // groups * d
        pieces = []
        for g in range(groups):
            pieces += [
                Piece(q, g * per_group, (g + 1) * per_group),
                Piece(k, g * d, (g + 1) * d),
                Piece(v, g * d, (g + 1) * d),
            ]
        return pieces
    if m.kind == "gate_up":
        gate, up = m.hf
        f = rows // 2 // tp  # rows of gate (and of up) per rank
        return [Piece(name, r * f, (r + 1) * f) for r in range(tp) for name in (gate, up)]
    raise ValueError(f"{m.param}: kind {m.kind!r} is not fused")


def hf_shapes(m: Mapping, local_shape: torch.Size, tp: int, shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """The full HF shape of each tensor ``m`` is made of, given this rank's parameter shape."""
    rows, rest = local_shape[0], tuple(local_shape[1:])
    if m.kind == "none":
        return {m.hf[0]: tuple(local_shape)}
    if m.kind == "row":
        return {m.hf[0]: (rows, rest[0] * tp)}
    if m.kind == "vocab":
        return {m.hf[0]: (shape.vocab_size, *rest)}
    if m.kind == "gate_up":
        return {name: (rows * tp // 2, *rest) for name in m.hf}
    q_rows, kv_rows = shape.num_attention_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    return dict(zip(m.hf, [(q_rows, *rest), (kv_rows, *rest), (kv_rows, *rest)], strict=True))


def shard_rows(pieces: list[Piece], start: int, stop: int) -> list[Piece]:
    """The parts of ``pieces`` that fall in rows [start, stop) of their concatenation."""
    out, offset = [], 0
    for p in pieces:
        lo, hi = max(start, offset), min(stop, offset + p.stop - p.start)
        if lo < hi:
            out.append(Piece(p.name, p.start + lo - offset, p.start + hi - offset))
        offset += p.stop - p.start
    return out


def cut_pieces(full: torch.Tensor, pieces: list[Piece]) -> dict[str, torch.Tensor]:
    """Inverse of laying ``pieces`` end to end: rebuild each HF tensor from the rows of ``full``."""
    parts: dict[str, list[torch.Tensor]] = {}
    offset = 0
    for p in pieces:
        n = p.stop - p.start
        parts.setdefault(p.name, []).append(full[offset : offset + n])
        offset += n
    return {name: torch.cat(chunks) for name, chunks in parts.items()}


# ---------------------------------------------------------------- reading a checkpoint shard by shard


class HFCheckpoint:
    """A Hugging Face safetensors checkpoint (one file or sharded with an index), read slice by slice."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        index = self.dir / "model.safetensors.index.json"
        single = self.dir / "model.safetensors"
        if index.is_file():
            self.files = {name: self.dir / f for name, f in json.loads(index.read_text())["weight_map"].items()}
        elif single.is_file():
            with safe_open(single, framework="pt") as f:
                self.files = dict.fromkeys(f.keys(), single)
        else:
            raise FileNotFoundError(f"{self.dir}: no model.safetensors or model.safetensors.index.json")
        self._open: dict[Path, object] = {}
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "HFCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _slice(self, name: str):
        if name not in self.files:
            raise KeyError(f"{self.dir}: the checkpoint has no tensor {name!r}")
        path = self.files[name]
        if path not in self._open:
            self._open[path] = self._stack.enter_context(safe_open(path, framework="pt"))
        return self._open[path].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._slice(name)[start:stop]

    def cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._slice(name)[:, start:stop]

    def full(self, name: str) -> torch.Tensor:
        return self._slice(name)[:]


def read_shard(
    ckpt: HFCheckpoint, m: Mapping, local_shape: torch.Size, tp_rank: int, tp: int, shape: ModelShape
) -> torch.Tensor:
    """This rank's shard of parameter ``m``, reading only the rows/columns it holds."""
    for name, want in hf_shapes(m, local_shape, tp, shape).items():
        have = ckpt.shape(name)
        if have != want:
            raise ValueError(f"{name}: shape {have} in the checkpoint, megatron's {m.param} needs {want}")
    rows = local_shape[0]
    if m.kind == "none":
        return ckpt.full(m.hf[0])
    if m.kind == "row":
        cols = local_shape[1]
        return ckpt.cols(m.hf[0], tp_rank * cols, (tp_rank + 1) * cols)
    if m.kind == "vocab":
        start = tp_rank * rows
        stop = min(start + rows, shape.vocab_size)
        real = ckpt.rows(m.hf[0], start, stop) if stop > start else None
        pad = torch.zeros(rows - max(stop - start, 0), *local_shape[1:], dtype=real.dtype if real is not None else None)
        return pad if real is None else torch.cat([real, pad])
    pieces = shard_rows(fused_pieces(m, shape, rows * tp, tp), tp_rank * rows, (tp_rank + 1) * rows)
    return torch.cat([ckpt.rows(p.name, p.start, p.stop) for p in pieces])


def split_full(m: Mapping, full: torch.Tensor, tp: int, shape: ModelShape) -> dict[str, torch.Tensor]:
    """HF tensors from the TP shards of ``m`` laid end to end (along dim 1 for ``row``, else dim 0)."""
    if m.kind in ("none", "row"):
        return {m.hf[0]: full}
    if m.kind == "vocab":
        return {m.hf[0]: full[: shape.vocab_size]}
    return cut_pieces(full, fused_pieces(m, shape, full.shape[0], tp))


# ---------------------------------------------------------------- writing one safetensors file, tensor by tensor

_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


class SafetensorsWriter:
    """Streams tensors into one .safetensors file in a planned order, holding one tensor at a time.

    The header (names, dtypes, shapes, byte offsets) is written first from ``plan``; then each
    ``write`` appends the next planned tensor's bytes. ``safetensors`` only asks that the offsets
    tile the data area, so the order of tensors in the file is ours to choose.
    """

    def __init__(self, path: Path, plan: list[tuple[str, tuple[int, ...], torch.dtype]]):
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape, dtype in plan:
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
        self._file = open(path, "wb")  # noqa: SIM115  (closed in close())
        self._file.write(len(blob).to_bytes(8, "little") + blob)
        self._plan = list(plan)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want = self._plan[self._next]
        got = (name, tuple(tensor.shape), tensor.dtype)
        if got != (want[0], tuple(want[1]), want[2]):
            raise RuntimeError(f"export out of order: planned {want}, got {got}")
        self._file.write(tensor.detach().cpu().contiguous().view(torch.uint8).numpy())
        self._next += 1

    def close(self) -> None:
        self._file.close()
        if self._next != len(self._plan):
            raise RuntimeError(f"export wrote {self._next} of {len(self._plan)} planned tensors")
