"""Marks that a shared cache entry (a validated corpus, a corpus index) is in use, so that another job's housekeeping
never evicts what this one is reading or searching: the entry's marker file is written before the use and rewritten
every REFRESH_S while it lasts, and evictions skip entries marked within GRACE_S. The marker's modification time is
what counts (an object's on object storage), so the one listing evictions make already holds it."""

from __future__ import annotations

import contextlib
import json
import threading
import time

from storage.paths import write_whole

REFRESH_S = 300  # a use rewrites its marker this often (a read of 100M rows, a search of a large corpus take long)
GRACE_S = 3 * REFRESH_S  # an entry marked more recently than this may be in use: never evicted

_lock = threading.Lock()
_held: dict[str, int] = {}  # marker -> how many uses in this process hold it
_refresher: dict[str, threading.Thread] = {}
_wake = threading.Event()  # set by a new hold: the refresher starts its wait again (and reads REFRESH_S anew)


def mark(marker: str) -> None:
    """Write ``marker`` now (a path or URI); a failure is a warning: housekeeping must not fail a job."""
    try:
        write_whole(marker, json.dumps({"at": time.time()}))
    except Exception as exc:  # noqa: BLE001
        print(f"[raoe] warning: could not mark {marker} in use ({type(exc).__name__}: {exc})", flush=True)


@contextlib.contextmanager
def held(marker: str):
    """``marker`` written before the block and every REFRESH_S until it ends."""
    hold(marker)
    try:
        yield
    finally:
        with _lock:
            _held[marker] -= 1
            if not _held[marker]:
                del _held[marker]


def hold(marker: str) -> None:
    """``marker`` written now and every REFRESH_S for as long as this process lives (or a ``held`` block lasts):
    what a job opened, it may search until it exits."""
    mark(marker)
    with _lock:
        _held[marker] = _held.get(marker, 0) + 1
        if "thread" not in _refresher:
            _refresher["thread"] = threading.Thread(target=_refresh, name="raoe-in-use", daemon=True)
            _refresher["thread"].start()
    _wake.set()


def _refresh() -> None:
    while True:
        _wake.wait(REFRESH_S)
        _wake.clear()
        with _lock:
            markers = list(_held)
        for marker in markers:
            mark(marker)
