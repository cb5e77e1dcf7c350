"""Kinds whose rows are texts: pairs (NLI with S, STS), SimCSE triplets, and sentences (unsupervised SimCSE, with
SAN's aligned negatives when the objective needs them)."""

from __future__ import annotations

import numpy as np
import torch

from objectives.composite import EmbeddingBatch
from objectives.gather import gather_no_grad, gather_with_grad
from training.kinds.base import BatchContext, EncodeCall, dropout_rate

_EMBEDDING_OF = {"text1": "emb1", "text2": "emb2", "text_neg": "emb_neg"}


def _pair_texts(rows: dict[str, np.ndarray]) -> dict[str, list[str]]:
    """The text columns of a chunk, in encoding order (the hard negative only where the rows carry one; a query
    group's negatives flat, row after row)."""
    return {name: [str(t) for cell in rows[name] for t in (cell if isinstance(cell, (list, np.ndarray)) else [cell])]
            for name in _EMBEDDING_OF if name in rows}


def draw_groups(ctx: BatchContext, rows: dict[str, np.ndarray], seed: int, step: int,
                index: np.ndarray) -> dict[str, np.ndarray]:
    """Query groups -> what a step trains on: each query with one of its positives and ``group_size - 1`` of its
    negatives, drawn by (seed, step, the row's corpus row number) alone, so any worker count, chunking or resume
    draws the same; no negative twice in a group while the row has others (a row with fewer repeats them in a new
    order)."""
    wanted = ctx.group_size - 1
    scored = "positive_scores" in rows  # kept for distillation (training.kinds.corpus_rows)
    queries, positives = [], []
    negatives, teacher = np.empty(len(index), dtype=object), np.empty(len(index), dtype=object)
    for i, (query, answers, row) in enumerate(zip(rows["query"], rows["positives"], index)):
        rng = np.random.default_rng([seed, step, int(row)])
        queries.append(str(query))
        pick = int(rng.integers(len(answers)))
        positives.append(str(answers[pick]))
        order = []
        if wanted and "negatives" in rows:
            pool = rows["negatives"][i]
            order = np.concatenate([rng.permutation(len(pool)) for _ in range(-(-wanted // len(pool)))])[:wanted]
            negatives[i] = [str(pool[j]) for j in order]
        if scored:
            pos, neg = rows["positive_scores"][i], rows["negative_scores"][i]
            teacher[i] = None if pos is None or neg is None else [float(pos[pick]), *(float(neg[j]) for j in order)]
    drawn = {"text1": np.array(queries, dtype=object), "text2": np.array(positives, dtype=object)}
    if wanted and "negatives" in rows:
        drawn["text_neg"] = negatives
    if scored:
        drawn["teacher_scores"] = teacher
    return drawn


def text_pairs_calls(ctx: BatchContext, rows: dict[str, np.ndarray]) -> list[EncodeCall]:
    return ctx.column_calls(_pair_texts(rows))


def text_pairs_embed(ctx: BatchContext, rows: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Pairs and SimCSE triplets: both texts (and the hard negative) through the encoder together in length-grouped
    passes; with query and document prompts or lengths, the queries in passes of their own."""
    return {_EMBEDDING_OF[name]: emb for name, emb in ctx.encode_columns(_pair_texts(rows)).items()}


def text_pairs_batch(ctx: BatchContext, rows: dict[str, np.ndarray], local: dict[str, torch.Tensor]) -> EmbeddingBatch:
    """The embeddings gathered with gradient, with the texts' ids and the fields the objective reads."""
    texts = _pair_texts(rows)
    return EmbeddingBatch(
        emb1=gather_with_grad(local["emb1"]), emb2=gather_with_grad(local["emb2"]),
        emb_neg=gather_with_grad(local["emb_neg"]) if "emb_neg" in local else None,
        ids1=ctx.gather_ids(texts["text1"]), ids2=ctx.gather_ids(texts["text2"]),
        ids_neg=ctx.gather_ids(texts["text_neg"]) if "text_neg" in texts else None, **ctx.gather_fields(rows),
    )


def _sentence_texts(rows: dict[str, np.ndarray]) -> tuple[list[str], list[str] | None, list[bool] | None]:
    """The sentences, and with a ``negative`` column (SAN) their negatives and which are real: an anchor the SAN
    guard left without a negative encodes itself there, masked out (every worker runs the negatives' pass)."""
    texts = [str(t) for t in rows["text"]]
    if "negative" not in rows:
        return texts, None, None
    present = [isinstance(t, str) and bool(t) for t in rows["negative"]]
    return texts, [str(t) if real else anchor for t, real, anchor in zip(rows["negative"], present, texts)], present


def sentences_calls(ctx: BatchContext, rows: dict[str, np.ndarray]) -> list[EncodeCall]:
    texts, negatives, _ = _sentence_texts(rows)
    return [(texts + texts, None, None)] + ([(negatives, None, None)] if negatives is not None else [])


def sentences_embed(ctx: BatchContext, rows: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Unsupervised SimCSE: each sentence twice through the encoder in one pass, so dropout (``model.dropout``)
    makes the two views its anchor and positive. With a ``negative`` column (SAN), the aligned negatives go through
    a pass of their own at dropout ``negative_dropout`` (the paper's p2)."""
    texts, negatives, _ = _sentence_texts(rows)
    views = ctx.encode(texts + texts)
    n = len(texts)
    out = {"emb1": views[:n], "emb2": views[n:]}
    if negatives is not None:
        with dropout_rate(ctx.model, ctx.negative_dropout):
            out["emb_neg"] = ctx.encode(negatives)
    return out


def sentences_batch(ctx: BatchContext, rows: dict[str, np.ndarray], local: dict[str, torch.Tensor]) -> EmbeddingBatch:
    """The views (and aligned negatives, with which are real) gathered; a sentence's ids are its own on both sides."""
    texts, negatives, present = _sentence_texts(rows)
    negative = mask = None
    if negatives is not None:
        negative = gather_with_grad(local["emb_neg"])
        mask = gather_no_grad(torch.tensor(present, dtype=torch.bool, device=ctx.device))
    ids = ctx.gather_ids(texts)
    return EmbeddingBatch(emb1=gather_with_grad(local["emb1"]), emb2=gather_with_grad(local["emb2"]),
                          emb_neg=negative, neg_mask=mask, ids1=ids, ids2=ids)
