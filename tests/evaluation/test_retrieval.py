"""Retrieval evaluation: BEIR's metrics equal pytrec_eval's, the chunked search equals a full sort, and the Ray suite
on a BEIR folder equals sentence-transformers' InformationRetrievalEvaluator on the same model."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from evaluation.retrieval import DEPTH, BeirFormatError, RetrievalTask, read_task, score_rankings
from evaluation.search import exact_top_k


def _graded_task(rng, num_queries=40, num_docs=400):
    docs = [f"d{i}" for i in range(num_docs)]
    qrels = {}
    for q in range(num_queries):
        many = 130 if q == 0 else int(rng.integers(1, 8))  # one query with more relevant documents than DEPTH
        chosen = rng.choice(num_docs, size=many, replace=False)
        qrels[f"q{q}"] = {docs[i]: int(rng.integers(1, 4)) for i in chosen}
    ids = list(qrels)
    return RetrievalTask("graded", "-", ids, ids, qrels), docs


def test_metrics_equal_pytrec_eval():
    pytrec_eval = pytest.importorskip("pytrec_eval")
    rng = np.random.default_rng(0)
    task, docs = _graded_task(rng)
    scores = rng.random((len(task.query_ids), len(docs)))  # distinct scores: no tie-breaking differences
    ranked, run = {}, {}
    for q, row in zip(task.query_ids, scores):
        order = np.argsort(-row)[:DEPTH]
        ranked[q] = [docs[i] for i in order]
        run[q] = {docs[i]: float(row[i]) for i in order}
    means, per_query = score_rankings(task, ranked)

    evaluator = pytrec_eval.RelevanceEvaluator(task.qrels, {"ndcg_cut.10", "recall.10,100", "map_cut.100"})
    reference = evaluator.evaluate(run)
    top10 = {q: dict(sorted(r.items(), key=lambda kv: -kv[1])[:10]) for q, r in run.items()}
    mrr = pytrec_eval.RelevanceEvaluator(task.qrels, {"recip_rank"}).evaluate(top10)
    for q in task.query_ids:
        assert per_query[q]["ndcg@10"] == pytest.approx(reference[q]["ndcg_cut_10"], abs=1e-9)
        assert per_query[q]["recall@10"] == pytest.approx(reference[q]["recall_10"], abs=1e-9)
        assert per_query[q]["recall@100"] == pytest.approx(reference[q]["recall_100"], abs=1e-9)
        assert per_query[q]["map@100"] == pytest.approx(reference[q]["map_cut_100"], abs=1e-9)
        assert per_query[q]["mrr@10"] == pytest.approx(mrr[q]["recip_rank"], abs=1e-9)
    assert per_query["q0"]["recall@100"] < 1.0  # 130 relevant, 100 retrieved: the normalisation is exercised
    assert means["ndcg@10"] == pytest.approx(np.mean([reference[q]["ndcg_cut_10"] for q in task.query_ids]), abs=1e-9)
    assert 0.0 < means["ndcg@10"] < 1.0


def _beir_cases(rng):
    """A search over rows whose ids hold every case where BEIR's rules matter, and random queries beside them:
    q0 is a corpus id and its own best hit; q1's best hit is a document held twice; q2 is judged only 0; q3's
    relevant "c" ties with "d" (the higher id ranks first, whatever the row order); q4 has more relevant documents
    than DEPTH."""
    fillers = [f"e{i:03d}" for i in range(140)]
    ids = ["q0", "a", "b", "b", "c", "d", *fillers]
    queries = [f"q{i}" for i in range(16)]
    scores = rng.random((len(queries), len(ids))).astype(np.float32) * 0.4  # distinct below the planted hits
    scores[:, 3] = scores[:, 2]  # "b" twice: a repeated corpus line, the same text and score
    plant = {"q0": {"q0": 0.9, "a": 0.8}, "q1": {"b": 0.9, "c": 0.7, "d": 0.6}, "q3": {"c": 0.5, "d": 0.5}}
    for q, hits in plant.items():
        for doc, score in hits.items():
            scores[queries.index(q), [r for r, i in enumerate(ids) if i == doc]] = score
    qrels = {"q0": {"a": 1}, "q1": {"c": 2, "d": 1}, "q2": {"a": 0}, "q3": {"c": 1},
             "q4": {doc: 1 for doc in fillers[:120]}}
    for q in queries[5:]:
        qrels[q] = {str(d): int(rng.integers(0, 3)) for d in rng.choice(ids[1:], size=4, replace=False)}
    return ids, queries, scores, qrels


@pytest.mark.parametrize("ignore_identical_ids", [True, False])
def test_metrics_equal_beir_evaluate_retrieval(ignore_identical_ids):
    """The five means equal the beir package's EvaluateRetrieval (pytrec_eval underneath, its MRR beside) on a
    search whose hits hold a query's own id, an id held twice, a query judged only 0 and ties, from the search's
    first SEARCH_DEPTH rows (ties at the cut by the lower row, as RunningTopK keeps them) where BEIR reads every
    score. BEIR's MRR follows its results' order among equal scores (its search leaves that to a heap): they are
    given in trec_eval's order, the one raoe uses for all five metrics."""
    from beir.retrieval.evaluation import EvaluateRetrieval

    from evaluation.retrieval import SEARCH_DEPTH, rankings

    rng = np.random.default_rng(7)
    ids, queries, scores, qrels = _beir_cases(rng)
    task = RetrievalTask("cases", "-", queries, queries, qrels, ignore_identical_ids)
    order = np.lexsort((np.arange(len(ids))[None].repeat(len(queries), 0), -scores), axis=1)[:, :SEARCH_DEPTH]
    ranked = rankings(task, np.take_along_axis(scores, order, 1), order, lambda found: [ids[r] for r in found])
    means, per_query = score_rankings(task, ranked)

    results = {q: dict(sorted(((ids[r], float(scores[i, r])) for r in range(len(ids))),
                              key=lambda hit: (-hit[1], tuple(-ord(c) for c in hit[0]))))
               for i, q in enumerate(queries)}
    ndcg, _map, recall, _ = EvaluateRetrieval.evaluate(qrels, results, [10, 100], ignore_identical_ids)
    mrr = EvaluateRetrieval.evaluate_custom(qrels, results, [10], "mrr")
    beir = {"ndcg@10": ndcg["NDCG@10"], "recall@10": recall["Recall@10"], "recall@100": recall["Recall@100"],
            "map@100": _map["MAP@100"], "mrr@10": mrr["MRR@10"]}
    assert means == pytest.approx(beir, abs=1e-5)  # BEIR rounds to 5 decimals
    # each case is exercised: the rule decides the figure
    assert per_query["q0"]["ndcg@10"] == (1.0 if ignore_identical_ids else pytest.approx(1 / np.log2(3)))
    assert ranked["q1"][:3] == ["b", "c", "d"]  # "b" once
    assert per_query["q2"] == dict.fromkeys(per_query["q2"], 0.0) and "q2" in per_query
    assert ranked["q3"][:2] == ["d", "c"] and per_query["q3"]["mrr@10"] == 0.5
    assert 0 < per_query["q4"]["recall@100"] < 1


