"""bench/uplift.py: the paired uplift's interval and p-value on tables small enough to work by hand."""

import importlib.util
import json
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("uplift", Path(__file__).parents[1] / "bench" / "uplift.py")
uplift = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(uplift)


def test_wilson_of_none_right():
    # 0 of 10: (0, z^2 / (n + z^2)) = 3.8415 / 13.8415
    assert uplift.wilson(0, 10) == pytest.approx((0.0, 0.27753), abs=1e-5)


def test_mcnemar_exact_by_hand():
    # 10 vs 2 discordant: 2 x (C(12,0) + C(12,1) + C(12,2)) / 2^12 = 158 / 4096
    assert uplift.mcnemar_exact(10, 2) == pytest.approx(158 / 4096)
    assert uplift.mcnemar_exact(2, 10) == uplift.mcnemar_exact(10, 2)
    assert uplift.mcnemar_exact(0, 0) == 1.0
    assert uplift.mcnemar_exact(5, 5) == 1.0


def test_newcombe_paired_by_hand():
    # 4 of 10 right after training, none before: phi = 0 (a margin is empty), so
    # lower = 0.4 - sqrt((0.4 - 0.16818)^2 + 0.27753^2), upper = Wilson(4, 10)'s upper
    diff, lower, upper = uplift.newcombe_paired(uplift.PairedTable(0, 4, 0, 6))
    assert (diff, lower, upper) == pytest.approx((0.4, 0.03838, 0.68733), abs=1e-4)


def test_newcombe_paired_swaps_sign_and_narrows_with_correlation():
    table = uplift.PairedTable(both=30, trained_only=12, base_only=3, neither=55)
    diff, lower, upper = uplift.newcombe_paired(table)
    mirror = uplift.newcombe_paired(uplift.PairedTable(30, 3, 12, 55))
    assert mirror == pytest.approx((-diff, -upper, -lower))
    assert diff == pytest.approx(0.09) and lower < diff < upper
    # the same margins (42 and 33 right of 100) with the pairs independent (phi ~ 0) give a wider interval
    _, lo_ind, up_ind = uplift.newcombe_paired(uplift.PairedTable(both=14, trained_only=28, base_only=19, neither=39))
    assert up_ind - lo_ind > upper - lower


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
    assert (out["trained_only"], out["base_only"], out["uplift"], out["mcnemar_p"]) == (2, 0, 0.5, 0.5)
    assert uplift.main([str(tmp_path / "nope"), str(tmp_path / "trained")]) == 2
    assert capsys.readouterr().err.startswith("error: no samples file")
