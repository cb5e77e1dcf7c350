"""Query groups: a row is a query, its positives and its negatives; each step draws one positive and group_size - 1
negatives per query by (seed, step, row) alone. The exact global batch of groups (1 = 2 workers, cached = direct, ZeRO)
is in test_exact_batch.py; mining groups and training on them, in tests/data_pipelines/test_mining.py."""

import json

import numpy as np
import pytest

from data_pipelines.records import RecordError, group_record


def _cells(lists):
    out = np.empty(len(lists), dtype=object)
    out[:] = lists
    return out


def test_a_group_record_reads_the_fields_users_write():
    assert group_record({"query": "q", "positives": ["p"], "negatives": ["n1", "n2"]}) == {
        "query": "q", "positives": ["p"], "negatives": ["n1", "n2"], "positive_scores": None, "negative_scores": None}
    flag = group_record({"query": "q", "pos": ["p", "p2"], "neg": ["n"], "pos_scores": [0.9, 0.8], "neg_scores": [1]})
    assert flag["positives"] == ["p", "p2"] and flag["positive_scores"] == [0.9, 0.8] and flag["negative_scores"] == [1.0]
    tevatron = group_record({"query": "q", "positive_passages": [{"docid": "1", "title": "T", "text": "body"}],
                             "negative_passages": [{"title": "", "text": "other"}]})
    assert tevatron["positives"] == ["T body"] and tevatron["negatives"] == ["other"]
    assert group_record({"anchor": "q", "positive": "p"})["negatives"] == []  # no negatives: in-batch ones only


@pytest.mark.parametrize("record, message", [
    ({"positives": ["p"]}, "missing field 'query'"),
    ({"query": "q"}, "missing field 'positives'"),
    ({"query": "q", "positives": []}, "'positives' is empty"),
    ({"query": "q", "positives": "p"}, "must be a list of texts"),
    ({"query": "q", "positives": ["p", " "]}, r"'positives\[1\]' is empty"),
    ({"query": "q", "positives": ["p"], "negatives": ["n", "p"]}, r"negatives\[1\] is also one of the query's"),
    ({"query": "q", "positives": ["p"], "negatives": ["n"], "negative_scores": [0.1, 0.2]}, "list of 1 numbers"),
    ({"query": "q", "positives": ["p"], "positive_scores": [float("nan")]}, "finite number"),
])
def test_a_bad_group_names_its_field(record, message):
    with pytest.raises(RecordError, match=message):
        group_record(record)


def _draw(rows, seed, step, index, group_size):
    from types import SimpleNamespace

    from training.kinds.text import draw_groups

    return draw_groups(SimpleNamespace(group_size=group_size), rows, seed, step, np.asarray(index))


ROWS = {"query": np.array(["q0", "q1", "q2"], dtype=object),
        "positives": _cells([["a0"], ["a1", "b1", "c1"], ["a2"]]),
        "negatives": _cells([[f"n0-{j}" for j in range(6)], ["n1-0", "n1-1"], [f"n2-{j}" for j in range(4)]])}


def test_each_step_draws_a_positive_and_distinct_negatives_by_seed_step_and_row():
    drawn = _draw(ROWS, 7, 3, [10, 11, 12], group_size=5)
    assert list(drawn["text1"]) == ["q0", "q1", "q2"]
    assert [len(n) for n in drawn["text_neg"]] == [4, 4, 4]
    assert len(set(drawn["text_neg"][0])) == 4 and set(drawn["text_neg"][0]) <= set(ROWS["negatives"][0])
    assert len(set(drawn["text_neg"][2])) == 4  # as many as it has: every one, once
    assert sorted(drawn["text_neg"][1]) == ["n1-0", "n1-0", "n1-1", "n1-1"]  # fewer than needed: each once, then again
    assert drawn["text2"][1] in ROWS["positives"][1]
    # a row's draw is its own: the same from any batch it is taken with (1 or N workers), in any position
    alone = _draw({k: v[2:] for k, v in ROWS.items()}, 7, 3, [12], group_size=5)
    assert alone["text_neg"][0] == drawn["text_neg"][2] and alone["text2"][0] == drawn["text2"][2]
    again = _draw(ROWS, 7, 3, [10, 11, 12], group_size=5)
    assert [list(n) for n in again["text_neg"]] == [list(n) for n in drawn["text_neg"]]
    # other steps (and seeds) draw other groups
    steps = {tuple(_draw(ROWS, 7, s, [10, 11, 12], group_size=3)["text_neg"][0]) for s in range(8)}
    positives = {_draw(ROWS, 7, s, [10, 11, 12], group_size=3)["text2"][1] for s in range(12)}
    assert len(steps) > 4 and positives == {"a1", "b1", "c1"}
    assert _draw(ROWS, 8, 3, [10, 11, 12], group_size=5)["text_neg"][0] != drawn["text_neg"][0]
    assert "text_neg" not in _draw(ROWS, 7, 3, [10, 11, 12], group_size=1)  # in-batch negatives only


