"""PNG plots of a run for people: reward and accuracy per step, throughput per step, accuracy before/after."""

from pathlib import Path


def _figure():
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and workers
    import matplotlib.pyplot as plt

    return plt, *plt.subplots(figsize=(6, 3.5), dpi=100)


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in rows if key in r]
    return [s for s, _ in points], [v for _, v in points]


def _save(plt, fig, ax, path: Path, title: str, ylabel: str) -> Path:
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_run(rows: list[dict], out_dir: Path, base: float | None = None, trained: float | None = None) -> list[Path]:
    """reward.png, throughput.png and accuracy.png (whatever the rows and the evaluations have) in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    if any("reward/mean" in r for r in rows):
        plt, fig, ax = _figure()
        for key, label in (("reward/mean", "mean reward"), ("reward/accuracy", "accuracy (samples)")):
            ax.plot(*_series(rows, key), marker=".", label=label)
        ax.set_xlabel("step")
        written.append(_save(plt, fig, ax, out_dir / "reward.png", "Reward per GRPO step", "reward"))
    if any("perf/throughput" in r for r in rows):
        plt, fig, ax = _figure()
        ax.plot(*_series(rows, "perf/throughput"), marker=".")
        ax.set_xlabel("step")
        written.append(_save(plt, fig, ax, out_dir / "throughput.png", "Throughput", "tokens/s per GPU"))
    if base is not None or any("val/accuracy" in r for r in rows):
        plt, fig, ax = _figure()
        if any("val/accuracy" in r for r in rows):
            ax.plot(*_series(rows, "val/accuracy"), marker="o", label="validation during training")
        if base is not None and trained is not None:
            last = max((r["step"] for r in rows), default=1)
            ax.plot([0, last], [base, trained], marker="s", linestyle="--", label="GSM8K eval: base → trained")
        ax.set_xlabel("step")
        written.append(_save(plt, fig, ax, out_dir / "accuracy.png", "Accuracy", "accuracy"))
    return written
