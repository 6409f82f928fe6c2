"""bench/step_limit.py: the lower bounds of a GRPO step, on a model small enough to count by hand."""

import importlib.util
import json
from pathlib import Path

import pytest

from grpo_core.models.shape import ModelShape

_spec = importlib.util.spec_from_file_location("step_limit", Path(__file__).parents[1] / "bench" / "step_limit.py")
step_limit = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(step_limit)

# one layer, hidden 4, one head of 4, MLP 8, vocabulary 10, tied: 72 attention + 96 MLP + 40 embedding + 4 norm
TINY = ModelShape("llama", 4, 1, 1, 1, 4, 8, 10, True, 64)


def test_forward_flops_by_hand():
    assert step_limit.matmul_params(TINY) == 212
    # 10 tokens x (2 x 212 weights + 4 x 1 layer x 4 wide x context 3)
    assert step_limit.forward_flops(TINY, 10, 3) == 10 * (424 + 48)


def test_untied_embedding_is_a_lookup():
    untied = ModelShape("llama", 4, 1, 1, 1, 4, 8, 10, False, 64)
    assert step_limit.matmul_params(untied) == 212  # lm_head multiplies; the input embedding does not


def test_decode_steps_are_memory_bound_at_a_huge_matmul_rate():
    work = step_limit.StepWork(rows=2, prompt_len=3, response_len=2, response_max=2)
    # bf16 weights 424 bytes each step, plus 2 rows x context x 16 KV bytes: 424 + 96, then 424 + 128
    assert step_limit.generation_bound(TINY, work, 1e30, 1.0) == pytest.approx(520 + 552)
    assert step_limit.decode_bound(TINY, work, 1e30, 1.0) == pytest.approx(520 + 552)  # prefill's FLOPs take ~0
    # at 1 FLOP/s the prefill's 6 tokens x (424 + 4 x 4 x 1.5) count too; two samples of one prompt prefill it once
    prefill = 6 * (424 + 24)
    decode = step_limit.decode_bound(TINY, work, 1.0, 1e30)
    assert step_limit.generation_bound(TINY, work, 1.0, 1e30) == prefill + decode
    group = step_limit.StepWork(rows=2, prompt_len=3, response_len=2, response_max=2, n=2)
    assert step_limit.generation_bound(TINY, group, 1.0, 1e30) == prefill / 2 + decode


def test_phase_bounds_update_is_three_log_prob_passes_plus_adam():
    work = step_limit.StepWork(rows=2, prompt_len=3, response_len=2, response_max=2)
    b = step_limit.phase_bounds(TINY, work, 1.0, 1e30, optimizer_steps=2)
    assert b["old_log_prob"] == b["ref"] == step_limit.forward_flops(TINY, 10, 2.5)
    assert b["update"] == pytest.approx(3 * b["old_log_prob"])


def test_cli_table_and_bad_input(tmp_path, capsys):
    record = {
        "step": 2,
        "timing/step": 3.0,
        "perf/total_tokens": 10.0,
        "prompt/length_mean": 3.0,
        "response/length_mean": 2.0,
        "response/length_max": 2,
        "timing/gen": 1.0,
        "rollout/decode_s": 0.5,
        "perf/throughput": 3.3,
    }
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 4,
                "num_hidden_layers": 1,
                "num_attention_heads": 1,
                "intermediate_size": 8,
                "vocab_size": 10,
                "tie_word_embeddings": True,
            }
        )
    )
    assert (
        step_limit.main([str(tmp_path / "run" / "metrics.jsonl"), "--model", str(tmp_path), "--tflops", "1e-12"]) == 0
    )
    row = capsys.readouterr().out.splitlines()[-1]
    assert row.startswith("| run | 2 | 1.00 (") and row.endswith(" | 3 |")
    assert row.split(" | ")[-2].startswith("0.50 (")  # the decode loop beside its own bound
    assert step_limit.main([str(tmp_path / "nope.jsonl"), "--model", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("error: no such metrics file")
    assert step_limit.main([str(tmp_path / "run" / "metrics.jsonl"), "--model", str(tmp_path), "--n", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: --n must be at least 1")
