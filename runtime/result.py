"""The job contract: the last line of standard output is one JSON object with what the job produced."""

from __future__ import annotations

import json
import math
import sys
import traceback
from typing import Any, Callable


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and callable(value.item):
        try:
            return _clean(value.item())
        except (ValueError, RuntimeError):
            pass
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def emit_result(payload: dict[str, Any]) -> None:
    """Print ``payload`` as one JSON line, flushed, after everything else the job printed."""
    sys.stderr.flush()
    sys.stdout.flush()
    print(json.dumps(_clean(payload), sort_keys=False), flush=True)


def root_cause(exc: BaseException) -> BaseException:
    """The user's own exception inside Ray's wrappers: a task error's ``cause``, a Ray Train worker group's first
    worker failure, and any ``ray.*`` exception's ``__cause__`` (Ray Data's UserCodeException)."""
    seen: set[int] = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        cause = getattr(exc, "cause", None)
        failures = getattr(exc, "worker_failures", None)
        if isinstance(cause, BaseException):
            exc = cause
        elif isinstance(failures, dict) and failures:
            exc = next(iter(failures.values()))
        elif type(exc).__module__.startswith("ray.") and exc.__cause__ is not None:
            exc = exc.__cause__
        else:
            break
    return exc


def error_message(exc: BaseException) -> str:
    """``Type: message`` of the root cause, without the tracebacks Ray folds into its wrappers' messages."""
    root = root_cause(exc)
    text = str(root)
    if "Traceback (most recent call last)" in text:  # a wrapper that could not be unwrapped: keep its last line
        text = [line for line in text.strip().splitlines() if line.strip()][-1]
    return f"{type(root).__name__}: {text}"


def run_job(main: Callable[[], dict[str, Any]], job: str) -> None:
    """Run a job's main; its result (or its error) becomes the JSON line. Errors exit with status 1."""
    try:
        payload = main()
    except SystemExit:
        raise
    except KeyboardInterrupt:
        emit_result({"job": job, "status": "interrupted"})
        raise SystemExit(130) from None
    except Exception as exc:  # noqa: BLE001 - every failure still ends with the JSON line
        traceback.print_exc()
        emit_result({"job": job, "status": "error", "error": error_message(exc)})
        raise SystemExit(1) from None
    emit_result({"job": job, "status": "ok", **payload})
