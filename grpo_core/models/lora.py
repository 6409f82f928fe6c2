"""LoRA adapters on megatron-core's parallel linears: W x + (alpha/rank) B A x, with W frozen.

Written here rather than taken from a library: peft wraps ``torch.nn.Linear`` (megatron's linears are not),
and megatron-bridge brings its own model providers. An adapter is a child ``lora`` (parameters ``A`` [r, in]
and ``B`` [out, r]) of the linear it adapts, and a forward hook adds its term to the linear's output, so the
base weight keeps its name (the HF mapping, checkpoints and the frozen-weight path of megatron's linears stay
as they are).

Tensor parallelism, as megatron's linears split their weight:

- column-parallel (``linear_qkv``, ``linear_fc1``; W split on its output rows): A is replicated and B split
  like W's rows. Every rank computes the same ``h = x A^T``; B's rows give this rank's output columns. ``h``'s
  gradient is summed over TP (``copy_to_tensor_model_parallel_region``), so A's gradient is whole on each rank.
  With sequence parallelism x is this rank's tokens: ``h`` is gathered over TP instead, and A's gradient
  (from this rank's tokens only) is summed over TP by ``finalize_model_grads`` (A is marked ``sequence_parallel``).
- row-parallel (``linear_proj``, ``linear_fc2``; W split on its input columns): A is split like W's columns
  and B replicated. ``h = x_local A_local^T`` is a partial sum, all-reduced over TP (reduce-scattered over the
  sequence with sequence parallelism, B then marked ``sequence_parallel``).

Either way a rank's merged shard is ``W_local + scale * B_local A_local`` (``merged_weight``): the rollout
engines get W + scale B A without any extra communication. Adapters are initialised from a generator seeded
by the layer's global name, whole, then sliced: every layout starts from the same adapters.
"""

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

from grpo_core.models.lora_settings import INIT_METHODS, LINEARS, LoRASettings


class LoRA(torch.nn.Module):
    """One linear's adapter: this rank's A [r, in] and B [out, r], and how they meet megatron's TP split."""

    def __init__(self, linear: torch.nn.Module, settings: LoRASettings, name: str):
        super().__init__()
        weight = linear.weight
        self.column = isinstance(linear, ColumnParallelLinear)
        self.group = linear.tp_group
        self.tp = torch.distributed.get_world_size(self.group) if self.group is not None else 1
        self.tp_rank = torch.distributed.get_rank(self.group) if self.group is not None else 0
        self.sequence_parallel = bool(linear.sequence_parallel) and self.tp > 1
        self.expert_comm = bool(getattr(linear, "explicit_expert_comm", False))
        if self.expert_comm and self.tp > 1:
            raise NotImplementedError(f"{name}: LoRA on experts split over expert tensor parallelism")
        self.scale, self.enabled = settings.scale, True
        self.dropout = torch.nn.Dropout(settings.dropout) if settings.dropout else None
        out_local, in_local = weight.shape
        out_full, in_full = (out_local * self.tp, in_local) if self.column else (out_local, in_local * self.tp)
        g = torch.Generator().manual_seed(settings.seed * 1_000_003 + _stable_hash(name))
        a = _init((settings.rank, in_full), settings.a_init, g)
        b = _init((out_full, settings.rank), settings.b_init, g)
        if self.column and name.endswith("linear_fc1") and linear.config.gated_linear_unit:
            # B's rows as [gate; up] whole; each rank's W rows are [its gate rows; its up rows]
            b = torch.cat([half.chunk(self.tp, 0)[self.tp_rank] for half in b.chunk(2, 0)])
        elif self.column:  # B's rows as W's rows (QKV: interleaved by query group at every TP alike)
            b = b.chunk(self.tp, 0)[self.tp_rank]
        else:  # A's columns as W's columns
            a = a.chunk(self.tp, 1)[self.tp_rank]
        kw = dict(dtype=weight.dtype, device=weight.device)
        self.A = torch.nn.Parameter(a.to(**kw).contiguous())
        self.B = torch.nn.Parameter(b.to(**kw).contiguous())
        split, replicated = (self.B, self.A) if self.column else (self.A, self.B)
        # the split one counts on every TP rank in the gradient norm, the replicated one once (megatron's attributes)
        tensor_parallel.set_tensor_model_parallel_attributes(split, self.tp > 1, 0 if self.column else 1, 1)
        replicated.sequence_parallel = self.sequence_parallel  # its gradient is summed over TP (tokens split)
        for p in (self.A, self.B):  # experts' gradients are reduced over the expert-data-parallel group
            p.allreduce = getattr(weight, "allreduce", True)

    def forward(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The linear's output ``out`` plus the adapter's term, the sum written by B's product itself (``addmm``):
        a separate scale and add passed over the [tokens, out] output three more times."""
        if self.dropout is not None:
            if self.column or self.tp == 1:
                x = self.dropout(x)  # the default generator: the same mask on every TP rank (replicated x)
            else:
                with tensor_parallel.get_cuda_rng_tracker().fork():  # this rank's input columns: its own mask
                    x = self.dropout(x)
        h = torch.matmul(x, self.A.t())
        if self.tp > 1 and not self.expert_comm:
            if self.column:
                h = (
                    gather_from_sequence_parallel_region(h, group=self.group)
                    if self.sequence_parallel
                    else copy_to_tensor_model_parallel_region(h, group=self.group)
                )
            else:
                h = (
                    reduce_scatter_to_sequence_parallel_region(h, group=self.group)
                    if self.sequence_parallel
                    else reduce_from_tensor_model_parallel_region(h, group=self.group)
                )
        h = h.to(out.dtype).reshape(-1, h.shape[-1])
        return torch.addmm(out.reshape(-1, out.shape[-1]), h, self.B.t().to(out.dtype), alpha=self.scale).view_as(out)

    def delta(self) -> torch.Tensor:
        """scale * B A for this rank's shard of W, computed in fp32."""
        return (self.B.detach().float() @ self.A.detach().float()) * self.scale


def _stable_hash(name: str) -> int:
    """A hash of ``name`` that is the same in every process (``hash`` is salted per process)."""
    return int.from_bytes(name.encode()[-16:].rjust(16, b"\0"), "big") % 1_000_000_007


def _init(shape: tuple[int, int], method: str, g: torch.Generator) -> torch.Tensor:
    """fp32 init: xavier (normal, gain 1), kaiming (uniform, a=sqrt(5), as torch's and peft's linears) or zero."""
    fan_out, fan_in = shape
    if method == "zero":
        return torch.zeros(shape)
    if method == "xavier":
        return torch.randn(shape, generator=g) * math.sqrt(2.0 / (fan_in + fan_out))
    if method == "kaiming":
        bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5)): sqrt(6 / ((1 + 5) fan_in))
        return (torch.rand(shape, generator=g) * 2 - 1) * bound
    raise ValueError(f"LoRA init method {method!r}: choose one of {list(INIT_METHODS)}")


