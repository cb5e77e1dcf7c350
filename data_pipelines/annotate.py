"""The enhanced NLI set: read and validate NLI pairs, score them with the teachers, write the result
with S, and summarise S per teacher and per NLI label (the paper's Figure 1)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from data_pipelines.records import LABEL_NAMES


def summarise(frame, teacher_names: list[str]) -> dict:
    """Mean/std/quantiles of S overall, per teacher and per NLI label."""

    def stats(values: np.ndarray) -> dict:
        if len(values) == 0:
            return {"count": 0}
        q = np.quantile(values, [0.1, 0.5, 0.9])
        return {"count": int(len(values)), "mean": float(values.mean()), "std": float(values.std()),
                "p10": float(q[0]), "median": float(q[1]), "p90": float(q[2])}

    s = frame["similarity"].to_numpy()
    return {
        "S": stats(s),
        "per_teacher": {t: stats(frame[f"s_{t}"].to_numpy()) for t in teacher_names},
        "per_label": {LABEL_NAMES.get(int(k), str(k)): stats(g["similarity"].to_numpy())
                      for k, g in frame.groupby("label")},
        "clipped_to_zero": int((np.mean([frame[f"s_{t}"] for t in teacher_names], axis=0) < 0).sum()),
    }


def plot_distribution(frame, path: Path) -> Path:
    """Histogram of S per NLI label (RAOE Figure 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    bins = np.linspace(0, 1, 41)
    for label, group in sorted(frame.groupby("label")):
        ax.hist(group["similarity"], bins=bins, alpha=0.5, label=f"{LABEL_NAMES.get(int(label), label)} (n={len(group)})")
    ax.set(xlabel="S (mean teacher cosine)", ylabel="pairs", title="Similarity score S by NLI label")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
