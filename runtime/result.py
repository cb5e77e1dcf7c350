"""The job contract: the last line of standard output is one JSON object with what the job produced."""

from __future__ import annotations

import json
import math
import re
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
    worker failure, its controller's failure, and any ``ray.*`` exception's ``__cause__`` (Ray Data's
    UserCodeException)."""
    seen: set[int] = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        cause = getattr(exc, "cause", None)
        failures = getattr(exc, "worker_failures", None)
        controller = getattr(exc, "controller_failure", None)
        if isinstance(cause, BaseException):
            exc = cause
        elif isinstance(controller, BaseException):
            exc = controller
        elif isinstance(failures, dict) and failures:
            exc = next(iter(failures.values()))
        elif type(exc).__module__.startswith("ray.") and exc.__cause__ is not None:
            exc = exc.__cause__
        else:
            break
    return exc


CAUSE_MARKER = "The above exception was the direct cause of the following exception"


def error_message(exc: BaseException) -> str:
    """``Type: message`` of the root cause, without the tracebacks Ray folds into its wrappers' messages. Ray Data
    does not ship the user's exception object back (only its formatted traceback inside UserCodeException's
    message): then the first exception line of that traceback is the message."""
    root = root_cause(exc)
    if type(root).__module__.startswith("ray."):
        text = str(exc)
        if CAUSE_MARKER in text:
            lines = text.split(CAUSE_MARKER)[0].rstrip().splitlines()
            start = max((i for i, line in enumerate(lines) if re.match(r"^[A-Za-z_][\w.]*(Error|Exception)\b", line)),
                        default=None)
            if start is not None:
                return "\n".join(lines[start:]).strip()
    return f"{type(root).__name__}: {root}"


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
