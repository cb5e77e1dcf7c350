"""A real `mlflow server` on 127.0.0.1 that goes away mid-run and comes back: step metrics are buffered, not lost,
and never stop training; the outage is recorded on the run. An unreachable server at start is a clear error naming
the URI; end-of-run calls retry with backoff and give up with a clear message after the configured time."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.local_head import free_port

MLFLOW = Path(sys.executable).parent / "mlflow"


def start_server(port: int, root: Path) -> subprocess.Popen:
    from tracking.metrics import check_reachable

    # Without the server's job runner: it would start eight more processes importing MLflow, for jobs never used here.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = subprocess.Popen([str(MLFLOW), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                             "--backend-store-uri", f"sqlite:///{root / 'server.db'}",
                             "--artifacts-destination", str(root / "artifacts")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 90
    while True:
        try:
            check_reachable(f"http://127.0.0.1:{port}", timeout=2)
            return proc
        except ConnectionError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise
            time.sleep(0.5)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(timeout=30)


def test_metrics_survive_a_tracking_server_outage(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    from tracking.metrics import GAP_TAG, MetricsLog, RunTarget

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # what MetricsLog sets in the worker
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    server = start_server(port, tmp_path)
    try:
        client = MlflowClient(uri)
        run_id = client.create_run(client.create_experiment("outage")).info.run_id
        log = MetricsLog(RunTarget(uri, run_id, retry_seconds=300.0))
        log.log({"train_loss": 1.0}, 1)
        stop(server)
        for step in (2, 3):  # the server is gone: training goes on, the metrics wait
            started = time.monotonic()
            log.log({"train_loss": float(step)}, step)
            assert time.monotonic() - started < 10
        assert len(log.pending) == 2 and log.down_since is not None
        server = start_server(port, tmp_path)
        log.log({"train_loss": 4.0}, 4)
        assert log.pending == [] and log.down_since is None
        history = client.get_metric_history(run_id, "train_loss")
        assert sorted(m.step for m in history) == [1, 2, 3, 4]
        assert sorted(m.value for m in history) == [1.0, 2.0, 3.0, 4.0]
        assert len(json.loads(client.get_run(run_id).data.tags[GAP_TAG])) == 1
    finally:
        stop(server)


def test_an_unreachable_server_is_named_at_start_and_retries_end_with_a_clear_error():
    from tracking.metrics import check_reachable, with_retries

    uri = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(ConnectionError, match=f"MLflow tracking server {uri} is not reachable"):
        check_reachable(uri)
    assert time.monotonic() - started < 10
    waits, attempts = [], []

    def flaky():
        attempts.append(1)
        if len(attempts) < 3:
            raise ConnectionError("refused")
        return "registered"

    assert with_retries(flaky, "registering raoe-s1", 60, sleep=waits.append) == "registered"
    assert waits == [1.0, 2.0]  # backoff
    with pytest.raises(RuntimeError, match=r"registering raoe-s1 failed for \d+ s \(tracking.retry_seconds=0\.5\)"):
        with_retries(lambda: 1 / 0, "registering raoe-s1", 0.5, sleep=lambda s: None)
