"""The seven STS tasks in SentEval's "all" setting (SimCSE, AnglE and RAOE report this): Spearman x 100
of cosine against gold; STS12-16 pool every subset of a year before one Spearman; STS-B and SICK-R on
their test split. Missing files make a task absent, never zero."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from evaluation.figures import pyplot, save_figure
from storage.paths import storage_path

STS_SUBSETS = {
    "STS12": ["MSRpar", "MSRvid", "SMTeuroparl", "surprise.OnWN", "surprise.SMTnews"],
    "STS13": ["FNWN", "headlines", "OnWN"],
    "STS14": ["deft-forum", "deft-news", "headlines", "images", "OnWN", "tweet-news"],
    "STS15": ["answers-forums", "answers-students", "belief", "headlines", "images"],
    "STS16": ["answer-answer", "headlines", "plagiarism", "postediting", "question-question"],
}
ALL_TASKS = [*STS_SUBSETS, "STSBenchmark", "SICKRelatedness"]


@dataclass
class STSPairs:
    """Pairs of one task (pooled over its subsets) with gold scores."""

    sentences1: list[str]
    sentences2: list[str]
    gold: np.ndarray

    def head(self, n: int | None) -> "STSPairs":
        return self if n is None else STSPairs(self.sentences1[:n], self.sentences2[:n], self.gold[:n])


def _read_lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def read_senteval_sts_year(folder: Path, subsets: list[str]) -> STSPairs | None:
    """STS.input.<subset>.txt (tab: s1, s2) + STS.gs.<subset>.txt; unscored (empty gold) lines skipped."""
    s1, s2, gold = [], [], []
    found = False
    for subset in subsets:
        inputs, scores = folder / f"STS.input.{subset}.txt", folder / f"STS.gs.{subset}.txt"
        if not (inputs.exists() and scores.exists()):
            continue
        found = True
        pairs, golds = _read_lines(inputs), _read_lines(scores)
        if len(pairs) != len(golds):
            raise ValueError(f"{inputs} has {len(pairs)} lines but {scores} has {len(golds)}")
        for line_no, (pair, g) in enumerate(zip(pairs, golds), start=1):
            if not g.strip():
                continue
            parts = pair.split("\t")
            if len(parts) < 2:
                raise ValueError(f"{inputs}:{line_no}: expected two tab-separated sentences")
            s1.append(parts[0])
            s2.append(parts[1])
            gold.append(float(g))
    return STSPairs(s1, s2, np.asarray(gold, dtype=np.float64)) if found else None


def read_stsb_senteval(path: Path) -> STSPairs | None:
    """SentEval's sts-{train,dev,test}.csv: tab-separated genre, file, year, id, score, s1, s2 (extras ignored)."""
    if not path.exists():
        return None
    s1, s2, gold = [], [], []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            parts = line.rstrip("\n").split("\t")
            if len(parts) < 7:
                raise ValueError(f"{path}:{line_no}: expected at least 7 tab-separated fields, got {len(parts)}")
            gold.append(float(parts[4]))
            s1.append(parts[5])
            s2.append(parts[6])
    return STSPairs(s1, s2, np.asarray(gold))


def read_sick(path: Path) -> STSPairs | None:
    """SICK tab-separated with header: pair_ID, sentence_A, sentence_B, relatedness_score, ..."""
    if not path.exists():
        return None
    with path.open(encoding="utf-8") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    return STSPairs(
        [r["sentence_A"] for r in rows], [r["sentence_B"] for r in rows],
        np.asarray([float(r["relatedness_score"]) for r in rows]),
    )


def load_task(data_dir: str | Path, task: str, split: str = "test") -> STSPairs | None:
    """The pairs of ``task`` under a SentEval root (local or on object storage), or None when its files are
    absent."""
    root = storage_path(data_dir)
    if task in STS_SUBSETS:
        return read_senteval_sts_year(root / "STS" / f"{task}-en-test", STS_SUBSETS[task])
    if task == "STSBenchmark":
        return read_stsb_senteval(root / "STS" / "STSBenchmark" / f"sts-{split}.csv")
    if task == "SICKRelatedness":
        return read_sick(root / "SICK" / "SICK_test_annotated.txt")
    raise ValueError(f"unknown STS task {task!r}; known: {ALL_TASKS}")


Encoder = Callable[[list[str]], np.ndarray]


def pair_embeddings(encode: Encoder, pairs: STSPairs) -> tuple[np.ndarray, np.ndarray]:
    """Embeddings of each pair's two sentences (float64); every distinct sentence is encoded once."""
    unique = sorted(set(pairs.sentences1) | set(pairs.sentences2))
    index = {s: i for i, s in enumerate(unique)}
    emb = np.asarray(encode(unique), dtype=np.float64)
    return emb[[index[s] for s in pairs.sentences1]], emb[[index[s] for s in pairs.sentences2]]


