"""Hard-negative mining: the job's groups equal a brute-force reference (exact search over every corpus text, known
positives and the query dropped, the margins against the query's lowest positive score, hardest first) computed
here with the same model, and sentence-transformers' mine_hard_negatives itself; its counts add up; its output,
query groups, trains a Stage 1 job."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import private_stores

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


def _reference(model_dir, pairs, corpus, rules: dict, teacher_dir=None, labelled: dict[str, set] | None = None):
    """{query: its negatives, hardest first}, queries left without one, candidates dropped: each query's first
    range_max texts by the mining model (its known positives, its ``labelled`` negatives and itself left out), ranked
    by the scorer (the teacher where there is one), kept within the margins below the query's lowest positive score
    and the score bounds, the first range_min skipped, the hardest taken to fill negatives_per_row after the hardest
    of its labelled negatives (outside the margins; a query they fill is not searched). Queries encode on the query
    side, candidates, positives and labelled negatives on the document side (their prompts, model.prompts)."""
    from encoders.backbone import inference_embeddings, load_encoder
    from evaluation.search import normalised

    r = {"range_min": 0, "absolute_margin": None, "relative_margin": None, "max_score": None, "min_score": None} | rules
    model = load_encoder(model_dir)
    scorer = load_encoder(teacher_dir) if teacher_dir else model
    texts = sorted(set(corpus))
    emb = normalised(inference_embeddings(model, texts, side="document"))
    scored = normalised(inference_embeddings(scorer, texts, side="document"))
    known: dict[str, set] = {}
    for row in pairs:
        known.setdefault(row["query"], set()).add(row["positive"])
    expected, without, dropped = {}, 0, 0
    for query, positives in known.items():
        given = sorted((labelled or {}).get(query, set()) - positives)
        q = normalised(inference_embeddings(model, [query], side="query"))[0]
        order = [i for i in np.argsort(-(emb @ q), kind="stable") if texts[i] not in positives | set(given) | {query}]
        order = order[: r["range_max"]] if len(given) < r["negatives_per_row"] else []  # full: not searched
        q = normalised(inference_embeddings(scorer, [query], side="query"))[0]
        scores = scored @ q
        p = min(float(normalised(inference_embeddings(scorer, [t], side="document"))[0] @ q) for t in positives)
        ranked = [i for i in sorted(order, key=lambda i: -scores[i])
                  if (r["absolute_margin"] is None or scores[i] <= p - r["absolute_margin"])
                  and (r["relative_margin"] is None or scores[i] <= p - abs(p) * r["relative_margin"])
                  and (r["max_score"] is None or scores[i] <= r["max_score"])
                  and (r["min_score"] is None or scores[i] >= r["min_score"])]
        dropped += len(order) - len(ranked)
        given_scores = normalised(inference_embeddings(scorer, given, side="document")) @ q if given else []
        kept = sorted(zip(given_scores, given), reverse=True)[: r["negatives_per_row"]]
        kept += [(scores[i], texts[i]) for i in ranked[r["range_min"]:][: r["negatives_per_row"] - len(kept)]]
        negatives = [t for _, t in sorted(kept, key=lambda k: -k[0])]
        without += not negatives
        if negatives:
            expected[query] = negatives
    return expected, without, dropped


def test_mined_rows_equal_a_brute_force_reference_with_a_teacher(ray_local, tmp_path, monkeypatch, s3):
    """Relative margin against each query's lowest positive, range_min, a teacher re-scoring (the tiny model pooled
    by its last token: other scores, so other candidates pass the margin than the mining model's own scores would let
    through) from its own index of the corpus, row for row the mining model's (the queries may find every corpus
    text); the corpus lacks a third of the positives, which the teacher encodes; the mining model has query and
    document prompts, which the reference applies by side. Both indexes are kept on object storage (the local S3
    endpoint, RAOE_INDEX_CACHE): the teacher's is built from the mining model's there, the actors read both by their
    URIs, and the driver copies neither. About 60 s alone here (as long with a local cache): the one run of the
    teacher path end to end starts four actor pools (the corpus, the teacher's index of it, the queries, the teacher's
    mining actors), each a process that imports the encoder stack and loads its model."""
    from encoders.backbone import build_encoder, export_encoder
    from encoders.sources import resolve_model_source
    from storage.paths import files_under, join, storage_path

    private_stores(monkeypatch, tmp_path)
    monkeypatch.setenv("RAOE_INDEX_CACHE", s3.uri("indexes"))
    monkeypatch.setenv("RAOE_NODE_CACHE", str(tmp_path / "node"))
    rng = np.random.default_rng(3)
    pairs = _pairs(rng)
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in pairs))
    extra = [" ".join(rng.choice(WORDS, size=5)) for _ in range(30)]
    positives = list(dict.fromkeys(r["positive"] for r in pairs))
    held, missing = positives[::3] + positives[1::3], positives[2::3]  # the corpus lacks a third of the positives
    assert all(sum(r["positive"] == m for r in pairs) == 1 for m in missing)  # each paired once: encoded once
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(extra + held) + "\n")
    sides = {"query": "query: ", "document": "passage: "}
    model = export_encoder(build_encoder(resolve_model_source("tiny:bert"), max_length=32, prompts=sides),
                           tmp_path / "model")
    teacher = export_encoder(build_encoder(resolve_model_source("tiny:bert"), max_length=32, pooling="last_token"),
                             tmp_path / "teacher")
    job = _mine_job()
    cfg = job.MineJobConfig(data={"train": str(data)}, output_dir=str(tmp_path / "mined"), cpus_per_actor=0.5,
                            mining={"model": str(model), "corpus": str(corpus), "range_max": 40, "range_min": 1,
                                    "relative_margin": 0.001, "negatives_per_row": 2, "queries_per_batch": 4,
                                    "teacher": str(teacher)},
                            tracking={"experiment": "raoe-test"})
    result = job.main(cfg)
    written = [json.loads(line) for f in sorted(Path(result["output_path"]).glob("*.json*")) for line in open(f)]
    got = {r["query"]: r["negatives"] for r in written}
    texts = extra + held
    rules = {"range_max": 40, "range_min": 1, "relative_margin": 0.001, "negatives_per_row": 2}
    expected, without, dropped = _reference(model, pairs, texts, rules, teacher)
    assert expected != _reference(model, pairs, texts, rules)[0]  # the teacher matters here
    assert got == expected and sum(map(len, got.values())) == result["negatives_written"]
    known = {}
    for r in pairs:
        known.setdefault(r["query"], set()).add(r["positive"])
    assert len(written) == result["rows_written"] == result["queries_in"] - result["rows_without_negative"] > 0
    assert result["rows_in"] == len(pairs) and result["pairs_in"] == len({(r["query"], r["positive"]) for r in pairs})
    assert result["queries_in"] == len(known) and result["pairs_in"] > len(known)  # queries with two positives
    assert result["rows_without_negative"] == without and result["candidates_dropped_by_margin"] == dropped
    assert result["positives_encoded"] == len(missing)  # the teacher encoded those the corpus lacks, the others it read
    # The teacher encoded the corpus once, into an index of the same rows as the mining model's (cached beside it):
    # row r of both is one text, and the teacher's stored embedding of it is its own encoding.
    from encoders.backbone import inference_embeddings, load_encoder
    from evaluation.corpus_index import CorpusIndex
    from evaluation.search import normalised

    assert result["index_path"].startswith(s3.uri("indexes/")) and not list((tmp_path / "node").glob("index-*/"))
    assert not list((tmp_path / "cache").rglob("meta.json"))  # no index in the local cache
    kept = [join(s3.uri("indexes"), name.removesuffix("/meta.json"))
            for name, _, _ in files_under(storage_path(s3.uri("indexes"))) if name.endswith("/meta.json")]
    indexes = [CorpusIndex.at(folder) for folder in kept]  # each reads its meta.json once
    aligned = [index for index in indexes if index.meta.get("aligned_with")]
    assert len(indexes) == 2 and len(aligned) == 1 and aligned[0].meta["model_path"] == str(teacher)
    assert aligned[0].meta["aligned_with"] == result["index_path"]
    own = CorpusIndex.at(aligned[0].meta["aligned_with"])
    rows = np.arange(own.rows)
    encoded = normalised(inference_embeddings(load_encoder(teacher), own.take("text", rows), side="document"))
    np.testing.assert_allclose(aligned[0].embeddings(rows), encoded, atol=1e-5)
    assert sum(result["histogram"]["negative"]) == result["negatives_written"]
    for group in written:  # every positive of the query, at most negatives_per_row negatives, the teacher's scores
        assert set(group["positives"]) == known[group["query"]] and 1 <= len(group["negatives"]) <= 2
        assert len(group["positive_scores"]) == len(group["positives"])
        assert len(group["negative_scores"]) == len(group["negatives"]) and not set(group["negatives"]) & set(
            group["positives"])
        lowest = min(group["positive_scores"])
        assert max(group["negative_scores"]) <= lowest - abs(lowest) * 0.001 + 1e-6
    assert Path(result["plot"]).exists()
    assert dropped > 0 and without > 0  # the margin really drops candidates here, and leaves some queries without


def test_nli_pairs_mine_among_their_entailments_and_train_as_query_groups(ray_local, tmp_path, monkeypatch, s3):
    """Labelled NLI pairs: only entailment pairs are (query, positive); a premise's contradictions are its negatives
    before any mined one (mining.labelled_negatives), never candidates, outside the margin; the default corpus is the
    positives; an absolute margin; the groups, written by the tasks to object storage (the local S3 endpoint), equal the
    brute-force reference, read back from there as query groups and train a Stage 1 job (groups of 3, query and
    document prompts, Matryoshka at 32/16/8 dimensions, distilled from the mining scores) straight from that
    storage. The corpus index is kept on that storage too (RAOE_INDEX_CACHE): the driver checks it from a listing and
    copies none of it (here, under this test's RAOE_NODE_CACHE), and the mining tasks and actors open the index by
    its URI (the parts they read, in the shared Ray's own node cache) and find the rows the reference finds.
    About 35 s: the mine job's actor pools, then a Stage 1 training run on what it wrote."""
    from data_pipelines.readers import load_corpus
    from encoders.sources import resolve_model_source
    from storage.paths import storage_path

    private_stores(monkeypatch, tmp_path)
    monkeypatch.setenv("RAOE_INDEX_CACHE", s3.uri("indexes"))
    monkeypatch.setenv("RAOE_NODE_CACHE", str(tmp_path / "node"))
    job = _mine_job()
    source = ROOT / "configs" / "tiny" / "data" / "nli_pairs.jsonl"
    rows = [json.loads(line) for line in open(source)]
    entailed = {(r["text1"], r["text2"]) for r in rows if r["label"] == "entailment"}
    positives, contradictions = {}, {}
    for q, p in entailed:
        positives.setdefault(q, set()).add(p)
    for r in rows:
        if r["label"] == "contradiction" and r["text1"] in positives:
            contradictions.setdefault(r["text1"], set()).add(r["text2"])
    cfg = job.MineJobConfig(data={"train": str(source)}, output_dir=s3.uri("mined"), cpus_per_actor=0.5,
                            mining={"model": "tiny:bert", "range_max": 40, "absolute_margin": 0.01,
                                    "relative_margin": None, "negatives_per_row": 2,
                                    "labelled_negatives": ["contradiction"]}, tracking={"experiment": "raoe-test"})
    result = job.main(cfg)
    as_pairs = [{"query": q, "positive": p} for q, p in sorted(entailed)]
    expected, without, dropped = _reference(resolve_model_source("tiny:bert"), as_pairs, [p for _, p in entailed],
                                            {"range_max": 40, "absolute_margin": 0.01, "negatives_per_row": 2},
                                            labelled=contradictions)
    given = {q: c - positives[q] for q, c in contradictions.items()}
    assert {1, 2} <= {len(c) for c in given.values()} and len(given) > 5  # premises with one and with several
    assert result["labelled_negatives_written"] == sum(min(2, len(c)) for c in given.values())
    assert result["rows_in"] == len(rows) and result["pairs_in"] == len(entailed)
    assert result["corpus_rows"] == len({p for _, p in entailed})
    assert result["positives_encoded"] == 0  # each positive scored from its embedding in the index (on S3)
    corpus = {p for _, p in entailed}  # the labelled negatives the corpus lacks are encoded, once each (one call)
    assert result["labelled_negatives_encoded"] == len(set().union(*given.values()) - corpus) > 0
    assert result["output_path"] == s3.uri("mined/data") and result["plot"] == s3.uri("mined/scores.png")
    assert result["index_path"].startswith(s3.uri("indexes/")) and not list((tmp_path / "node").glob("index-*/"))
    assert storage_path(result["plot"]).read_bytes().startswith(b"\x89PNG")
    ds, report = load_corpus("groups", result["output_path"], fmt="groups_jsonl")
    mined = ds.take_all()
    assert report.rows_written == result["rows_written"] == len(mined) > 0
    assert {r["query"]: set(r["negatives"]) for r in mined} == {q: set(n) for q, n in expected.items()}  # the
    # order is checked below by the job's own scores: a near tie may order two otherwise
    assert (result["rows_without_negative"], result["candidates_dropped_by_margin"]) == (without, dropped)
    assert all({(r["query"], p) for p in r["positives"]} <= entailed and len(r["negatives"]) for r in mined)
    for r in mined:  # hardest first; the mined ones under the absolute margin below the query's lowest positive
        assert list(r["negative_scores"]) == sorted(r["negative_scores"], reverse=True)
        mined_scores = [s for t, s in zip(r["negatives"], r["negative_scores"]) if t not in given.get(r["query"], ())]
        assert max(mined_scores, default=-1) <= min(r["positive_scores"]) - 0.01 + 1e-6
        assert len(given.get(r["query"], ())) <= 2 or set(r["negatives"]) <= given[r["query"]]
    assert any(max(r["negative_scores"]) > min(r["positive_scores"]) - 0.01 for r in mined)  # a labelled one above
    assert all(not set(r["negatives"]) & positives[r["query"]] for r in mined)  # never a known positive

    from tests.training.conftest import tiny_config
    from training.run import run_training

    trained = run_training(tiny_config(
        tmp_path, "mined-groups", f"data.train={result['output_path']}", "data.format=groups_jsonl",
        "data.group_size=3", "objective.weights={infonce: 1.0, distill_kl: 0.5}", "trainer.max_steps=2",
        "trainer.global_batch_size=8", "trainer.num_workers=0",  # in the test's process
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


def test_single_positive_queries_mine_what_sentence_transformers_mines(ray_local, tmp_path, monkeypatch):
    """The same exported model, pairs and corpus through sentence-transformers' mine_hard_negatives (range_min,
    absolute_margin, num_negatives; range_max above the corpus size, where the two tools' candidate pools differ by
    design, see data_pipelines/mining.py): the same negatives, in the same order, with the same scores, for every
    query with one positive; a query with two is held to the lowest. The positives, in the corpus, are scored from
    the index's stored embeddings, never encoded again, and score as sentence-transformers' encoded ones. Two actors
    of 1 CPU hold every CPU of the shared Ray, as a user's pools hold their node's: a task between phases that
    needed a CPU would hang the job; the corpus, under SHARD_ROWS rows in several blocks, is cut into two shards of
    one size, one for each actor (it was one shard). About 40 s: each pool starts two actors that load the model."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.util import mine_hard_negatives

    from encoders.backbone import build_encoder, export_encoder
    from encoders.sources import resolve_model_source
    from evaluation.corpus_index import CorpusIndex

    private_stores(monkeypatch, tmp_path)
    rng = np.random.default_rng(11)
    pairs = _pairs(rng)
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in pairs))
    texts = [" ".join(rng.choice(WORDS, size=5)) for _ in range(40)] + [r["positive"] for r in pairs]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(texts) + "\n")
    model = export_encoder(build_encoder(resolve_model_source("tiny:bert"), max_length=32), tmp_path / "model")
    rules = {"range_max": 80, "range_min": 1, "absolute_margin": 0.0, "relative_margin": None, "negatives_per_row": 3}
    job = _mine_job()
    result = job.main(job.MineJobConfig(data={"train": str(data)}, output_dir=str(tmp_path / "mined"), actors=2,
                                        cpus_per_actor=1.0, mining={"model": str(model), "corpus": str(corpus), **rules},
                                        tracking={"experiment": "raoe-test"}))  # the pools hold every CPU of the
    # shared Ray, as on a user's node: a task between phases that needed one would wait forever
    ours = {r["query"]: r for f in sorted(Path(result["output_path"]).glob("*.json*")) for r in map(json.loads, open(f))}

    theirs = mine_hard_negatives(
        Dataset.from_dict({"query": [r["query"] for r in pairs], "positive": [r["positive"] for r in pairs]}),
        SentenceTransformer(str(model), device="cpu"), corpus=texts, range_min=1, range_max=80, absolute_margin=0.0,
        num_negatives=3, sampling_strategy="top", output_format="labeled-list", output_scores=True, batch_size=16,
        verbose=False)
    counts = {}
    for r in pairs:
        counts[r["query"]] = counts.get(r["query"], 0) + 1
    single = [row for row in theirs if counts[row["query"]] == 1]
    assert len(single) > 3 and {row["query"] for row in single} <= set(ours)
    for row in single:
        assert ours[row["query"]]["negatives"] == row["positive"][1:]
        assert ours[row["query"]]["negative_scores"] == pytest.approx(row["scores"][1:], abs=1e-5)
        assert ours[row["query"]]["positive_scores"] == pytest.approx(row["scores"][:1], abs=1e-5)
    assert result["positives_encoded"] == 0
    [index] = (tmp_path / "cache" / "corpus-embeddings").glob("*/meta.json")
    sizes = CorpusIndex.at(str(index.parent)).shard_rows()  # two shards, one for each actor (was one shard)
    assert len(sizes) == 2 and abs(sizes[0] - sizes[1]) <= 1 and sum(sizes) == result["corpus_rows"]
    assert {q for q, n in counts.items() if n == 1} & set(ours) == {row["query"] for row in single}
    assert any(len(ours[q]["positives"]) == 2 for q in ours)  # two positives: one group, the lowest one's margin


def test_mining_rules_are_bounded_named_and_the_old_keys_still_read(capsys, tmp_path):
    """Out-of-range rules are refused by key, labelled negatives for data without NLI labels by name; margin /
    margin_type / top_k are read as sentence-transformers' names, also from a config file (where every default
    arrives filled in); sampling: random draws among the candidates past range_min, the same for a query on any
    actor."""
    from pydantic import ValidationError

    from data_pipelines.mining import MiningSettings
    from jobconfig import load_config
    from jobconfig.loader import ConfigError

    job = _mine_job()
    old_file = tmp_path / "old.yaml"
    old_file.write_text("data: {train: pairs.jsonl}\nmining: {top_k: 8, margin: 0.1, margin_type: absolute}\n"
                        "output_path: outputs/old-mined\n")
    old = load_config(job.MineJobConfig, old_file)
    assert (old.mining.range_max, old.mining.absolute_margin, old.mining.relative_margin) == (8, 0.1, None)
    assert old.output_dir.endswith("outputs/old-mined")
    with pytest.raises(ConfigError, match="top_k is the old name of range_max"):
        load_config(job.MineJobConfig, old_file, ["mining.range_max=9"])
    with pytest.raises(ConfigError, match="seed"):
        load_config(job.MineJobConfig, old_file, ["mining.seed=-1"])
    for bad, key in (({"relative_margin": 1.5}, "relative_margin"), ({"absolute_margin": -0.1}, "absolute_margin"),
                     ({"range_min": 50}, "range_min"), ({"negatives_per_row": 9, "range_max": 10, "range_min": 2},
                                                        "negatives_per_row"),
                     ({"labelled_negatives": ["entailment"]}, "labelled_negatives")):
        with pytest.raises(ValidationError, match=key):
            job.MiningConfig(**bad)
    from data_pipelines.mining import check_labelled_negatives

    triples = job.MiningDataConfig(train=str(ROOT / "configs" / "tiny" / "data" / "triples.jsonl"))
    with pytest.raises(ValueError, match=r"mining.labelled_negatives \['contradiction'\] needs labelled NLI pairs; "
                                         r"data.train .*triples.jsonl is \(query, positive\) rows without labels"):
        check_labelled_negatives(triples, ["contradiction"])
    check_labelled_negatives(job.MiningDataConfig(train=str(ROOT / "configs" / "tiny" / "data" / "nli_pairs.jsonl")),
                             ["contradiction", "neutral"])
    old = job.MiningConfig(top_k=30, margin=0.95, margin_type="relative")
    assert (old.range_max, old.relative_margin, old.absolute_margin) == (30, pytest.approx(0.05), None)
    old = job.MiningConfig(margin=0.1, margin_type="absolute")
    assert (old.absolute_margin, old.relative_margin) == (0.1, None)
    assert "mining.top_k / margin / margin_type are deprecated" in capsys.readouterr().err

    rules = MiningSettings("m", "i", range_max=10, range_min=2, relative_margin=None, negatives_per_row=3,
                           sampling="random", seed=5)
    scores = np.linspace(1.0, 0.1, 10)
    ranked = list(range(10))
    drawn = rules.pick(ranked, scores, "a query")
    assert drawn == rules.pick(ranked, scores, "a query") and len(set(drawn)) == 3 and min(drawn) >= 2
    assert drawn == sorted(drawn)  # hardest first
    others = {tuple(rules.pick(ranked, scores, f"query {i}")) for i in range(20)}
    assert len(others) > 5  # another query, another draw
    assert MiningSettings("m", "i", range_min=2, negatives_per_row=3).pick(ranked, scores, "q") == [2, 3, 4]
    lowest = -0.4  # sign-safe: 5% of the magnitude below a negative positive score
    assert MiningSettings("m", "i").allowed(np.array([-0.41, -0.43]), lowest).tolist() == [False, True]


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
    The search here is FAISS's (mining.search.method faiss; 30 rows make one list, scanned whole, so its recall
    against exact search is 1). Qrels that judge a document the corpus lacks are refused with its id.
    About 30 s: the mine job end to end, its actor pools each a process that imports the encoder stack."""
    from data_pipelines.mining import beir_pairs
    from tests.evaluation.test_retrieval import write_beir

    private_stores(monkeypatch, tmp_path)
    rng = np.random.default_rng(4)
    corpus = {f"d{i}": " ".join(rng.choice(WORDS, size=5)) for i in range(30)}
    queries = {f"q{i}": " ".join(rng.choice(WORDS, size=3)) for i in range(8)}
    qrels = [(f"q{i}", f"d{(3 * i + j) % 30}", 1 + j) for i in range(8) for j in range(2)] + [("q0", "d29", 0)]
    folder = write_beir(tmp_path / "beir", corpus, queries, qrels, split="train")
    titled = {d: f"{'' if i % 2 else 't'} {t}".strip() for i, (d, t) in enumerate(corpus.items())}  # as written
    job = _mine_job()
    cfg = job.MineJobConfig(data={"train": str(folder)}, output_dir=str(tmp_path / "mined"), cpus_per_actor=0.5,
                            mining={"model": "tiny:bert", "range_max": 10, "relative_margin": None,
                                    "negatives_per_row": 3, "search": {"method": "faiss"}},
                            tracking={"experiment": "raoe-test"})
    result = job.main(cfg)
    assert result["search"] == "faiss" and result["search_recall"] == 1.0
    written = [json.loads(line) for f in sorted(Path(result["output_path"]).glob("*.json*")) for line in open(f)]
    judged = {(queries[q], titled[d]) for q, d, g in qrels if g > 0}
    assert result["pairs_in"] == len(judged) == 16 and result["corpus_rows"] == 30
    assert {(g["query"], p) for g in written for p in g["positives"]} == judged  # no margin: every query keeps some
    assert len(written) == result["queries_in"] == 8
    for group in written:
        own = {t for q, t in judged if q == group["query"]}
        assert len(group["negatives"]) == 3 and not own & set(group["negatives"])
        assert set(group["negatives"]) <= set(titled.values())

    lacking = write_beir(tmp_path / "lacking", corpus, queries, [*qrels, ("q1", "d99", 1)], split="train")
    with pytest.raises(ValueError, match=r"judge 1 document\(s\) its corpus lacks, e.g. \['d99'\]"):
        beir_pairs(str(lacking), "train")
    with open(lacking / "corpus.jsonl", "a") as f:  # d3, judged, twice: which text is the positive is ambiguous
        f.write(json.dumps({"_id": "d3", "title": "", "text": "another text"}) + "\n")
        f.write(json.dumps({"_id": "d99", "title": "", "text": "found now"}) + "\n")
    with pytest.raises(ValueError, match=r"holds 1 judged document id\(s\) more than once, e.g. \['d3'\]"):
        beir_pairs(str(lacking), "train")


def test_positives_the_index_holds_are_read_from_it_and_only_the_others_encoded(ray_local, tmp_path):
    """The join of the pairs' positives with the index's (id, row) table finds each held positive's row across
    shards (-1 for one the corpus lacks), and the positives' scores from the stored embeddings equal those of
    encoding them, with only the missing ones encoded (each once)."""
    import ray

    from data_pipelines.mining import _scores_of_positives, held_rows, located_positives
    from encoders.backbone import build_encoder, inference_embeddings
    from encoders.sources import resolve_model_source
    from evaluation.search import normalised

    model = build_encoder(resolve_model_source("tiny:bert"), max_length=32)
    index = _hand_built_index(tmp_path / "index", model, HELD)
    held, lacking = HELD, ["violin in the desert", "a harbor at night"]
    pairs = [{"text1": f"query {i}", "text2": t, "is_negative": False} for i, t in enumerate(held[3:9] + lacking)]
    located = located_positives(ray.data.from_items(pairs), index).take_all()
    row_of = {r["text2"]: r["positive_row"] for r in located}
    assert len(located) == len(pairs) and all(row_of[t] == -1 for t in lacking)
    assert all(index.take("text", [row_of[t]]) == [t] for t in held[3:9])  # both shards' rows, by their offsets

    queries = ["a silver engine", "bread and music"]
    q_emb = normalised(inference_embeddings(model, queries, side="query"))
    positives = [[held[4], lacking[0], held[7]], [lacking[0], held[8], lacking[1]]]
    rows = [np.array([row_of.get(p, -1) for p in known]) for known in positives]
    scores, encoded = _scores_of_positives(model, index, q_emb, positives, rows, batch_size=4)
    direct = [normalised(inference_embeddings(model, known, side="document")) @ q_emb[i]
              for i, known in enumerate(positives)]
    assert encoded == 2  # the two lacking texts, lacking[0] once for both queries
    for got, want in zip(scores, direct):
        np.testing.assert_allclose(got, want, atol=1e-5)
    # a row whose text is not the positive's (a 64-bit id collision) is not read for it
    assert [r.tolist() for r in held_rows(index, [[held[4], held[5]]], [np.array([row_of[held[4]], 0])])] == \
        [[row_of[held[4]], -1]]


def test_positives_grouped_by_query_are_whole_distinct_sorted_and_aligned_with_their_rows(ray_local):
    """Each query's positives come back once each, sorted, each beside its own index row, however the pairs are
    spread over input blocks (a query's pairs in several) and over the hash partitions; repeated pairs count once.
    Its labelled negatives come back the same way beside them, less any text that is also its positive; a query with
    labelled negatives only is left out. The groups then reach the encoder actors in blocks of one call each (every
    actor gets calls)."""
    import ray

    from data_pipelines.mining import in_encoder_calls, positives_by_query

    rng = np.random.default_rng(0)
    pairs = [{"text1": f"query {q}", "text2": f"{WORDS[p]} {q % 3}", "positive_row": 100 * q + p,
              "is_negative": q % 5 == 0 and i > 0}  # 6 queries with labelled negatives beside a positive
             for q in range(40) for i, p in enumerate(rng.choice(len(WORDS), size=1 + q % 4, replace=False))]
    first_of_query_1 = next(pair for pair in pairs if pair["text1"] == "query 1")
    pairs += [{**first_of_query_1, "is_negative": True},  # labelled as a negative, and a positive
              {"text1": "only negatives", "text2": "river", "positive_row": 8, "is_negative": True}]
    pairs += pairs[::7]  # repeated pairs
    rng.shuffle(pairs)
    want: dict[str, dict[bool, dict[str, int]]] = {}
    for pair in pairs:
        want.setdefault(pair["text1"], {False: {}, True: {}})[pair["is_negative"]][pair["text2"]] = pair["positive_row"]
    for known in want.values():
        known[True] = {t: r for t, r in known[True].items() if t not in known[False]}
    del want["only negatives"]
    assert sum(bool(k[True]) for k in want.values()) == 6 and not want["query 1"][True]
    for partitions in (1, 3):
        grouped = positives_by_query(ray.data.from_items(pairs, override_num_blocks=6), partitions).materialize()
        calls, rows = in_encoder_calls(grouped, queries_per_batch=4, actors=2)
        assert rows == 5 and calls.num_blocks() == 8  # 40 queries: 4 calls for each of 2 actors, split already
        got = calls.take_all()
        assert len(got) == len(want)
        for row in got:
            for texts, at, known in (("positives", "positive_rows", want[row["text1"]][False]),
                                     ("labelled_negatives", "labelled_rows", want[row["text1"]][True])):
                assert list(row[texts]) == sorted(known)
                assert list(row[at]) == [known[t] for t in sorted(known)]


HELD = [f"{a} {b} {c}" for a, b, c in zip(WORDS, WORDS[3:], WORDS[7:])]


def _hand_built_index(folder: Path, model, texts: list[str]):
    """An index of ``texts`` written here as the corpus-index builder writes one, in two shards (rows of the second
    offset by the first), with ``model``'s unit document embeddings."""
    from data_pipelines.mining import text_id
    from encoders.backbone import inference_embeddings
    from evaluation.corpus_index import CorpusIndex, write_shard
    from evaluation.search import normalised

    emb = normalised(inference_embeddings(model, texts, side="document"))
    folder.mkdir(parents=True)
    shards = [write_shard({"id": np.array([text_id(t) for t in texts[s]], dtype=object), "embedding": emb[s],
                           "text": np.array(texts[s], dtype=object)}, str(folder))
              for s in (slice(0, 5), slice(5, None))]
    (folder / "meta.json").write_text(json.dumps({"model_path": "test", "corpus": "test", "rows": len(texts),
                                                  "dim": emb.shape[1], "shards": [s["shard"][0] for s in shards],
                                                  "text": True}))
    return CorpusIndex.at(str(folder))


def test_a_teachers_scores_read_from_its_aligned_index_equal_encoding_each_batch(ray_local, tmp_path, capsys):
    """The two ways a teacher scores (its index of the corpus row for row, or each batch's candidates, positives and
    labelled negatives encoded) give the same scores; the teacher's index is built by aligned_index into a local
    cache folder (the end-to-end teacher test keeps its indexes on object storage), shard for shard, and found there
    the second time;
    its cache key changes with the shards of the index it follows (a rebuilt corpus index, in another row order, never
    finds the old teacher index)."""
    import dataclasses

    from data_pipelines.mining import MiningSettings, NegativeMiner
    from encoders.backbone import build_encoder, export_encoder
    from encoders.devices import EncoderPool
    from encoders.sources import resolve_model_source
    from evaluation.corpus_index import aligned_index, aligned_key

    teacher = export_encoder(build_encoder(resolve_model_source("tiny:bert"), max_length=32, pooling="last_token"),
                             tmp_path / "teacher")
    student = build_encoder(resolve_model_source("tiny:bert"), max_length=32)
    index = _hand_built_index(tmp_path / "index", student, HELD)
    pool = EncoderPool(actors=1, cpus_per_actor=0.5)
    aligned = aligned_index(index, str(teacher), pool=pool, root=tmp_path / "cache")
    assert aligned.path.parent == tmp_path / "cache" and aligned.meta["aligned_with"] == index.location
    assert aligned.meta["shards"] == index.meta["shards"] and aligned.shard_rows() == index.shard_rows() == [5, 8]
    capsys.readouterr()
    assert aligned_index(index, str(teacher), pool=pool, root=tmp_path / "cache").path == aligned.path
    assert f"corpus embeddings from the cache: {aligned.path}" in capsys.readouterr().out
    settings = MiningSettings(model_path="unused", index_path=str(index.path), teacher_path=str(teacher))
    by_row = NegativeMiner(dataclasses.replace(settings, teacher_index_path=str(aligned.path)))
    by_batch = NegativeMiner(settings)
    queries = ["a silver engine", "bread and music"]
    batch = {"positives": [[HELD[1], "a harbor at night"], [HELD[9]]], "positive_rows": [[1, -1], [9]],
             "labelled_negatives": [[HELD[5]], ["a violin at dusk", HELD[6]]], "labelled_rows": [[5], [-1, 6]]}
    found_of = [[(HELD[r], 0.0, r) for r in (3, 7, 12)], [(HELD[r], 0.0, r) for r in (7, 2)]]
    (pos_a, labelled_a), cand_a, encoded_a = by_row._teacher_scores(queries, batch, found_of)
    (pos_b, labelled_b), cand_b, encoded_b = by_batch._teacher_scores(queries, batch, found_of)
    assert (encoded_a, encoded_b) == ([1, 1], [3, 3])  # what the corpus lacks; every known text of the batch
    for a, b in zip(pos_a + labelled_a + cand_a, pos_b + labelled_b + cand_b):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert [len(s) for s in labelled_a] == [1, 2]

    # the whole phase with the teacher: the labelled negatives in the groups with its scores, the hardest first
    columns = {"text1": queries, **batch, "positive_scores": [np.zeros(0)] * 2, "labelled_scores": [np.zeros(0)] * 2,
               "candidate_rows": [np.array([3, 7, 12]), np.array([7, 2])],
               "candidate_scores": [np.array([0.9, 0.8, 0.7]), np.array([0.9, 0.8])]}
    two = NegativeMiner(dataclasses.replace(settings, teacher_index_path=str(aligned.path), negatives_per_row=2,
                                            relative_margin=None))
    groups = two({**{k: np.array(list(v) + [None], dtype=object)[:-1] for k, v in columns.items()},
                  "known_encoded": np.zeros((2, 2), np.int64)}).to_pylist()  # as the encoder phase passes them
    first, second = groups[0], groups[1]
    by_teacher = dict(zip([HELD[r] for r in (3, 7, 12)], cand_a[0]))
    assert len(first["negatives"]) == 2 and HELD[5] in first["negatives"]  # its one labelled, one mined
    assert set(first["negatives"]) - {HELD[5]} == {max(by_teacher, key=by_teacher.get)}
    assert sorted(second["negatives"]) == sorted(batch["labelled_negatives"][1])  # its two labelled fill the group
    np.testing.assert_allclose(sorted(second["negative_scores"], reverse=True), second["negative_scores"])
    np.testing.assert_allclose(sorted(second["negative_scores"]), sorted(labelled_a[1]), atol=1e-5)
    stats = json.loads(groups[2]["batch_stats"])
    assert (stats["labelled_negatives"], stats["positives_encoded"], stats["labelled_encoded"]) == (3, 1, 1)
    assert len(cand_a[0]) == 3 and len(cand_a[1]) == 2

    rebuilt = _hand_built_index(tmp_path / "rebuilt" / "index", student, HELD)  # the same key (folder), new shards
    assert aligned_key(index, str(teacher)) == aligned_key(index, str(teacher))
    assert aligned_key(rebuilt, str(teacher)) != aligned_key(index, str(teacher))