def test_an_index_looks_rows_up_shard_by_shard_without_holding_its_columns(tmp_path):
    """Shards of unequal sizes written as the actors write them; ``take`` returns the ids and texts of any rows,
    in the asked order, repeats included, and names a row outside the index."""
    from evaluation.corpus_index import CorpusIndex, write_shard

    rng = np.random.default_rng(4)
    texts = [f"text {i} " + "x" * int(rng.integers(0, 40)) for i in range(53)]
    names, start = [], 0
    for size in (16, 5, 20, 12):
        rows = range(start, start + size)
        batch = {"id": np.array([f"d{i}" for i in rows], dtype=object), "text": np.array([texts[i] for i in rows],
                 dtype=object), "embedding": rng.normal(size=(size, 3)).astype(np.float32)}
        names += write_shard(batch, str(tmp_path))["shard"]
        start += size
    (tmp_path / "meta.json").write_text(json.dumps({"rows": start, "dim": 3, "shards": names, "text": True}))
    index = CorpusIndex(tmp_path)
    asked = rng.integers(0, start, size=200)
    assert index.take("id", asked) == [f"d{i}" for i in asked]
    assert index.take("text", asked) == [texts[i] for i in asked]
    assert [off for off, _ in index.shards()] == [0, 16, 21, 41] and index.take("id", []) == []
    with pytest.raises(IndexError, match=r"\[0, 53\)"):
        index.take("id", [53])


def test_an_actor_keeps_the_shards_it_searches_within_its_budget(monkeypatch):
    """A search actor searches every block of queries against its shards: the shards that fit its budget are
    copied to its device once and kept (the same tensor at the next batch), the rest copied at each pass; the search
    through them equals the search over the whole corpus."""
    import torch

    from evaluation.search import RESIDENT_ENV, ResidentShards, RunningTopK

    rng = np.random.default_rng(3)
    shards = [rng.normal(size=(16, 4)).astype(np.float32) for _ in range(3)]
    resident = ResidentShards("cpu", budget_bytes=2 * shards[0].nbytes)
    first = [resident.get(16 * i, s) for i, s in enumerate(shards)]
    again = [resident.get(16 * i, s) for i, s in enumerate(shards)]
    assert again[0] is first[0] and again[1] is first[1] and again[2] is not first[2]  # the third is over budget
    assert all(torch.equal(t, torch.from_numpy(s)) for t, s in zip(again, shards))
    queries = rng.normal(size=(5, 4)).astype(np.float32)
    best = RunningTopK(len(queries), 7)
    for i, s in enumerate(shards):
        best.add(queries, resident.get(16 * i, s), 16 * i)
    expected = exact_top_k(queries, np.concatenate(shards), 7)
    np.testing.assert_array_equal(best.result()[1], expected[1])
    monkeypatch.setenv(RESIDENT_ENV, "0.5")
    assert ResidentShards("cpu").budget == 0.5 * 2**30


def test_a_row_with_nan_scores_ranks_them_first_as_topk_does_and_keeps_the_tie_rule():
    """A broken embedding scores NaN: torch.topk ranks NaN above every number, so the tie rule at the cut must count
    NaN as above it (it raised on a row whose cut was shared, NaN in front: ``[nan, nan, 1, 1]`` with 3 to take)."""
    import torch

    from evaluation.search import _top_lowest_first

    nan = float("nan")
    block = torch.tensor([[nan, nan, 1.0, 1.0, 0.0], [1.0, nan, 1.0, 1.0, 2.0], [0.0, 1.0, 1.0, 1.0, 1.0]])
    values, columns = _top_lowest_first(block, 3)
    assert columns.tolist() == [[0, 1, 2], [0, 1, 4], [1, 2, 3]]  # NaN first, then the lowest of the tied
    assert torch.equal(values.isnan(), block.gather(1, columns).isnan())


@pytest.mark.parametrize("chunk_rows, k", [(7, 5), (64, 100), (1000, 3)])
def test_chunked_search_equals_a_full_sort(chunk_rows, k):
    """Small integer vectors: every dot product is exact in float32 whatever the summation order of the CPU's
    matrix kernel, so the many ties here are real ties on any machine, and the lower row must come first (also where
    a chunk's k-th place is shared by more rows than fit)."""
    rng = np.random.default_rng(1)
    corpus = rng.integers(-3, 4, size=(300, 16)).astype(np.float32)
    queries = rng.integers(-3, 4, size=(23, 16)).astype(np.float32)
    corpus[17] = corpus[3]
    queries[0] = corpus[3]
    scores, rows = exact_top_k(queries, corpus, k, chunk_rows=chunk_rows)
    full = queries.astype(np.int64) @ corpus.astype(np.int64).T  # exact
    expected = np.argsort(-full, axis=1, kind="stable")[:, :k]
    np.testing.assert_array_equal(rows, expected)
    np.testing.assert_array_equal(scores, np.take_along_axis(full, expected, 1))
    assert rows[0, 0] == 3 and rows[0, 1] == 17
    kth = np.take_along_axis(full, expected[:, -1:], 1)
    above, tied = (full > kth).sum(1), (full == kth).sum(1)
    assert (tied > k - above).any()  # some query's k-th place is shared by more rows than fit: the boundary rule ran


