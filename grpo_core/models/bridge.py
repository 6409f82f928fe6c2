"""Hugging Face <-> megatron-core: the TransformerConfig, the GPTModel, and weights in and out.

Covers Llama (and Mistral without its sliding window), Qwen2 (QKV bias), Qwen3 (QK norm) and
Qwen3-MoE (top-k softmax router with renormalised probabilities, SwiGLU experts, no shared expert).
Which HF tensor becomes which megatron parameter, and how each is sharded, is in weights.py.

Loading reads only this rank's slices of the safetensors files. Exporting gathers each parameter
over TP, and one rank per shard sends the HF tensors to global rank 0, which streams them into one
``model.safetensors``: rank 0 holds one HF tensor at a time, every other rank one TP-gathered
parameter at a time (the largest is the embedding: vocab x hidden).
"""

import contextlib
import dataclasses
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig

from grpo_core.atomic import write_text_atomic
from grpo_core.models import context_parallel
from grpo_core.models.fused import fusion_flags
from grpo_core.models.lora import global_linear_names as lora_linears
from grpo_core.models.lora import merged_weight
from grpo_core.models.shape import ModelShape
from grpo_core.models.spec import final_norm, gpt_layer_spec
from grpo_core.models.weights import (
    HFCheckpoint,
    Mapping,
    SafetensorsWriter,
    hf_shapes,
    layer_mappings,
    read_shard,
    split_full,
)

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
RECOMPUTE = {
    None: {},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "selective": {"recompute_granularity": "selective"},
}


