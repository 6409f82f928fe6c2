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
    found["wrong_types"] = base / "wrong_types.parquet"  # the right names; the messages a string, the reward too
    pq.write_table(with_rows(found["data"] / "train.parquet", plain_prompt), found["wrong_types"])
    return found


def with_rows(path: Path, change, rows: slice = slice(None)) -> pa.Table:
    """The rows of a parquet file, ``change(row)`` applied to those in ``rows``."""
    table = pq.read_table(path).to_pylist()
    chosen = set(range(len(table))[rows])
    return pa.Table.from_pylist([change(row) if i in chosen else row for i, row in enumerate(table)])


def plain_prompt(row: dict) -> dict:
    return {**row, "prompt": row["prompt"][0]["content"], "reward_model": row["reward_model"]["ground_truth"]}


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
    "training parquet whose columns hold the wrong types": (  # the ranks' chat template failed after 50 s
        lambda i: [f"data.train_files=[{i['wrong_types']}]"],
        lambda i: (
            f"error: {i['wrong_types']}: row 0, column prompt: expected a list of chat messages ({{role, "
            "content}), got str 'Say apple 0 in capital letters.'"
        ),
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


def test_the_data_check_reads_its_first_rows_as_training_reads_them(inputs, tmp_path):
    """check_prompt_rows (before any rank starts) reads the first 8 rows through what load_prompts (the ranks)
    does to every row: the same DataError, naming the file, the row and the column. A column of the wrong type
    fails at row 0; a null or empty value at its row; one past the first 8 rows is the ranks' to find."""
    from grpo_core.data.gsm8k import DataError
    from grpo_core.data.prompts import check_prompt_rows, load_prompts
    from grpo_core.rollout.hf import load_tokenizer

    tokenizer = load_tokenizer(str(inputs["model"]))
    train = inputs["data"] / "train.parquet"
    check_prompt_rows(train, tokenizer)
    every, third = slice(None), slice(3, 4)
    bad = {  # name: (what is done to which rows, what the error says after "FILE: ")
        "reward_model a string": (lambda r: {**r, "reward_model": "4"}, every, "row 0, column reward_model: expected"),
        "no ground truth": (lambda r: {**r, "reward_model": {"style": "rule"}}, every, "row 0, column reward_model"),
        "messages as strings": (lambda r: {**r, "prompt": ["hi"]}, every, "row 0, column prompt: expected a list"),
        "content a number": (
            lambda r: {**r, "prompt": [{"role": "user", "content": 4}]},
            every,
            "row 0, column prompt: the tokenizer's chat template fails on it: TypeError: ",
        ),
        "no messages": (lambda r: {**r, "prompt": []}, third, "row 3, column prompt: expected a list of chat"),
        "no reward_model": (lambda r: {**r, "reward_model": None}, third, "row 3, column reward_model: expected a"),
    }
    for name, (change, rows, says) in bad.items():
        path = tmp_path / f"{name}.parquet"
        pq.write_table(with_rows(train, change, rows), path)
        for read in (lambda p: check_prompt_rows(p, tokenizer), lambda p: load_prompts([str(p)], tokenizer, 64)):
            with pytest.raises(DataError) as error:
                read(path)
            assert str(error.value).startswith(f"{path}: {says}"), (name, str(error.value))
    late = tmp_path / "late.parquet"  # only row 20 is bad: not among the rows checked
    pq.write_table(with_rows(train, lambda r: {**r, "prompt": []}, slice(20, 21)), late)
    check_prompt_rows(late, tokenizer)
    with pytest.raises(DataError, match=r"late\.parquet: row 20, column prompt: expected a list of chat messages"):
        load_prompts([str(late)], tokenizer, 64)
