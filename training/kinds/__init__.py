"""Kinds of training data, each in one place: which corpus it reads, which EmbeddingBatch fields it can fill, how
the driver prepares its rows and how a worker's micro-batch becomes the gathered (global) batch.

The Ray Train loop and the driver only name a kind; adding one touches this table and a module beside it
(``text`` for pairs, triplets and sentences, ``lists`` for ranked lists, ``triples`` for RSE)."""

from training.kinds.base import FIELD_COLUMNS, BatchContext, DataKind, ModelAdditions, corpus_cache_dir
from training.kinds.lists import lists_batch, lists_calls, lists_embed, lists_with_teacher
from training.kinds.text import (
                                 mined_with_negatives,
                                 nli_to_triplets,
                                 sentences_batch,
                                 sentences_calls,
                                 sentences_embed,
                                 sentences_only,
                                 sentences_with_negatives,
                                 text_pairs_batch,
                                 text_pairs_calls,
                                 text_pairs_embed,
)
from training.kinds.triples import (
    add_relation_table,
    load_relation_triples,
    relation_report,
    triples_batch,
    triples_calls,
    triples_embed,
)

_PAIR_FIELDS = ("emb1", "emb2", "scores", "ids1", "ids2")
_PAIRS = {"embed": text_pairs_embed, "assemble": text_pairs_batch, "encode_calls": text_pairs_calls}
_SENTENCES = {"embed": sentences_embed, "assemble": sentences_batch, "encode_calls": sentences_calls}

TRAINING_KINDS: dict[str, DataKind] = {
    k.name: k for k in [
        DataKind(name="pairs", corpus="pairs", provides=(*_PAIR_FIELDS, "labels"), **_PAIRS),
        DataKind(name="sts", corpus="sts", provides=_PAIR_FIELDS, **_PAIRS),
        DataKind(name="triplets", corpus="pairs", provides=(*_PAIR_FIELDS, "labels", "emb_neg", "ids_neg"), **_PAIRS,
                 unit="SimCSE triplets (premise, entailment, contradiction)", corpus_to_rows=nli_to_triplets),
        DataKind(name="mined_triplets", corpus="triplets", provides=(*_PAIR_FIELDS, "labels", "emb_neg", "ids_neg"),
                 **_PAIRS,
                 unit="mined triplets (query, positive, hard negative)", corpus_to_rows=mined_with_negatives),
        DataKind(name="sentences", corpus="sentences", provides=("emb1", "emb2", "ids1", "ids2"), **_SENTENCES,
                 unit="sentences", corpus_to_rows=sentences_only),
        DataKind(name="sentences_san", corpus="sentences",
                 provides=("emb1", "emb2", "emb_neg", "neg_mask", "ids1", "ids2"), **_SENTENCES,
                 unit="sentences with aligned negatives", corpus_to_rows=sentences_with_negatives),
        DataKind(name="lists", corpus="lists", provides=("list_emb", "list_mask", "list_target"), embed=lists_embed,
                 assemble=lists_batch, encode_calls=lists_calls, unit="ranked lists", corpus_to_rows=lists_with_teacher),
        DataKind(name="triples", corpus="triples",
                 provides=("emb1", "emb2", "emb_neg", "ids1", "ids2", "ids_neg", "relation", "relation_table"),
                 embed=triples_embed, assemble=triples_batch, encode_calls=triples_calls, unit="relation triples",
                 load=load_relation_triples, setup_model=add_relation_table, finish=relation_report),
    ]
}

__all__ = ["FIELD_COLUMNS", "TRAINING_KINDS", "BatchContext", "DataKind", "ModelAdditions", "corpus_cache_dir"]