def transformer_config(
    shape: ModelShape,
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    sequence_parallel: bool = False,
    dtype: str = "float32",
    recompute: str | None = None,
    overrides: dict | None = None,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> TransformerConfig:
    """megatron's config for ``shape``; ``overrides`` (any TransformerConfig field) win over what is derived here."""
    if shape.qkv_bias and shape.model_type != "qwen2":
        raise NotImplementedError(
            f"{shape.model_type} with attention_bias also biases o_proj; only Qwen2's QKV bias is mapped"
        )
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r}: choose one of {list(RECOMPUTE)}")
    torch_dtype = DTYPES[dtype]
    overrides = dict(overrides or {})
    kwargs = dict(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=shape.norm_eps,
        gated_linear_unit=True,  # SwiGLU: fc1 is [gate; up], silu(gate) * up
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        sequence_parallel=sequence_parallel and tp > 1,
        params_dtype=torch_dtype,
        pipeline_dtype=torch_dtype,
        bf16=torch_dtype == torch.bfloat16,
        fp16=torch_dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        num_layers_in_first_pipeline_stage=first_stage_layers,
        num_layers_in_last_pipeline_stage=last_stage_layers,
        **RECOMPUTE[recompute],
    )
    if shape.is_moe:
        kwargs.update(
            num_moe_experts=shape.num_experts,
            moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
            moe_router_topk=shape.experts_per_token,
            moe_router_score_function="softmax",
            moe_router_pre_softmax=False,  # softmax over the top-k logits = HF's renormalised top-k probs
            moe_grouped_gemm=False,  # grouped GEMM needs TE or the grouped_gemm package
            # alltoall is the fast one on GPUs; on CPU its split sizes stay tensors, which gloo refuses
            moe_token_dispatcher_type="alltoall" if torch.cuda.is_available() else "allgather",
            moe_router_load_balancing_type="none",  # no aux loss: the forward stays exactly HF's
            moe_aux_loss_coeff=0.0,
        )
    kwargs.update(fusion_flags(overrides, torch_dtype))  # kernels in place of TE/Apex's (models/fused.py)
    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise TypeError(f"TransformerConfig has no field(s) {unknown}")
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """megatron splits the vocabulary evenly over TP; the extra rows are zeros and are dropped on export.

    When padding happens (vocab_size % tp != 0) the logits have extra columns the caller must ignore.
    """
    return -(-vocab_size // tp) * tp


def build_model(
    shape: ModelShape,
    config: TransformerConfig,
    *,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    vp_stage: int | None = None,
    use_te: bool | None = None,
) -> GPTModel:
    """This pipeline stage's (or virtual stage's) GPTModel with our layer spec and HF's rotary base."""
    if pre_process is None:
        pre_process = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if post_process is None:
        post_process = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    layer = gpt_layer_spec(shape, use_te)
    block = TransformerBlockSubmodules(
        layer_specs=[layer] * get_num_layers_to_build(config, vp_stage=vp_stage), layer_norm=final_norm(use_te)
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=padded_vocab_size(shape.vocab_size, config.tensor_model_parallel_size),
        max_sequence_length=shape.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=shape.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=shape.rope_theta,
        rope_scaling=shape.rope_scaling_factor is not None,
        rope_scaling_factor=shape.rope_scaling_factor or 8.0,
        vp_stage=vp_stage,
    )
    if config.context_parallel_size > 1:
        context_parallel.cut_rotary(model.rotary_pos_emb)
    if post_process and not config.sequence_parallel:
        batch_first_logits(model.output_layer)
    return model


def batch_first_logits(output_layer: torch.nn.Module) -> None:
    """Make the output layer write its logits batch-first, [b, s, vocab], returned as the [s, b, vocab] view
    GPTModel expects. GPTModel then transposes them back to [b, s, vocab] with ``.contiguous()``, which no longer
    copies: at 152k columns that copy and its backward moved ~10 GB per 8k-token micro-batch, where transposing
    the hidden states instead moves 2% of it. Not with sequence parallelism, whose all-gather is along dim 0.
    Inside ``logits_at`` it computes the logits of the positions given only."""
    forward = output_layer.forward
    output_layer.logit_positions = None

    def batch_first(hidden: torch.Tensor, *args, **kwargs):
        if output_layer.logit_positions is not None:
            hidden = hidden.index_select(0, output_layer.logit_positions)
        logits, bias = forward(hidden.transpose(0, 1).contiguous(), *args, **kwargs)
        return logits.transpose(0, 1), bias

    output_layer.forward = batch_first


@contextlib.contextmanager
def logits_at(model: torch.nn.Module, positions: torch.Tensor | None):
    """Within it, ``model``'s output layer (on its last pipeline stage; none elsewhere) computes the logits of the
    sequence ``positions`` only, [b, len(positions), vocab] (None: every position's): a packed micro-batch needs
    them where a response token is predicted, about half its tokens in a GSM8K rollout, so the lm-head's three
    products and the log-prob passes over the vocabulary do half the work. Not with sequence parallelism (each
    rank holds a slice of the sequence), where the output layer has no ``logit_positions``: the caller checks."""
    while hasattr(model, "module"):  # DDP, Float16Module
        model = model.module
    layer = getattr(model, "output_layer", None) if getattr(model, "post_process", False) else None
    if layer is None or positions is None:
        yield
        return
    layer.logit_positions = positions
    try:
        yield
    finally:
        layer.logit_positions = None


# ---------------------------------------------------------------- weights


def load_hf_weights(model: GPTModel | Sequence[GPTModel], hf_dir: str | Path, shape: ModelShape) -> None:
    """Copy HF weights into this rank's parameters, reading only its TP slices, PP layers and EP experts.

    Call it before the optimizer is built: megatron's optimizer keeps its own fp32 copy of the weights.
    """
    with HFCheckpoint(hf_dir) as ckpt:
        for chunk in _chunks(model):
            params = dict(chunk.named_parameters())
            for m in _mappings(chunk, shape):
                param = params[m.param]
                rank, size, _ = _shard_group(m)
                shard = read_shard(ckpt, m, param.shape, rank, size, shape)
                if shard.shape != param.shape:
                    raise ValueError(
                        f"{m.param}: built {tuple(shard.shape)} from {m.hf}, parameter is {tuple(param.shape)}"
                    )
                with torch.no_grad():
                    param.copy_(shard)


def gather_hf_weights(
    model: GPTModel | Sequence[GPTModel],
    shape: ModelShape,
    dtype: str | torch.dtype | None = None,
    dst: int | None = None,
) -> tuple[list[tuple[str, tuple[int, ...], torch.dtype]], Iterator[tuple[str, torch.Tensor]]]:
    """The model as full HF-named tensors: ``(plan, tensors)``, the same plan on every rank.

    Every rank of the model must call it and exhaust ``tensors``. Each parameter is gathered over its
    TP group by the first data-parallel replica, then sent from that replica's TP rank 0 to ``dst``
    (or broadcast to every rank when ``dst`` is None, for rollout engines on every rank). ``tensors``
    yields on the receiving rank(s) only, one tensor at a time, in plan order: no rank ever holds more
    than one gathered parameter, so a consumer that loads in buckets never holds two full models.
    ``dtype``: the tensors' dtype (default: the parameters').
    """
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    items = [(m, p) for chunk in _chunks(model) for m, p in _export_items(chunk, shape)]
    rank = dist.get_rank()
    mine = []  # (order, [(hf name, shape, dtype)], source rank) of the mappings this rank's TP group exports
    for m, p in items:
        tp_rank, size, _ = _shard_group(m)
        if tp_rank == 0:
            names = [(n, s, dtype or p.dtype) for n, s in hf_shapes(m, p.shape, size, shape).items()]
            mine.append((m.order, names, rank))
    everyone: list[list] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, mine)
    units = sorted((u for part in everyone for u in part), key=lambda u: u[0])
    plan = [entry for _, names, _ in units for entry in names]
    if len({name for name, _, _ in plan}) != len(plan):
        raise RuntimeError("two ranks planned the same HF tensor")
    return plan, _stream(units, dict((m.order, (m, p)) for m, p in items), shape, dtype, dst)


