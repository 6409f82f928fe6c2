"""HF <-> megatron-core bridge: logits match transformers, exports are bit-exact, ranks read only their shards.

megatron runs in subprocesses (tests/dist/bridge_worker.py under torchrun), one launch per process
count with many layouts each, so this process never imports megatron. The fused-layout bookkeeping
and the streaming safetensors writer are tested here directly.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from grpo_core.models.shape import ModelShape, ModelShapeError
from grpo_core.models.weights import (
    HFCheckpoint,
    Mapping,
    Piece,
    SafetensorsWriter,
    cut_pieces,
    fused_pieces,
    read_shard,
    shard_rows,
)

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "dist" / "bridge_worker.py"
TOL = 1e-4

COMMON = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    rope_theta=50000.0,
)
LLAMA31_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(vocab_size=96, tie_word_embeddings=False)),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", dict(vocab_size=95, tie_word_embeddings=True)),
    "llama31": (  # Llama 3.1's "llama3" RoPE scaling stretches two of the four frequencies here
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(vocab_size=96, tie_word_embeddings=False, rope_parameters=LLAMA31_ROPE),
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(vocab_size=96, tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(vocab_size=96, head_dim=16, tie_word_embeddings=False)),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            vocab_size=96,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
    ),
}
SINGLE = list(MODELS)  # the one-process run's models
# 8 query heads over 2 KV heads, for TP=4 (more ranks than KV heads) in the four-process run only
MODELS["qwen2_h8"] = (
    "Qwen2Config",
    "Qwen2ForCausalLM",
    dict(vocab_size=96, num_attention_heads=8, tie_word_embeddings=False),
)
SHARDED = {"qwen2"}  # saved as several safetensors files with an index


def make_model(name: str, out: Path) -> None:
    """A tiny random fp32 model: every weight random (biases and norms too) so each mapping matters."""
    import transformers

    config_cls, model_cls, extra = MODELS[name]
    config = getattr(transformers, config_cls)(**{**COMMON, **extra})
    torch.manual_seed(hash(name) % 1000)
    model = getattr(transformers, model_cls)(config).float()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() > 1 else 0.1) + ("norm" in pname))
    model.save_pretrained(out, max_shard_size="40KB" if name in SHARDED else "1GB")


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf_models")
    for name in MODELS:
        make_model(name, root / name)
    assert (root / "qwen2" / "model.safetensors.index.json").is_file()
    return root


_RESULTS: dict[int, dict] = {}


def worker_results(nproc: int, models_dir: Path, tmp_root: Path) -> dict:
    """Run the worker once per process count; the output is shown when it fails."""
    if nproc not in _RESULTS:
        out = tmp_root / f"out{nproc}"
        out.mkdir()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            str(WORKER),
            str(models_dir),
            str(out),
        ]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            pytest.fail(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-8000:]}\n{proc.stderr[-12000:]}")
        results = json.loads((out / "results.json").read_text())
        results["_seconds"] = round(time.perf_counter() - start, 1)
        _RESULTS[nproc] = results
    return _RESULTS[nproc]


@pytest.fixture(scope="module")
def results(models_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("bridge_runs")
    return lambda nproc: worker_results(nproc, models_dir, root)


def check_case(record: dict) -> None:
    assert record["logits_diff"] < TOL, record
    assert record["export_mismatches"] == [], record["export_mismatches"]
    assert record["read_problems"] == [], record["read_problems"]
    assert record["config_written"]
    for r in record["ranks"]:  # nobody reads more than it holds (padding rows are not read)
        assert r["read_elems"] <= r["held_elems"], record["ranks"]
    if "sp_marked" in record:
        assert record["sp_marked"]


# ---------------------------------------------------------------- one process


@pytest.mark.parametrize("name", SINGLE)
def test_single_process_logits_and_round_trip(results, name):
    record = results(1)[name]
    check_case(record)
    assert record["reloaded_diff"] == 0.0  # transformers loads the export and gives the same logits
    for r in record["ranks"]:
        assert r["read_elems"] == r["held_elems"]  # TP=1, no padding: everything read exactly once


@pytest.mark.parametrize("name", SINGLE)
def test_masks_and_packed_sequences(results, name):
    record = results(1)[name]
    assert record["explicit_mask_diff"] < TOL
    assert record["padding_mask_diff"] < TOL
    assert record["packed_diff"] < TOL


def test_transformer_config(results):
    c = results(1)["config"]
    assert c["rope_theta"] == 1e6
    assert (c["kv_channels"], c["num_query_groups"], c["layernorm_epsilon"], c["qk_layernorm"]) == (16, 2, 1e-5, True)
    assert c["moe"] == [4, 2, 16, False]
    assert c["dispatcher"] == "allgather"  # the override won over the derived "alltoall"
    assert c["last_stage_layers"] == 3
    assert c["recompute"] == ["full", "uniform", 1]
    assert c["dtype"] == ["torch.bfloat16", True, False]
    assert c["sequence_parallel"] and c["unknown_override_refused"]


# ---------------------------------------------------------------- several processes

TWO = [
    "llama-tp2",
    "llama_tied-tp2",
    "qwen2-tp2-spTrue",
    "qwen3-tp2-spTrue",
    "qwen3_moe-tp2-spTrue",
    "qwen3_moe-ep2",
    "llama_tied-pp2",
]
FOUR = [
    "llama-tp2-pp2",
    "llama_tied-tp2-pp2",
    "qwen2-tp2-pp2-spTrue",
    "qwen3-tp2-pp2",
    "qwen3_moe-tp2-pp2-spTrue",
    "qwen3_moe-ep2-pp2",
    "qwen3_moe-tp2-ep2-etp1-spTrue",
    "llama-tp2-pp2-first3",
    "qwen2_h8-tp4-spTrue",
    "qwen3-tp4",
]


@pytest.mark.parametrize("case", TWO)
def test_two_processes(results, case):
    record = results(2)[case]
    check_case(record)
    if case.startswith("llama_tied-tp2"):
        assert record["padded_vocab"] == 96  # 95 rows padded to split over 2 ranks


@pytest.mark.parametrize("case", FOUR)
def test_four_processes(results, case):
    check_case(results(4)[case])


@pytest.mark.parametrize(
    "case,rows",
    [
        ("qwen2_h8-tp4-spTrue", (8 + 2 * 2) * 4 // 4),  # head_dim 32/8 = 4: rank 1 holds q head 3, k0, v0
        ("qwen3-tp4", (4 + 2 * 2) * 16 // 4),  # head_dim 16: rank 1 holds k0 and v0
    ],
)
def test_tp_above_kv_heads_splits_the_fused_qkv_rows(results, case, rows):
    # megatron keeps no KV replica in its weights: each rank holds (heads + 2 * kv) * head_dim / TP QKV rows
    # and attends with one whole KV head (its query group's, gathered from the ranks that hold it).
    record = results(4)[case]
    assert record["qkv_rows"] == rows
    assert record["query_groups_per_rank"] == 1


# ---------------------------------------------------------------- layouts and the writer, no megatron

SHAPE = ModelShape.from_hf_config(
    {
        "model_type": "llama",
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 2,
        "intermediate_size": 6,
        "vocab_size": 10,
    }
)
QKV = Mapping("qkv", ("q", "k", "v"), "qkv", expert=False, order=(0, "qkv"))


def test_qkv_is_interleaved_per_query_group():
    # 2 groups of [2 q heads, k, v], head_dim 2: q rows 0-3, k 0-1, v 0-1, then q 4-7, k 2-3, v 2-3
    assert fused_pieces(QKV, SHAPE, 16, tp=1) == [
        Piece("q", 0, 4),
        Piece("k", 0, 2),
        Piece("v", 0, 2),
        Piece("q", 4, 8),
        Piece("k", 2, 4),
        Piece("v", 2, 4),
    ]


def test_shard_rows_splits_a_group_when_tp_exceeds_kv_heads():
    pieces = fused_pieces(QKV, SHAPE, 16, tp=4)
    assert shard_rows(pieces, 0, 4) == [Piece("q", 0, 4)]
    assert shard_rows(pieces, 4, 8) == [Piece("k", 0, 2), Piece("v", 0, 2)]
    assert shard_rows(pieces, 7, 13) == [Piece("v", 1, 2), Piece("q", 4, 8), Piece("k", 2, 3)]


def test_gate_up_alternates_per_rank_and_cuts_back():
    m = Mapping("fc1", ("gate", "up"), "gate_up", expert=False, order=(0, "fc1"))
    pieces = fused_pieces(m, SHAPE, 12, tp=3)
    assert pieces[:3] == [Piece("gate", 0, 2), Piece("up", 0, 2), Piece("gate", 2, 4)]
    gate, up = torch.randn(6, 8), torch.randn(6, 8)
    full = torch.cat([{"gate": gate, "up": up}[p.name][p.start : p.stop] for p in pieces])
    back = cut_pieces(full, pieces)
    assert torch.equal(back["gate"], gate) and torch.equal(back["up"], up)


def test_safetensors_writer_streams_a_loadable_file(tmp_path):
    tensors = {
        "b": torch.randn(3, 5).bfloat16(),
        "a": torch.arange(7, dtype=torch.float32),
        "c": torch.randn(2, 2).half(),
    }
    path = tmp_path / "model.safetensors"
    writer = SafetensorsWriter(path, [(k, tuple(t.shape), t.dtype) for k, t in tensors.items()])
    for k, t in tensors.items():
        writer.write(k, t)
    writer.close()
    loaded = load_file(path)
    assert all(torch.equal(loaded[k], t) for k, t in tensors.items())


def test_safetensors_writer_refuses_out_of_order(tmp_path):
    writer = SafetensorsWriter(tmp_path / "x.safetensors", [("a", (2,), torch.float32), ("b", (2,), torch.float32)])
    with pytest.raises(RuntimeError, match="out of order"):
        writer.write("b", torch.zeros(2))
    writer._file.close()


def test_checkpoint_errors_name_the_tensor(tmp_path):
    save_file({"model.layers.0.self_attn.o_proj.weight": torch.zeros(8, 6)}, tmp_path / "model.safetensors")
    o_proj = Mapping("linear_proj.weight", ("model.layers.0.self_attn.o_proj.weight",), "row", False, (0, "p"))
    missing = Mapping("linear_fc2.weight", ("model.layers.0.mlp.down_proj.weight",), "row", False, (0, "q"))
    with HFCheckpoint(tmp_path) as ckpt:
        assert read_shard(ckpt, o_proj, torch.Size([8, 3]), 1, 2, SHAPE).shape == (8, 3)
        with pytest.raises(ValueError, match=r"o_proj.weight: shape \(8, 6\) in the checkpoint.*needs \(8, 8\)"):
            read_shard(ckpt, o_proj, torch.Size([8, 4]), 0, 2, SHAPE)
        with pytest.raises(KeyError, match="no tensor 'model.layers.0.mlp.down_proj.weight'"):
            read_shard(ckpt, missing, torch.Size([8, 3]), 0, 2, SHAPE)


def test_rope_theta_and_eps_read_from_hf_configs():
    base = {
        "model_type": "llama",
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 8,
        "vocab_size": 10,
    }
    assert ModelShape.from_hf_config(base).rope_theta == 10000.0
    assert ModelShape.from_hf_config({**base, "rope_theta": 5e5}).rope_theta == 5e5
    assert ModelShape.from_hf_config({**base, "rope_parameters": {"rope_theta": 1e5}}).rope_theta == 1e5
    assert ModelShape.from_hf_config({**base, "rope_scaling": {"rope_theta": 2e5}}).rope_theta == 2e5
    assert ModelShape.from_hf_config({**base, "rms_norm_eps": 1e-5}).norm_eps == 1e-5


def test_llama3_rope_scaling_is_read_and_other_scalings_refused():
    base = {"model_type": "llama", "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "vocab_size": 10}  # fmt: skip
    assert ModelShape.from_hf_config(base).rope_scaling_factor is None
    assert ModelShape.from_hf_config({**base, "rope_parameters": LLAMA31_ROPE}).rope_scaling_factor == 8.0
    assert (
        ModelShape.from_hf_config({**base, "rope_scaling": {**LLAMA31_ROPE, "factor": 32.0}}).rope_scaling_factor == 32
    )
    with pytest.raises(ModelShapeError, match="not supported"):
        ModelShape.from_hf_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
