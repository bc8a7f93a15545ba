"""Figure helpers shared by the simulator, the planner and the serving benchmark (`mnemojax.bench.serving`), so
their plots look alike and are written alike. matplotlib is imported only when a figure is drawn."""
from __future__ import annotations

import os
from collections.abc import Sequence


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str, axes: Sequence = (), *, dpi: int = 120) -> str:
    """A light grid and a legend (when something is labelled) on each of `axes`, then the figure written to
    `path` (its folder made) and closed. Returns `path`."""
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path