def _stream(units: list, items: dict, shape: ModelShape, dtype: torch.dtype | None, dst: int | None):
    rank = dist.get_rank()
    device = next(p for _, p in items.values()).device if items else torch.device("cpu")
    for order, names, src in units:
        tensors = {}
        if order in items:  # this rank's TP group holds it: gather (a collective of that group)
            m, p = items[order]
            tensors = _full(m, p, shape)
        for name, hf_shape, dt in names:
            if dst is None:
                t = tensors[name].to(dt) if rank == src else torch.empty(hf_shape, dtype=dt, device=device)
                dist.broadcast(t, src=src)
                yield name, t
            elif rank == dst:
                if src == dst:
                    yield name, tensors[name].to(dt)
                else:
                    t = torch.empty(hf_shape, dtype=dt, device=device)
                    dist.recv(t, src=src)
                    yield name, t
            elif rank == src:
                dist.send(tensors[name].to(dt).contiguous(), dst=dst)


def _full(m: Mapping, p: torch.nn.Parameter, shape: ModelShape) -> dict[str, torch.Tensor]:
    """The HF tensors of one parameter, gathered over its TP group (on that group's rank 0 only)."""
    rank, size, group = _shard_group(m)
    full = merged_weight(p)  # W + scale * B A of this shard where a LoRA adapter is on it (models/lora.py)
    if size > 1 and m.kind != "none":
        shards = [torch.empty_like(full) for _ in range(size)]
        dist.all_gather(shards, full.contiguous(), group=group)
        full = torch.cat(shards, dim=1 if m.kind == "row" else 0)
    return split_full(m, full, size, shape) if rank == 0 else {}


def export_hf_weights(
    model: GPTModel | Sequence[GPTModel],
    shape: ModelShape,
    out_dir: str | Path,
    hf_config: dict,
    dtype: str | torch.dtype | None = None,
) -> None:
    """Write ``model.safetensors`` and ``config.json`` (``hf_config`` as given) into ``out_dir`` from rank 0.

    Every rank of the model must call it. Files appear atomically (temp file, then ``os.replace``);
    all ranks return once they are in place. ``dtype``: the tensors' dtype in the file (default: the parameters').
    """
    out_dir = Path(out_dir)
    plan, tensors = gather_hf_weights(model, shape, dtype, dst=0)
    if dist.get_rank() == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / f".model.safetensors.tmp-{os.getpid()}"
        writer = SafetensorsWriter(tmp, plan)
        try:
            for name, tensor in tensors:
                writer.write(name, tensor)
        finally:
            writer.close()
        os.replace(tmp, out_dir / "model.safetensors")
        tmp_config = out_dir / f".config.json.tmp-{os.getpid()}"
        tmp_config.write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
        os.replace(tmp_config, out_dir / "config.json")
    else:
        for _ in tensors:
            pass
    dist.barrier()


