"""A folder on shared storage copied once to each node's own disk, for files a node reads many times through the page
cache (memory-mapped training corpora, ``data.node_local``).

The copy is keyed by a name that says what the folder holds (a content fingerprint), so a copy is never stale: a
corpus that changes has another name. Every process of a node that needs the folder calls ``node_copy``; the first
copies under a file lock, into a staging folder renamed into place when whole, and the others wait on the lock and find
it there. The copies live under the node's own ``RAOE_NODE_CACHE`` (default ``<tmp>/raoe-node-cache-<uid>``): a disk of
the node, never a shared mount (each node must hold its own; a network file system is warned about).

A process that asks for a copy holds a shared lock on it until it exits (the copy is memory-mapped for that long).
With ``RAOE_NODE_CACHE_MAX_GB`` set, each new copy then removes whole copies, least recently asked for first, until the
node's copies fit, never one a live process holds (the one just made included)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

from storage.paths import ABANDONED_AFTER_S, files_under, is_uri, storage_path

COMPLETE = ".complete"  # written last into a node's copy: the copy is whole
MAX_GB_ENV = "RAOE_NODE_CACHE_MAX_GB"  # the node copies' size limit (unset: none)
_HELD: dict[Path, object] = {}  # copy -> the open lock file whose shared lock marks it in use by this process


# File systems whose folders other nodes may share, or whose flock may not hold between nodes: the node cache warns.
NETWORK_FILE_SYSTEMS = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "glusterfs", "ceph", "fuse.sshfs",
                        "fuse.s3fs", "fuse.gcsfuse", "fuse.mountpoint-s3", "beegfs", "gpfs", "9p"}
_WARNED: set[Path] = set()


def node_cache_root() -> Path:
    """This node's own copies: ``RAOE_NODE_CACHE`` from the node's own environment (a job never forwards the driver's),
    else a folder of this user's under the system's temporary directory, a disk of the node on every cluster image
    (the home folder is an NFS mount on many). A root on a network file system is warned about once."""
    default = Path(tempfile.gettempdir()) / f"raoe-node-cache-{os.getuid()}"
    root = Path(os.environ.get("RAOE_NODE_CACHE") or default).expanduser()
    if root not in _WARNED:
        _WARNED.add(root)
        kind = file_system_type(root)
        if kind in NETWORK_FILE_SYSTEMS:
            print(f"[raoe] warning: the node cache {root} is on a {kind} file system: each node must keep its own "
                  f"copies on its own disk (two nodes sharing the folder would remove each other's copies in use, "
                  f"as file locks may not hold between them); set RAOE_NODE_CACHE to a local disk", flush=True)
    return root


def file_system_type(path: Path) -> str | None:
    """The type of the file system ``path`` (or its nearest existing parent) is on, from /proc/self/mounts (Linux);
    None where that cannot be read."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/self/mounts").read_text().splitlines()]
    except OSError:
        return None
    path = path.absolute()
    best = max(((point.replace("\\040", " "), kind) for point, kind in mounts
                if path == Path(point) or Path(point) in path.parents), key=lambda pair: len(pair[0]), default=None)
    return best[1] if best else None


def node_copy(source: str, name: str, files: list[str] | None = None, contents: dict[str, str] | None = None) -> Path:
    """The node-local copy of the folder ``source`` (a local path or a URI), as ``<RAOE_NODE_CACHE>/<name>``: made by
    the first process of the node that asks, under a lock, and found by the others; held in use by this process
    until it exits. ``files``: only these (relative names), not all the folder holds; ``contents``: files written
    with this text instead of copied (what the caller already read, so the copy holds exactly what it named)."""
    target = node_cache_root() / name
    if target in _HELD:
        return target
    max_bytes = _max_bytes()  # a malformed limit fails before the copy, not after
    target.parent.mkdir(parents=True, exist_ok=True)
    copied = False
    while target not in _HELD:
        if not (target / COMPLETE).exists():
            with _locked(target.parent / f"{name}.lock"):
                if not (target / COMPLETE).exists():
                    _copy_in(source, target, files, contents or {})
                    copied = True
        in_use = open(target.parent / f"{name}.use", "a")  # a lock of its own: copiers never wait on users
        fcntl.flock(in_use, fcntl.LOCK_SH)  # in use: no pruning removes it while this process lives
        if (target / COMPLETE).exists():  # not pruned between the copy and the shared lock
            _HELD[target] = in_use
            os.utime(in_use.name)  # last asked for now: least recently used goes first
        else:
            in_use.close()
    if copied:
        prune(max_bytes)
    return target


