"""The annotation job's S equals the teachers' mean cosine computed directly on the same pairs."""

import json
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from data_pipelines.teachers import TeacherConfig, TeacherEncoder


@pytest.mark.parametrize("pools", ["shared", "separate"])
def test_annotate_job_scores_equal_direct_teacher_cosines(tmp_path, pools):
    pairs = [
        {"text1": "a man is playing music", "text2": "a person plays a guitar", "label": "entailment"},
        {"text1": "a man is playing music", "text2": "a dog sleeps", "label": "contradiction"},
        {"text1": "two children run in the park", "text2": "kids are outside", "label": "neutral"},
        {"text1": "a woman rides a bike", "text2": "", "label": "neutral"},  # bad: empty text2
        {"text1": "the cat eats food", "text2": "an animal is eating", "label": 0},
    ]
    data = tmp_path / "nli.jsonl"
    data.write_text("\n".join(json.dumps(p) for p in pairs) + "\n")
    out = tmp_path / "out"
    cmd = [
        sys.executable, "ray_jobs/annotate.py", "--config", "configs/tiny/annotate.yaml",
        "--set", f"data.train={data}", "--set", "data.format=pairs_jsonl", "--set", "data.splits=[]",
        "--set", "data.max_rows=null", "--set", "data.on_bad_record=quarantine", "--set", f"output_dir={out}",
        "--set", f"teacher_pools={pools}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db",
                               "RAOE_MLFLOW_ARTIFACTS": str(tmp_path / "artifacts")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (result["rows_in"], result["rows_written"], result["rows_quarantined"]) == (5, 4, 1)
    quarantined = [json.loads(line) for line in open(result["quarantine_path"])]
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
