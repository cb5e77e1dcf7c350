"""RSE models outside training: the exported folder (plain SentenceTransformer + relation table), scoring by
relation and by weights, relation prediction on a toy case with a known answer, and the triple corpus preparation."""

import json

import numpy as np
import pandas as pd
import pytest


@pytest.fixture(scope="module")
def rse_folder(tmp_path_factory):
    """A tiny encoder with a known relation table, exported the way training exports it."""
    from encoders.backbone import build_encoder, export_encoder
    from encoders.relational import attach_relation_table
    from encoders.sources import resolve_model_source

    model = build_encoder(str(resolve_model_source("tiny:bert")), pooling="cls", max_length=32)
    attach_relation_table(model, ["entailment", "same-sent"], None, init_std=0.5, seed=3)
    folder = tmp_path_factory.mktemp("rse") / "model"
    export_encoder(model, folder)
    return folder


A = ["a child is holding a ball.", "the group is running in the park."]
B = ["a child is playing.", "two people is eating food."]


def _cos(u, v):
    return float(np.dot(u, v) / (np.linalg.norm(u) * np.linalg.norm(v)))


def test_scores_are_cosines_of_translated_heads_from_the_plain_folder(rse_folder):
    from safetensors.numpy import load_file
    from sentence_transformers import SentenceTransformer

    from encoders.relational import RelationalEncoder

    plain = SentenceTransformer(str(rse_folder), device="cpu")  # still an ordinary sentence-transformers folder
    ea, eb = plain.encode(A), plain.encode(B)
    names = json.loads((rse_folder / "relations.json").read_text())["relations"]
    table = load_file(str(rse_folder / "relations.safetensors"))["relation_vectors"]
    assert names == ["entailment", "same-sent"] and table.shape == (2, ea.shape[1])
    model = RelationalEncoder(rse_folder)
    assert set(model.relations) == set(names) and np.array_equal(model.relations["same-sent"], table[1])
    for k, name in enumerate(names):
        want = [_cos(ea[i] + table[k], eb[i]) for i in range(len(A))]
        np.testing.assert_allclose(model.score(A, B, relation=name), want, rtol=1e-5)
    mix = [0.25 * _cos(ea[i] + table[0], eb[i]) + 0.75 * _cos(ea[i] + table[1], eb[i]) for i in range(len(A))]
    np.testing.assert_allclose(model.score(A, B, weights={"entailment": 1.0, "same-sent": 3.0}), mix, rtol=1e-5)
    back = [0.25 * _cos(eb[i] + table[0], ea[i]) + 0.75 * _cos(eb[i] + table[1], ea[i]) for i in range(len(A))]
    np.testing.assert_allclose(model.score(A, B, weights={"entailment": 1, "same-sent": 3}, both_directions=True),
                               np.maximum(mix, back), rtol=1e-5)
    with pytest.raises(ValueError, match="unknown relation.*'paraphrase'"):
        model.score(A, B, relation="paraphrase")


def test_relation_table_survives_a_reload_into_training(rse_folder):
    from encoders.backbone import build_encoder
    from encoders.relational import attach_relation_table, read_relation_table

    model = build_encoder(str(rse_folder), pooling="cls", max_length=32)
    attach_relation_table(model, ["same-sent", "paraphrase", "entailment"], rse_folder, init_std=0.02, seed=0)
    names, saved = read_relation_table(rse_folder)
    table = model.relation_vectors.detach().numpy()
    assert np.array_equal(table[0], saved[names.index("same-sent")])  # by name, not by position
    assert np.array_equal(table[2], saved[names.index("entailment")])
    assert 0 < np.abs(table[1]).max() < 0.2  # a new relation starts small and random