def test_search_actors_holding_shards_between_them_equal_one_pass(tmp_path, ray_local, monkeypatch):
    """Three actors hold runs of an index's six shards of unequal sizes: their merged top-k equals one pass over the
    whole index, with real ties (small integer vectors: exact in float32 on any CPU) between shards that different
    actors hold ordered lower row first, k beyond one actor's rows and the query block split over calls; a
    Matryoshka size searched by the same actors scores as the cut, renormalised one-pass search."""
    from encoders.devices import EncoderPool
    from evaluation import search_actors as module
    from evaluation.corpus_index import CorpusIndex, write_shard
    from evaluation.search import normalised

    rng = np.random.default_rng(5)
    sizes = [16, 5, 20, 12, 30, 9]
    corpus = rng.integers(-3, 4, size=(sum(sizes), 8)).astype(np.float32)
    corpus[88] = corpus[2]  # the same row in the first actor's shards and the last's
    queries = rng.integers(-3, 4, size=(11, 8)).astype(np.float32)
    queries[0] = corpus[2]
    names, start = [], 0
    for size in sizes:
        rows = range(start, start + size)
        batch = {"id": np.array([f"d{i}" for i in rows], dtype=object), "embedding": corpus[start : start + size]}
        names += write_shard(batch, str(tmp_path))["shard"]
        start += size
    (tmp_path / "meta.json").write_text(json.dumps({"rows": start, "dim": 8, "shards": names, "text": False}))
    assert module.assign_shards(sizes, 3) == [[0, 1, 2], [3, 4], [5]]
    monkeypatch.setattr(module, "QUERIES_PER_CALL", 4)
    with module.search_actors(CorpusIndex.at(str(tmp_path)), EncoderPool(actors=3, cpus_per_actor=0.5)) as searcher:
        assert len(searcher.actors) == 3
        scores, rows = searcher.search(queries, 25)
        cut_scores, cut_rows = searcher.search(queries, 25, dim=4)
    full = queries.astype(np.int64) @ corpus.astype(np.int64).T  # exact
    expected = np.argsort(-full, axis=1, kind="stable")[:, :25]
    np.testing.assert_array_equal(rows, expected)
    np.testing.assert_array_equal(scores, np.take_along_axis(full, expected, 1))
    assert rows[0, 0] == 2 and rows[0, 1] == 88
    cosines = normalised(queries, 4).astype(np.float64) @ normalised(corpus, 4).astype(np.float64).T
    best = -np.sort(-cosines, axis=1)[:, :25]
    np.testing.assert_allclose(np.take_along_axis(cosines, cut_rows, 1), best, atol=1e-5)  # the best rows, any tie
    np.testing.assert_allclose(cut_scores, best, atol=1e-5)


def test_faiss_search_actors_are_exact_when_every_list_is_probed_and_measure_their_recall(tmp_path, ray_local):
    """eval.search / mining.search method faiss: each of two actors builds inverted lists over its shards. Probing
    every list scans every row, so the rows found are exact search's (the best scores, any tie); probing one list of
    many misses some, and the recall the actors report is the share of exact search's top-k that the approximate
    search found, recomputed here. A training job's dev retrieval refuses it by name."""
    from encoders.devices import EncoderPool
    from evaluation.corpus_index import CorpusIndex, write_shard
    from evaluation.search import exact_top_k, normalised
    from evaluation.search_actors import SearchMethod, search_actors
    from jobconfig.schema import EvalConfig, TrainEvalConfig

    rng = np.random.default_rng(6)
    corpus = normalised(rng.standard_normal((3000, 16), dtype=np.float32))
    queries = normalised(rng.standard_normal((40, 16), dtype=np.float32))
    names = []
    for start in range(0, 3000, 700):
        batch = {"id": np.array([f"d{i}" for i in range(start, min(3000, start + 700))], dtype=object),
                 "embedding": corpus[start : start + 700]}
        names += write_shard(batch, str(tmp_path))["shard"]
    (tmp_path / "meta.json").write_text(json.dumps({"rows": 3000, "dim": 16, "shards": names, "text": False}))
    index, pool = CorpusIndex.at(str(tmp_path)), EncoderPool(actors=2, cpus_per_actor=0.5)
    cosines = queries.astype(np.float64) @ corpus.astype(np.float64).T
    best = -np.sort(-cosines, axis=1)[:, :20]
    with search_actors(index, pool, SearchMethod("faiss", lists=16, probes=16, recall_queries=40)) as searcher:
        scores, rows = searcher.search(queries, 20)
        assert searcher.recall(queries, 20) == pytest.approx(1.0)
        _, cut_rows = searcher.search(queries, 20, dim=8)  # a Matryoshka size: lists built again over the cut rows
        again = searcher.search(queries, 20)[1]
    np.testing.assert_allclose(np.take_along_axis(cosines, rows, 1), best, atol=1e-5)
    np.testing.assert_allclose(scores, best, atol=1e-5)
    np.testing.assert_array_equal(again, rows)
    cut = normalised(queries, 8).astype(np.float64) @ normalised(corpus, 8).astype(np.float64).T
    np.testing.assert_allclose(np.take_along_axis(cut, cut_rows, 1), -np.sort(-cut, axis=1)[:, :20], atol=1e-5)
    with search_actors(index, pool, SearchMethod("faiss", lists=32, probes=1, recall_queries=40)) as searcher:
        _, found = searcher.search(queries, 20)
        recall = searcher.recall(queries, 20)
    _, truth = exact_top_k(queries, corpus, 20)
    shares = [len(set(f[f >= 0]) & set(t)) / 20 for f, t in zip(found, truth)]
    assert recall == pytest.approx(np.mean(shares)) and 0.05 < recall < 0.9
    assert EvalConfig.model_validate({"search": {"method": "faiss"}}).search.method_settings().approximate
    with pytest.raises(ValueError, match="eval.search.method: a training job's dev retrieval"):
        TrainEvalConfig.model_validate({"search": {"method": "faiss"}})