def prune(max_bytes: int | None) -> list[str]:
    """Remove whole copies, least recently asked for first, until the node's copies take at most ``max_bytes``;
    a copy some live process holds is skipped. Returns the names removed."""
    root = node_cache_root()
    if max_bytes is None or not root.is_dir():
        return []
    copies = [path for path in root.iterdir() if ".staging-" not in path.name and (path / COMPLETE).exists()]
    sizes = {path: _size(path) for path in copies}
    used = {path: _mtime(path.with_name(f"{path.name}.use")) for path in copies}
    total, removed = sum(sizes.values()), []
    for path in sorted(copies, key=used.get):
        if total <= max_bytes:
            break
        with open(path.with_name(f"{path.name}.use"), "a") as in_use:
            try:
                fcntl.flock(in_use, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live process holds it: kept
            if not (path / COMPLETE).exists():
                continue  # another pruner took it first (and a new copy of the name may be on its way)
            doomed = path.with_name(f"{path.name}.staging-pruned-{uuid.uuid4().hex}")
            (path / COMPLETE).unlink(missing_ok=True)  # no longer whole: nobody starts to use it
            os.rename(path, doomed)  # out of the name's place first: a new copy of the name never meets the removal
            fcntl.flock(in_use, fcntl.LOCK_UN)
        shutil.rmtree(doomed, ignore_errors=True)
        total -= sizes[path]
        removed.append(path.name)
    if removed:
        print(f"[raoe] node cache over {MAX_GB_ENV}: removed {removed} (least recently used)", flush=True)
    return removed


def _size(folder: Path) -> int:
    """Bytes under ``folder``; files another pruner removes meanwhile count 0."""
    total = 0
    for base, _, names in os.walk(folder):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(base, name)).st_size
    return total


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _max_bytes() -> int | None:
    value = os.environ.get(MAX_GB_ENV)
    if not value:
        return None
    try:
        return int(float(value) * (1 << 30))
    except ValueError:
        raise ValueError(f"{MAX_GB_ENV}={value!r} is not a number of GB") from None


@contextlib.contextmanager
def _locked(path: Path):
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the process dies: a killed copier never blocks the node
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _copy_in(source: str, target: Path, files: list[str] | None, contents: dict[str, str]) -> None:
    """Copy the files of ``source`` into a staging folder beside ``target``, then rename it into place. Called under
    the name's lock: any staging folder of the name is a killed copier's."""
    for leftover in target.parent.glob(f"{target.name}.staging-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    _remove_abandoned(target.parent)
    staging = target.with_name(f"{target.name}.staging-{os.getpid()}")
    place = storage_path(source)
    names = [name for name, _, _ in files_under(place)] if files is None else list(files)
    names = [name for name in names if name not in contents]
    if not names and not contents:
        raise FileNotFoundError(f"nothing to copy to this node under {source}")
    for name in names:
        (staging / name).parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    if is_uri(source):
        place.fs.get([f"{place.path.rstrip('/')}/{name}" for name in names], [str(staging / name) for name in names])
    else:
        for name in names:
            shutil.copyfile(place / name, staging / name)
    for name, text in contents.items():
        (staging / name).parent.mkdir(parents=True, exist_ok=True)
        (staging / name).write_text(text)
    (staging / COMPLETE).write_text(f"{len(names)} files from {source} in {time.time() - started:.1f} s\n")
    shutil.rmtree(target, ignore_errors=True)  # a folder of the name without its marker: not a whole copy
    os.rename(staging, target)


def _remove_abandoned(root: Path) -> None:
    """Staging folders of other names' copiers killed long ago (a live copier holds its lock, and finishes long
    before)."""
    for staging in root.glob("*.staging-*"):
        with contextlib.suppress(OSError):
            if time.time() - staging.stat().st_mtime > ABANDONED_AFTER_S:
                shutil.rmtree(staging, ignore_errors=True)
