"""generate_lists: seeds are the premises, lam and lam = 0 lists are matched by seed id (Ray Data returns rows in any
order), the tiny config writes lists, and a run that writes none says so instead of "ok"."""

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny" / "generate_lists.yaml"
PAIRS = ROOT / "configs" / "tiny" / "data" / "nli_pairs.jsonl"


@pytest.fixture(scope="module")
def job():
    sys.path.insert(0, str(ROOT / "ray_jobs"))
    try:
        import generate_lists
    finally:
        sys.path.remove(str(ROOT / "ray_jobs"))
    return generate_lists


def _lists(seed_ids: list[int], lam: str) -> pd.DataFrame:
    return pd.DataFrame({"seed_id": seed_ids,
                         "sentences": [[f"seed {i}.", f"{lam} one from {i}.", f"{lam} two from {i}."] for i in seed_ids]})


@pytest.mark.parametrize("order", [[0, 1, 2, 3, 4], [4, 2, 0, 3, 1], [3, 4, 1, 0, 2]])
def test_lam_lists_are_matched_to_the_lam_zero_lists_by_seed_id_in_any_row_order(job, order):
    pairs = job.match_by_seed(_lists(order, "lam"), _lists([o for o in order if o in (1, 3, 4)], "zero"))
    assert [p["seed_id"] for p in pairs] == [1, 3, 4]
    for p in pairs:
        assert p["seed"] == p["lam"][0] == p["lam0"][0] == f"seed {p['seed_id']}."
        assert p["lam"][1] == f"lam one from {p['seed_id']}." and p["lam0"][1] == f"zero one from {p['seed_id']}."


def test_a_lam_zero_list_without_its_lam_list_is_an_error(job):
    with pytest.raises(RuntimeError, match="seed 7"):
        job.match_by_seed(_lists([0, 1], "lam"), _lists([7], "zero"))
    shifted = _lists([0, 1], "lam").assign(seed_id=[1, 0])  # ids that do not belong to their rows' seeds
    with pytest.raises(RuntimeError, match="seed 0"):
        job.match_by_seed(shifted, _lists([0], "zero"))


def test_the_list_generator_hands_the_seed_id_back_with_each_list():
    from data_pipelines.ranked import ListGenerator
    from encoders.tiny import WRITER_PROMPT

    generator = ListGenerator("tiny:qwen2-writer", WRITER_PROMPT, steps=1, lam=0.5, max_new_tokens=16)
    out = generator({"seed_id": np.array([7, 3]), "text": np.array(["a man is eating food.", "a dog is playing music."])})
    assert out["seed_id"].tolist() == [7, 3]
    assert [s[0] for s in out["sentences"]] == ["a man is eating food.", "a dog is playing music."]


def test_seed_candidates_are_the_distinct_premises_found_on_the_cluster(ray_local):
    import ray

    from data_pipelines.ranked import kmeans_sample, seed_candidates

    rows = [json.loads(line) for line in open(PAIRS)]
    rows += [{**rows[0], "text1": "  " + rows[0]["text1"] + " "}, {**rows[0], "text1": "   "}]  # padded, blank
    ds = ray.data.from_items(rows, override_num_blocks=4)
    candidates = seed_candidates(ds, "text1").materialize()
    premises = sorted(r["text"] for r in candidates.take_all())
    assert premises == sorted({r["text1"].strip() for r in rows} - {""}) and len(premises) < len(rows)
    assert not set(premises) & ({r["text2"] for r in rows} - {r["text1"] for r in rows})  # no hypothesis
    every, total = kmeans_sample(candidates, len(premises), seed=3)
    assert total == len(premises) and sorted(r["text"] for r in every.take_all()) == premises  # all when they fit
    reversed_blocks = seed_candidates(ray.data.from_items(rows[::-1], override_num_blocks=3), "text1")
    sample = [sorted(r["text"] for r in kmeans_sample(d, 5, seed=3)[0].take_all())
              for d in (candidates, reversed_blocks)]
    assert len(sample[0]) == 5 and sample[0] == sample[1] and set(sample[0]) <= set(premises)  # any block order
    other = sorted(r["text"] for r in kmeans_sample(candidates, 5, seed=4)[0].take_all())
    assert other != sample[0]  # the seed draws it


