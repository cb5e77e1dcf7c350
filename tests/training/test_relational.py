"""The RSE job end to end: 1 DDP worker vs 2 DeepSpeed ZeRO-2 workers on the same global batches (dropout 0) log the
same loss, global gradient norm and relation-table gradient norm at every step (the table is used outside the
encoder's forward; a x2 error in its gradient would show in its own norm, Adam's step would hide it); the
registered model loads with its relation table, and dev selection used the relation-weighted score."""

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.training.conftest import ONE_STEP_APART_REL, ROOT, SAME_START_REL, metric_by_step

STEPS = 2
RUNS = {"1 worker": ("trainer.num_workers=0",),  # in the test's process (Ray Train's local mode)
        "2 workers zero-2": ("trainer.num_workers=2", "trainer.strategy=deepspeed", "trainer.zero_stage=2"),
        "2 workers ddp": ("trainer.num_workers=2",)}


def relational_config(root, name, *overrides):
    from jobconfig import load_config
    from jobconfig.schema import RelationalJobConfig

    base = [f"tracking.run_name={name}", f"trainer.storage_path={root / 'runs'}", f"output_dir={root / 'models'}",
            "model.dropout=0.0", "model.pooling=mean", "tracking.experiment=raoe-test", f"trainer.max_steps={STEPS}",
            f"trainer.eval_every={STEPS}", f"data.train={ROOT / 'configs/tiny/data/triples.jsonl'}",
            f"data.sources=[{{train: {ROOT / 'configs/tiny/data/sentences_san.jsonl'}, mapping: same-sent, "
            "max_rows: 32}]"]
    return load_config(RelationalJobConfig, ROOT / "configs" / "tiny" / "relational.yaml", base + list(overrides))


@pytest.fixture(scope="module")
def runs(train_env):
    """RUNS, once for the module. About 85 s here: two of them start a group of two Ray Train workers (ZeRO-2, DDP);
    the one in this process takes a few seconds."""
    from tests.conftest import DEV_DATA
    from training.run import run_training

    if not DEV_DATA.exists():
        pytest.skip(f"development data not found at {DEV_DATA} (set RAOE_DEV_DATA)")
    dev_data = DEV_DATA
    out = {}
    for name, extra in RUNS.items():
        dev = f"eval.data_dir={dev_data / 'senteval'}" if name == "1 worker" else "eval.data_dir=/nonexistent"
        out[name] = run_training(relational_config(train_env, "rse-" + name.replace(" ", "-"), dev, "eval.max_pairs=60",
                                                   *extra), register=name == "1 worker")
    return out


@pytest.mark.parametrize("other", ["2 workers ddp", "2 workers zero-2"])
def test_two_workers_have_the_one_worker_losses_and_gradients_including_the_relation_table(runs, other):
    one, two = runs["1 worker"], runs[other]
    assert two["plan"]["micro_batch"] == 8 and one["plan"]["rows"] == two["plan"]["rows"] == 104
    for key in ("train_loss", "grad_norm", "grad_norm/relation_vectors"):
        expected, got = metric_by_step(one["run_id"], key), metric_by_step(two["run_id"], key)
        assert sorted(got) == list(range(1, STEPS + 1)), key
        print(f"{other} {key}: 1 worker {expected}, 2 workers {got}")
        assert got[1] == pytest.approx(expected[1], rel=SAME_START_REL), f"{key} at step 1"
        assert got[2] == pytest.approx(expected[2], rel=ONE_STEP_APART_REL), f"{key} at step 2"
    assert metric_by_step(one["run_id"], "grad_norm/relation_vectors")[1] > 0.05
    tables = [load_file(f"{r['model_path']}/relations.safetensors")["relation_vectors"] for r in (one, two)]
    np.testing.assert_allclose(tables[1], tables[0], atol=1e-4)


def test_registered_model_scores_with_its_relations_and_dev_used_them(runs, dev_data):
    from encoders.relational import RelationalEncoder
    from evaluation.sts import relation_sts_scorer, stsb_dev_spearman

    one = runs["1 worker"]
    assert one["model_uri"] == "models:/raoe-rse/1"
    registered, exported = RelationalEncoder(one["model_uri"]), RelationalEncoder(one["model_path"])
    assert registered.names == exported.names == ["duplicate_question", "entailment", "same-sent"]
    np.testing.assert_array_equal(registered.vectors, exported.vectors)
    a, b = ["a child is holding a ball."], ["a child is eating food."]
    assert registered.score(a, b, relation="entailment") == pytest.approx(exported.score(a, b, relation="entailment"))
    weights = {"entailment": 1.0, "duplicate_question": 0.5}  # configs/tiny/relational.yaml
    dev = stsb_dev_spearman(exported.encode, dev_data / "senteval", max_pairs=60,
                            score=relation_sts_scorer(exported.names, exported.vectors, weights))
    assert one["metrics"]["best_stsb_dev_spearman"] == pytest.approx(dev, abs=1e-6)
    plain = stsb_dev_spearman(exported.encode, dev_data / "senteval", max_pairs=60)
    assert plain != pytest.approx(dev, abs=1e-3)  # the relation-weighted score is not the plain cosine
    prediction = one["relation_prediction"]
    assert set(prediction) == {"duplicate_question", "entailment", "same-sent", "all"}
    assert prediction["all"]["triples"] == 24 and 0 < prediction["all"]["mrr"] <= 1
    assert json.loads(json.dumps(one))["relations"] == {"duplicate_question": 40, "entailment": 40, "same-sent": 24}
    from encoders.model_uris import resolve_model

    card = (Path(resolve_model(one["model_uri"])) / "README.md").read_text()  # raoe's card, not the flavor's
    assert "Wang & Li 2022, Relational Sentence Embedding" in card and "| entailment |" in card
    assert "eprint = {2212.08802}" in card  # BibTeX of every objective's paper
    assert "RelationalEncoder(" in card and "Base model: `tiny:bert`" in card


def test_relation_weights_naming_a_relation_the_corpus_lacks_are_refused_before_training(train_env, tmp_path):
    """Found on the driver from the corpus's relations, not by a worker at its first dev evaluation."""
    from training.run import run_training

    entailment = tmp_path / "entailment.jsonl"
    entailment.write_text("".join(line + "\n" for line in (ROOT / "configs/tiny/data/triples.jsonl").read_text()
                                  .splitlines() if '"entailment"' in line))
    cfg = relational_config(train_env, "rse-unknown-weight", f"data.train={entailment}",
                            "eval.relation_weights={entailment: 1.0, duplicate_question: 0.5}")
    with pytest.raises(ValueError, match=r"eval.relation_weights names relation\(s\) \['duplicate_question'\].*"
                                         r"their relations: \['entailment', 'same-sent'\]"):
        run_training(cfg)
    assert not (train_env / "runs" / "rse-unknown-weight").exists()  # no worker group ever started