def peft_adapter_tensors(model: GPTModel | Sequence[GPTModel], shape: ModelShape) -> dict[str, torch.Tensor]:
    """The LoRA adapters under peft's key names (``base_model.model.<HF module>.lora_A.weight``), whole, on global
    rank 0 (empty elsewhere); every rank of the model calls it. A fused linear's adapter is one adapter per HF
    module it fuses: the same A for each, B's rows cut apart as the weight's are (q/k/v, gate/up)."""
    local: dict[str, torch.Tensor] = {}
    dp_rank, expert_dp_rank = ps.get_data_parallel_rank(with_context_parallel=True), ps.get_expert_data_parallel_rank()
    for chunk in _chunks(model):
        mappings = {m.param: m for m in _mappings(chunk, shape)}
        for local_name, _, module in lora_linears(chunk):
            adapter = getattr(module, "lora", None)
            m = mappings[f"{local_name}.weight"]
            if adapter is None or (expert_dp_rank if m.expert else dp_rank) != 0:
                continue
            rank, size, group = _shard_group(m)
            a, b = adapter.A.detach(), adapter.B.detach()
            if size > 1:  # B's rows (column-parallel) or A's columns (row-parallel) are split like the weight's
                split = b if adapter.column else a
                shards = [torch.empty_like(split) for _ in range(size)]
                dist.all_gather(shards, split.contiguous(), group=group)
                b, a = (torch.cat(shards, 0), a) if adapter.column else (b, torch.cat(shards, 1))
            if rank != 0:
                continue
            for hf_name, rows in split_full(m, b, size, shape).items():
                key = "base_model.model." + hf_name.removesuffix(".weight")
                local[f"{key}.lora_A.weight"] = a.cpu().clone()
                local[f"{key}.lora_B.weight"] = rows.cpu().clone()
    parts: list[dict] | None = [{} for _ in range(dist.get_world_size())] if dist.get_rank() == 0 else None
    dist.gather_object(local, parts, dst=0)
    return {k: v for part in parts for k, v in part.items()} if parts is not None else {}


class _InMemory:
    """HFCheckpoint's reading interface over tensors in memory: ``read_shard`` slices an adapter's B (or A) exactly
    as it slices the weight it adapts."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.tensors[name][start:stop]

    def cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.tensors[name][:, start:stop]

    def full(self, name: str) -> torch.Tensor:
        return self.tensors[name]


def load_peft_adapter(model: GPTModel | Sequence[GPTModel], shape: ModelShape, adapter) -> None:
    """Copy a PEFT adapter (models/adapter.py's ``Adapter``) into this rank's LoRA modules: the inverse of
    ``peft_adapter_tensors``. Every adapted linear must find its modules' tensors, and a fused linear's modules one
    A between them (as ``grpo export --peft`` writes it); AdapterError otherwise. Call it before the optimizer is
    built (its fp32 copies are made from the parameters)."""
    from grpo_core.models.adapter import AdapterError

    used = set()
    for chunk in _chunks(model):
        mappings = {m.param: m for m in _mappings(chunk, shape)}
        for local_name, global_name, module in lora_linears(chunk):
            lora = getattr(module, "lora", None)
            if lora is None:
                continue
            m = mappings[f"{local_name}.weight"]
            pairs = [adapter.pair(name) for name in m.hf]
            if any(p is None for p in pairs):
                raise AdapterError(f"{adapter.path}: no adapter for {m.hf[0]}, which this run adapts ({global_name})")
            used |= set(m.hf)
            rank, size, _ = _shard_group(m)
            a_of, b_of = ({n: p[i] for n, p in zip(m.hf, pairs, strict=True)} for i in (0, 1))
            if lora.column:  # A replicated: one for the fused modules; B's rows sliced as the weight's
                if any(not torch.equal(a, pairs[0][0]) for a, _ in pairs):
                    raise AdapterError(f"{adapter.path}: {', '.join(m.hf)} have different A: not one fused adapter")
                a, b = pairs[0][0], read_shard(_InMemory(b_of), m, lora.B.shape, rank, size, shape)
            else:  # A's columns sliced as the weight's; B replicated
                a, b = read_shard(_InMemory(a_of), m, lora.A.shape, rank, size, shape), pairs[0][1]
            with torch.no_grad():
                lora.A.copy_(a)
                lora.B.copy_(b)
    # the linears of other pipeline stages are checked on their ranks; this stage's must not be left out
    stage = {n for chunk in _chunks(model) for m in _mappings(chunk, shape) for n in m.hf}
    if extra := (adapter.modules() & stage) - used:
        raise AdapterError(f"{adapter.path}: adapts {sorted(extra)[0]}, which this run's target_modules leave out")


def write_peft_adapter(model, shape: ModelShape, out_dir: str | Path, lora, base_model: str) -> None:
    """``adapter_model.safetensors`` (peft's key names) and ``adapter_config.json`` in ``out_dir``, from rank 0
    (every rank of the model calls it): what ``peft.PeftModel.from_pretrained(base, out_dir)`` loads. ``lora``: the
    LoRASettings the adapters were built with; ``base_model``: the model they belong to."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    tensors = peft_adapter_tensors(model, shape)
    if dist.get_rank() == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / f".adapter_model.safetensors.tmp-{os.getpid()}"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, out_dir / "adapter_model.safetensors")
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": lora.rank,
            "lora_alpha": lora.alpha,
            "lora_dropout": lora.dropout,
            # the HF modules adapted (a linear excluded in some layers has no tensors there: peft's B = 0 there)
            "target_modules": sorted({k.rsplit(".", 3)[1] for k in tensors}),
            "bias": "none",
            "fan_in_fan_out": False,
            "inference_mode": True,
            "init_lora_weights": True,
            "use_rslora": False,
            "use_dora": False,
            "modules_to_save": None,
        }
        tmp_config = out_dir / f".adapter_config.json.tmp-{os.getpid()}"
        tmp_config.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        os.replace(tmp_config, out_dir / "adapter_config.json")
    dist.barrier()


