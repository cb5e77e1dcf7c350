"""Does an export still embed as the model it came from? Per-text cosine between the two embeddings of the same
texts, the STS score each gives, the nDCG@10 each gives on a dev-sized retrieval task when one is named, and the
export's speed on those texts (this machine)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np

from encoders.backbone import inference_embeddings
from evaluation.search import normalised
from evaluation.sts import STSPairs, cosine_scores, spearman_x100


@dataclass(frozen=True)
class Parity:
    min_cosine: float
    mean_cosine: float
    score: float  # the export's STS Spearman x100 on the sample
    score_delta: float  # export minus source, Spearman x100 points
    texts_per_s: float
    retrieval_score: float | None = None  # the export's nDCG@10 x100 on the retrieval task, when one is named
    retrieval_delta: float | None = None  # export minus source, nDCG@10 x100 points

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SourceEmbeddings:
    """The source model's embeddings of the sample's distinct texts, its STS score and speed: computed once, every
    export compared with them."""

    texts: list[str]
    embeddings: np.ndarray
    score: float
    texts_per_s: float
    retrieval_score: float | None = None


def sample_texts(pairs: STSPairs) -> list[str]:
    return sorted(set(pairs.sentences1) | set(pairs.sentences2))


def embed_timed(model, texts: list[str], batch_size: int) -> tuple[np.ndarray, float]:
    """(embeddings, texts per second): one warm-up batch first, so a lazy first call is not timed."""
    inference_embeddings(model, texts[:batch_size], batch_size)
    started = time.perf_counter()
    emb = inference_embeddings(model, texts, batch_size)
    return emb, len(texts) / max(time.perf_counter() - started, 1e-9)


def source_embeddings(model, pairs: STSPairs, batch_size: int = 32, dev=None) -> SourceEmbeddings:
    """The source's figures; ``dev`` a RetrievalDevSet (evaluation.retrieval.read_dev_set) or None."""
    texts = sample_texts(pairs)
    emb, rate = embed_timed(model, texts, batch_size)
    return SourceEmbeddings(texts, emb, _score(texts, emb, pairs), rate, _retrieval(model, dev, batch_size))


def parity(source: SourceEmbeddings, export, pairs: STSPairs, batch_size: int = 32, dev=None) -> Parity:
    """The export's figures against the source's on the same texts (and retrieval task)."""
    emb, rate = embed_timed(export, source.texts, batch_size)
    cos = cosines(source.embeddings, emb)
    score = _score(source.texts, emb, pairs)
    retrieval = _retrieval(export, dev, batch_size)
    delta = None if retrieval is None or source.retrieval_score is None else retrieval - source.retrieval_score
    return Parity(float(cos.min()), float(cos.mean()), score, score - source.score, rate, retrieval, delta)


def _retrieval(model, dev, batch_size: int) -> float | None:
    """nDCG@10 x100 on the dev set, by the evaluation suite's exact search (queries and documents on their sides)."""
    if dev is None:
        return None
    from evaluation.retrieval import dev_ndcg_at_10

    return dev_ndcg_at_10(lambda texts, side: inference_embeddings(model, texts, batch_size, side), dev)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine between two embedding matrices of the same texts."""
    return (normalised(a) * normalised(b)).sum(axis=1)


def _score(texts: list[str], emb: np.ndarray, pairs: STSPairs) -> float:
    index = {t: i for i, t in enumerate(texts)}
    return spearman_x100(cosine_scores(lambda batch: emb[[index[t] for t in batch]], pairs), pairs.gold)
