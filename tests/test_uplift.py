"""bench/uplift.py: the format rate read back from the reward, and the command line (its statistics are
grpo_core.evaluation.stats', tested in tests/test_stats.py)."""

import importlib.util
import json
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("uplift", Path(__file__).parents[1] / "bench" / "uplift.py")
uplift = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(uplift)


def test_format_rate_from_reward():
    # half right (1), a quarter formatted but wrong (0.1), a quarter unformatted (0): mean 0.525
    assert uplift.format_rate(0.525, 0.5, 0.1) == pytest.approx(0.75)


def test_cli(tmp_path, capsys):
    for name, right in (("base", [1, 0, 0, 0]), ("trained", [1, 1, 1, 0])):
        (tmp_path / name).mkdir()
        lines = [json.dumps({"index": i, "sample": 0, "correct_strict": bool(r)}) for i, r in enumerate(right)]
        (tmp_path / name / "samples.jsonl").write_text("\n".join(lines) + "\n")
    assert uplift.main([str(tmp_path / "base"), str(tmp_path / "trained"), "--json", str(tmp_path / "u.json")]) == 0
    out = json.loads((tmp_path / "u.json").read_text())
    assert (out["only_trained"], out["only_base"], out["uplift"], out["mcnemar_p"]) == (2, 0, 0.5, 0.5)
    assert uplift.main([str(tmp_path / "nope"), str(tmp_path / "trained")]) == 2
    assert capsys.readouterr().err.startswith("error: no samples file")