def _export_items(chunk: GPTModel, shape: ModelShape) -> list[tuple[Mapping, torch.nn.Parameter]]:
    """The parameters this rank takes part in exporting: those of the first data-parallel replica."""
    params = dict(chunk.named_parameters())
    dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
    expert_dp_rank = ps.get_expert_data_parallel_rank()
    return [
        (m, params[m.param])
        for m in _mappings(chunk, shape)
        if m.export and (expert_dp_rank if m.expert else dp_rank) == 0
    ]


def _mappings(chunk: GPTModel, shape: ModelShape) -> list[Mapping]:
    return layer_mappings(chunk, shape, ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size())


def _shard_group(m: Mapping) -> tuple[int, int, dist.ProcessGroup]:
    """(rank, size, group) of the group ``m`` is split over: expert-TP for experts, TP otherwise."""
    if m.expert:
        return (
            ps.get_expert_tensor_parallel_rank(),
            ps.get_expert_tensor_parallel_world_size(),
            ps.get_expert_tensor_parallel_group(),
        )
    return (
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_tensor_model_parallel_group(),
    )


def _chunks(model: GPTModel | Sequence[GPTModel]) -> list[GPTModel]:
    """Model chunks (one per virtual stage), unwrapped from DDP / Float16Module."""
    chunks = list(model) if isinstance(model, Sequence) else [model]
    out = []
    for chunk in chunks:
        while not isinstance(chunk, GPTModel) and hasattr(chunk, "module"):
            chunk = chunk.module
        out.append(chunk)
    return out


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def write_hf_model(model, shape, out_dir: Path, trainer_state: dict) -> None:
    """The model as Hugging Face files: weights and ``hf_config`` (every rank of the model calls this), then the
    tokenizer's files from ``tokenizer_path`` and the rows its training drew (rank 0)."""
    export_hf_weights(model, shape, out_dir, trainer_state["hf_config"])
    if dist.get_rank() != 0:
        return
    tokenizer = Path(trainer_state.get("tokenizer_path") or "")
    if tokenizer.is_dir():
        for name in TOKENIZER_FILES:
            if (tokenizer / name).is_file():
                shutil.copy2(tokenizer / name, out_dir / name)
    write_rows_seen(out_dir, trainer_state)


def write_rows_seen(out_dir: Path, trainer_state: dict) -> None:
    """Which data trained a model (or adapter): the training set and every row drawn, its start's included (rank 0;
    data/prompts.py reads it back when a run starts from it)."""
    from grpo_core.data.prompts import SEEN_FILE

    if "rows_seen" in trainer_state:
        data = trainer_state.get("data", {})
        record = {"train_digest": data.get("train_digest"), "rows": data.get("rows")}
        write_text_atomic(out_dir / SEEN_FILE, json.dumps({**record, "rows_seen": trainer_state["rows_seen"]}) + "\n")
