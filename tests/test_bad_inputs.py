"""Bad input files for `grpo train` and `grpo evaluate`: one `error:` line naming the file and what is wrong,
exit 2, no traceback, and (for training) no rank started: the checks run before any process group exists."""

import json
import os
import shutil
import time
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


LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HUGE = "{{ 'x' * 4000000000 }}"  # 4 GB: past the renderer's memory limit


@pytest.mark.parametrize(
    "template,says",
    [
        (LOOP, "did not finish rendering it within 2 s (a loop without end?)"),
        (HUGE, "needs more than 2 GiB to render it"),
    ],
    ids=["a loop of 10^10 steps", "a 4 GB string"],
)
def test_a_chat_template_that_never_ends_is_one_line_before_any_rank_starts(
    template, says, inputs, tmp_path, capsys, monkeypatch
):
    """issue 53: a model directory's chat template runs in jinja2's sandbox in a child process, under a time and a
    memory limit (here 2 s): one line naming the file, the row and what the template did, exit 2, no rank started
    (it hung the pre-flight silently, and would have hung every rank)."""
    from grpo_core.cli import main
    from grpo_core.data import template_sandbox

    monkeypatch.setattr(template_sandbox, "RENDER_TIMEOUT_S", 2.0)
    model = tmp_path / "model"
    shutil.copytree(inputs["model"], model)
    (model / "chat_template.jinja").write_text(template)
    run = tmp_path / "run"
    started = time.monotonic()
    status = main(["train", *base_overrides(model, inputs["data"], 1), f"trainer.default_local_dir={run}"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    train = inputs["data"] / "train.parquet"
    assert status == 2 and errors == [f"error: {train}: row 0, column prompt: the tokenizer's chat template {says}"]
    assert "Traceback" not in err and time.monotonic() - started < 30
    assert not (run / "launch").exists()


def test_an_overlong_prompt_is_measured_in_characters_before_it_is_tokenized(inputs, tmp_path, capsys):
    """issue 53: a 30 MB prompt (it aborted a rank with the tokenizer's Rust backtrace) is handled as
    data.truncation and data.filter_overlong_prompts say, as verl does, before any tokenizer sees megabytes:
    refused in one line by the pre-flight (truncation=error), dropped, or cut to max_prompt_length tokens."""
    from grpo_core.cli import main
    from grpo_core.data.prompts import load_prompts
    from grpo_core.rollout.hf import load_tokenizer

    huge = "Say apple in capital letters. " + "word " * 6_000_000  # 30 MB
    data = tmp_path / "data"
    shutil.copytree(inputs["data"], data)
    train = data / "train.parquet"
    pq.write_table(with_rows(train, lambda r: {**r, "prompt": [{"role": "user", "content": huge}]}, slice(0, 1)), train)
    run = tmp_path / "run"
    overrides = [*base_overrides(inputs["model"], data, 1), "data.filter_overlong_prompts=false"]
    assert main(["train", *overrides, f"trainer.default_local_dir={run}"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: {train}: row 0 has more than data.max_prompt_length=64 prompt tokens (set "
        "data.filter_overlong_prompts=true or data.truncation=left|right|middle)"
    ]
    assert "Traceback" not in err and not (run / "launch").exists()

    tokenizer = load_tokenizer(str(inputs["model"]))
    started = time.monotonic()
    kept, dropped = load_prompts([str(train)], tokenizer, 64)  # filter_overlong_prompts=true, the default
    assert dropped == 1 and len(kept) == len(pq.read_table(train)) - 1
    short = load_prompts([str(inputs["data"] / "train.parquet")], tokenizer, 64, limit=1)[0][0].ids
    for truncation in ("left", "right", "middle"):
        (first, *_), _ = load_prompts([str(train)], tokenizer, 64, False, truncation, limit=1)
        assert len(first.ids) == 64, truncation
        if truncation != "right":  # the end of the prompt (the assistant's turn) is kept
            assert first.ids[-3:] == short[-3:], truncation
    assert time.monotonic() - started < 20  # each tokenization of the 30 MB took ~30 s here


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


INT_TENSOR = "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"
NAN_TENSOR = "base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight"


def _config(**changes):
    def change(path: Path) -> None:
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))

    return change


def _tensors(change):
    """``change(tensors)`` applied to an adapter's tensors, saved again as `grpo export --peft` saves them."""

    def rewrite(path: Path) -> None:
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(path))
        change(tensors)
        save_file(tensors, str(path), metadata={"format": "pt"})

    return rewrite


def _header_length(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[:8] = (25 * 10**9).to_bytes(8, "little")  # the length of a 25 GB header
    path.write_bytes(bytes(data))


ADAPTER_CASES = {  # name: (its file, the change, what the error says after "FILE: ")
    "config: the rank as a string": (
        "adapter_config.json",
        _config(r="4"),
        "field 'r': expected an integer, got a string",
    ),
    "config: not an object": (
        "adapter_config.json",
        lambda p: p.write_text("[4, 8]"),
        "unreadable adapter config: expected an object, got a list",
    ),
    "config: DoRA": (
        "adapter_config.json",
        _config(use_dora=True),
        "field 'use_dora': DoRA is not offered here: a plain LoRA adapter is needed, got true",
    ),
    "tensors: an integer dtype": (
        "adapter_model.safetensors",
        _tensors(lambda t: t.update({INT_TENSOR: t[INT_TENSOR].int()})),
        f"tensor '{INT_TENSOR}': dtype I32, expected a float (F64, F32, F16, BF16)",
    ),
    "tensors: NaN": (
        "adapter_model.safetensors",
        _tensors(lambda t: t[NAN_TENSOR].__setitem__((0, 0), float("nan"))),
        f"tensor '{NAN_TENSOR}': holds NaN or infinite values",
    ),
    "tensors: a corrupt header (25 GB long)": (
        "adapter_model.safetensors",
        _header_length,
        "not a safetensors file: its header's length (25000000000 bytes) does not fit the file (",
    ),
    "tensors: cut": ("adapter_model.safetensors", lambda p: os.truncate(p, p.stat().st_size // 2), "tensor '"),
}


def test_files_read_back_that_do_not_validate_are_refused_before_any_rank_starts(inputs, tmp_path, capsys):
    """Issue 53: what a run reads back is typed (grpo_core/records). A start adapter whose config has the wrong types
    or shape, whose tensors have an integer dtype, NaN, a corrupt header or a cut file, or another model's shapes
    (the reason was only in the rank's log); a start model's rows_seen.json holding a string (read as its
    characters); a prepare record of the wrong shape beside the data: each is one line naming the file and the
    field, exit 2, from `grpo train` (its dry run too) before any rank starts. `grpo evaluate` of an adapter
    directory says what is wrong with it, or that it is not a model. Sound files of each kind pass."""
    from grpo_core.cli import main
    from grpo_core.data.lineage import record_text
    from tests.test_registry import write_adapter

    model, data, run = tmp_path / "model", tmp_path / "data", tmp_path / "run"
    shutil.copytree(inputs["model"], model)
    shutil.copytree(inputs["data"], data)
    good = write_adapter(model, tmp_path / "adapter")  # as `grpo export --peft` writes one
    seen = {"train_digest": "0" * 32, "rows": 64, "rows_seen": ["0123456789abcdef"]}
    (model / "rows_seen.json").write_text(json.dumps(seen))  # as models/bridge.py write_rows_seen writes it
    parquet = {name: data / name for name in ("train.parquet", "test.parquet")}
    record = {"format_version": 1, "source": "capitals", "source_kind": "local", "rows": {"train": 64, "test": 16}}
    (data / "manifest.json").write_text(record_text(record, parquet))  # as `grpo prepare` writes it
    lora = ["actor_rollout_ref.model.lora.rank=4", "actor_rollout_ref.model.lora.alpha=8"]

    def dry_run(*overrides: str) -> tuple[int, list[str]]:
        code = main(
            ["train", "--dry-run", f"trainer.default_local_dir={run}", *base_overrides(model, data, 1), *overrides]
        )
        err = capsys.readouterr().err
        assert "Traceback" not in err
        return code, error_lines(err)

    adapters = {}
    for name, (file, change, says) in ADAPTER_CASES.items():
        adapter = shutil.copytree(good, tmp_path / name.replace(" ", "_").replace(":", ""))
        change(adapter / file)
        adapters[name] = adapter
        code, [error] = dry_run(*lora, f"actor_rollout_ref.model.lora.adapter_path={adapter}")
        assert code == 2 and error.startswith(
            f"error: actor_rollout_ref.model.lora.adapter_path: {adapter / file}: {says}"
        ), (name, error)
    other = write_adapter(inputs["small_vocab"], tmp_path / "of another model")  # sound, of other shapes
    code, [error] = dry_run(*lora, f"actor_rollout_ref.model.lora.adapter_path={other}")
    said = f"error: actor_rollout_ref.model.lora.adapter_path: {other / 'adapter_model.safetensors'}: module model."
    assert code == 2 and error.startswith(said) and f"update; the base {model} has [" in error, error
    assert dry_run(*lora, f"actor_rollout_ref.model.lora.adapter_path={good}") == (0, [])

    (model / "rows_seen.json").write_text(json.dumps({**seen, "rows_seen": "0123456789abcdef"}))
    assert dry_run() == (2, [
        f"error: actor_rollout_ref.model.path: {model / 'rows_seen.json'}: field 'rows_seen': expected a list, got "
        "a string; delete it to count every row as new"
    ])  # fmt: skip
    (model / "rows_seen.json").write_text(json.dumps(seen))
    prepared = json.loads((data / "manifest.json").read_text())
    (data / "manifest.json").write_text(json.dumps({**prepared, "rows": [64, 16]}))
    assert dry_run() == (2, [
        f"error: data: {data / 'manifest.json'}: field 'rows': expected an object, got a list; `grpo prepare` "
        "writes it anew (or delete it)"
    ])  # fmt: skip
    assert not run.exists()  # nothing started, nothing made

    evaluate = ["evaluate", "--data", str(data / "test.parquet"), "--output", str(tmp_path / "eval"), "--model"]
    assert main([*evaluate, str(adapters["tensors: an integer dtype"])]) == 2
    file = adapters["tensors: an integer dtype"] / "adapter_model.safetensors"
    assert error_lines(capsys.readouterr().err) == [f"error: {file}: {ADAPTER_CASES['tensors: an integer dtype'][2]}"]
    assert main([*evaluate, str(good)]) == 2
    assert error_lines(capsys.readouterr().err) == [
        f"error: {good}: a PEFT LoRA adapter (of {model}), not a model; evaluate the checkpoint it was exported from "
        "(`grpo evaluate --model CHECKPOINT` merges it) or its registered version (models:/NAME/N)"
    ]
    assert not (tmp_path / "eval").exists()


def test_an_evaluation_set_that_does_not_validate_is_one_line(tmp_path):
    """`eval_set.json` (the questions an evaluation asked), read back by the pipeline to judge and tag a version:
    one line naming the file and the field, exit 2 (a KeyError, or a string's characters as the questions)."""
    from grpo_core.cli import exit_status
    from grpo_core.evaluation.gsm8k import read_eval_set, write_eval_set
    from grpo_core.records.reader import RecordError

    write_eval_set(tmp_path, "0" * 32, [{"id": "0123456789abcdef", "index": 0}])
    written = read_eval_set(tmp_path)
    assert written == {"data_digest": "0" * 32, "questions": ["0123456789abcdef"]}
    for changed, says in (
        ({"questions": "0123456789abcdef"}, "field 'questions': expected a list, got a string"),
        ({"data_digest": None}, "field 'data_digest': expected a string, got null"),
    ):
        (tmp_path / "eval_set.json").write_text(json.dumps({**written, **changed}))
        with pytest.raises(RecordError) as error:
            read_eval_set(tmp_path)
        assert str(error.value) == f"{tmp_path / 'eval_set.json'}: {says}" and exit_status(error.value) == 2
