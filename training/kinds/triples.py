"""Relation triples (RSE): the driver mixes the relation sources into training triples with a held-out slice, each
worker adds the relation table to its model, batches carry heads, tails and hard negatives, and after training the
driver reports relation prediction on the held-out triples."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from encoders.relation_table import TABLE
from encoders.relational import RelationalEncoder, attach_relation_table, plot_relation_similarity, relation_prediction
from objectives.composite import EmbeddingBatch
from objectives.gather import gather_no_grad, gather_with_grad
from training.kinds.base import BatchContext, EncodeCall, ModelAdditions


def add_relation_table(model, extras: dict, start_folder: str | None, seed: int) -> ModelAdditions:
    """The relation table on the model, in an optimizer group of its own (``relational.relation_lr``, no weight
    decay: its vectors start random), its gradient norm logged per step as ``grad_norm/relation_vectors``."""
    attach_relation_table(model, extras["relations"], start_folder, init_std=extras["init_std"], seed=seed)
    table = model.get_parameter(TABLE)
    return ModelAdditions(param_groups=({"params": [table], "lr": extras["relation_lr"], "weight_decay": 0.0},),
                          watched={TABLE: table})


def relation_report(cfg, model_dir, extras: dict, out_dir) -> dict:
    """After training: relation prediction on the held-out triples and the relation-vector cosine plot."""
    encoder = RelationalEncoder(model_dir)
    plot = plot_relation_similarity(encoder.names, encoder.vectors, Path(out_dir) / "relation_similarity.png")
    out = {"relations": extras["counts"], "relation_similarity_plot": str(plot)}
    if extras["heldout"]:  # kept next to the model, for ray_jobs/evaluate.py --set eval.triples=...
        path = Path(out_dir) / "heldout_triples.jsonl"
        path.write_text("".join(json.dumps({k: t[k] for k in ("head", "relation", "tail")}) + "\n"
                                for t in extras["heldout"]), encoding="utf-8")
        out["heldout_triples"] = str(path)
        out["relation_prediction"] = relation_prediction(encoder.encode, extras["heldout"], encoder.names,
                                                         encoder.vectors)
    return out


def _triple_texts(rows: dict[str, np.ndarray]) -> tuple[list[str], list[str], list[str]]:
    return [str(t) for t in rows["head"]], [str(t) for t in rows["tail"]], [str(t) for t in rows["negative"]]


def triples_calls(ctx: BatchContext, rows: dict[str, np.ndarray]) -> list[EncodeCall]:
    head, tail, negative = _triple_texts(rows)
    return [(head + tail + negative, None, None)]


def triples_embed(ctx: BatchContext, rows: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Heads, tails and hard negatives through the encoder together (a same-sent triple's head and tail are two
    dropout views)."""
    head, tail, negative = _triple_texts(rows)
    every = ctx.encode(head + tail + negative)
    n = len(head)
    return {"emb1": every[:n], "emb2": every[n: 2 * n], "emb_neg": every[2 * n:]}


def triples_batch(ctx: BatchContext, rows: dict[str, np.ndarray], local: dict[str, torch.Tensor]) -> EmbeddingBatch:
    """The embeddings gathered with gradient, relation ids and text ids gathered; the relation table is the model's
    own parameter, the same full tensor on every worker."""
    head, tail, negative = _triple_texts(rows)
    relation_ids = torch.as_tensor(np.asarray(rows["relation_id"], dtype=np.int64), device=ctx.device)
    return EmbeddingBatch(emb1=gather_with_grad(local["emb1"]), emb2=gather_with_grad(local["emb2"]),
                          emb_neg=gather_with_grad(local["emb_neg"]), ids1=ctx.gather_ids(head),
                          ids2=ctx.gather_ids(tail), ids_neg=ctx.gather_ids(negative),
                          relation=gather_no_grad(relation_ids), relation_table=ctx.model.get_parameter(TABLE))
