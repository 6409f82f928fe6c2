"""Paired accuracy uplift of a trained model over its base on the same questions, and a run's training curves.

    python3 bench/uplift.py BASE_EVAL_DIR TRAINED_EVAL_DIR [--metrics RUN/metrics.jsonl --plot OUT.png]
        [--format-score 0.1] [--json OUT.json]

Each EVAL_DIR holds a `grpo evaluate` (or bench/eval_static.py) samples.jsonl, one greedy sample per question.
The uplift is trained minus base strict accuracy, with Newcombe's (1998) method-10 95% interval for a difference
of paired proportions and the exact (binomial) two-sided McNemar p-value on the discordant questions
(`grpo_core.evaluation.stats.paired_uplift`). The curves:
reward, strict accuracy and format rate of the training samples per step; the format rate is read back from
the mean reward, whose values are 1 (right), ``format_score`` (a wrong `#### N`) and 0 (no `####`).
"""

import argparse
import json
import sys
from pathlib import Path

from grpo_core.evaluation.gsm8k import compare_evaluations


def format_rate(mean_reward: float, accuracy: float, format_score: float) -> float:
    """Share of samples with a `#### N` answer: mean = accuracy + format_score x (format - accuracy)."""
    return accuracy + (mean_reward - accuracy) / format_score


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
    try:
        r = compare_evaluations(args.base, args.trained, "accuracy_strict")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n, diff, lower, upper, p = r["n"], r["uplift"], r["ci_low"], r["ci_high"], r["p_value"]
    result = {
        **r,
        "base_accuracy": (r["both"] + r["only_base"]) / n,
        "trained_accuracy": (r["both"] + r["only_trained"]) / n,
        "ci95": [lower, upper],
        "mcnemar_p": p,
    }
    print(
        f"{n} questions: base {result['base_accuracy']:.2%}, trained {result['trained_accuracy']:.2%}; "
        f"uplift {diff * 100:+.2f} pts (95% CI {lower * 100:+.2f} to {upper * 100:+.2f}), "
        f"discordant {r['only_trained']} trained-only / {r['only_base']} base-only, exact McNemar p = {p:.3g}"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot and args.metrics:
        rows = [json.loads(line) for line in args.metrics.read_text().splitlines() if line.strip()]
        plot_curves(rows, args.plot, args.format_score, result["base_accuracy"], result["trained_accuracy"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
