"""Every job ends its standard output with one JSON object, also when it fails."""

import json
import subprocess
import sys

import numpy as np
import pytest

from runtime.result import emit_result, run_job


def test_emit_result_is_one_json_line_with_clean_values(capsys):
    print("progress ...")
    emit_result({"a": np.float32(1.5), "nan": float("nan"), "nested": {"x": (1, 2)}})
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == {"a": 1.5, "nan": None, "nested": {"x": [1, 2]}}


def test_run_job_reports_errors_as_the_json_line(capsys):
    def boom():
        raise ValueError("bad input")

    with pytest.raises(SystemExit) as exc:
        run_job(boom, "demo")
    assert exc.value.code == 1
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == {"job": "demo", "status": "error", "error": "ValueError: bad input"}


def test_a_bad_config_is_rejected_before_ray_starts(tmp_path):
    proc = subprocess.run(
        [sys.executable, "ray_jobs/evaluate.py", "--set", "eval.batch_size=0"],
        capture_output=True, text=True, cwd=tmp_path.parent if False else None,
    )
    assert proc.returncode == 2
    assert "eval.batch_size: Input should be greater than or equal to 1" in proc.stderr
    assert "Started a local Ray" not in proc.stderr + proc.stdout
