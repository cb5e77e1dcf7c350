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
        emit_result({"job": job, "status": "error", "error": f"{type(exc).__name__}: {exc}"})
        raise SystemExit(1) from None
    emit_result({"job": job, "status": "ok", **payload})
