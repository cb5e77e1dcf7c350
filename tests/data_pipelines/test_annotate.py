"""The annotation job's S equals the teachers' mean cosine computed directly on the same pairs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from data_pipelines.teachers import TeacherConfig, TeacherEncoder
from storage.paths import storage_path

ROOT = Path(__file__).resolve().parents[2]


def _run_in_this_process(sets: list[str], tmp_path, monkeypatch, capsys) -> dict:
    """The job's main as its command line runs it (the same config, --set values and JSON line), on the tests'
    shared Ray: what a job joining a running cluster does."""
    from jobconfig import load_config
    from runtime.result import run_job

    sys.path.insert(0, str(ROOT / "ray_jobs"))
    try:
        import annotate as job
    finally:
        sys.path.remove(str(ROOT / "ray_jobs"))
    from tests.conftest import mlflow_store

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_store(tmp_path))
    monkeypatch.setenv("RAOE_MLFLOW_ARTIFACTS", str(tmp_path / "artifacts"))
    cfg = load_config(job.AnnotateJobConfig, ROOT / "configs" / "tiny" / "annotate.yaml", sets)
    capsys.readouterr()
    run_job(lambda: job.main(cfg), "annotate")
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


# "shared": the command line in a process of its own, which starts and stops the local Ray it runs on (the one test
# of a job doing so end to end); "separate": the same job on the tests' running Ray (~20 s less than another process
# and Ray start), writing its outputs to object storage (the local S3 endpoint).
@pytest.mark.parametrize("pools", ["shared", "separate"])
def test_annotate_job_scores_equal_direct_teacher_cosines(tmp_path, pools, monkeypatch, capsys, request):
    """The job's scores are the teacher's cosines computed here, bad rows set aside. About 45 s here for "shared" (a
    process of its own that starts and stops a Ray, then the teacher pools), 25 s for "separate"."""
    from tests.conftest import mlflow_store

    pairs = [
        {"text1": "a man is playing music", "text2": "a person plays a guitar", "label": "entailment"},
        {"text1": "a man is playing music", "text2": "a dog sleeps", "label": "contradiction"},
        {"text1": "two children run in the park", "text2": "kids are outside", "label": "neutral"},
        {"text1": "a woman rides a bike", "text2": "", "label": "neutral"},  # bad: empty text2
        {"text1": "the cat eats food", "text2": "an animal is eating", "label": 0},
    ]
    data = tmp_path / "nli.jsonl"
    data.write_text("\n".join(json.dumps(p) for p in pairs) + "\n")
    out = request.getfixturevalue("s3").uri("annotated") if pools == "separate" else tmp_path / "out"
    sets = [f"data.train={data}", "data.format=pairs_jsonl", "data.splits=[]", "data.max_rows=null",
            "data.on_bad_record=quarantine", f"output_dir={out}", f"teacher_pools={pools}"]
    if pools == "separate":
        result = _run_in_this_process(sets, tmp_path, monkeypatch, capsys)
    else:
        cmd = [sys.executable, "ray_jobs/annotate.py", "--config", "configs/tiny/annotate.yaml",
               *[arg for value in sets for arg in ("--set", value)]]
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                              env={**env, "MLFLOW_TRACKING_URI": mlflow_store(tmp_path),
                                   "RAOE_MLFLOW_ARTIFACTS": str(tmp_path / "artifacts")})
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (result["rows_in"], result["rows_written"], result["rows_quarantined"]) == (5, 4, 1)
    assert result["output_path"] == f"{out}/data" and result["plot"] == f"{out}/s_distribution.png"
    assert storage_path(result["plot"]).read_bytes().startswith(b"\x89PNG")
    quarantined = [json.loads(line) for line in storage_path(result["quarantine_path"]).read_text().splitlines()]
    assert quarantined[0]["line"] == 4 and quarantined[0]["reason"] == "field 'text2' is empty"
    assert set(result["statistics"]["per_label"]) == {"entailment", "neutral", "contradiction"}

    written = pd.read_parquet(result["output_path"])
    teachers = [TeacherEncoder(TeacherConfig(name=n, source=s)) for n, s in (("tiny_a", "tiny:bert"),
                                                                             ("tiny_b", "tiny:bert-alt"))]
    for _, row in written.iterrows():
        direct = [t.pair_cosines([row["text1"]], [row["text2"]])[0] for t in teachers]
        assert row["s_tiny_a"] == pytest.approx(direct[0], abs=1e-5)
        assert row["s_tiny_b"] == pytest.approx(direct[1], abs=1e-5)
        assert row["similarity"] == pytest.approx(np.clip(np.mean(direct), 0, 1), abs=1e-5)
    assert sorted(written["label"]) == [0, 0, 1, 2]


def test_statistics_from_counts_added_over_batches_equal_numpy_on_all_rows():
    """What the job reports without collecting the scores: mean and std exact, quantiles within a bin (0.002)."""
    from data_pipelines.annotate import merge_counts, score_counts, summarise

    rng = np.random.default_rng(0)
    frame = pd.DataFrame({"label": rng.integers(0, 3, 3000).astype(float),
                          "s_a": rng.uniform(-0.3, 1, 3000), "s_b": rng.beta(5, 2, 3000)})
    frame["similarity"] = frame[["s_a", "s_b"]].mean(axis=1).clip(0, 1)
    batches = (frame.iloc[i::7] for i in range(7))
    got = summarise(merge_counts(score_counts(part, ["a", "b"]) for part in batches), ["a", "b"])
    for stats, values in [(got["S"], frame["similarity"]), (got["per_teacher"]["a"], frame["s_a"]),
                          (got["per_label"]["neutral"], frame.loc[frame["label"] == 1, "similarity"])]:
        assert stats["count"] == len(values)
        assert stats["mean"] == pytest.approx(values.mean(), abs=1e-9)
        assert stats["std"] == pytest.approx(values.std(ddof=0), abs=1e-9)
        for key, q in (("p10", 0.1), ("median", 0.5), ("p90", 0.9)):
            assert stats[key] == pytest.approx(np.quantile(values, q), abs=2e-3), key
    assert set(got["per_label"]) == {"entailment", "neutral", "contradiction"}
    assert got["clipped_to_zero"] == int((frame[["s_a", "s_b"]].mean(axis=1) < 0).sum()) > 0


def test_query_groups_are_scored_by_a_bi_encoder_and_a_cross_encoder(tmp_path, monkeypatch, capsys, ray_local):
    """data.format groups_jsonl: every (query, positive) and (query, negative) pair gets the mean of a bi-encoder
    teacher's cosine and a tiny random cross-encoder's prediction (teachers[].kind cross_encoder, also found by
    kind auto), written as each group's positive_scores and negative_scores; a cross-encoder cannot embed."""
    import torch
    from sentence_transformers import CrossEncoder

    from encoders.sources import resolve_model_source

    torch.manual_seed(0)
    reranker = tmp_path / "reranker"
    CrossEncoder(resolve_model_source("tiny:bert"), num_labels=1).save(str(reranker))
    groups = [{"query": "a man is playing music", "positives": ["a person plays a guitar"],
               "negatives": ["a dog sleeps", "the sky is blue"]},
              {"query": "two children run in the park", "positives": ["kids are outside", "children play"],
               "negatives": ["a woman rides a bike"]},
              {"query": "the cat eats food", "positives": ["an animal is eating"], "negatives": []}]
    data = tmp_path / "groups.jsonl"
    data.write_text("".join(json.dumps(g) + "\n" for g in groups))
    teachers = (f"teachers=[{{name: bi, source: 'tiny:bert'}}, {{name: rerank, source: '{reranker}', "
                f"kind: cross_encoder}}]")
    result = _run_in_this_process([f"data.train={data}", "data.format=groups_jsonl", "data.splits=[]",
                                   "data.max_rows=null", f"output_dir={tmp_path / 'out'}", "output_format=jsonl",
                                   teachers], tmp_path, monkeypatch, capsys)
    assert (result["rows_written"], result["statistics"]["groups"], result["statistics"]["pairs"]) == (3, 3, 7)
    assert Path(result["plot"]).read_bytes().startswith(b"\x89PNG")
    written = {r["query"]: r for f in sorted(Path(result["output_path"]).glob("*.json*")) for r in map(json.loads,
                                                                                                      open(f))}
    bi = TeacherEncoder(TeacherConfig(name="bi", source="tiny:bert"))
    cross = TeacherEncoder(TeacherConfig(name="rerank", source=str(reranker)))  # kind auto: its config says so
    assert cross.kind == "cross_encoder"
    for group in groups:
        row = written[group["query"]]
        for texts, scores in ((group["positives"], row["positive_scores"]), (group["negatives"], row["negative_scores"])):
            if not texts:
                assert scores == []
                continue
            queries = [group["query"]] * len(texts)
            want = (bi.pair_cosines(queries, texts) + np.asarray(cross.model.predict(list(zip(queries, texts))))) / 2
            np.testing.assert_allclose(scores, want, atol=1e-5)
    with pytest.raises(ValueError, match="is a cross-encoder: it scores pairs"):
        cross.encode(["a text"])
