"""The driver's side of each kind of training data: from the validated corpus (or, for RSE, its sources) to the
training rows, before any worker starts. Free of torch, like the rest of the driver's path to its first step's rows
(training.kinds.kind): a corpus that fails here fails without loading it. The ranked lists are the exception: their
teacher scores the lists on actors (training.kinds.lists)."""

from __future__ import annotations

from data_pipelines.formats import groups_without_negatives, keep_groups_with_negatives
from data_pipelines.readers import count_where, counts_where
from data_pipelines.relations import load_triples, prepare_triples_ds
from data_pipelines.triplets import nli_triplets
from objectives.catalog import CATALOG


def nli_to_triplets(ds, cfg, start_model: str):
    """NLI pairs -> (premise, entailment, contradiction), then shuffled with a seed (they come sorted by premise)
    before data.max_rows, which counts triplets here: a pair subsample would break the groups."""
    ds = nli_triplets(ds).random_shuffle(seed=cfg.data.shuffle_seed or cfg.trainer.seed)
    return ds.limit(cfg.data.max_rows) if cfg.data.max_rows is not None else ds


def _without_hard_negative(table):
    import pyarrow.compute as pc

    return pc.is_null(table["text_neg"])


def mined_with_negatives(ds, cfg, start_model: str):
    """Mined triplets (ray_jobs/mine_negatives.py writes them): every row must carry its hard negative, or the
    negatives' slot of the step would hold fewer rows than its anchors."""
    missing = count_where(ds, _without_hard_negative)
    if missing:
        raise ValueError(f"{missing} rows of {cfg.data.train} have no 'negative': data.format triplets_jsonl trains "
                         "(query, positive, negative) rows; drop them or mine negatives for them")
    return ds


def _without_teacher_scores(table):
    import pyarrow.compute as pc

    return pc.or_(pc.is_null(table["positive_scores"]), pc.is_null(table["negative_scores"]))


def groups_with_negatives(ds, cfg, start_model: str):
    """Query groups: with data.group_size above 1 each query meets negatives every step, so a group without any
    cannot train and is left out, counted and said. Their teacher scores stay when a distillation objective reads
    them, and every group must then carry them."""
    distilled = any("teacher_scores" in CATALOG[n].requires for n, w in cfg.objective.weights.items() if w)
    ds = ds.select_columns(["query", "positives", "negatives"]
                           + (["positive_scores", "negative_scores"] if distilled else []))
    drawn = cfg.data.texts_per_group > 1
    if not (distilled or drawn):
        return ds
    checks = {**({"unscored": _without_teacher_scores} if distilled else {}),
              **({"missing": groups_without_negatives} if drawn else {})}
    counts = counts_where(ds, **checks)  # one pass over the corpus, whatever is checked
    if counts.get("unscored"):
        raise ValueError(f"{counts['unscored']} query groups of {cfg.data.train} carry no teacher scores "
                         f"(positive_scores, negative_scores), which the distillation objective reads: score them "
                         f"with ray_jobs/annotate.py, or mine them with ray_jobs/mine_negatives.py (it writes them)")
    if not drawn:
        return ds
    total, missing = counts["rows"], counts["missing"]
    if missing == total:
        raise ValueError(f"none of the {total} query groups of {cfg.data.train} has a negative; data.group_size "
                         f"{cfg.data.texts_per_group} needs them: mine them (ray_jobs/mine_negatives.py) or set "
                         f"data.group_size=1 (in-batch negatives only)")
    if missing:
        print(f"[raoe] {missing} of {total} query groups have no negative: left out (data.group_size "
              f"{cfg.data.texts_per_group} needs them)", flush=True)
        ds = ds.map_batches(keep_groups_with_negatives, batch_format="pyarrow")
    return ds


def sentences_only(ds, cfg, start_model: str):
    return ds.select_columns(["text"])  # a SAN corpus trains plain SimCSE too: its negatives stay behind


def _without_negative(table):
    import pyarrow as pa
    import pyarrow.compute as pc

    column = table["negative"]
    if pa.types.is_null(column.type):
        return pa.array([True] * len(column))
    return pc.fill_null(pc.equal(column, ""), True)


def sentences_with_negatives(ds, cfg, start_model: str):
    """Every sentence trains, with or without its aligned negative (the paper trains SimCSE+SAN on all of Wiki1M;
    HiNCE leaves a missing negative out of the softmax). A corpus with none is refused: it would be plain SimCSE."""
    counts = counts_where(ds, missing=_without_negative)  # one pass over the corpus
    total, missing = counts["rows"], counts["missing"]
    if missing == total:
        raise ValueError(f"the {total} sentences of {cfg.data.train} have no 'negative'; the objective (hince) needs "
                         f"aligned negatives: generate them with ray_jobs/generate_san.py")
    if missing:
        print(f"[raoe] {missing} of {total} sentences have no aligned negative (guarded by generate_san): they train "
              f"with in-batch candidates only", flush=True)
    return ds.select_columns(["text", "negative"])


def load_relation_triples(cfg, quarantine_path):
    """RSE: every source as triples, then held-out slice, caps, weights and hard negatives (seeded)."""
    triples_ds, report = load_triples(cfg.data, quarantine_path)
    triples = prepare_triples_ds(triples_ds, cfg.data, cfg.trainer.seed)
    unknown = sorted(set(cfg.eval.relation_weights or {}) - set(triples.relations))
    if unknown:  # else the first dev evaluation fails in a worker, the steps before it lost
        raise ValueError(f"eval.relation_weights names relation(s) {unknown} that the training triples do not hold; "
                         f"their relations: {list(triples.relations)}")
    print(f"[raoe] relations {triples.counts} (training triples), {len(triples.heldout)} held out", flush=True)
    columns = ["head", "tail", "negative", "relation_id"]
    extras = {"relations": triples.relations, "relation_lr": cfg.relational.relation_lr,
              "init_std": cfg.relational.init_std, "heldout": triples.heldout.to_dict("records"),
              "counts": triples.counts}
    return triples.train.select_columns(columns), report, extras