def write_beir(folder, corpus: dict[str, str], queries: dict[str, str], qrels: list[tuple[str, str, int]],
               split="test"):
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "corpus.jsonl", "w") as f:
        for i, (doc_id, text) in enumerate(corpus.items()):
            f.write(json.dumps({"_id": doc_id, "title": "" if i % 2 else "t", "text": text}) + "\n")
    with open(folder / "queries.jsonl", "w") as f:
        for qid, text in queries.items():
            f.write(json.dumps({"_id": qid, "text": text}) + "\n")
    (folder / "qrels").mkdir(exist_ok=True)
    lines = ["query-id\tcorpus-id\tscore"] + [f"{q}\t{d}\t{s}" for q, d, s in qrels]
    (folder / "qrels" / f"{split}.tsv").write_text("\n".join(lines) + "\n")
    return folder


def test_reader_keeps_judged_queries_and_names_bad_lines(tmp_path):
    folder = write_beir(tmp_path / "t", {"a": "x", "b": "y"}, {"q1": "one", "q2": "two", "q3": "three"},
                        [("q1", "a", 1), ("q2", "b", 0), ("q3", "b", 2)])
    task = read_task(str(folder), max_queries=5)
    assert task.query_ids == ["q1", "q2", "q3"]  # q2 has only a non-relevant judgement: BEIR counts it, as 0
    assert task.qrels == {"q1": {"a": 1}, "q2": {"b": 0}, "q3": {"b": 2}}
    assert read_task(str(folder), max_queries=2).query_ids == ["q1", "q2"]
    (folder / "queries.jsonl").write_text('{"_id": "q1", "text": "one"}\n{"_id": "q3"}\n')
    with pytest.raises(BeirFormatError, match=r"queries.jsonl:2: missing field\(s\) \['text'\]"):
        read_task(str(folder))
    with pytest.raises(BeirFormatError, match=r"no qrels/dev.tsv \(split 'dev'\); its splits: \['test'\]"):
        read_task(str(folder), split="dev")


WORDS = ("river stone music light paper garden window winter bread horse cloud silver market ocean engine forest "
         "candle violin desert harbor").split()


def _random_beir(tmp_path, rng, num_docs=60, num_queries=12):
    corpus = {f"doc{i}": " ".join(rng.choice(WORDS, size=int(rng.integers(3, 9)))) for i in range(num_docs)}
    queries = {f"q{i}": " ".join(rng.choice(WORDS, size=4)) for i in range(num_queries)}
    qrels = [(q, f"doc{int(d)}", 1) for q in queries for d in rng.choice(num_docs, size=int(rng.integers(1, 4)),
                                                                         replace=False)]
    return write_beir(tmp_path / "beir-tiny", corpus, queries, qrels), corpus, queries, qrels


# Query and document prompts and a query length (model.prompts): the evaluator encodes queries with encode_query and
# documents with encode_document, and so must raoe
SIDES = {"prompts": {"query": "query: ", "document": "passage: "}, "query_max_length": 8}


def _st_reference(model, corpus, queries, qrels, truncate_dim: int | None = None) -> dict[str, float]:
    """sentence-transformers' InformationRetrievalEvaluator on the same model and task (documents as title + text),
    queries through encode_query and documents through encode_document."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

    relevant: dict[str, set] = {}
    for q, d, _ in qrels:
        relevant.setdefault(q, set()).add(d)
    titled = {d: f"{'' if i % 2 else 't'} {t}".strip() for i, (d, t) in enumerate(corpus.items())}
    st = InformationRetrievalEvaluator(queries, titled, relevant, mrr_at_k=[10], ndcg_at_k=[10],
                                       precision_recall_at_k=[10, 100], map_at_k=[100], accuracy_at_k=[1],
                                       name="t", write_csv=False)
    return st(SentenceTransformer(str(model), device="cpu", truncate_dim=truncate_dim))


def test_sts_sentences_and_every_tasks_queries_share_one_encoding_pass(tmp_path, monkeypatch, ray_local):
    """The evaluate and promote jobs encode the suite's STS sentences and every retrieval task's queries in one Ray
    Data pass (one actor start and model load: about 5 s each here, where a pass per task took 5 actor starts for
    STS and two tasks), each text with its own side's prompt and max length; later calls read the table."""
    from encoders.backbone import build_encoder, export_encoder, inference_embeddings, load_encoder
    from encoders.sources import resolve_model_source
    from evaluation import encode as encode_module
    from evaluation.retrieval_suite import expect_queries

    model = export_encoder(build_encoder(resolve_model_source("tiny:bert"), max_length=32, **SIDES), tmp_path / "model")
    passes, real = [], encode_module.ray_encode
    monkeypatch.setattr(encode_module, "ray_encode", lambda *a, **kw: passes.append(kw) or real(*a, **kw))
    long = "which of these documents says the most about the cat on the mat today"  # longer than the query length
    tasks = [RetrievalTask("a", "a", ["q1", "q2"], ["a cat", long], {}),
             RetrievalTask("b", "b", ["q3"], ["the mat"], {})]
    sentences = ["a cat", "a dog runs", "the mat"]  # the same texts as queries: each side has its own embedding
    encodings = encode_module.Encodings(str(model), batch_size=2)
    expect_queries(encodings, tasks)
    got_sentences = encodings(sentences)
    got_queries = encodings([*tasks[0].query_texts, *tasks[1].query_texts], side="query")
    assert len(passes) == 1 and sorted(str(side) for side in passes[0]["sides"]) == ["None"] * 3 + ["query"] * 3
    encoder = load_encoder(str(model))
    np.testing.assert_allclose(got_sentences, inference_embeddings(encoder, sentences, 8), atol=1e-5)
    want = inference_embeddings(encoder, ["a cat", long, "the mat"], 8, "query")
    np.testing.assert_allclose(got_queries, want, atol=1e-5)
    assert not np.allclose(got_queries[[0, 2]], got_sentences[[0, 2]], atol=1e-3)  # the query prompt applied


