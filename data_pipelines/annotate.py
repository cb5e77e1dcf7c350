"""The enhanced NLI set: read and validate NLI pairs, score them with the teachers, write the result
with S, and summarise S per teacher and per NLI label (the paper's Figure 1)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from data_pipelines.records import LABEL_NAMES
from evaluation.figures import pyplot, save_figure

# Scores are cosines in [-1, 1]: counted in bins of 0.001 per column and label, quantiles are read from the counts
# (within half a bin of numpy's), mean and std from exact sums.
EDGES = np.linspace(-1.0, 1.0, 2001)
PLOT_BINS = np.linspace(0, 1, 41)


def group_score_summary(scored) -> dict:
    """Query groups' teacher scores summarised from per-batch sums and a histogram over their observed range (two
    light passes; no group reaches the driver): counts, mean, min and max of positive and negative scores."""
    import pyarrow as pa
    import pyarrow.compute as pc

    def flat(table, name):
        return pc.list_flatten(table[name]).to_numpy(zero_copy_only=False).astype(np.float64)

    def sums(table):
        parts = {"groups": [table.num_rows]}
        for name in ("positive", "negative"):
            values = flat(table, f"{name}_scores")
            parts |= {f"{name}_n": [len(values)], f"{name}_sum": [float(values.sum())],
                      f"{name}_min": [float(values.min()) if len(values) else np.inf],
                      f"{name}_max": [float(values.max()) if len(values) else -np.inf]}
        return pa.table(parts)

    parts = scored.map_batches(sums, batch_format="pyarrow", batch_size=None).take_all()
    low = min(min(p["positive_min"], p["negative_min"]) for p in parts) if parts else 0.0
    high = max(max(p["positive_max"], p["negative_max"]) for p in parts) if parts else 1.0
    edges = np.linspace(low, high if high > low else low + 1.0, 41)

    def histogram(table):
        return pa.table({name: [np.histogram(flat(table, f"{name}_scores"), edges)[0].tolist()]
                         for name in ("positive", "negative")})

    counts = scored.map_batches(histogram, batch_format="pyarrow", batch_size=None).take_all()
    out = {"groups": int(sum(p["groups"] for p in parts)), "histogram": {"bins": edges.tolist()}}
    for name in ("positive", "negative"):
        n = int(sum(p[f"{name}_n"] for p in parts))
        out[name] = {"count": n, "mean": sum(p[f"{name}_sum"] for p in parts) / max(n, 1),
                     "min": min(p[f"{name}_min"] for p in parts), "max": max(p[f"{name}_max"] for p in parts)}
        out["histogram"][name] = np.sum([c[name] for c in counts], axis=0).astype(int).tolist()
    out["pairs"] = out["positive"]["count"] + out["negative"]["count"]
    return out


def plot_group_scores(summary: dict, path: str | Path, teachers: str) -> Path:
    """The teachers' scores of positives against negatives: distillation learns the gap between them."""
    plt = pyplot()
    bins = np.asarray(summary["histogram"]["bins"])
    centres, width = (bins[:-1] + bins[1:]) / 2, bins[1] - bins[0]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, colour in (("positive", "tab:green"), ("negative", "tab:red")):
        ax.bar(centres, summary["histogram"][name], width=width, alpha=0.6, color=colour,
               label=f"{name}s ({summary[name]['count']})")
    ax.set_xlabel(f"teacher score ({teachers})")
    ax.set_ylabel("pairs")
    ax.legend()
    return save_figure(fig, path)


