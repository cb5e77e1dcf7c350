"""MLflow calls that a tracking-server outage must not turn into a lost training run.

Per-step metrics are buffered when the server does not answer and written when it answers again (the outage is
recorded on the run); registration and the end-of-run logging retry with backoff for ``tracking.retry_seconds``;
an unreachable server at start is an error before any Ray resource is taken."""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

T = TypeVar("T")
BATCH = 1000  # MLflow's log_batch limit on metrics per call
GAP_TAG = "raoe.tracking_outages"


def metric_name(key: str) -> str:
    """A result key as an MLflow metric name (letters, digits, _ - . / and spaces; Hits@k as hits_at_k)."""
    return re.sub(r"[^A-Za-z0-9_\-./ ]", "_", key.replace("@", "_at_"))


def check_reachable(uri: str, timeout: float = 5.0) -> None:
    """An http(s) tracking server must answer its health check now (files and sqlite need nothing)."""
    if not uri.startswith(("http://", "https://")):
        return
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout) as response:
            if response.status == 200:
                return
            reason = f"HTTP {response.status}"
    except (urllib.error.URLError, OSError) as exc:
        reason = str(getattr(exc, "reason", exc))
    raise ConnectionError(f"MLflow tracking server {uri} is not reachable ({reason}); start it, or point "
                          f"MLFLOW_TRACKING_URI at a running one (or at sqlite:///<path>)")


def with_retries(call: Callable[[], T], what: str, seconds: float, sleep: Callable[[float], None] = time.sleep) -> T:
    """``call()`` until it succeeds, backing off 1, 2, 4 ... 30 s, for at most ``seconds``; then a clear error."""
    started, delay = time.monotonic(), 1.0
    while True:
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - any tracking failure is retried until the deadline
            waited = time.monotonic() - started
            if waited + delay > seconds:
                raise RuntimeError(f"{what} failed for {waited:.0f} s (tracking.retry_seconds={seconds:g}): "
                                   f"{type(exc).__name__}: {exc}") from exc
            print(f"[raoe] {what} failed ({type(exc).__name__}); retrying in {delay:.0f} s", flush=True)
            sleep(delay)
            delay = min(30.0, delay * 2)


@dataclass(frozen=True)
class RunTarget:
    """The MLflow run a worker logs to, and how long an absent server is waited for (tracking.retry_seconds)."""

    tracking_uri: str
    run_id: str
    retry_seconds: float


class MetricsLog:
    """Per-step metrics from rank 0 straight to the job's MLflow run (Train v2 takes no logger callbacks). A log
    that fails waits in a buffer and goes out with the next one that succeeds; training never stops for it, and
    each outage (first failure, recovery, metrics held back) is added to the run's ``raoe.tracking_outages`` tag."""

    def __init__(self, target: RunTarget | None):
        self.client, self.pending, self.down_since, self.outages = None, [], None, []
        self.retry_seconds = target.retry_seconds if target else 0.0
        if target is not None:
            # One quick try per log (MLflow would otherwise retry for minutes inside the training step).
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
            from mlflow import MlflowClient

            self.client, self.run_id = MlflowClient(target.tracking_uri), target.run_id

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.client is None:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.pending += [Metric(k, float(v), now, step) for k, v in metrics.items() if v is not None]
        self.flush()

    def flush(self) -> bool:
        """Write every buffered metric; False (and keep them) while the server does not answer."""
        if self.client is None:
            return True
        try:
            while self.pending:
                self.client.log_batch(self.run_id, metrics=self.pending[:BATCH])
                del self.pending[:BATCH]
        except Exception as exc:  # noqa: BLE001 - the server is away: keep the metrics, keep training
            if self.down_since is None:
                self.down_since = time.time()
                print(f"[raoe] MLflow did not take the step metrics ({type(exc).__name__}); buffering them and "
                      f"training on", flush=True)
            return False
        if self.down_since is not None:
            import json

            outage = {"from": self.down_since, "to": time.time()}
            self.outages.append(outage)
            self.down_since = None
            print(f"[raoe] MLflow answers again after {outage['to'] - outage['from']:.0f} s; buffered metrics "
                  f"written", flush=True)
            try:
                self.client.set_tag(self.run_id, GAP_TAG, json.dumps(self.outages))
            except Exception:  # noqa: BLE001 - the tag is a courtesy; the metrics are in
                pass
        return True

    def close(self) -> None:
        """At the end of training: retry the buffered metrics with backoff for ``retry_seconds``, then say how many
        could not be written (the checkpoints' progress.json still holds the evaluated steps)."""
        if self.client is None or self.flush():
            return

        def flushed() -> None:
            if not self.flush():
                raise ConnectionError("the tracking server does not answer")

        try:
            with_retries(flushed, f"writing {len(self.pending)} buffered step metrics", self.retry_seconds)
        except RuntimeError as exc:
            print(f"[raoe] {exc}; they are not in the run", flush=True)