def _add_adapter_term(module: torch.nn.Module, args: tuple, kwargs: dict, output):
    lora = module.lora
    if not lora.enabled:
        return output
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return lora(x, out), bias


def global_linear_names(chunk: torch.nn.Module) -> Iterator[tuple[str, str, torch.nn.Module]]:
    """(local module name, global name, module) of each layer linear of a GPTModel chunk: the global name has
    the layer's index in the whole model (PP/VP offsets added) and, for experts, the global expert index."""
    layers = chunk.decoder.layers if hasattr(chunk, "decoder") else []
    ep_rank = ps.get_expert_model_parallel_rank()
    for i, layer in enumerate(layers):
        for name, module in layer.named_modules():
            linear = isinstance(module, ColumnParallelLinear | RowParallelLinear)
            if not linear or name.rsplit(".", 1)[-1] not in LINEARS:
                continue
            parts = name.split(".")
            if "local_experts" in parts:
                k = parts.index("local_experts") + 1
                local = len(layer.mlp.experts.local_experts)
                parts[k] = str(ep_rank * local + int(parts[k]))
            yield f"decoder.layers.{i}.{name}", f"decoder.layers.{layer.layer_number - 1}.{'.'.join(parts)}", module


def apply_lora(chunk: torch.nn.Module, settings: LoRASettings) -> int:
    """Freeze every weight of ``chunk`` and add adapters to the linears ``settings`` selects (before DDP and the
    optimizer are built: they then see only the adapters). Returns how many linears got one."""
    chunk.requires_grad_(False)
    count = 0
    for _, global_name, module in global_linear_names(chunk):
        if not settings.selects(global_name):
            continue
        if module.weight is None:
            raise NotImplementedError(f"{global_name}: LoRA needs the linear's own weight")
        module.lora = LoRA(module, settings, global_name)
        module.weight.lora = module.lora  # for merged_weight (export and sync)
        module.register_forward_hook(_add_adapter_term, with_kwargs=True)
        module.sharded_state_dict = _sharded_state_dict_with_adapters(module, module.sharded_state_dict)
        count += 1
    if count == 0:
        raise ValueError(f"LoRA: no linear matches target_modules={list(settings.target_modules)}")
    return count


def _sharded_state_dict_with_adapters(module: torch.nn.Module, base_fn):
    """The linear's ``sharded_state_dict`` with its adapter's tensors split over TP as the adapter is (megatron's
    own treats every tensor but weight and bias as replicated)."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    def sharded_state_dict(prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        state = base_fn(prefix, sharded_offsets, metadata)
        own = {k: v for k, v in module.state_dict(prefix="", keep_vars=True).items() if k.startswith("lora.")}
        axis = {"lora.B": 0} if module.lora.column else {"lora.A": 1}
        state.update(
            make_sharded_tensors_for_checkpoint(
                own,
                prefix,
                axis,
                sharded_offsets,
                tp_group=module.tp_group,
                dp_cp_group=(metadata or {}).get("dp_cp_group")
                or ps.get_data_parallel_group(with_context_parallel=True),
            )
        )
        if prefix.endswith("linear_fc1.") and module.lora.column and module.lora.tp > 1:
            from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

            key = f"{prefix}lora.B"  # [gate shard; up shard] on each rank, as the weight
            state[key] = apply_swiglu_sharded_factory(state[key], sharded_offsets)
        return state

    return sharded_state_dict


def adapters(model: torch.nn.Module | Sequence[torch.nn.Module]) -> list[LoRA]:
    chunks = list(model) if isinstance(model, Sequence) else [model]
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, LoRA)]


def has_adapters(model) -> bool:
    return bool(adapters(model))


@contextmanager
def adapters_disabled(model) -> Iterator[None]:
    """The base model: every adapter of ``model`` off inside the block (the reference policy with LoRA)."""
    found = adapters(model)
    for a in found:
        a.enabled = False
    try:
        yield
    finally:
        for a in found:
            a.enabled = True


def merged_weight(param: torch.Tensor) -> torch.Tensor:
    """``param`` (detached) with its adapter's scale * B A added, in its dtype: what an engine must hold."""
    lora = getattr(param, "lora", None)
    if lora is None or not lora.enabled:
        return param.detach()
    return (param.detach().float() + lora.delta()).to(param.dtype)


def is_adapter_param(name: str) -> bool:
    return ".lora." in name