def test_a_retrieval_dev_set_scores_as_the_evaluator_and_must_be_dev_sized(tmp_path):
    """The score that selects checkpoints in training (whole corpus in memory, in the worker) equals
    sentence-transformers' nDCG@10 x 100; a corpus over the cap is refused by name."""
    from encoders.backbone import build_encoder, export_encoder, inference_embeddings, load_encoder
    from encoders.sources import resolve_model_source
    from evaluation.retrieval import dev_ndcg_at_10, read_dev_set

    folder, corpus, queries, qrels = _random_beir(tmp_path, np.random.default_rng(5))
    model = export_encoder(build_encoder(resolve_model_source("tiny:bert"), max_length=32, **SIDES), tmp_path / "model")
    dev = read_dev_set(str(folder), split="test")
    assert dev.corpus_ids == list(corpus) and dev.task.name == "beir-tiny"
    encoder = load_encoder(str(model))
    got = dev_ndcg_at_10(lambda texts, side: inference_embeddings(encoder, texts, 16, side), dev)
    assert got == pytest.approx(100 * _st_reference(model, corpus, queries, qrels)["t_cosine_ndcg@10"], abs=1e-2)
    with pytest.raises(ValueError, match="eval.dev_retrieval: .* more than 59 documents"):
        read_dev_set(str(folder), split="test", max_documents=59)


def test_ray_suite_equals_sentence_transformers_evaluator(tmp_path, monkeypatch, ray_local, s3):
    """The whole path (Ray Data actors encode the corpus into cached shards, chunked top-100, BEIR metrics) against
    sentence-transformers' evaluator on the same tiny model; then the evaluate job on the same task copied to object
    storage (the local S3 endpoint), its plot written there, gives the same numbers from the cached shards (the
    index is keyed by the corpus's content, not its place).
    About 60 s: two evaluations on actor pools (processes that import the encoder stack and load the model), the
    first encoding the corpus and the queries, the second the queries alone, and sentence-transformers' evaluator
    twice (whole and truncated)."""
    from encoders.backbone import build_encoder, export_encoder
    from encoders.devices import EncoderPool
    from encoders.sources import resolve_model_source
    from evaluation import corpus_index as index_module
    from evaluation.retrieval_suite import evaluate_retrieval
    from jobconfig.schema import RetrievalTaskConfig

    monkeypatch.setenv("RAOE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(index_module, "SHARD_ROWS", 16)  # several shards: the running top-k crosses them
    folder, corpus, queries, qrels = _random_beir(tmp_path, np.random.default_rng(2))
    model = export_encoder(build_encoder(resolve_model_source("tiny:bert"), max_length=32, **SIDES), tmp_path / "model")
    tasks = [RetrievalTaskConfig.model_validate(str(folder))]
    per_query: dict = {}
    ours = evaluate_retrieval(str(model), tasks, pool=EncoderPool(), batch_size=8, per_query=per_query)
    index_dirs = list((tmp_path / "cache" / "corpus-embeddings").iterdir())
    meta_time = (index_dirs[0] / "meta.json").stat().st_mtime_ns
    used = (index_dirs[0] / "last_used").stat().st_mtime_ns
    again = _evaluate_job_on(s3.upload(folder, "beir-tiny"), model, tmp_path, monkeypatch, s3)
    assert len(index_dirs) == 1 and len(json.loads((index_dirs[0] / "meta.json").read_text())["shards"]) >= 4
    assert (index_dirs[0] / "meta.json").stat().st_mtime_ns == meta_time  # read from the cache, not rebuilt
    assert (index_dirs[0] / "last_used").stat().st_mtime_ns > used  # ... and its use recorded (least recent goes)
    assert again["retrieval"] == ours and again["metrics"]["STSBenchmark"] is None  # no STS data: absent
    # eval.dims: the same index searched at the leading 16 of 32 dimensions, as sentence-transformers' truncate_dim
    cut = _st_reference(model, corpus, queries, qrels, truncate_dim=16)
    assert again["dims"]["16"]["retrieval"]["beir-tiny"]["ndcg@10"] == pytest.approx(cut["t_cosine_ndcg@10"], abs=1e-4)
    assert again["dims"]["16"]["retrieval"]["beir-tiny"]["ndcg@10"] != ours["beir-tiny"]["ndcg@10"]

    reference = _st_reference(model, corpus, queries, qrels)
    got = ours["beir-tiny"]
    for metric, key in [("ndcg@10", "ndcg@10"), ("mrr@10", "mrr@10"), ("recall@10", "recall@10"),
                        ("recall@100", "recall@100"), ("map@100", "map@100")]:
        assert got[metric] == pytest.approx(reference[f"t_cosine_{key}"], abs=1e-4), metric
    assert set(per_query["beir-tiny"]) == set(queries)


def _evaluate_job_on(task: str, model, tmp_path, monkeypatch, s3) -> dict:
    from jobconfig import load_config
    from storage.paths import storage_path

    jobs = str(Path(__file__).resolve().parents[2] / "ray_jobs")
    sys.path.insert(0, jobs)
    try:
        import evaluate as job
    finally:
        sys.path.remove(jobs)
    from tests.conftest import mlflow_store

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_store(tmp_path))
    monkeypatch.setenv("RAOE_MLFLOW_ARTIFACTS", str(tmp_path / "artifacts"))
    cfg = load_config(job.EvaluateJobConfig, None, [
        f"model.source={model}", f"eval.retrieval=[{task}]", f"eval.data_dir={tmp_path / 'no-sts'}",
        "eval.batch_size=8", f"output_dir={s3.uri('eval')}", "tracking.experiment=raoe-test", "cpus_per_actor=0.5",
        "eval.dims=[16]"])
    result = job.main(cfg)
    assert result["retrieval_plot"].startswith(s3.uri("eval/")) and result["retrieval_plot"].endswith("-retrieval.png")
    assert storage_path(result["retrieval_plot"]).read_bytes().startswith(b"\x89PNG")
    return result


