"""Runs under torchrun for tests/test_bridge.py: HF -> megatron-core -> HF in several parallel layouts.

    torchrun --standalone --nproc-per-node N tests/dist/bridge_worker.py MODELS_DIR OUT_DIR

For each case of CASES[N] (one model, one layout) every rank loads its shard of a tiny HF model
(recording every safetensors slice it reads), runs one forward through megatron's pipeline schedule,
and exports the model back. Rank 0 writes OUT_DIR/results.json: per case the largest logit
difference from transformers, the reads that broke the "own shard only" rule, and the tensors that
did not come back bit-exact. N=1 adds checks of the config, packed sequences and masks.
"""

import json
import os
import re
import sys
import time
from pathlib import Path

from grpo_core import cpu_compat

cpu_compat.apply()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core import tensor_parallel  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from grpo_core.models import bridge, weights  # noqa: E402
from grpo_core.models.shape import ModelShape  # noqa: E402
from grpo_core.models.spec import RMSNorm  # noqa: E402

ALL = ["llama", "llama_tied", "llama31", "qwen2", "qwen3", "qwen3_moe"]
CASES = {
    1: [(name, {}) for name in ALL],
    2: [
        ("llama", {"tp": 2}),
        ("llama_tied", {"tp": 2}),  # vocab 95: padded to 96 over TP
        ("qwen2", {"tp": 2, "sp": True}),
        ("qwen3", {"tp": 2, "sp": True}),
        ("qwen3_moe", {"tp": 2, "sp": True}),
        ("qwen3_moe", {"ep": 2}),
        ("llama_tied", {"pp": 2}),
    ],
    4: [
        ("llama", {"tp": 2, "pp": 2}),
        ("llama_tied", {"tp": 2, "pp": 2}),
        ("qwen2", {"tp": 2, "pp": 2, "sp": True}),
        ("qwen3", {"tp": 2, "pp": 2}),
        ("qwen3_moe", {"tp": 2, "pp": 2, "sp": True}),
        ("qwen3_moe", {"ep": 2, "pp": 2}),
        ("qwen3_moe", {"tp": 2, "ep": 2, "etp": 1, "sp": True}),
        ("llama", {"tp": 2, "pp": 2, "first": 3}),  # uneven stages: 3 + 1 layers
        # TP above the KV heads: each rank's QKV rows cut a query group (megatron all-gathers them)
        ("qwen2_h8", {"tp": 4, "sp": True}),  # 8 heads / 2 KV: 3 head rows per rank, biased
        ("qwen3", {"tp": 4}),  # 4 heads / 2 KV, QK norm
    ],
}
REPLICATED = ("norm.weight", "layernorm.weight", "mlp.gate.weight")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the worker also runs on GPUs (NCCL)


def case_id(name: str, layout: dict) -> str:
    return "-".join([name] + [f"{k}{v}" for k, v in layout.items()])


def shape_of(hf_config: dict) -> ModelShape:
    # transformers 5 writes num_local_experts where the hub configs say num_experts.
    if "num_local_experts" in hf_config and "num_experts" not in hf_config:
        hf_config = {**hf_config, "num_experts": hf_config["num_local_experts"]}
    return ModelShape.from_hf_config(hf_config)


# ---------------------------------------------------------------- recording safetensors reads


class _RecordingSlice:
    def __init__(self, inner, name: str, log: list):
        self.inner, self.name, self.log = inner, name, log

    def get_shape(self):
        return self.inner.get_shape()

    def __getitem__(self, key):
        shape = list(self.inner.get_shape())
        key = key if isinstance(key, tuple) else (key,)
        ranges = [s.indices(n)[:2] for s, n in zip(key, shape, strict=False)]
        ranges += [(0, n) for n in shape[len(ranges) :]]
        self.log.append((self.name, shape, ranges))
        return self.inner[key if len(key) > 1 else key[0]]


class _RecordingOpen:
    def __init__(self, path, framework, log):
        self.inner, self.log = weights_safe_open(path, framework=framework), log

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def keys(self):
        return self.inner.keys()

    def get_slice(self, name):
        return _RecordingSlice(self.inner.get_slice(name), name, self.log)


weights_safe_open = weights.safe_open


def load_recording_reads(model, hf_dir: Path, shape: ModelShape) -> list:
    log: list = []
    weights.safe_open = lambda path, framework: _RecordingOpen(path, framework, log)
    try:
        bridge.load_hf_weights(model, hf_dir, shape)
    finally:
        weights.safe_open = weights_safe_open
    return log


