"""PNG plots of a run for people: reward and accuracy per step, throughput per step, accuracy before/after,
and several runs' reward and accuracy curves overlaid (``grpo compare --plot``, and each pipeline run's own).

Steps are integers and the x axis spans the steps the data has, so a 3-step run reads as 3 steps."""

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Curves:
    """One run's curves: (step, value) per training step, and accuracies measured with an interval."""

    label: str
    reward: list[tuple[int, float]] = field(default_factory=list)
    accuracy: list[tuple[int, float, float, float]] = field(default_factory=list)  # step, value, ci low, ci high


def _figure(rows: int = 1):
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and workers
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, 1, figsize=(6, 3.5 * rows), dpi=100, squeeze=False)
    return plt, fig, list(axes[:, 0])


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in rows if key in r]
    return [s for s, _ in points], [v for _, v in points]


def step_axis(ax, steps: list[int]) -> None:
    """Integer ticks, and an x axis from the first step the data has to the last."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    if steps and max(steps) > min(steps):
        ax.set_xlim(min(steps), max(steps))


def _finish(ax, title: str, ylabel: str) -> None:
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_run(rows: list[dict], out_dir: Path, base: float | None = None, trained: float | None = None) -> list[Path]:
    """reward.png, throughput.png and accuracy.png (whatever the rows and the evaluations have) in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    steps = [r["step"] for r in rows]
    if any("reward/mean" in r for r in rows):
        plt, fig, (ax,) = _figure()
        for key, label in (("reward/mean", "mean reward"), ("reward/accuracy", "accuracy (samples)")):
            ax.plot(*_series(rows, key), marker=".", label=label)
        step_axis(ax, steps)
        _finish(ax, "Reward per GRPO step", "reward")
        written.append(_save(plt, fig, out_dir / "reward.png"))
    if any("perf/throughput" in r for r in rows):
        plt, fig, (ax,) = _figure()
        ax.plot(*_series(rows, "perf/throughput"), marker=".")
        step_axis(ax, steps)
        _finish(ax, "Throughput", "tokens/s per GPU")
        written.append(_save(plt, fig, out_dir / "throughput.png"))
    if base is not None or any("val/accuracy" in r for r in rows):
        plt, fig, (ax,) = _figure()
        if any("val/accuracy" in r for r in rows):
            ax.plot(*_series(rows, "val/accuracy"), marker="o", label="validation during training")
        last = max(steps, default=1)
        if base is not None and trained is not None:
            ax.plot([0, last], [base, trained], marker="s", linestyle="--", label="GSM8K eval: base → trained")
        step_axis(ax, [0, last] if base is not None else steps)
        _finish(ax, "Accuracy", "accuracy")
        written.append(_save(plt, fig, out_dir / "accuracy.png"))
    return written


def plot_curves(runs: list[Curves], path: Path) -> Path:
    """Reward per step (top) and accuracy with its 95% interval as error bars (bottom), one colour per run."""
    path.parent.mkdir(parents=True, exist_ok=True)
    plt, fig, (top, bottom) = _figure(2)
    reward_steps, accuracy_steps = [], []
    span = max((s for run in runs for s, *_ in run.accuracy), default=1) or 1
    for i, run in enumerate(runs):
        dodge = (i - (len(runs) - 1) / 2) * 0.015 * span  # runs' error bars side by side, not on top of each other
        colour = f"C{i % 10}"
        if run.reward:
            top.plot(*zip(*run.reward, strict=True), marker=".", color=colour, label=run.label)
            reward_steps += [s for s, _ in run.reward]
        if run.accuracy:
            steps, values, lows, highs = zip(*run.accuracy, strict=True)
            errors = [
                [v - lo for v, lo in zip(values, lows, strict=True)],
                [h - v for v, h in zip(values, highs, strict=True)],
            ]
            steps = [s + dodge for s in steps]
            bottom.errorbar(steps, values, yerr=errors, marker="s", capsize=4, color=colour, label=run.label)
            accuracy_steps += list(steps)
    step_axis(top, reward_steps)
    _finish(top, "Mean reward per GRPO step", "reward")
    step_axis(bottom, accuracy_steps)
    if accuracy_steps and max(accuracy_steps) > min(accuracy_steps):
        span = max(accuracy_steps) - min(accuracy_steps)  # room for the error bars' caps at the ends
        bottom.set_xlim(min(accuracy_steps) - 0.03 * span, max(accuracy_steps) + 0.03 * span)
    _finish(bottom, "GSM8K accuracy (95% Wilson interval): base at step 0, trained at the last step", "accuracy")
    bottom.title.set_fontsize(9)
    return _save(plt, fig, path)


def eval_points(base: float, trained: float, questions: int, last_step: int) -> list[tuple[int, float, float, float]]:
    """The base model's accuracy at step 0 and the trained model's at ``last_step``, each with its Wilson interval."""
    from grpo_core.evaluation.stats import wilson_interval

    return [
        (step, value, *wilson_interval(round(value * questions), questions))
        for step, value in ((0, base), (last_step, trained))
    ]


def reward_and_format_figure(rows: list[dict]):
    """The training curves the run page shows first: mean reward and the answer-format rate per step (a Figure,
    for ``MlflowClient.log_figure``; close it with ``close_figure``)."""
    plt, fig, (ax,) = _figure()
    for key, label in (("reward/mean", "mean reward"), ("reward/format_rate", "format rate (`#### N` answers)")):
        if any(key in r for r in rows):
            ax.plot(*_series(rows, key), marker=".", label=label)
    step_axis(ax, [r["step"] for r in rows])
    _finish(ax, "Reward and format rate per GRPO step", "per sample")
    fig.tight_layout()
    return fig


def before_after_figure(before: dict[str, tuple[float, int]], after: dict[str, tuple[float, int]], title: str):
    """Each measure (name -> (rate, questions)) before and after training, side by side with its 95% Wilson
    interval as an error bar: a gain whose bars overlap may be noise."""
    from grpo_core.evaluation.stats import wilson_interval

    plt, fig, (ax,) = _figure()
    names = list(before)
    for i, (label, values) in enumerate((("base model", before), ("trained model", after))):
        xs = [j + (i - 0.5) * 0.35 for j in range(len(names))]
        rates = [values[n][0] for n in names]
        intervals = [wilson_interval(round(rate * n), n) for rate, n in (values[name] for name in names)]
        errors = [[r - lo for r, (lo, _) in zip(rates, intervals, strict=True)],
                  [hi - r for r, (_, hi) in zip(rates, intervals, strict=True)]]  # fmt: skip
        ax.bar(xs, rates, width=0.35, yerr=errors, capsize=4, label=label, color=f"C{i}")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylim(0, 1.05)
    _finish(ax, title, "rate (95% Wilson interval)")
    ax.title.set_fontsize(9)
    fig.tight_layout()
    return fig


def close_figure(fig) -> None:
    import matplotlib.pyplot as plt

    plt.close(fig)