def test_relation_prediction_on_a_toy_case_with_a_known_answer():
    from encoders.relational import relation_prediction

    vectors = {"h1": [1, 0, 0], "h2": [0, 1, 0], "t1": [1, 0, 0], "t2": [0.9, 0.1, 0], "t3": [0, 0, 1]}
    encode = lambda texts: np.array([vectors[t] for t in texts], dtype=float)  # noqa: E731
    table = np.zeros((2, 3))
    table[1] = [0, -1, 1]  # r1 turns h2 into t3's direction
    triples = [{"head": "h1", "relation": "r0", "tail": "t2"},  # t1 scores higher: rank 2
               {"head": "h2", "relation": "r0", "tail": "t2"},  # rank 1
               {"head": "h2", "relation": "r1", "tail": "t3"},  # rank 1
               {"head": "h2", "relation": "r1", "tail": "t1"}]  # rank 1: t3 scores higher but is a true tail too
    got = relation_prediction(encode, triples, ["r0", "r1"], table)
    assert got["r0"]["mrr"] == pytest.approx((1 / 2 + 1) / 2) and got["r0"]["hits@1"] == 0.5
    assert got["r1"]["mrr"] == 1.0 and got["all"]["hits@1"] == pytest.approx(3 / 4)
    assert got["all"]["hits@3"] == 1.0 and got["all"]["candidates"] == 3  # the distinct tails t1, t2, t3
    # filtered setting: once (h1, r0, t1) is a true triple too, t1 above t2 is no error
    filtered = relation_prediction(encode, triples + [{"head": "h1", "relation": "r0", "tail": "t1"}], ["r0", "r1"],
                                   table)
    assert filtered["r0"]["mrr"] == 1.0 and filtered["r0"]["triples"] == 3


def _data_cfg(**overrides):
    from jobconfig.schema import RelationalDataConfig

    return RelationalDataConfig(train="unused", **overrides)


def _frame():
    rows = [{"head": f"e{i}", "tail": f"f{i}", "relation": "entailment", "negative": f"c{i}"} for i in range(20)]
    rows += [{"head": f"q{i}", "tail": f"d{i % 10}", "relation": "dup", "negative": None} for i in range(30)]
    return pd.DataFrame(rows)


def test_triples_are_held_out_capped_weighted_and_given_in_relation_negatives():
    from data_pipelines.relations import prepare_triples

    cfg = _data_cfg(heldout=4, caps={"dup": 20}, weights={"entailment": 1.5})
    data = prepare_triples(_frame(), cfg, seed=0)
    assert data.relations == ["dup", "entailment"]
    assert data.counts == {"dup": 20, "entailment": 16 + 8}  # 30-4 capped at 20; (20-4) x 1.5
    held = data.heldout
    assert len(held) == 8 and set(held["relation"]) == {"dup", "entailment"}
    train = data.train
    assert not set(zip(held["head"], held["tail"])) & set(zip(train["head"], train["tail"]))
    dup = train[train["relation"] == "dup"]
    assert dup["negative"].notna().all() and (dup["negative"] != dup["tail"]).all()
    assert set(dup["negative"]) <= set(dup["tail"])  # a random tail of the same relation
    ent = train[train["relation"] == "entailment"]
    assert (ent["negative"].str[0] == "c").all()  # the corpus's own hard negatives are kept
    assert train["relation_id"].tolist() == [data.relations.index(r) for r in train["relation"]]
    again = prepare_triples(_frame(), cfg, seed=0)
    assert again.train.equals(train)  # seeded


def test_a_large_relation_is_prepared_in_shares_with_the_totals_of_one():
    """Above rows_per_task a relation is split over tasks by content-hashed slots; the held-out slice, cap and
    weight draws are apportioned so the totals are those of one task, every share draws its own in-relation
    negatives, and the result does not depend on the input order."""
    from data_pipelines.relations import SLOTS, _apportion, prepare_triples, relation_plan

    cfg = _data_cfg(heldout=4, caps={"dup": 20}, weights={"entailment": 1.5})
    whole = prepare_triples(_frame(), cfg, seed=0)
    split = prepare_triples(_frame(), cfg, seed=0, rows_per_task=8)
    assert split.counts == whole.counts == {"dup": 20, "entailment": 24}
    assert len(split.heldout) == 8 and split.heldout["relation"].value_counts().to_dict() == {"dup": 4, "entailment": 4}
    train = split.train
    assert not set(zip(split.heldout["head"], split.heldout["tail"])) & set(zip(train["head"], train["tail"]))
    dup = train[train["relation"] == "dup"]
    assert dup["negative"].notna().all() and (dup["negative"] != dup["tail"]).all()
    assert set(dup["negative"]) <= {f"d{i}" for i in range(10)}
    assert (train[train["relation"] == "entailment"]["negative"].str[0] == "c").all()
    assert not train.sort_values(["head", "tail"], ignore_index=True).equals(
        whole.train.sort_values(["head", "tail"], ignore_index=True))  # other draws: the split is real
    shuffled = prepare_triples(_frame().sample(frac=1.0, random_state=3), cfg, seed=0, rows_per_task=8)
    key = ["relation_id", "head", "tail", "negative"]
    assert shuffled.train.sort_values(key, ignore_index=True).equals(train.sort_values(key, ignore_index=True))

    slots = {"dup": np.bincount(np.arange(30) * 131 % SLOTS, minlength=SLOTS)}
    plan = relation_plan(slots, cfg, rows_per_task=8)
    shares = [plan["dup", b] for b in range(4)]
    assert [s.buckets for s in shares] == [4] * 4  # ceil(30 / 8) tasks
    assert (sum(s.heldout for s in shares), sum(s.kept for s in shares), sum(s.extra for s in shares)) == (4, 20, 0)
    rng = np.random.default_rng(0)
    for _ in range(200):  # largest remainder: exact totals, never more than a part holds
        sizes = rng.integers(0, 50, size=rng.integers(1, 9))
        total = int(rng.integers(0, sizes.sum() + 1))
        got = _apportion(total, sizes)
        assert got.sum() == total and (got <= sizes).all() and (np.abs(got - total * sizes / max(sizes.sum(), 1)) < 1).all()