def read_problems(log: list, model, shape: ModelShape, tp: int, etp: int, ep: int) -> list[str]:
    """Reads outside this rank's layers / experts, and full reads of tensors split over TP."""
    layers = {layer.layer_number - 1 for layer in model.decoder.layers}
    per_rank = shape.num_experts // ep if shape.is_moe else 0
    experts = set(
        range(ps.get_expert_model_parallel_rank() * per_rank, (ps.get_expert_model_parallel_rank() + 1) * per_rank)
    )
    problems = []
    for name, full, ranges in log:
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m and int(m.group(1)) not in layers:
            problems.append(f"{name}: layer not on this stage")
        e = re.search(r"experts\.(\d+)\.", name)
        if e and int(e.group(1)) not in experts:
            problems.append(f"{name}: expert not on this EP rank")
        if name == "model.embed_tokens.weight" and not (model.pre_process or model.post_process):
            problems.append(f"{name}: read on a middle stage")
        split = etp if e else tp
        is_full = all(r == (0, n) for r, n in zip(ranges, full, strict=True))
        if split > 1 and is_full and not name.endswith(REPLICATED):
            problems.append(f"{name}: read in full though split over {split} ranks")
    return problems


# ---------------------------------------------------------------- forward


def forward_logits(model, ids, mask=None, packed=None):
    """Full-vocabulary logits [b, s, V] on the last stage (None elsewhere), through megatron's schedule."""
    captured = {}

    def step(data_iterator, model):
        out = model(next(data_iterator), None, mask, packed_seq_params=packed)

        def loss_func(output):
            captured["logits"] = output.detach()
            return output.sum() * 0, {}

        return out, loss_func

    get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=iter([ids]),
        model=[model],
        num_microbatches=1,
        seq_length=ids.shape[1],
        micro_batch_size=ids.shape[0],
        forward_only=True,
    )
    if not ps.is_pipeline_last_stage():
        return None
    return tensor_parallel.gather_from_tensor_model_parallel_region(captured["logits"]).cpu()


def hf_logits(hf_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(ids).logits


def export_mismatches(original: Path, exported: Path) -> list[str]:
    a = {k: v for f in sorted(original.glob("*.safetensors")) for k, v in load_file(f).items()}
    b = load_file(exported / "model.safetensors")
    problems = [f"{k}: missing from export" for k in sorted(set(a) - set(b))]
    problems += [f"{k}: not in the original" for k in sorted(set(b) - set(a))]
    problems += [f"{k}: differs" for k in sorted(set(a) & set(b)) if not torch.equal(a[k], b[k])]
    return problems


# ---------------------------------------------------------------- one case


def run_case(name: str, layout: dict, models_dir: Path, out_dir: Path) -> dict:
    tp, pp, ep = layout.get("tp", 1), layout.get("pp", 1), layout.get("ep", 1)
    etp = layout.get("etp")
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    model_parallel_cuda_manual_seed(1)
    hf_dir = models_dir / name
    hf_config = json.loads((hf_dir / "config.json").read_text())
    shape = shape_of(hf_config)
    config = bridge.transformer_config(
        shape,
        tp=tp,
        pp=pp,
        ep=ep,
        etp=etp,
        sequence_parallel=layout.get("sp", False),
        first_stage_layers=layout.get("first"),
    )
    model = bridge.build_model(shape, config).eval()
    log = load_recording_reads(model, hf_dir, shape)
    record = {
        "read_problems": read_problems(log, model, shape, tp, config.expert_tensor_parallel_size, ep),
        "read_elems": sum(torch.Size(ranges_shape(r)).numel() for _, _, r in log),
        "held_elems": sum(p.numel() for p in model.parameters()),
    }
    attention = model.decoder.layers[0].self_attention
    record["qkv_rows"] = attention.linear_qkv.weight.shape[0]
    record["query_groups_per_rank"] = attention.num_query_groups_per_partition
    if layout.get("sp"):
        norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
        record["sp_marked"] = bool(norms) and all(m.weight.sequence_parallel for m in norms)
    ids = torch.randint(0, shape.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    logits = forward_logits(model, ids.to(DEVICE))
    if logits is not None:
        record["logits_diff"] = (logits[..., : shape.vocab_size] - hf_logits(hf_dir, ids)).abs().max().item()
        record["padded_vocab"] = logits.shape[-1]
    exported = out_dir / case_id(name, layout)
    bridge.export_hf_weights(model, shape, exported, hf_config)
    if dist.get_rank() == 0:
        record["export_mismatches"] = export_mismatches(hf_dir, exported)
        record["config_written"] = json.loads((exported / "config.json").read_text()) == hf_config
        if dist.get_world_size() == 1:
            record["reloaded_diff"] = (hf_logits(exported, ids) - hf_logits(hf_dir, ids)).abs().max().item()
    if dist.get_world_size() == 1:
        record.update(single_process_checks(model, shape, hf_dir, ids))
    return record


def ranges_shape(ranges: list) -> list[int]:
    return [hi - lo for lo, hi in ranges]


def single_process_checks(megatron_model, shape: ModelShape, hf_dir: Path, ids: torch.Tensor) -> dict:
    """Masks and packed sequences against transformers run on each sequence alone."""
    out = {}
    s = ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)[None, None]
    ref = hf_logits(hf_dir, ids)

    def model(ids, mask, packed_seq_params=None):
        mask = None if mask is None else mask.to(DEVICE)
        return megatron_model(ids.to(DEVICE), None, mask, packed_seq_params=packed_seq_params).cpu()

    with torch.no_grad():
        out["explicit_mask_diff"] = (model(ids, causal) - ref).abs().max().item()
        # right padding: the second row's last 3 tokens are padding, masked as keys
        valid = torch.ones(2, s, dtype=torch.bool)
        valid[1, -3:] = False
        mask = causal | ~valid[:, None, None, :]
        padded = model(ids, mask)
        short = hf_logits(hf_dir, ids[1:, : s - 3])
        out["padding_mask_diff"] = (padded[1, : s - 3] - short[0]).abs().max().item()
        # three sequences packed into one row (thd), positions restarting in each
        lengths = [5, 3, 8]
        seqs = [torch.randint(0, shape.vocab_size, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]
        cu = torch.tensor([0, 5, 8, 16], dtype=torch.int32, device=DEVICE)
        params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths)
        )
        packed = model(torch.cat(seqs)[None], None, packed_seq_params=params)[0]
        refs = torch.cat([hf_logits(hf_dir, seq[None])[0] for seq in seqs])
        out["packed_diff"] = (packed - refs).abs().max().item()
    return out


