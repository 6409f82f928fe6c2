"""custom_reward_function.path / .name (verl's keys): a user's reward file replaces the built-in reward,
and every way the file can be unusable is one `error:` line and exit 2 before anything starts."""

import textwrap

import pytest

from grpo_core.cli import main
from grpo_core.config import load_config
from grpo_core.rewards import build_scorer
from grpo_core.rewards.custom import RewardFileError, as_score, load_custom_reward
from tests.conftest import REPO

BASE = str(REPO / "configs" / "grpo_base.yaml")

# Length-normalised keyword reward: 1 per occurrence of the ground truth, minus 0.1 per word over 5 words,
# plus 0.5 when extra_info marks the row as a bonus row; dict results carry extra keys, as verl allows.
REWARD_FILE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    hits = solution_str.count(ground_truth)
    penalty = 0.1 * max(len(solution_str.split()) - 5, 0)
    bonus = 0.5 if (extra_info or {}).get("bonus") else 0.0
    score = hits - penalty + bonus
    if data_source == "dict/source":
        return {"score": score, "hits": hits}
    return score


def other(data_source, solution_str, ground_truth, **kwargs):
    return 7
"""


def write(tmp_path, text: str, name: str = "reward.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def scorer_for(path: str, name: str = "compute_score"):
    return build_scorer(
        load_config(None, [f"custom_reward_function.path={path}", f"custom_reward_function.name={name}"])
    )


def test_the_user_function_scores_responses(tmp_path):
    score = scorer_for(write(tmp_path, REWARD_FILE))
    # "cat cat dog": 2 hits, 3 words, no bonus -> 2.0
    assert score("any", "cat cat dog", "cat", None) == 2.0
    # 8 words, 1 hit -> 1 - 0.3 = 0.7; the bonus row adds 0.5 -> 1.2
    eight = "one cat two three four five six seven"
    assert score("any", eight, "cat", {}) == pytest.approx(0.7)
    assert score("any", eight, "cat", {"bonus": True}) == pytest.approx(1.2)
    # A dict result: its "score" is the reward.
    assert score("dict/source", "cat", "cat", None) == 1.0
    # The built-in GSM8K reward is not consulted: an unknown data_source is fine.
    assert score("no/such/source", "x", "cat", None) == 0.0


def test_name_picks_another_function_with_keyword_catch_all(tmp_path):
    assert scorer_for(write(tmp_path, REWARD_FILE), name="other")("d", "s", "g", {"x": 1}) == 7.0


def test_without_a_path_the_builtin_reward_applies():
    score = build_scorer(load_config(None, []))
    assert score("openai/gsm8k", "so #### 18", "18", None) == 1.0
    assert score("openai/gsm8k", "so #### 17", "18", None) == 0.0


def test_results_that_are_not_scores():
    assert as_score(3) == 3.0 and as_score({"score": 0.25, "acc": 1}) == 0.25
    with pytest.raises(RewardFileError, match="dict without a 'score' key: \\['acc'\\]"):
        as_score({"acc": 1})
    with pytest.raises(RewardFileError, match="returned str 'yes'; expected a number"):
        as_score("yes")


BAD_FILES = [
    (None, "no such file"),
    ("def compute_score(data_source, solution_str, ground_truth, extra_info=None)\n    return 1\n", ":1: syntax error"),
    (
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1\n",
        "no function 'compute_score'",
    ),
    ("def compute_score(solution_str, ground_truth):\n    return 1\n", "cannot be called as compute_score("),
    ("compute_score = 3\n", "'compute_score' is a int, not a function"),
    ("import no_such_module_here\n", "importing it raised ModuleNotFoundError"),
]


@pytest.mark.parametrize(("text", "message"), BAD_FILES, ids=[m for _, m in BAD_FILES])
def test_bad_reward_files_are_one_line_errors(text, message, tmp_path, capsys):
    path = str(tmp_path / "missing.py") if text is None else write(tmp_path, text)
    with pytest.raises(RewardFileError, match=message.replace("(", "\\(")):
        load_custom_reward(path)
    # The dry run (and `grpo train`) stop before anything starts: exit 2, one error line naming the key.
    assert main(["train", "--config", BASE, f"custom_reward_function.path={path}", "--dry-run"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and f"custom_reward_function.path={path}" in lines[0] and message in lines[0], err
    assert "Traceback" not in err


def test_wrong_signature_message_quotes_both(tmp_path):
    path = write(tmp_path, "def compute_score(solution_str, ground_truth):\n    return 1\n")
    with pytest.raises(RewardFileError) as e:
        load_custom_reward(path)
    assert "compute_score(solution_str, ground_truth) cannot be called as " in str(e.value)
    assert "compute_score(data_source, solution_str, ground_truth, extra_info=None)" in str(e.value)


def test_a_good_file_passes_the_dry_run(tmp_path, capsys):
    path = write(tmp_path, REWARD_FILE)
    assert main(["train", "--config", BASE, f"custom_reward_function.path={path}", "--dry-run"]) == 0
    assert "dry run OK" in capsys.readouterr().out


def test_the_pipeline_key_follows_the_reward_file(tmp_path):
    """An edited reward file must not reuse the cached training of the old one."""
    from grpo_core.pipeline.inputs import pipeline_key

    path = write(tmp_path, REWARD_FILE)
    cfg = load_config(None, [f"custom_reward_function.path={path}"])
    before = pipeline_key(cfg)
    assert pipeline_key(cfg) == before
    write(tmp_path, REWARD_FILE.replace("0.5 if", "0.25 if"))
    assert pipeline_key(cfg) != before


def test_a_reward_file_may_define_dataclasses(tmp_path):
    """Its module is registered as an import would be (dataclasses look their module up in sys.modules)."""
    text = """
    from __future__ import annotations
    from dataclasses import dataclass

    @dataclass
    class Weights:
        hit: float = 2.0

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return Weights().hit * (ground_truth in solution_str)
    """
    assert scorer_for(write(tmp_path, text))("d", "a cat", "cat", None) == 2.0