@pytest.mark.parametrize("rows_per_task", [1_000_000, 8])
def test_the_cluster_prepares_each_relation_as_this_process_does_whatever_the_block_order(ray_local, rows_per_task):
    """prepare_triples_ds (one Ray task per share of a relation, the triples left in the object store) gives the rows,
    counts and held-out triples of prepare_triples, from blocks in any order, with blocks so small that a share
    handed over in pieces would fail (each share checks it got all its triples)."""
    import ray

    from data_pipelines.relations import prepare_triples, prepare_triples_ds

    cfg = _data_cfg(heldout=4, caps={"dup": 20}, weights={"entailment": 1.5})
    local = prepare_triples(_frame(), cfg, seed=0, rows_per_task=rows_per_task)
    context = ray.data.DataContext.get_current()
    block_bytes = context.target_max_block_size
    context.target_max_block_size = 256  # bytes: the shuffle would cut a share into pieces if it could
    try:
        frame = _frame().iloc[::-1]  # blocks in another order than the local run read its rows
        got = prepare_triples_ds(ray.data.from_pandas([frame[:17], frame[17:33], frame[33:]]), cfg, seed=0,
                                 rows_per_task=rows_per_task)
    finally:
        context.target_max_block_size = block_bytes
    assert (got.relations, got.counts) == (local.relations, local.counts)
    train = pd.DataFrame(got.train.take_all())[local.train.columns]
    key = ["relation_id", "head", "tail", "negative"]
    pd.testing.assert_frame_equal(train.sort_values(key, ignore_index=True),
                                  local.train.sort_values(key, ignore_index=True), check_dtype=False)
    assert sorted(map(tuple, got.heldout[key].values)) == sorted(map(tuple, local.heldout[key].values))


def test_relation_set_and_table_names_are_checked():
    from data_pipelines.relations import prepare_triples

    with pytest.raises(ValueError, match=r"\{'dup': 30\}.*not in data.relations"):
        prepare_triples(_frame(), _data_cfg(relations=["entailment"]), seed=0)
    with pytest.raises(ValueError, match="data.caps names relation.*'paraphrase'"):
        prepare_triples(_frame(), _data_cfg(caps={"paraphrase": 3}), seed=0)
    fixed = prepare_triples(_frame(), _data_cfg(relations=["entailment", "dup", "same-sent"]), seed=0)
    assert fixed.relations == ["entailment", "dup", "same-sent"]  # table order as given, unused names kept


def test_triple_records_are_validated(tmp_path):
    from data_pipelines.formats import parse

    path = tmp_path / "t.jsonl"
    path.write_text('{"head": "a man sits", "tail": "a person sits", "relation": "entailment"}\n'
                    '{"head": "a man sits", "tail": "a person sits", "relation": "entailment", '
                    '"negative": "a person sits"}\n'
                    '{"head": "a man sits", "relation": "entailment"}\n'
                    '{"head": "a man sits", "tail": "...", "relation": "entailment"}\n'
                    '{"head": "a man sits", "tail": "a person sits"}\n')
    rows = list(parse("triples", "jsonl", path))
    assert rows[0]["error"] is None and rows[0]["negative"] is None
    assert "equals the tail" in rows[1]["error"] and rows[2]["error"] == "missing field 'tail'"
    assert "only punctuation" in rows[3]["error"]
    assert rows[4]["error"] is None and rows[4]["relation"] is None  # takes its source's relation