def score_counts(frame, teacher_names: list[str]) -> dict:
    """Additive counts of one batch of scored pairs: per score column (``similarity`` and each ``s_<teacher>``),
    overall and per NLI label, the count, sum, sum of squares and histogram over EDGES; and how many pairs' mean
    teacher cosine is below 0 (clipped to S = 0). ``merge_counts`` adds them; nothing else needs the rows."""
    counts = {"clipped_to_zero": int((np.mean([frame[f"s_{t}"] for t in teacher_names], axis=0) < 0).sum())}
    for column in ["similarity", *[f"s_{t}" for t in teacher_names]]:
        groups = [("all", frame[column])] + [(_label_key(k), g[column]) for k, g in frame.groupby("label")]
        for label, values in groups:
            values = values.to_numpy(np.float64)
            counts[f"{column}|{label}"] = [len(values), float(values.sum()), float((values ** 2).sum()),
                                           np.histogram(values.clip(-1, 1), EDGES)[0].tolist()]
    return counts


def merge_counts(parts) -> dict:
    """``score_counts`` of every batch, added up (an iterable: batches stream through, none is kept)."""
    total: dict = {"clipped_to_zero": 0}
    for part in parts:
        total["clipped_to_zero"] += part["clipped_to_zero"]
        for key, (n, s, ss, hist) in ((k, v) for k, v in part.items() if k != "clipped_to_zero"):
            if key not in total:
                total[key] = [0, 0.0, 0.0, np.zeros(len(EDGES) - 1, dtype=np.int64)]
            entry = total[key]
            entry[0], entry[1], entry[2] = entry[0] + n, entry[1] + s, entry[2] + ss
            entry[3] += np.asarray(hist, dtype=np.int64)
    return total


def summarise(counts: dict, teacher_names: list[str]) -> dict:
    """Mean/std/quantiles of S overall, per teacher and per NLI label, from ``merge_counts``."""

    def stats(key: str) -> dict:
        n, s, ss, hist = counts.get(key, (0, 0.0, 0.0, None))
        if n == 0:
            return {"count": 0}
        mean = s / n
        q = [_quantile(hist, p) for p in (0.1, 0.5, 0.9)]
        return {"count": int(n), "mean": mean, "std": float(np.sqrt(max(ss / n - mean * mean, 0.0))),
                "p10": q[0], "median": q[1], "p90": q[2]}

    labels = sorted({k.split("|", 1)[1] for k in counts if k.startswith("similarity|")} - {"all"}, key=_label_order)
    return {
        "S": stats("similarity|all"),
        "per_teacher": {t: stats(f"s_{t}|all") for t in teacher_names},
        "per_label": {LABEL_NAMES.get(int(k), k) if k.lstrip("-").isdigit() else k: stats(f"similarity|{k}")
                      for k in labels},
        "clipped_to_zero": counts["clipped_to_zero"],
    }


def _label_key(label) -> str:
    try:
        return str(int(label))  # 0, 0.0 and "0" alike (a label column with a gap is float in pandas)
    except (TypeError, ValueError):
        return str(label)


def _label_order(label: str):
    return (0, int(label)) if label.lstrip("-").isdigit() else (1, label)


def _quantile(hist: np.ndarray, p: float) -> float:
    """numpy's linear quantile, read from counts in bins of EDGES: the bin where rank p (n - 1) falls, at its
    middle."""
    n = int(hist.sum())
    rank = p * (n - 1)
    index = int(np.searchsorted(np.cumsum(hist), rank, side="right"))
    return float((EDGES[index] + EDGES[index + 1]) / 2)


def plot_distribution(counts: dict, path: Path) -> Path:
    """Histogram of S per NLI label (RAOE Figure 1), drawn from ``merge_counts``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    centres = (EDGES[:-1] + EDGES[1:]) / 2
    for key in sorted((k for k in counts if k.startswith("similarity|") and not k.endswith("|all")),
                      key=lambda k: _label_order(k.split("|", 1)[1])):
        label, (n, _, _, hist) = key.split("|", 1)[1], counts[key]
        name = LABEL_NAMES.get(int(label), label) if label.lstrip("-").isdigit() else label
        ax.hist(centres, bins=PLOT_BINS, weights=hist, alpha=0.5, label=f"{name} (n={n})")
    ax.set(xlabel="S (mean teacher cosine)", ylabel="pairs", title="Similarity score S by NLI label")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
