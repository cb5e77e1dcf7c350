"""Kinds of training data, each in one place: which corpus it reads, which EmbeddingBatch fields it can fill, how
the driver prepares its rows and how a worker's micro-batch becomes the gathered (global) batch.

The Ray Train loop and the driver only name a kind; adding one touches this table and a module beside it
(``text`` for pairs, triplets and sentences, ``lists`` for ranked lists, ``triples`` for RSE; the driver's side of
each in ``corpus_rows``). The table names those modules' functions, imported on first call (``kind.on_first_call``):
the driver reads its corpus without torch (the ranked lists' teacher excepted)."""

import importlib

from training.kinds.kind import FIELD_COLUMNS, DataKind, corpus_cache_dir, on_first_call


def _text(name):
    return on_first_call("training.kinds.text", name)


def _rows(name):
    return on_first_call("training.kinds.corpus_rows", name)


def _lists(name):
    return on_first_call("training.kinds.lists", name)


def _triples(name):
    return on_first_call("training.kinds.triples", name)


_PAIR_FIELDS = ("emb1", "emb2", "scores", "ids1", "ids2")
_PAIRS = {"embed": _text("text_pairs_embed"), "assemble": _text("text_pairs_batch"),
          "encode_calls": _text("text_pairs_calls")}
# pairs whose first text asks and whose second (and hard negative) answers; STS pairs are symmetric
_QUERY_DOCUMENT = {"text1": "query", "text2": "document", "text_neg": "document"}
_SENTENCES = {"embed": _text("sentences_embed"), "assemble": _text("sentences_batch"),
              "encode_calls": _text("sentences_calls")}

TRAINING_KINDS: dict[str, DataKind] = {
    k.name: k for k in [
        DataKind(name="pairs", corpus="pairs", provides=(*_PAIR_FIELDS, "labels"), **_PAIRS, sides=_QUERY_DOCUMENT),
        DataKind(name="sts", corpus="sts", provides=_PAIR_FIELDS, **_PAIRS),
        DataKind(name="triplets", corpus="pairs", provides=(*_PAIR_FIELDS, "labels", "emb_neg", "ids_neg"), **_PAIRS,
                 sides=_QUERY_DOCUMENT,
                 unit="SimCSE triplets (premise, entailment, contradiction)", corpus_to_rows=_rows("nli_to_triplets")),
        DataKind(name="mined_triplets", corpus="triplets", provides=(*_PAIR_FIELDS, "labels", "emb_neg", "ids_neg"),
                 **_PAIRS, sides=_QUERY_DOCUMENT,
                 unit="mined triplets (query, positive, hard negative)", corpus_to_rows=_rows("mined_with_negatives")),
        DataKind(name="groups", corpus="groups",
                 provides=("emb1", "emb2", "ids1", "ids2", "emb_neg", "ids_neg", "teacher_scores"),
                 **_PAIRS, sides=_QUERY_DOCUMENT, unit="query groups", corpus_to_rows=_rows("groups_with_negatives"),
                 draw=_text("draw_groups")),
        DataKind(name="sentences", corpus="sentences", provides=("emb1", "emb2", "ids1", "ids2"), **_SENTENCES,
                 unit="sentences", corpus_to_rows=_rows("sentences_only")),
        DataKind(name="sentences_san", corpus="sentences",
                 provides=("emb1", "emb2", "emb_neg", "neg_mask", "ids1", "ids2"), **_SENTENCES,
                 unit="sentences with aligned negatives", corpus_to_rows=_rows("sentences_with_negatives")),
        DataKind(name="lists", corpus="lists", provides=("list_emb", "list_mask", "list_target"),
                 embed=_lists("lists_embed"), assemble=_lists("lists_batch"), encode_calls=_lists("lists_calls"),
                 unit="ranked lists",
                 corpus_to_rows=_lists("lists_with_teacher")),
        DataKind(name="triples", corpus="triples",
                 provides=("emb1", "emb2", "emb_neg", "ids1", "ids2", "ids_neg", "relation", "relation_table"),
                 embed=_triples("triples_embed"), assemble=_triples("triples_batch"),
                 encode_calls=_triples("triples_calls"), unit="relation triples", load=_rows("load_relation_triples"),
                 setup_model=_triples("add_relation_table"), finish=_triples("relation_report")),
    ]
}

__all__ = ["FIELD_COLUMNS", "TRAINING_KINDS", "BatchContext", "DataKind", "ModelAdditions", "corpus_cache_dir"]


def __getattr__(name: str):  # the batch-building classes (torch) load when first named
    if name in ("BatchContext", "ModelAdditions"):
        return getattr(importlib.import_module("training.kinds.base"), name)
    raise AttributeError(f"module 'training.kinds' has no attribute {name!r}")
