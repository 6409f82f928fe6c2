"""Bad input files for `grpo train` and `grpo evaluate`: one `error:` line naming the file and what is wrong,
exit 2, no traceback, and (for training) no rank started: the checks run before any process group exists."""

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.support.tiny import TOKENIZER, TOKENIZER_FILES, capitals_data, tiny_model_dir
from tests.test_checkpoint import cli, one_error
from tests.test_train import base_overrides, grpo_train


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """Good data and model, and one bad version of each input."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if not TOKENIZER.is_dir():
        pytest.skip(f"{TOKENIZER} (the shared SmolLM2 tokenizer) is not present")
    base = tmp_path_factory.mktemp("inputs")
    found = {"data": capitals_data(base / "data"), "model": tiny_model_dir(base / "model")}
    found["no_weights"] = base / "no_weights"
    shutil.copytree(found["model"], found["no_weights"], ignore=shutil.ignore_patterns("*.safetensors"))
    small = LlamaConfig(vocab_size=1000, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)  # fmt: skip
    found["small_vocab"] = base / "small_vocab"
    LlamaForCausalLM(small).save_pretrained(found["small_vocab"])  # with SmolLM2's tokenizer: 49152 tokens
    for name in TOKENIZER_FILES:
        if (TOKENIZER / name).is_file():
            shutil.copy2(TOKENIZER / name, found["small_vocab"] / name)
    found["no_columns"] = base / "questions.parquet"
    pq.write_table(pa.table({"question": ["What is 2 + 2?"]}), found["no_columns"])
    found["empty"] = base / "empty.parquet"
    pq.write_table(pq.read_table(found["data"] / "train.parquet").slice(0, 0), found["empty"])
    return found


TRAIN_CASES = {  # name: (overrides from the inputs, what the error line says)
    "model without weights": (
        lambda i: [f"actor_rollout_ref.model.path={i['no_weights']}"],
        lambda i: f"error: {i['no_weights']}: no *.safetensors weights there",
    ),
    "tokenizer larger than the model": (
        lambda i: [f"actor_rollout_ref.model.path={i['small_vocab']}"],
        lambda i: f"error: {i['small_vocab']}: the tokenizer has 49152 tokens, more than the model's vocabulary (1000",
    ),
    "training parquet without the columns": (
        lambda i: [f"data.train_files=[{i['no_columns']}]"],
        lambda i: f"error: {i['no_columns']} has no prompt/reward_model column (columns: question)",
    ),
    "a prompt column the files lack (data.prompt_key)": (
        lambda i: ["data.prompt_key=messages"],
        lambda i: f"error: {i['data'] / 'train.parquet'} has no messages column (columns: ",
    ),
    "empty validation set": (
        lambda i: [f"data.val_files=[{i['empty']}]"],
        lambda i: f"error: {i['empty']} has no rows (an empty dataset)",
    ),
}


@pytest.mark.parametrize("case", list(TRAIN_CASES))
def test_train_refuses_a_bad_input_before_any_rank_starts(case, inputs, tmp_path):
    overrides, says = TRAIN_CASES[case]
    run = tmp_path / "run"
    proc = grpo_train(run, *base_overrides(inputs["model"], inputs["data"], 1), *overrides(inputs))
    assert one_error(proc).startswith(says(inputs)), proc.stderr[-2000:]
    assert not (run / "launch").exists()  # no rank was started


EVALUATE_CASES = {
    "evaluation parquet without the columns": (
        lambda i: ["--model", str(i["model"]), "--data", str(i["no_columns"])],
        lambda i: f"error: {i['no_columns']} has no prompt/reward_model column (columns: question)",
    ),
    "a prompt column the file lacks (--prompt-key)": (
        lambda i: ["--model", str(i["model"]), "--data", str(i["data"] / "test.parquet"), "--prompt-key", "messages"],
        lambda i: f"error: {i['data'] / 'test.parquet'} has no messages column (columns: ",
    ),
    "tokenizer larger than the model": (
        lambda i: ["--model", str(i["small_vocab"]), "--data", str(i["data"] / "test.parquet")],
        lambda i: f"error: {i['small_vocab']}: the tokenizer has 49152 tokens, more than the model's vocabulary (1000",
    ),
}


@pytest.mark.parametrize("case", list(EVALUATE_CASES))
def test_evaluate_refuses_a_bad_input(case, inputs, tmp_path):
    args, says = EVALUATE_CASES[case]
    proc = cli("evaluate", *args(inputs), "--output", str(tmp_path / "eval"), "--limit", "2")
    assert one_error(proc).startswith(says(inputs)), proc.stderr[-2000:]
    assert not (tmp_path / "eval").exists()
