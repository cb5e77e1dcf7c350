"""Figures the jobs write (headless): one way to open and save them."""

from __future__ import annotations

from pathlib import Path


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (jobs run without a display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path, dpi: int = 110) -> Path:
    """Lay out, write (creating the folder) and close ``fig``; returns the path."""
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    fig.clf()
    pyplot().close(fig)
    return path
