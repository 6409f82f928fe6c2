"""Paired accuracy uplift of a trained model over its base on the same questions, and a run's training curves.

    python3 bench/uplift.py BASE_EVAL_DIR TRAINED_EVAL_DIR [--metrics RUN/metrics.jsonl --plot OUT.png]
        [--format-score 0.1] [--json OUT.json]

Each EVAL_DIR holds a `grpo evaluate` (or bench/eval_static.py) samples.jsonl, one greedy sample per question.
The uplift is trained minus base strict accuracy, with Newcombe's (1998) method-10 95% interval for a difference
of paired proportions and the exact (binomial) two-sided McNemar p-value on the discordant questions. The curves:
reward, strict accuracy and format rate of the training samples per step; the format rate is read back from
the mean reward, whose values are 1 (right), ``format_score`` (a wrong `#### N`) and 0 (no `####`).
"""

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

Z95 = 1.959963984540054


@dataclass(frozen=True)
class PairedTable:
    """Questions by (trained right?, base right?)."""

    both: int
    trained_only: int
    base_only: int
    neither: int

    @property
    def n(self) -> int:
        return self.both + self.trained_only + self.base_only + self.neither


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion."""
    p = successes / n
    centre = p + z * z / (2 * n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    scale = 1 + z * z / n
    return (centre - half) / scale, (centre + half) / scale


def newcombe_paired(t: PairedTable, z: float = Z95) -> tuple[float, float, float]:
    """(trained - base, lower, upper): Newcombe's method 10, Wilson intervals of both margins combined with the
    correlation of the pairs (phi, with ad - bc reduced by n/2 towards 0 when positive, as Newcombe sets it)."""
    n = t.n
    trained, base = t.both + t.trained_only, t.both + t.base_only
    p1, p2 = trained / n, base / n
    l1, u1 = wilson(trained, n, z)
    l2, u2 = wilson(base, n, z)
    margins = trained * (n - trained) * base * (n - base)
    cross = t.both * t.neither - t.trained_only * t.base_only
    if cross > 0:
        cross = max(cross - n / 2, 0.0)
    phi = cross / math.sqrt(margins) if margins else 0.0
    lower = (p1 - p2) - math.sqrt(max((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2, 0.0))
    upper = (p1 - p2) + math.sqrt(max((u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2, 0.0))
    return p1 - p2, lower, upper


def mcnemar_exact(trained_only: int, base_only: int) -> float:
    """Two-sided exact McNemar p: twice the binomial(discordant, 1/2) tail of the rarer discordant count."""
    m = trained_only + base_only
    if m == 0:
        return 1.0
    tail = sum(math.comb(m, i) for i in range(min(trained_only, base_only) + 1)) / 2**m
    return min(1.0, 2 * tail)


def paired_table(base: list[bool], trained: list[bool]) -> PairedTable:
    if len(base) != len(trained):
        raise ValueError(f"{len(base)} base answers against {len(trained)} trained ones")
    pairs = list(zip(trained, base, strict=True))
    return PairedTable(
        both=sum(t and b for t, b in pairs),
        trained_only=sum(t and not b for t, b in pairs),
        base_only=sum(b and not t for t, b in pairs),
        neither=sum(not t and not b for t, b in pairs),
    )


def format_rate(mean_reward: float, accuracy: float, format_score: float) -> float:
    """Share of samples with a `#### N` answer: mean = accuracy + format_score x (format - accuracy)."""
    return accuracy + (mean_reward - accuracy) / format_score


def _correct_by_question(eval_dir: Path) -> dict[int, bool]:
    records = [json.loads(line) for line in (eval_dir / "samples.jsonl").read_text().splitlines() if line.strip()]
    return {r["index"]: bool(r["correct_strict"]) for r in records if r.get("sample", 0) == 0}


def plot_curves(rows: list[dict], out: Path, format_score: float, base: float, trained: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "reward/mean" in r]
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    series = {
        "mean reward (samples, T=1)": [r["reward/mean"] for r in rows],
        "strict accuracy (samples)": [r["reward/accuracy"] for r in rows],
        "`####` format rate (samples)": [
            format_rate(r["reward/mean"], r["reward/accuracy"], format_score) for r in rows
        ],
    }
    for label, values in series.items():
        ax.plot(steps, values, linewidth=1, label=label)
    ax.axhline(base, color="grey", linestyle=":", label=f"test strict accuracy, base ({base:.1%})")
    ax.axhline(trained, color="black", linestyle="--", label=f"test strict accuracy, trained ({trained:.1%})")
    ax.set_xlabel("GRPO step")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center right")
    ax.set_title("SmolLM2-135M-Instruct, GRPO on GSM8K (one H200, static engine)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path)
    parser.add_argument("trained", type=Path)
    parser.add_argument("--metrics", type=Path, help="the run's metrics.jsonl, for --plot")
    parser.add_argument("--plot", type=Path, help="write the training curves here (PNG)")
    parser.add_argument("--format-score", type=float, default=0.1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    missing = [str(d / "samples.jsonl") for d in (args.base, args.trained) if not (d / "samples.jsonl").is_file()]
    if missing:
        print(f"error: no samples file: {', '.join(missing)}", file=sys.stderr)
        return 2
    base, trained = _correct_by_question(args.base), _correct_by_question(args.trained)
    if set(base) != set(trained):
        print(f"error: the two evaluations answer different questions ({len(base)} vs {len(trained)})", file=sys.stderr)
        return 2
    questions = sorted(base)
    table = paired_table([base[q] for q in questions], [trained[q] for q in questions])
    diff, lower, upper = newcombe_paired(table)
    p = mcnemar_exact(table.trained_only, table.base_only)
    result = {
        **asdict(table),
        "questions": table.n,
        "base_accuracy": (table.both + table.base_only) / table.n,
        "trained_accuracy": (table.both + table.trained_only) / table.n,
        "uplift": diff,
        "ci95": [lower, upper],
        "mcnemar_p": p,
    }
    print(
        f"{table.n} questions: base {result['base_accuracy']:.2%}, trained {result['trained_accuracy']:.2%}; "
        f"uplift {diff * 100:+.2f} pts (95% CI {lower * 100:+.2f} to {upper * 100:+.2f}), "
        f"discordant {table.trained_only} trained-only / {table.base_only} base-only, exact McNemar p = {p:.3g}"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot and args.metrics:
        rows = [json.loads(line) for line in args.metrics.read_text().splitlines() if line.strip()]
        plot_curves(rows, args.plot, args.format_score, result["base_accuracy"], result["trained_accuracy"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