def cosine_scores(encode: Encoder, pairs: STSPairs) -> np.ndarray:
    """Cosine of each pair."""
    a, b = pair_embeddings(encode, pairs)
    a /= np.linalg.norm(a, axis=1, keepdims=True).clip(min=1e-12)
    b /= np.linalg.norm(b, axis=1, keepdims=True).clip(min=1e-12)
    return np.sum(a * b, axis=1)


def spearman_x100(predicted: np.ndarray, gold: np.ndarray) -> float:
    from scipy.stats import spearmanr  # here, not at the top: scipy.stats costs a training driver 0.7 s to import

    return float(spearmanr(predicted, gold).statistic * 100.0)


def encoded_once(encode: Encoder, tasks: list[STSPairs]) -> Encoder:
    """``encode`` called once for every distinct sentence of ``tasks``, then a lookup: one encoding pass serves
    every task (for a Ray actor pool, one actor start and one model load instead of one per task)."""
    unique = sorted({s for pairs in tasks for s in (*pairs.sentences1, *pairs.sentences2)})
    if not unique:
        return encode
    table = dict(zip(unique, np.asarray(encode(unique))))
    return lambda sentences: np.stack([table[s] for s in sentences])


def evaluate_sts(
    encode: Encoder, data_dir: str | Path, tasks: list[str] | None = None, *, max_pairs: int | None = None,
    stsb_split: str = "test", predictions: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
    score: Callable[[Encoder, STSPairs], np.ndarray] | None = None,
) -> dict[str, float | None]:
    """{task: Spearman x 100 or None when absent, ..., "avg": mean of the present tasks}. Pass a dict as
    ``predictions`` to also get each task's (cosine, gold) arrays, e.g. for a scatter plot. ``score`` replaces
    the cosine (an RSE model's relation-weighted score)."""
    results: dict[str, float | None] = {}
    scored: dict[str, STSPairs] = {}
    for task in ALL_TASKS if tasks is None else tasks:  # [] scores no STS task (a retrieval-only suite)
        pairs = load_task(data_dir, task, split=stsb_split)
        results[task] = None  # absent until scored below
        if pairs is not None and len(pairs.gold) > 0:
            scored[task] = pairs.head(max_pairs)
    encode = encoded_once(encode, list(scored.values()))
    for task, pairs in scored.items():
        cosine = (score or cosine_scores)(encode, pairs)
        results[task] = spearman_x100(cosine, pairs.gold)  # pairs_spearman, keeping the cosines for the plot
        if predictions is not None:
            predictions[task] = (cosine, np.asarray(pairs.gold))
    present = [v for v in results.values() if v is not None]
    results["avg"] = float(np.mean(present)) if present else None
    return results


def pairs_spearman(encode: Encoder, pairs: STSPairs,
                   score: Callable[[Encoder, STSPairs], np.ndarray] | None = None) -> float:
    """Spearman x 100 of one task's pairs, scored as ``evaluate_sts`` scores them. Training selects checkpoints by
    this on STS-B dev pairs the driver read once and handed to every worker (a worker's node may lack the files)."""
    return spearman_x100((score or cosine_scores)(encode, pairs), pairs.gold)


def relation_sts_scorer(names: list[str], vectors: np.ndarray, weights: dict[str, float] | None):
    """A scorer for ``evaluate_sts`` / ``pairs_spearman``: an RSE model's relation-weighted score
    sum_k w_k cos(a + r_k, b), the max over both directions, in place of the cosine."""
    from encoders.relational import normalised_weights, relation_pair_scores  # torch: not for a driver reading STS-B

    w = normalised_weights(names, weights)

    def score(encode: Encoder, pairs: STSPairs) -> np.ndarray:
        return relation_pair_scores(*pair_embeddings(encode, pairs), vectors, w, both_directions=True)

    return score


def stsb_dev_pairs(data_dir: str | Path, max_pairs: int | None = None) -> STSPairs | None:
    """The STS-B dev pairs training selects checkpoints by (the first ``max_pairs``), or None when absent."""
    pairs = load_task(data_dir, "STSBenchmark", "dev")
    return None if pairs is None or len(pairs.gold) == 0 else pairs.head(max_pairs)


def stsb_dev_spearman(encode: Encoder, data_dir: str | Path, max_pairs: int | None = None,
                      score: Callable[[Encoder, STSPairs], np.ndarray] | None = None) -> float | None:
    """What training selects checkpoints by, read from ``data_dir``; None without STS-B dev there."""
    pairs = stsb_dev_pairs(data_dir, max_pairs)
    return None if pairs is None else pairs_spearman(encode, pairs, score)


def plot_cosine_vs_gold(cosine: np.ndarray, gold: np.ndarray, path: str | Path, title: str) -> Path:
    """Predicted cosine against gold score (AnglE's Figure 5 view): a good model's cloud rises monotonically."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(4.5, 4))
    ax.scatter(gold, cosine, s=4, alpha=0.35)
    ax.set_xlabel("gold score")
    ax.set_ylabel("predicted cosine")
    ax.set_title(f"{title}: Spearman {spearman_x100(cosine, gold):.2f}")
    ax.grid(alpha=0.3)
    return save_figure(fig, path, dpi=120)
