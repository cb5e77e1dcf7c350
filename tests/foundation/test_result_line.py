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


def test_an_error_inside_a_ray_data_task_reaches_the_json_line_as_the_users_own(tmp_path, ray_local):
    """Ray wraps a failing task's exception (RayTaskError(UserCodeException) with two tracebacks in its message);
    the JSON line carries the original type and message only."""
    import ray

    from runtime.result import error_message, root_cause

    def fail(row):
        raise ValueError(f"row {row['id']} has no 'text'")

    with pytest.raises(Exception) as caught:
        ray.data.range(3, override_num_blocks=1).map(fail).take_all()
    assert 'File "' in str(caught.value) and "UserCodeException" in repr(caught.value)  # what the user saw before
    assert error_message(caught.value) == "ValueError: row 0 has no 'text'"
    assert isinstance(root_cause(RuntimeError("x")), RuntimeError)


def test_a_format_that_cannot_read_the_path_is_refused_before_any_task(tmp_path):
    from data_pipelines.readers import corpus_files

    data = tmp_path / "pairs.jsonl"
    data.write_text('{"text1": "a", "text2": "b", "label": "entailment"}\n')
    with pytest.raises(ValueError, match="senteval_nli reads a SentEval NLI folder.*pairs.jsonl' is not one"):
        corpus_files(data, "pairs", "senteval_nli")
    with pytest.raises(ValueError, match="'parquet' cannot read pairs.jsonl: .jsonl, .json, .ndjson files are read by"):
        corpus_files(data, "pairs", "parquet")
    with pytest.raises(ValueError, match="'txt' does not hold pairs"):
        corpus_files(data, "pairs", "txt")
    assert corpus_files(data, "pairs", "pairs_jsonl") == ([data], "pairs_jsonl")


def test_storage_errors_from_ray_trains_controller_name_the_path_and_what_to_do():
    """Ray Train's controller failing to rewrite its checkpoint record (read-only storage) reaches the JSON line as
    the OS error with raoe's advice, not as "ControllerError"; other failures pass through unchanged."""
    from ray.train.v2.api.exceptions import ControllerError

    from runtime.result import error_message
    from training.checkpoints import storage_failure

    os_error = OSError(30, "Failed to open local file '/data/run/checkpoint_manager_snapshot.json'. Detail: [errno 30] "
                           "Read-only file system")
    wrapped = ControllerError(os_error)
    assert error_message(wrapped).startswith("OSError: [Errno 30] Failed to open local file '/data/run/")
    failure = storage_failure(wrapped, "/data/run")
    assert str(failure).startswith("could not write Ray Train's checkpoint record under /data/run: [Errno 30] ")
    assert "Read-only file system" in str(failure) and "resubmit the same job" in str(failure)
    assert storage_failure(ControllerError(ValueError("other")), "/data/run") is None
