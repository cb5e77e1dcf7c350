"""Tokenisation off the training thread: each kind's ``encode_calls`` names exactly the forward passes its builder
runs (``embed``), so the feed tokenises all of them ahead and the step tokenises none, with embeddings equal to tokenising in
the step (dropout on, the same seed)."""

import numpy as np
import pytest
import torch

from encoders.backbone import build_encoder, length_groups
from encoders.relational import attach_relation_table
from encoders.sources import resolve_model_source
from training.kinds import TRAINING_KINDS, BatchContext

TEXTS = np.array(["a man sits on a bench in the park", "a dog runs", "two kids play football on the beach today",
                  "rain", "the cat sleeps", "a woman reads a very long book about the history of trains"],
                 dtype=object)
ROWS = {
    "pairs": {"text1": TEXTS, "text2": TEXTS[::-1], "label": np.array([0, 1, 2, 0, 1, 2]),
              "similarity": np.linspace(0.1, 0.9, 6)},
    "triplets": {"text1": TEXTS, "text2": TEXTS[::-1], "text_neg": np.roll(TEXTS, 2), "label": np.zeros(6, int)},
    "sentences": {"text": TEXTS},
    "sentences_san": {"text": TEXTS, "negative": np.array(["a man stands", None, "two kids", "", "a cat", "a book"],
                                                          dtype=object)},
    "lists": {"sentences": np.array([list(TEXTS[:3]), list(TEXTS[3:5]), list(TEXTS[2:6]), list(TEXTS[:2])],
                                    dtype=object),
              "teacher_sim": np.array([np.eye(n).ravel() for n in (3, 2, 4, 2)], dtype=object)},
    "triples": {"head": TEXTS, "tail": TEXTS[::-1], "negative": np.roll(TEXTS, 3),
                "relation_id": np.array([0, 1, 0, 1, 0, 1])},
}


@pytest.fixture(scope="module")
def model():
    model = build_encoder(resolve_model_source("tiny:bert"), dropout=0.1)
    attach_relation_table(model, ["entailment", "contradiction"], None, init_std=0.1, seed=0)
    return model.train()


@pytest.fixture(scope="module")
def sided_model():
    """Queries and documents with prompts and lengths of their own: a kind with sides encodes them in calls of their
    own."""
    return build_encoder(resolve_model_source("tiny:bert"), dropout=0.1, query_max_length=8,
                         prompts={"query": "query: ", "document": "passage: "}).train()


def _built(model, kind, rows, prefetched: bool):
    ctx = BatchContext(model, model, torch.device("cpu"), length_buckets=2, negative_dropout=0.3, sides=kind.sides)
    if prefetched:
        ctx.tokens.use(ctx.tokenized(kind.encode_calls(ctx, rows)))
    torch.manual_seed(3)  # the same dropout masks both ways
    return ctx, kind.build(ctx, rows)


@pytest.mark.parametrize("name", [*sorted(ROWS), "triplets sided"])
def test_every_forward_pass_of_a_micro_batch_is_tokenised_ahead(model, sided_model, name):
    kind_name, sided = name.split()[0], name.endswith("sided")
    kind, model = TRAINING_KINDS[kind_name], sided_model if sided else model
    (ahead, prefetched), (_, in_step) = (_built(model, kind, ROWS[kind_name], p) for p in (True, False))
    calls = kind.encode_calls(ahead, ROWS[kind_name])
    assert len(calls) == (2 if sided or kind_name == "sentences_san" else 1)
    passes = sum(len(length_groups(texts, buckets or 2)) for texts, buckets, _ in calls)
    assert (ahead.tokens.hits, ahead.tokens.misses) == (passes, 0)
    for field in ("emb1", "emb2", "emb_neg", "list_emb"):
        a, b = getattr(prefetched, field, None), getattr(in_step, field, None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0)
            assert a.abs().sum() > 0


def test_texts_not_prepared_are_tokenised_in_the_step(model):
    kind = TRAINING_KINDS["pairs"]
    ctx = BatchContext(model, model, torch.device("cpu"), length_buckets=2)
    ctx.tokens.use(ctx.tokenized(kind.encode_calls(ctx, ROWS["pairs"])))
    other = {**ROWS["pairs"], "text2": np.array([t.upper() for t in TEXTS], dtype=object)}  # not what was prepared:
    # still right, counted as misses
    kind.embed(ctx, other)
    assert ctx.tokens.misses == 2 and ctx.tokens.hits == 0  # both length buckets changed
