"""Hard-negative mining: the job's rows equal a brute-force reference (exact search over every corpus text, known
positives and the query dropped, the margin against each positive's score, hardest first) computed here with the
same model; its counts add up; its output, query groups, trains a Stage 1 job."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
WORDS = ("river stone music light paper garden window winter bread horse cloud silver market ocean engine forest "
         "candle violin desert harbor").split()


def _mine_job():
    sys.path.insert(0, str(ROOT / "ray_jobs"))
    try:
        import mine_negatives
    finally:
        sys.path.remove(str(ROOT / "ray_jobs"))
    return mine_negatives


def _pairs(rng, queries=14):
    rows = []
    for q in range(queries):
        query = " ".join(rng.choice(WORDS, size=4))
        for _ in range(1 if q % 3 else 2):  # some queries with two positives
            rows.append({"query": query, "positive": " ".join(rng.choice(WORDS, size=int(rng.integers(3, 7))))})
    return rows


def _reference(model_dir, pairs, corpus, top_k, margin, margin_type, per_row, teacher_dir=None):
    """Candidates ranked by the mining model; the margin compares the teacher's scores where there is one. Queries
    encode on the query side, candidates and positives on the document side (their prompts, model.prompts)."""
    from encoders.backbone import inference_embeddings, load_encoder
    from evaluation.search import normalised

    model = load_encoder(model_dir)
    scorer = load_encoder(teacher_dir) if teacher_dir else model
    texts = sorted(set(corpus))
    emb = normalised(inference_embeddings(model, texts, side="document"))
    scored = normalised(inference_embeddings(scorer, texts, side="document"))
    known: dict[str, set] = {}
    for r in pairs:
        known.setdefault(r["query"], set()).add(r["positive"])
    expected, without, dropped = set(), 0, 0
    for query, positives in known.items():
        q = normalised(inference_embeddings(model, [query], side="query"))[0]
        order = [i for i in np.argsort(-(emb @ q), kind="stable") if texts[i] not in positives | {query}][:top_k]
        q = normalised(inference_embeddings(scorer, [query], side="query"))[0]
        scores = scored @ q
        for positive in positives:
            pos = float(normalised(inference_embeddings(scorer, [positive], side="document"))[0] @ q)
            limit = margin * pos if margin_type == "relative" else pos - margin
            keep = [texts[i] for i in order if scores[i] <= limit]
            dropped += len(order) - len(keep)
            without += not keep
            expected |= {(query, positive, t) for t in keep[:per_row]}
    return expected, without, dropped


def test_mined_rows_equal_a_brute_force_reference_with_a_teacher(ray_local, tmp_path, monkeypatch, margin=0.999,
                                                                 margin_type="relative"):
    """Relative margin, a teacher re-scoring (the tiny model pooled by its last token: other scores, so other
    candidates pass the margin than the mining model's own scores would let through); the mining model has query and
    document prompts, which the reference applies by side."""
    from encoders.backbone import build_encoder, export_encoder
    from encoders.sources import resolve_model_source

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("RAOE_MLFLOW_ARTIFACTS", str(tmp_path / "artifacts"))
    monkeypatch.setenv("RAOE_CACHE", str(tmp_path / "cache"))
    rng = np.random.default_rng(3)
    pairs = _pairs(rng)
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in pairs))
    extra = [" ".join(rng.choice(WORDS, size=5)) for _ in range(30)]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(extra + [r["positive"] for r in pairs]) + "\n")
    sides = {"query": "query: ", "document": "passage: "}
    model = export_encoder(build_encoder(resolve_model_source("tiny:bert"), max_length=32, prompts=sides),
                           tmp_path / "model")
    teacher = export_encoder(build_encoder(resolve_model_source("tiny:bert"), max_length=32, pooling="last_token"),
                             tmp_path / "teacher")
    job = _mine_job()
    cfg = job.MineJobConfig(data={"train": str(data)}, output_dir=str(tmp_path / "mined"), cpus_per_actor=0.5,
                            mining={"model": str(model), "corpus": str(corpus), "top_k": 40, "margin": margin,
                                    "margin_type": margin_type, "negatives_per_row": 2, "queries_per_batch": 4,
                                    "teacher": str(teacher)},
                            tracking={"experiment": "raoe-test"})
    result = job.main(cfg)
    written = [json.loads(line) for f in sorted(Path(result["output_path"]).glob("*.json*")) for line in open(f)]
    got = {(r["query"], r["positives"][0], n) for r in written for n in r["negatives"]}
    texts = extra + [r["positive"] for r in pairs]
    expected, without, dropped = _reference(model, pairs, texts, 40, margin, margin_type, 2, teacher)
    assert expected != _reference(model, pairs, texts, 40, margin, margin_type, 2)[0]  # the teacher matters here
    assert got == expected and sum(len(r["negatives"]) for r in written) == len(got) == result["negatives_written"]
    assert len(written) == result["rows_written"] == result["pairs_in"] - result["rows_without_negative"] > 0
    assert result["rows_in"] == len(pairs) and result["pairs_in"] == len({(r["query"], r["positive"]) for r in pairs})
    assert result["rows_without_negative"] == without and result["candidates_dropped_by_margin"] == dropped
    assert sum(result["histogram"]["negative"]) == result["negatives_written"]
    for group in written:  # one positive, at most negatives_per_row negatives, with the teacher's scores
        assert len(group["positives"]) == len(group["positive_scores"]) == 1 and 1 <= len(group["negatives"]) <= 2
        assert len(group["negative_scores"]) == len(group["negatives"]) and not set(group["negatives"]) & set(
            group["positives"])
        assert max(group["negative_scores"]) <= margin * group["positive_scores"][0] + 1e-6
    assert Path(result["plot"]).exists()
    assert dropped > 0 and without > 0  # the margin really drops candidates here, and leaves some pairs without


def test_nli_pairs_mine_among_their_entailments_and_train_as_query_groups(ray_local, tmp_path, monkeypatch, s3):
    """Labelled NLI pairs: only entailment pairs are (query, positive); the default corpus is their positives; an
    absolute margin; the groups, written by the tasks to object storage (the local S3 endpoint), equal the
    brute-force reference, read back from there as query groups and train a Stage 1 job (groups of 3, query and
    document prompts, Matryoshka at 32/16/8 dimensions, distilled from the mining scores) straight from that
    storage. The corpus index is kept on that storage too (RAOE_INDEX_CACHE): the driver makes its node's copy (here,
    under this test's RAOE_NODE_CACHE), and the mining actors open the index by its URI (the shared Ray's own node
    cache) and find the rows the reference finds."""
    from data_pipelines.readers import load_corpus
    from encoders.sources import resolve_model_source
    from storage.paths import storage_path

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("RAOE_MLFLOW_ARTIFACTS", str(tmp_path / "artifacts"))
    monkeypatch.setenv("RAOE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("RAOE_INDEX_CACHE", s3.uri("indexes"))
    monkeypatch.setenv("RAOE_NODE_CACHE", str(tmp_path / "node"))
    job = _mine_job()
    source = ROOT / "configs" / "tiny" / "data" / "nli_pairs.jsonl"
    rows = [json.loads(line) for line in open(source)]
    entailed = {(r["text1"], r["text2"]) for r in rows if r["label"] == "entailment"}
    cfg = job.MineJobConfig(data={"train": str(source)}, output_dir=s3.uri("mined"), cpus_per_actor=0.5,
                            mining={"model": "tiny:bert", "top_k": 40, "margin": 0.01, "margin_type": "absolute",
                                    "negatives_per_row": 2}, tracking={"experiment": "raoe-test"})
    result = job.main(cfg)
    as_pairs = [{"query": q, "positive": p} for q, p in sorted(entailed)]
    expected, without, dropped = _reference(resolve_model_source("tiny:bert"), as_pairs, [p for _, p in entailed],
                                            40, 0.01, "absolute", 2)
    assert result["rows_in"] == len(rows) and result["pairs_in"] == len(entailed)
    assert result["corpus_rows"] == len({p for _, p in entailed})
    assert result["output_path"] == s3.uri("mined/data") and result["plot"] == s3.uri("mined/scores.png")
    assert result["index_path"].startswith(s3.uri("indexes/")) and len(list((tmp_path / "node").glob("index-*/"))) == 1
    assert storage_path(result["plot"]).read_bytes().startswith(b"\x89PNG")
    ds, report = load_corpus("groups", result["output_path"], fmt="groups_jsonl")
    mined = ds.take_all()
    assert report.rows_written == result["rows_written"] == len(mined) > 0
    assert {(r["query"], r["positives"][0], n) for r in mined for n in r["negatives"]} == expected
    assert (result["rows_without_negative"], result["candidates_dropped_by_margin"]) == (without, dropped)
    assert all((r["query"], r["positives"][0]) in entailed and len(r["negatives"]) for r in mined)
    for r in mined:  # hardest first, each under the absolute margin
        assert list(r["negative_scores"]) == sorted(r["negative_scores"], reverse=True)
        assert max(r["negative_scores"]) <= r["positive_scores"][0] - 0.01 + 1e-6
    positives = {}
    for q, p in entailed:
        positives.setdefault(q, set()).add(p)
    assert all(not set(r["negatives"]) & positives[r["query"]] for r in mined)  # never a known positive

    from tests.training.conftest import tiny_config
    from training.run import run_training

    trained = run_training(tiny_config(
        tmp_path, "mined-groups", f"data.train={result['output_path']}", "data.format=groups_jsonl",
        "data.group_size=3", "objective.weights={infonce: 1.0, distill_kl: 0.5}", "trainer.max_steps=2",
        "trainer.global_batch_size=8",
        "model.prompts={query: 'query: ', document: 'passage: '}", "objective.matryoshka={dims: [32, 16, 8]}"))
    assert trained["rows_written"] == len(mined) and trained["metrics"]["steps"] == 2
    assert np.isfinite(trained["metrics"]["train_loss"]) and trained["metrics"]["train_loss"] > 0
    model = Path(trained["model_path"])  # the Matryoshka sizes recorded with the model, its card says them
    assert json.loads((model / "raoe_encoder.json").read_text())["matryoshka_dims"] == [32, 16, 8]
    assert "Matryoshka: trained at 32, 16, 8 dimensions" in (model / "README.md").read_text()
    from mlflow import MlflowClient

    logged = MlflowClient().get_run(trained["run_id"]).data.metrics
    assert {"loss/infonce_dim32", "loss/infonce_dim16", "loss/infonce_dim8", "loss/distill_kl_dim8"} <= set(logged)
    assert logged["loss/distill_kl_dim32"] > 0  # distilled from the scores mining stored with each group


def test_mined_triplets_without_a_negative_are_refused_by_name(ray_local):
    from types import SimpleNamespace

    import ray

    from training.kinds.corpus_rows import mined_with_negatives

    rows = ray.data.from_items([{"text1": "q", "text2": "p", "text_neg": "n"}, {"text1": "q2", "text2": "p2",
                                                                               "text_neg": None}])
    cfg = SimpleNamespace(data=SimpleNamespace(train="mined.jsonl"))
    with pytest.raises(ValueError, match="1 rows of mined.jsonl have no 'negative'"):
        mined_with_negatives(rows, cfg, "")


def test_the_old_output_path_key_is_read_as_output_dir_with_a_word(capsys):
    from pydantic import ValidationError

    job = _mine_job()
    cfg = job.MineJobConfig(data={"train": "pairs.jsonl"}, output_path="s3://bucket/mined")
    assert cfg.output_dir == "s3://bucket/mined"
    assert "output_path is deprecated, read as output_dir='s3://bucket/mined'" in capsys.readouterr().err
    with pytest.raises(ValidationError, match="output_path and output_dir both set"):
        job.MineJobConfig(data={"train": "pairs.jsonl"}, output_path="a", output_dir="b")


def test_a_beir_folder_mines_groups_for_its_judged_pairs_among_its_corpus(ray_local, tmp_path, monkeypatch):
    """data.train a BEIR folder: every (query, judged document) pair of qrels/train (grade > 0) is mined among the
    folder's corpus, documents read "title text"; no group holds a document judged for its query as a negative.
    Qrels that judge a document the corpus lacks are refused with its id."""
    from data_pipelines.mining import beir_pairs
    from tests.evaluation.test_retrieval import write_beir

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("RAOE_MLFLOW_ARTIFACTS", str(tmp_path / "artifacts"))
    monkeypatch.setenv("RAOE_CACHE", str(tmp_path / "cache"))
    rng = np.random.default_rng(4)
    corpus = {f"d{i}": " ".join(rng.choice(WORDS, size=5)) for i in range(30)}
    queries = {f"q{i}": " ".join(rng.choice(WORDS, size=3)) for i in range(8)}
    qrels = [(f"q{i}", f"d{(3 * i + j) % 30}", 1 + j) for i in range(8) for j in range(2)] + [("q0", "d29", 0)]
    folder = write_beir(tmp_path / "beir", corpus, queries, qrels, split="train")
    titled = {d: f"{'' if i % 2 else 't'} {t}".strip() for i, (d, t) in enumerate(corpus.items())}  # as written
    job = _mine_job()
    cfg = job.MineJobConfig(data={"train": str(folder)}, output_dir=str(tmp_path / "mined"), cpus_per_actor=0.5,
                            mining={"model": "tiny:bert", "top_k": 10, "margin": -2.0, "margin_type": "absolute",
                                    "negatives_per_row": 3}, tracking={"experiment": "raoe-test"})
    result = job.main(cfg)
    written = [json.loads(line) for f in sorted(Path(result["output_path"]).glob("*.json*")) for line in open(f)]
    judged = {(queries[q], titled[d]) for q, d, g in qrels if g > 0}
    assert result["pairs_in"] == len(judged) == 16 and result["corpus_rows"] == 30
    assert {(g["query"], g["positives"][0]) for g in written} == judged  # a margin of -2 keeps every candidate
    for group in written:
        own = {t for q, t in judged if q == group["query"]}
        assert len(group["negatives"]) == 3 and not own & set(group["negatives"])
        assert set(group["negatives"]) <= set(titled.values())

    lacking = write_beir(tmp_path / "lacking", corpus, queries, [*qrels, ("q1", "d99", 1)], split="train")
    with pytest.raises(ValueError, match=r"corpus lacks \(1 of 17 judged pairs\), e.g. \['d99'\]"):
        beir_pairs(str(lacking), "train")