def test_seeds_come_from_premises_by_default_and_say_so(job):
    field = job.ListsSection.model_fields["seeds_from"]
    assert field.default == "premises" and "text1" in field.description
    assert job.SEED_SOURCES["premises"] == ("pairs", "text1")


def test_comparison_seeds_are_a_seeded_sample(job):
    ids = job.comparison_ids(40, 8, seed=42)
    assert ids == job.comparison_ids(40, 8, seed=42) == sorted(set(ids)) and len(ids) == 8 and ids != list(range(8))
    assert job.comparison_ids(3, 8, seed=42) == [0, 1, 2]


def test_the_tiny_config_prompts_the_tiny_writer_as_it_was_fitted():
    from encoders.tiny import WRITER_PROMPT

    sys.path.insert(0, str(ROOT / "ray_jobs"))
    try:
        from generate_lists import GenerateListsJobConfig
    finally:
        sys.path.remove(str(ROOT / "ray_jobs"))
    from jobconfig import load_config

    cfg = load_config(GenerateListsJobConfig, TINY, [])
    assert cfg.lists.model == "tiny:qwen2-writer" and cfg.lists.prompt == WRITER_PROMPT
    assert cfg.lists.seeds_from == "premises" and cfg.lists.actors == 2


def test_the_tiny_writer_ends_its_sentences():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from data_pipelines.ranked import directed_greedy
    from encoders.sources import resolve_model_source
    from encoders.tiny import WRITER_PROMPT

    path = resolve_model_source("tiny:qwen2-writer")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    seeds = ["a girl is riding a bike.", "two people is holding a ball in the snow."]
    outputs = directed_greedy(model, tokenizer, [WRITER_PROMPT.replace("{sentence}", s) for s in seeds], None,
                              lam=0.0, max_new_tokens=16)
    assert all(o.strip().endswith(".") and o.strip() != s for o, s in zip(outputs, seeds))
    assert all(len(tokenizer(o, add_special_tokens=False)["input_ids"]) < 16 for o in outputs)  # EOS, not the limit


def test_empty_reason_names_the_stops_and_the_token_limit(job):
    reason = job.empty_reason(8, {"unfinished": 6, "looping": 2}, max_new_tokens=8)
    assert "all 8 lists" in reason and "unfinished 6, looping 2" in reason and "lists.max_new_tokens=8" in reason


def test_a_run_that_writes_no_list_does_not_report_ok(job, tmp_path, monkeypatch, capsys):
    """The random tiny LM never ends a sentence: every list stops at x1, and the JSON line says "empty" and why.
    About 30 s: the job end to end (its actor pools load the seed encoder and the language model) before it
    finds no list written."""
    from jobconfig import load_config
    from runtime.result import run_job

    cfg = load_config(job.GenerateListsJobConfig, TINY, [
        f"data.train={PAIRS}", f"output_dir={tmp_path}", "tracking.experiment=raoe-test", "lists.model=tiny:qwen2-lm",
        "lists.steps=1", "lists.clusters=2", "lists.per_cluster=2", "lists.compare_lists=0", "lists.actors=1",
        "lists.batch_size=4"])
    from tests.conftest import mlflow_store

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_store(tmp_path))
    monkeypatch.setenv("RAOE_MLFLOW_ARTIFACTS", str(tmp_path / "artifacts"))
    run_job(lambda: job.main(cfg), "generate_lists")
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["status"] == "empty" and line["lists_written"] == 0 and line["seeds"] == 4
    assert sum(line["stopped"].values()) == 4
    assert all(f"{reason} {n}" in line["reason"] for reason, n in line["stopped"].items())
