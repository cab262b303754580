"""PNG plots of simulation results (matplotlib, imported on first use, headless)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display needed; must precede pyplot
    import matplotlib.pyplot as plt

    return plt


def plot_throughput_vs_interactivity(
    curves: Mapping[str, Sequence[tuple[float, float, int]]], path: str | Path
) -> Path:
    """curves[label] = [(p90 interactivity tok/s/user, throughput tok/s/GPU, concurrency), ...]."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for label, points in curves.items():
        pts = sorted(points)
        (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        # Neighbouring points of a curve can sit close together (a saturated configuration):
        # their labels go above and below in turn, in the curve's colour.
        for i, (x, y, c) in enumerate(pts):
            ax.annotate(
                str(c),
                (x, y),
                textcoords="offset points",
                fontsize=7,
                xytext=(4, 4 if i % 2 == 0 else -11),
                color=line.get_color(),
            )
    ax.set_xlabel("P90 interactivity (output tokens/s per user)")
    ax.set_ylabel("output tokens/s per GPU (incl. drain)")
    ax.set_title("Throughput vs interactivity (labels: concurrency)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_hit_rate_over_time(
    series: Mapping[str, Sequence[tuple[float, float]]], path: str | Path
) -> Path:
    """series[label] = [(time s, prefill cache hit rate), ...]."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, pts in series.items():
        ax.plot([t / 60.0 for t, _ in pts], [100.0 * h for _, h in pts], label=label)
    ax.set_xlabel("simulated time (min)")
    ax.set_ylabel("prefill cache hit rate (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