def test_config_names_tasks_and_promotion_scores_them_next_to_sts(tmp_path):
    from pydantic import ValidationError

    from jobconfig.schema import EvalConfig
    from tracking.promotion import evaluation_key, suite_scores

    folder = write_beir(tmp_path / "snli-test", {"d1": "x", "d2": "y"}, {"q1": "one"}, [("q1", "d1", 1)])
    cfg = EvalConfig(retrieval=[str(folder), {"source": "hf:zeta-alpha-ai/NanoFiQA2018", "split": "train"}])
    assert [t.task_name for t in cfg.retrieval] == ["snli-test", "NanoFiQA2018"]
    key = evaluation_key(cfg)
    write_beir(folder, {"d1": "x", "d2": "y"}, {"q1": "one"}, [("q1", "d2", 1)])  # regenerated at the same path
    assert evaluation_key(cfg) != key  # remembered scores of the old judgements are not reused
    assert evaluation_key(EvalConfig(retrieval=[{"source": str(folder), "ignore_identical_ids": False}])) != \
        evaluation_key(EvalConfig(retrieval=[str(folder)]))
    with pytest.raises(ValidationError, match=r"task name\(s\) \['snli-test'\] appear twice"):
        EvalConfig(retrieval=[str(tmp_path / "snli-test"), str(tmp_path / "other" / "snli-test")])
    assert evaluation_key(cfg) != evaluation_key(EvalConfig())  # results on other retrieval tasks are not reused
    assert evaluation_key(EvalConfig(retrieval=[])) == evaluation_key(EvalConfig())
    assert evaluation_key(cfg, 128) != evaluation_key(cfg)  # a Matryoshka size's results are remembered apart
    scores = suite_scores({"STSBenchmark": 80.0, "STS12": None, "avg": 80.0}, {"snli-test": {"ndcg@10": 0.5}})
    assert scores == {"STSBenchmark": 80.0, "STS12": None, "snli-test": 50.0, "avg": 65.0}


def test_a_dev_task_reads_the_dev_split_unless_told_and_a_missing_hub_split_is_named(monkeypatch):
    """eval.dev_retrieval selects checkpoints: it reads 'dev' (never the test judgements) unless its split says; a
    hub dataset without the split asked for is an error naming the ones it has, not a silent first split."""
    import datasets

    from jobconfig.schema import TrainEvalConfig

    assert TrainEvalConfig(dev_retrieval="outputs/beir/x").dev_retrieval.split == "dev"
    assert TrainEvalConfig(dev_retrieval={"source": "outputs/beir/x", "split": "test"}).dev_retrieval.split == "test"
    assert TrainEvalConfig(retrieval=["outputs/beir/x"]).retrieval[0].split == "test"  # evaluation: test, as BEIR

    def hub(name, config=None, split=None):
        if config == "queries":
            return {"queries": [{"_id": "q1", "text": "one"}]}
        return {"train": [{"query-id": "q1", "corpus-id": "d1", "score": 1}]}

    monkeypatch.setattr(datasets, "load_dataset", hub)
    assert read_task("hf:someone/nano", split="train").qrels == {"q1": {"d1": 1}}
    with pytest.raises(BeirFormatError, match=r"hf:someone/nano: no qrels split 'dev'; its splits: \['train'\]"):
        read_task("hf:someone/nano", split="dev")


def test_promotion_guards_must_name_suite_tasks():
    from pydantic import ValidationError

    jobs = str(Path(__file__).resolve().parents[2] / "ray_jobs")
    sys.path.insert(0, jobs)
    try:
        import promote
    finally:
        sys.path.remove(jobs)
    ok = promote.PromoteJobConfig(guard_tasks=["STSBenchmark", "snli-test"], eval={"retrieval": ["x/snli-test"]})
    assert ok.guard_tasks == ["STSBenchmark", "snli-test"]
    with pytest.raises(ValidationError, match=r"guard_tasks: \['nq'\] not in the suite"):
        promote.PromoteJobConfig(guard_tasks=["nq"])


def test_a_cached_index_that_lost_a_file_is_built_again_and_killed_builds_go_after_a_day(tmp_path):
    """The corpus-index cache follows the corpus cache's rules: an index is used only when its shards are all there
    with the rows meta.json counts; a killed builder's staging folder is removed once a day old."""
    import os
    import time

    from evaluation.corpus_index import index_problem, remove_stale_builds, write_shard

    folder = tmp_path / "index"
    folder.mkdir()
    shards = [write_shard({"id": np.array(["a", "b"]), "embedding": np.eye(2, dtype=np.float32)}, str(folder))
              for _ in range(2)]
    names = [s["shard"][0] for s in shards]
    meta = {"rows": 4, "dim": 2, "shards": names, "text": False}
    (folder / "meta.json").write_text(json.dumps(meta))
    assert index_problem(folder) is None
    (folder / "meta.json").write_text(json.dumps({**meta, "rows": 5}))
    assert index_problem(folder) == "its shards hold 4 rows where meta.json counts 5"
    (folder / "meta.json").write_text(json.dumps(meta))
    (folder / f"{names[1]}.arrow").unlink()
    assert index_problem(folder) == f"shard {names[1]}.arrow is missing"
    (folder / f"{names[0]}.npy").unlink()
    assert index_problem(folder) == f"shard {names[0]}.npy is missing"
    (folder / "meta.json").write_text("{")
    assert index_problem(folder).startswith("it cannot be read (JSONDecodeError")
    old, fresh = tmp_path / ".key.12-ab.tmp", tmp_path / ".key.13-cd.tmp"
    for staging, age in ((old, 2 * 86400), (fresh, 3600)):
        (staging / "part").mkdir(parents=True)
        (staging / "part" / "x.npy").write_bytes(b"x")
        for path in (staging / "part" / "x.npy", staging / "part", staging):
            os.utime(path, (time.time() - age, time.time() - age))
    assert remove_stale_builds(tmp_path) == [old.name] and fresh.exists() and not old.exists()


@pytest.mark.parametrize("blocks, actors", [
    ([(0, 29_990)], 2), ([(0, 150)] * 199 + [(0, 140)], 2), ([(0, 24_962)] * 3 + [(0, 24_964)], 2),
    ([(0, 24_962)] * 3 + [(0, 24_964)], 1), ([(3, 10), (0, 0), (5, 9), (0, 40)], 4), ([(0, 5)], 4),
    ([(0, 1_000)], 64), ([(0, 25_000)] * 40, 64), ([], 2)])