def test_group_config_is_checked_before_anything_runs(tmp_path):
    from pydantic import ValidationError

    from jobconfig.schema import DataConfig, TrainJobConfig
    from training.run import choose_kind

    with pytest.raises(ValidationError, match="data.group_size is for query groups"):
        DataConfig(group_size=4)
    assert DataConfig(format="groups_jsonl").texts_per_group == 8
    cfg = TrainJobConfig(data={"train": "g.jsonl", "format": "groups_jsonl", "group_size": 4},
                         objective={"weights": {"infonce": 1.0}})
    kind, needed = choose_kind(cfg)
    assert kind.name == "groups" and "emb_neg" in needed and kind.sides["text1"] == "query"
    with pytest.raises(ValueError, match="do not fit this data"):  # groups carry no S
        choose_kind(TrainJobConfig(data={"train": "g.jsonl", "format": "groups_jsonl"},
                                   objective={"weights": {"rank_margin": 1.0}}))


def test_groups_read_from_json_lines_and_parquet(ray_local, tmp_path):
    """Both formats through the validating reader: a bad group is named by file and line, then quarantined."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data_pipelines.readers import load_corpus

    groups = [{"query": f"q{i}", "positives": [f"p{i}"], "negatives": [f"n{i}-{j}" for j in range(i % 3)]}
              for i in range(6)]
    lines = tmp_path / "groups.jsonl"
    lines.write_text("".join(json.dumps(g) + "\n" for g in groups) + json.dumps({"query": "bad", "positives": []}) + "\n")
    parquet = tmp_path / "groups.parquet"
    pq.write_table(pa.Table.from_pylist(groups), parquet)
    with pytest.raises(ValueError, match=r"groups.jsonl:7: field 'positives' is empty"):
        load_corpus("groups", str(lines), fmt="groups_jsonl", cache_dir=None)
    ds, report = load_corpus("groups", str(lines), fmt="groups_jsonl", on_bad_record="quarantine",
                             quarantine_path=tmp_path / "bad.jsonl", cache_dir=None)
    assert report.rows_written == 6 and report.rows_quarantined == 1
    from_parquet, _ = load_corpus("groups", str(parquet), cache_dir=None)  # auto: .parquet of the groups kind
    for read in (ds, from_parquet):
        rows = sorted(read.take_all(), key=lambda r: r["query"])
        assert [list(r["negatives"]) for r in rows] == [g["negatives"] for g in groups]


def test_distillation_needs_every_group_scored(ray_local, capsys):
    """A distillation objective reads the groups' teacher scores: groups without them are refused by count before
    training; without such an objective the scores stay behind. With data.group_size above 1 a group without
    negatives is left out and counted (all of them: refused); with group_size 1 it trains on in-batch negatives."""
    from types import SimpleNamespace

    import ray

    from training.kinds.corpus_rows import groups_with_negatives

    rows = [{"query": "q1", "positives": ["p1"], "negatives": ["n1"], "positive_scores": [0.9],
             "negative_scores": [0.2]},
            {"query": "q2", "positives": ["p2"], "negatives": ["n2"], "positive_scores": None, "negative_scores": None},
            {"query": "q3", "positives": ["p3"], "negatives": [], "positive_scores": [0.8], "negative_scores": []}]
    ds = ray.data.from_items(rows)

    def cfg(weights, texts_per_group=2):
        return SimpleNamespace(objective=SimpleNamespace(weights=weights),
                               data=SimpleNamespace(train="groups.jsonl", texts_per_group=texts_per_group))

    with pytest.raises(ValueError, match="1 query groups of groups.jsonl carry no teacher scores"):
        groups_with_negatives(ds, cfg({"infonce": 1.0, "margin_mse": 1.0}), "")
    kept = groups_with_negatives(ds, cfg({"infonce": 1.0}), "")
    assert kept.columns() == ["query", "positives", "negatives"]
    assert sorted(row["query"] for row in kept.take_all()) == ["q1", "q2"]
    assert "1 of 3 query groups have no negative: left out" in capsys.readouterr().out
    assert groups_with_negatives(ds, cfg({"infonce": 1.0}, texts_per_group=1), "").count() == 3
    with pytest.raises(ValueError, match="none of the 1 query groups of groups.jsonl has a negative"):
        groups_with_negatives(ray.data.from_items(rows[2:]), cfg({"infonce": 1.0}), "")


def test_the_source_schedule_is_a_seeded_draw_by_weight_whatever_the_run_length():
    from training.sources import source_schedule, steps_per_source

    drawn, local = source_schedule([3.0, 1.0], seed=42, steps=4000)
    assert abs(np.mean(drawn == 0) - 0.75) < 0.03  # by weight
    again, _ = source_schedule([3.0, 1.0], seed=42, steps=100)
    assert (again == drawn[:100]).all()  # a longer or resumed run draws the same first steps
    assert not (source_schedule([3.0, 1.0], seed=43, steps=100)[0] == again).all()
    for source in (0, 1):  # each source walks its own steps in order
        assert (local[drawn == source] == np.arange(int((drawn == source).sum()))).all()
    assert steps_per_source([3.0, 1.0], 42, 4000) == np.bincount(drawn).tolist()


def test_mixed_sources_train_each_step_on_one_source(train_env):
    """data.sources: NLI pairs under the RAOE composite and query groups under InfoNCE with prompts of their own;
    each step is one source's whole batch, its objective alone (logged on its steps only), as the schedule draws;
    the JSON line and MLflow report the steps and rows per source. Bad sources are named before anything runs."""
    from mlflow import MlflowClient

    from tests.training.conftest import TINY_NLI, tiny_config
    from training.run import run_training
    from training.sources import source_schedule

    groups = train_env / "groups.jsonl"
    nli = [json.loads(line) for line in TINY_NLI.read_text().splitlines()]
    groups.write_text("".join(json.dumps({"query": r["text1"], "positives": [r["text2"]],
                                          "negatives": [o["text2"] for o in nli[i + 1:i + 4]]}) + "\n"
                              for i, r in enumerate(nli[:40])))
    sources = (f"data.sources=[{{train: '{TINY_NLI}', name: nli, weight: 1}}, {{train: '{groups}', name: groups, "
               f"format: groups_jsonl, group_size: 3, weight: 2, objective: {{infonce: 1.0}}, "
               f"prompts: {{query: 'query: ', document: 'passage: '}}}}]")
    cfg = tiny_config(train_env, "mixed-sources", "data.train=null", sources, "trainer.max_steps=6",
                      "trainer.global_batch_size=8", "trainer.num_workers=0")  # in the test's process
    result = run_training(cfg)
    drawn, _ = source_schedule([1.0, 2.0], cfg.trainer.seed, 6)
    steps = {name: [s + 1 for s in range(6) if drawn[s] == i] for i, name in enumerate(["nli", "groups"])}
    assert all(steps.values())  # both drawn in 6 steps (seed 42)
    assert result["sources"]["nli"]["steps"] == len(steps["nli"]) and result["sources"]["groups"]["rows"] == 40
    assert result["sources"]["groups"]["rows_trained"] == 8 * len(steps["groups"])
    client = MlflowClient()
    logged = lambda key: sorted(m.step for m in client.get_metric_history(result["run_id"], key))  # noqa: E731
    assert logged("loss/rank_margin") == steps["nli"] == logged("loss/source_nli")
    assert logged("loss/infonce") == steps["groups"] == logged("loss/source_groups")
    bad = tiny_config(train_env, "mixed-bad", "data.train=null",
                      f"data.sources=[{{train: '{groups}', format: groups_jsonl}}]")  # groups carry no S
    with pytest.raises(ValueError, match=r"data.sources\[groups.jsonl\]: objective.weights .* do not fit this data"):
        run_training(bad)
