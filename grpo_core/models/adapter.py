"""PEFT LoRA adapter directories: what ``grpo export --peft`` writes and what the registry versions for a LoRA run.

Read here (every read checks its files: records/adapter.py; and checked against a run's LoRA settings and its base
model's shapes) to start a run's adapters from one, and merged into their base as a plain Hugging Face model for
the engines that evaluate it. Written without peft, which is a
development dependency only: an adapter directory is two files, and merging is W + alpha/r B A per module.
"""

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from grpo_core.records.adapter import check_against_base, read_adapter_config, read_adapter_tensors, weight_shapes

if TYPE_CHECKING:  # torch is imported where tensors are read: the CLI's registry lookups stay light
    import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # peft's key prefix before the HF module name


class AdapterError(ValueError):
    """An adapter directory that cannot be used (missing files, another kind of adapter, another base): exit 2."""


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


@dataclass(frozen=True)
class Adapter:
    """One PEFT LoRA adapter: its rank, alpha, the base it names, and its tensors under peft's key names."""

    path: Path
    rank: int
    alpha: float
    base_model: str
    tensors: dict[str, "torch.Tensor"] = field(repr=False)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def pair(self, hf_weight: str) -> tuple["torch.Tensor", "torch.Tensor"] | None:
        """(A, B) of the HF weight ``hf_weight`` (``model.layers.0.self_attn.q_proj.weight``), None when not adapted."""
        key = PREFIX + hf_weight.removesuffix(".weight")
        if f"{key}.lora_A.weight" not in self.tensors:
            return None
        return self.tensors[f"{key}.lora_A.weight"], self.tensors[f"{key}.lora_B.weight"]

    def modules(self) -> set[str]:
        """The HF weights it adapts."""
        suffix = ".lora_A.weight"
        return {k.removeprefix(PREFIX).removesuffix(suffix) + ".weight" for k in self.tensors if k.endswith(suffix)}

    def check_base(self, base_dir: str | Path) -> None:
        """RecordError unless every module it adapts is a weight of the model in ``base_dir`` (a Hugging Face
        directory of safetensors) of the shape its A and B make."""
        shapes = {name: tuple(tensor.shape) for name, tensor in self.tensors.items()}
        check_against_base(self.path / ADAPTER_WEIGHTS, shapes, weight_shapes_of(base_dir), str(base_dir))


def read_adapter(path: str | Path, base_dir: str | Path | None = None) -> Adapter:
    """The adapter in ``path``, its config and tensors checked (records/adapter.py), and against the model in
    ``base_dir`` when given; AdapterError or RecordError (one line) when it cannot be used."""
    path = Path(path)
    if not is_adapter_dir(path):
        raise AdapterError(f"{path}: not a PEFT adapter directory (no {ADAPTER_CONFIG})")
    config = read_adapter_config(path / ADAPTER_CONFIG)
    if not (path / ADAPTER_WEIGHTS).is_file():
        raise AdapterError(f"{path}: no {ADAPTER_WEIGHTS}")
    tensors = read_adapter_tensors(path / ADAPTER_WEIGHTS, config.r)
    adapter = Adapter(path, config.r, config.lora_alpha, str(config.base_model_name_or_path), tensors)
    if base_dir is not None:
        adapter.check_base(base_dir)
    return adapter


def weight_shapes_of(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Every weight's shape in a Hugging Face directory's safetensors files, from their (checked) headers."""
    shapes = {}
    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        shapes |= weight_shapes(shard)
    return shapes


def settings_mismatch(adapter: Adapter, rank: int, alpha: float) -> str:
    """Empty when the adapter was trained with LoRA ``rank`` and ``alpha``; else what differs, in words."""
    if (adapter.rank, adapter.alpha) == (rank, float(alpha)):
        return ""
    theirs = f"rank {adapter.rank} and alpha {adapter.alpha:g}"
    return f"the adapter {adapter.path} has {theirs}, the run rank {rank} and alpha {alpha:g}"


def merge_into(weight: "torch.Tensor", a: "torch.Tensor", b: "torch.Tensor", scale: float) -> "torch.Tensor":
    """W + scale B A, computed in fp32 and returned in W's dtype (what peft's merge_and_unload gives); the actor's
    parameters merge the same way through models.lora.merged_weight, where each TP shard holds its own A or B."""
    return (weight.float() + scale * (b.float() @ a.float())).to(weight.dtype)


def merge_adapter(base_dir: str | Path, adapter: Adapter, out_dir: str | Path) -> Path:
    """The base model (a Hugging Face directory of safetensors) with ``adapter`` merged in, written to ``out_dir``
    (atomically: a directory renamed into place): the model every engine can load, tokenizer files included."""
    from safetensors.torch import load_file, save_file

    base_dir, out_dir = Path(base_dir), Path(out_dir)
    shards = sorted(base_dir.glob("*.safetensors"))
    if not shards:
        raise AdapterError(f"{base_dir}: the adapter's base has no safetensors weights to merge into")
    adapter.check_base(base_dir)  # every module it adapts, of the shape it makes: before anything is written
    partial = out_dir.with_name(f"{out_dir.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    left = adapter.modules()
    for shard in shards:
        tensors = load_file(str(shard))
        for name in left & tensors.keys():
            tensors[name] = merge_into(tensors[name], *adapter.pair(name), adapter.scale)
        left -= tensors.keys()
        save_file(tensors, str(partial / shard.name), metadata={"format": "pt"})
    for other in base_dir.iterdir():  # config, generation config, tokenizer, the shards' index
        if other.is_file() and other.suffix != ".safetensors":
            shutil.copy2(other, partial / other.name)
    shutil.rmtree(out_dir, ignore_errors=True)
    partial.rename(out_dir)
    return out_dir