def test_an_index_is_cut_into_rounds_of_even_shards_for_the_actors_whatever_its_blocks(blocks, actors):
    """Shards of at most SHARD_ROWS rows, sizes within one row, a whole number of rounds of the pool's actors (fewer
    only where there are fewer rows than actors), their pieces taking every row of every block once, in order, across
    block ends: one block of 29,990 rows on 2 actors is 2 shards (one actor encoded it all), so are 200 blocks of
    150."""
    from evaluation.corpus_index import SHARD_ROWS, shard_pieces

    shards = shard_pieces(blocks, actors)
    total = sum(end - start for start, end in blocks)
    assert len(shards) == min(total, actors * -(-total // (SHARD_ROWS * actors)))
    sizes = [sum(stop - start for _, start, stop in pieces) for pieces in shards]
    assert max(sizes, default=0) <= SHARD_ROWS and max(sizes, default=0) - min(sizes, default=0) <= 1
    rows = [(block, row) for pieces in shards for block, start, stop in pieces for row in range(start, stop)]
    assert rows == [(block, row) for block, (start, end) in enumerate(blocks) for row in range(start, end)]


def test_the_index_cache_keeps_under_its_limit_by_least_recent_use(tmp_path):
    """RAOE_INDEX_CACHE_MAX_GB: after a build, whole indexes go by least recent use until the cache fits; never the
    one just built, one used within the grace period (15 minutes: another job may be searching it, and a search
    marks its index every 5 minutes) or a build in progress."""
    import os
    import time

    from evaluation.corpus_index import LAST_USED, evict_least_recent

    now = time.time()
    for name, hours_ago in (("old", 48), ("older", 72), ("recent", 0.1), ("built", 0)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "0.npy").write_bytes(b"x" * 1000)
        (tmp_path / name / "meta.json").write_text("{}")
        (tmp_path / name / LAST_USED).touch()
        os.utime(tmp_path / name / LAST_USED, (now - hours_ago * 3600,) * 2)
    (tmp_path / ".built.1-ab.tmp").mkdir()
    (tmp_path / ".built.1-ab.tmp" / "0.npy").write_bytes(b"x" * 1000)
    removed = evict_least_recent(tmp_path, max_gb=2500e-9, keep="built", now=now)
    assert [r.split()[0] for r in removed] == ["older", "old"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".built.1-ab.tmp", "built", "recent"]
    assert evict_least_recent(tmp_path, max_gb=500e-9, keep="built", now=now) == []  # the rest is in use


def test_an_index_cache_on_object_storage_gives_the_evaluator_numbers_and_each_node_copies_it_once(tmp_path, monkeypatch,
                                                                                               ray_local, s3):
    """RAOE_INDEX_CACHE on object storage (the local S3 endpoint): the actors write the shards there and meta.json
    commits them; the driver copies only the index's id column to its node, once. The metrics are sentence-
    transformers' (as for a local cache, above); a second evaluation reads the index (nothing written again).
    About 30-50 s: each of the two evaluations starts its encoder actor pools (the corpus, the queries), the one way
    to show the shards written by the actors to S3 and searched from the node's copy."""
    from encoders.backbone import build_encoder, export_encoder
    from encoders.devices import EncoderPool
    from encoders.sources import resolve_model_source
    from evaluation import corpus_index as index_module
    from evaluation.retrieval_suite import evaluate_retrieval
    from jobconfig.schema import RetrievalTaskConfig
    from storage.paths import files_under, storage_path

    monkeypatch.setenv("RAOE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("RAOE_NODE_CACHE", str(tmp_path / "node"))
    monkeypatch.setattr(index_module, "SHARD_ROWS", 16)
    folder, corpus, queries, qrels = _random_beir(tmp_path, np.random.default_rng(5))
    model = str(export_encoder(build_encoder(resolve_model_source("tiny:bert"), max_length=32), tmp_path / "model"))
    tasks = [RetrievalTaskConfig.model_validate(str(folder))]
    monkeypatch.setenv("RAOE_INDEX_CACHE", s3.uri("indexes"))
    on_s3 = evaluate_retrieval(model, tasks, pool=EncoderPool(), batch_size=8)["beir-tiny"]
    reference = _st_reference(model, corpus, queries, qrels)
    for metric in ("ndcg@10", "mrr@10", "recall@10", "recall@100", "map@100"):
        assert on_s3[metric] == pytest.approx(reference[f"t_cosine_{metric}"], abs=1e-4), metric
    assert not (tmp_path / "cache" / "corpus-embeddings").exists()  # nothing in the local cache
    stored = sorted(files_under(storage_path(s3.uri("indexes"))))
    meta = json.loads(storage_path(s3.uri(f"indexes/{stored[0][0].split('/')[0]}/meta.json")).read_text())
    assert len(meta["shards"]) >= 4 and {name.split("/")[0] for name, _, _ in stored} == {stored[0][0].split("/")[0]}
    assert evaluate_retrieval(model, tasks, pool=EncoderPool(), batch_size=8)["beir-tiny"] == on_s3
    again = sorted(files_under(storage_path(s3.uri("indexes"))))
    assert [f for f in again if not f[0].endswith("last_used")] == [f for f in stored if not f[0].endswith(
        "last_used")]  # read, not built again
    copies = sorted(p.name for p in (tmp_path / "node").iterdir() if p.is_dir())
    assert [c.split("-", 3)[-1] for c in copies] == ["columns"], copies  # the driver: the ids of the rows found,
    # once for both evaluations, and no embeddings (the search actor copies its shards' on its node)


def test_an_error_of_the_store_is_no_evidence_that_a_cached_index_is_broken(tmp_path, monkeypatch, s3):
    """Any OSError while checking a cached index (an S3 SlowDown, a timeout) once counted as "cannot be read": the
    shared index that other jobs were searching was removed and built again. Only definite evidence (a missing
    shard, a size or row count that disagrees with meta.json, a meta.json that is not one) rebuilds it."""
    import evaluation.corpus_index as corpus_index
    from storage.paths import files_under, storage_path

    location, built = s3.uri("index"), []

    def build(folder):
        built.append(folder)
        names = corpus_index.write_shard({"id": np.array(["d0", "d1"], dtype=object),
                                          "embedding": np.ones((2, 3), dtype=np.float32)}, folder)["shard"]
        storage_path(f"{folder}/meta.json").write_text(json.dumps({"rows": 2, "dim": 3, "shards": names,
                                                                   "shard_rows": [2], "text": False}))
        return names

    names = build(location)
    stored = sorted(name for name, _, _ in files_under(storage_path(location)))

    def slow_down(place):
        raise OSError("Please reduce your request rate. (SlowDown)")

    with monkeypatch.context() as patch:
        patch.setattr(corpus_index, "files_under", slow_down)
        with pytest.raises(OSError, match=r"could not check the cached corpus index .* left as it is"):
            corpus_index._on_object_storage(build, location)
    assert built == [location] and set(stored) <= {name for name, _, _ in files_under(storage_path(location))}
    assert not corpus_index._on_object_storage(build, location).built  # whole: read, not built again
    storage_path(f"{location}/{names[0]}.npy").write_bytes(b"cut")  # definite: a shard of another size
    assert corpus_index._on_object_storage(build, location).built and built == [location, location]


def test_a_use_longer_than_the_grace_period_keeps_its_mark_fresh(tmp_path, monkeypatch):
    """A search or a read longer than the grace period rewrites its entry's marker every REFRESH_S (an index in a
    search longer than the hour it was given was evicted by another job); a use that ended stops."""
    import time

    from storage import in_use

    monkeypatch.setattr(in_use, "REFRESH_S", 0.2)
    marker = tmp_path / "entry" / "last_used"
    with in_use.held(str(marker)):
        first = marker.stat().st_mtime_ns
        time.sleep(1.0)
        assert marker.stat().st_mtime_ns > first
    time.sleep(0.5)
    ended = marker.stat().st_mtime_ns
    time.sleep(0.6)
    assert marker.stat().st_mtime_ns == ended


def test_a_node_copies_only_the_parts_of_an_index_on_object_storage_that_it_reads(tmp_path, monkeypatch, s3):
    """An index on object storage is checked whole from one listing (each shard's files, their sizes against
    meta.json's row counts), and read through node copies of what is read: the ids and texts alone for a join or a
    lookup, a search actor's own shards' embeddings alone (not the whole index on every node); rows anywhere (a
    mining batch's known positives) by ranged reads, copying nothing."""
    from evaluation.corpus_index import CorpusIndex, index_problem, write_shard
    from storage.paths import storage_path

    monkeypatch.setenv("RAOE_NODE_CACHE", str(tmp_path / "node"))
    rng, location, names, stored = np.random.default_rng(0), s3.uri("index"), [], []
    for shard in range(4):
        emb = rng.standard_normal((3, 5)).astype(np.float32)
        names += write_shard({"id": np.array([f"d{shard}{i}" for i in range(3)], dtype=object), "embedding": emb,
                              "text": np.array([f"text {shard}{i}" for i in range(3)], dtype=object)}, location)["shard"]
        stored.append(emb)
    meta = {"rows": 12, "dim": 5, "shards": names, "shard_rows": [3] * 4, "text": True}
    storage_path(f"{location}/meta.json").write_text(json.dumps(meta))
    assert index_problem(location) is None

    def held():
        return {p.name.split("-", 3)[-1]: sorted(f.name for f in p.iterdir() if f.name != ".complete")
                for p in (tmp_path / "node").iterdir() if p.is_dir()}

    index = CorpusIndex.at(location)
    assert index.ids_and_rows(0, 4)["row"].to_pylist() == list(range(12)) and index.take("text", [4]) == ["text 11"]
    assert held() == {"columns": sorted([f"{n}.arrow" for n in names] + ["meta.json"])}
    searcher = CorpusIndex.at(location)
    searcher.hold([2, 3])
    for number in (2, 3):
        offset, rows = searcher.shard(number)
        assert offset == 3 * number and np.array_equal(rows, stored[number])
    assert held()["embeddings-2-3-2"] == sorted([f"{names[2]}.npy", f"{names[3]}.npy", "meta.json"])
    reader = CorpusIndex.at(location)  # rows anywhere (a mining batch's positives): read by ranges, nothing copied
    np.testing.assert_array_equal(reader.embeddings([10, 1, 11]), [stored[3][1], stored[0][1], stored[3][2]])
    assert "embeddings" not in held()
    assert sum(len(rows) for _, rows in reader.shards()) == 12  # every shard's: the whole embeddings copied once
    assert len(held()["embeddings"]) == 5
    np.testing.assert_array_equal(reader.embeddings([4]), stored[1][1:2])  # now from that copy

    storage_path(f"{location}/meta.json").write_text(json.dumps({**meta, "shard_rows": [3, 3, 4, 2]}))
    assert index_problem(location).startswith(f"shard {names[2]}.npy holds ")  # its size is 3 rows', not 4
    storage_path(f"{location}/{names[1]}.npy").unlink()
    assert index_problem(location) == f"shard {names[1]}.npy is missing"


def test_the_index_cache_on_object_storage_keeps_under_its_limit_by_least_recent_use(s3):
    """The same least-recent-use rule over an object-store prefix, from one listing; a build in progress (shards
    written in place, no meta.json yet) is neither counted nor removed."""
    import time

    from evaluation.corpus_index import LAST_USED, evict_least_recent
    from storage.paths import storage_path

    root = s3.uri("evict")
    storage_path(f"{root}/building/0.npy").write_bytes(b"x" * 5000)
    for name in ("older", "old", "built"):
        storage_path(f"{root}/{name}/0.npy").write_bytes(b"x" * 1000)
        storage_path(f"{root}/{name}/meta.json").write_text("{}")
        storage_path(f"{root}/{name}/{LAST_USED}").write_text("used\n")
        time.sleep(1.1)  # an object's time is its upload's, to the second
    removed = evict_least_recent(root, max_gb=1500e-9, keep="built", now=time.time() + 7200)
    assert [r.split()[0] for r in removed] == ["older", "old"]
    assert sorted(p.name for p in storage_path(root).iterdir()) == ["building", "built"]