def config_checks() -> dict:
    """transformer_config: HF numbers carried over, overrides applied, unknown overrides refused."""
    shape = ModelShape.from_hf_config(
        {
            "model_type": "qwen3_moe",
            "hidden_size": 32,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "intermediate_size": 64,
            "vocab_size": 96,
            "num_experts": 4,
            "moe_intermediate_size": 16,
            "num_experts_per_tok": 2,
            "rope_parameters": {"rope_theta": 1e6},
            "rms_norm_eps": 1e-5,
        }
    )
    c = bridge.transformer_config(
        shape, tp=2, pp=2, ep=2, sequence_parallel=True, dtype="bfloat16", recompute="full",
        overrides={"moe_token_dispatcher_type": "allgather", "num_layers_in_last_pipeline_stage": 3},
    )
    try:
        bridge.transformer_config(shape, overrides={"no_such_field": 1})
        refused = False
    except TypeError:
        refused = True
    return {
        "rope_theta": shape.rope_theta,
        "kv_channels": c.kv_channels,
        "num_query_groups": c.num_query_groups,
        "layernorm_epsilon": c.layernorm_epsilon,
        "qk_layernorm": c.qk_layernorm,
        "moe": [c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size, c.moe_grouped_gemm],
        "dispatcher": c.moe_token_dispatcher_type,
        "last_stage_layers": c.num_layers_in_last_pipeline_stage,
        "recompute": [c.recompute_granularity, c.recompute_method, c.recompute_num_layers],
        "dtype": [str(c.params_dtype), c.bf16, c.fp16],
        "sequence_parallel": c.sequence_parallel,
        "unknown_override_refused": refused,
    }


def main() -> None:
    models_dir, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    if DEVICE.type == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if DEVICE.type == "cuda" else "gloo")
    world = dist.get_world_size()
    results = {}
    for name, layout in CASES[world]:
        start = time.perf_counter()
        record = run_case(name, layout, models_dir, out_dir)
        records: list = [None] * world
        dist.all_gather_object(records, record)
        merged = {"seconds": round(time.perf_counter() - start, 2)}
        for r in records:
            for key, value in r.items():
                if isinstance(value, list) and key in merged:
                    merged[key] = merged[key] + value
                elif key == "logits_diff" and key in merged:
                    merged[key] = max(merged[key], value)
                else:
                    merged.setdefault(key, value)
        merged["ranks"] = [{k: r[k] for k in ("read_elems", "held_elems")} for r in records]
        results[case_id(name, layout)] = merged
    if world == 1:
        results["config"] = config_checks()
    if dist.get_rank() == 0:
        (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
