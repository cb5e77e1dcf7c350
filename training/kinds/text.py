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


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, element-wise: a counter-based draw, the same for the same inputs in any batch."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _row_keys(seed: int, step: int, index: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        key = _mix(np.full(len(index), np.uint64(seed % 2**64)) + _GOLDEN)
        key = _mix(key ^ (np.uint64(step) + _GOLDEN))
        return _mix(key ^ (np.asarray(index).astype(np.uint64) + _GOLDEN))


def draw_groups(ctx: BatchContext, rows: dict[str, np.ndarray], seed: int, step: int,
                index: np.ndarray) -> dict[str, np.ndarray]:
    """Query groups -> what a step trains on: each query with one of its positives and ``group_size - 1`` of its
    negatives, drawn by (seed, step, the row's corpus row number) alone, so any worker count, chunking or resume
    draws the same; no negative twice in a group while the row has others (a row with fewer repeats them in a new
    order). Vectorised over the batch: a counter-based hash per (row, slot), a sort per row's rounds."""
    wanted = ctx.group_size - 1
    scored = "positive_scores" in rows  # kept for distillation (training.kinds.corpus_rows)
    keys = _row_keys(seed, step, index)
    n_pos = np.array([len(p) for p in rows["positives"]], dtype=np.uint64)
    pick = (_mix(keys ^ np.uint64(0x5851F42D4C957F2D)) % n_pos).astype(np.int64)
    drawn = {"text1": np.array([str(q) for q in rows["query"]], dtype=object),
             "text2": np.array([str(p[i]) for p, i in zip(rows["positives"], pick)], dtype=object)}
    order = np.zeros((len(index), 0), dtype=np.int64)
    if wanted and "negatives" in rows:
        order = _negative_order(keys, np.array([len(n) for n in rows["negatives"]], dtype=np.int64), wanted)
        negatives = np.empty(len(index), dtype=object)
        negatives[:] = [[str(pool[j]) for j in chosen] for pool, chosen in zip(rows["negatives"], order)]
        drawn["text_neg"] = negatives
    if scored:
        teacher = np.empty(len(index), dtype=object)
        teacher[:] = [None if pos is None or neg is None else [float(pos[i]), *(float(neg[j]) for j in chosen)]
                      for pos, neg, i, chosen in zip(rows["positive_scores"], rows["negative_scores"], pick, order)]
        drawn["teacher_scores"] = teacher
    return drawn


def _negative_order(keys: np.ndarray, pool: np.ndarray, wanted: int) -> np.ndarray:
    """[rows, wanted] positions in each row's negatives: the row's pool shuffled, then shuffled again for as many
    rounds as ``wanted`` needs (round r's positions all come before round r + 1's)."""
    if (pool == 0).any():
        raise ValueError("a query group without negatives reached the draw (data.group_size needs them)")
    rounds = -(-wanted // pool)
    block = rounds * pool  # slots per row
    starts = np.cumsum(block) - block
    row_of = np.repeat(np.arange(len(pool)), block)
    within = np.arange(block.sum()) - np.repeat(starts, block)
    width = np.repeat(pool, block)
    with np.errstate(over="ignore"):
        rand = _mix(np.repeat(keys, block) ^ ((within.astype(np.uint64) + np.uint64(1)) * _GOLDEN))
    shuffled = (within % width)[np.lexsort((rand, within // width, row_of))]
    return shuffled[(starts[:, None] + np.arange(wanted)[None]).ravel()].reshape(len(pool), wanted)


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
