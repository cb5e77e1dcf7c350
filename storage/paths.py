"""One storage layer: a path a job reads may be a local path, a ``file://`` URI or an object-store URI (``s3://``,
``gs://``, ``abfs://``, any fsspec protocol), and the code reading it is the same.

``storage_path`` gives a pathlib object for each: ``pathlib.Path`` for local paths, universal_pathlib's ``UPath``
(pathlib's API over fsspec) for object storage. Readers use only what both share (``open``, ``stat``, ``is_dir``,
``glob``, ``rglob``, ``iterdir``, ``/``, ``name``, ``suffix``), never ``open(path)``, ``os.path`` or ``shutil``.

Credentials and endpoints come from the standard variables of each store, nothing raoe-specific: for S3
``AWS_ENDPOINT_URL`` (an S3-compatible server such as MinIO), ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_REGION``, or an instance role on a cloud node. Every node that reads must see them: a cluster's nodes through
their own environment (the cluster YAML, an instance role), a local Ray through the driver's. A Ray started or
joined by a job also gets the driver's endpoint, region and client settings (STORAGE_ENV) through runtime.local_ray,
never its secrets (a job's runtime environment is shown on the dashboard) nor its profile (a name in the driver's own
~/.aws files): each node brings its own credentials.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

# Where the object stores are and how to speak to them (never a secret): handed from a job's driver to every Ray worker
# it starts. The checksum settings are what MinIO and Ceph need from botocore 1.36 on; the CA bundle, a private
# endpoint's certificate. Never AWS_PROFILE: a profile names a section of the driver's own ~/.aws files, which another
# node does not have (botocore then fails with ProfileNotFound even where the node has keys or an instance role).
STORAGE_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_CA_BUNDLE",
               "AWS_REQUEST_CHECKSUM_CALCULATION", "AWS_RESPONSE_CHECKSUM_VALIDATION", "AWS_RETRY_MODE",
               "AWS_MAX_ATTEMPTS", "MLFLOW_S3_ENDPOINT_URL")
# A cache's staging folder or uncommitted attempt untouched this long is a killed writer's, not one still writing: the
# caches (corpus, corpus index) remove it then.
ABANDONED_AFTER_S = 24 * 3600
PUBLISHED = "_published.json"  # a published folder's commit marker: the files of the export, written after them
HEAD_BYTES = 64 << 10  # what a read of a file's first lines fetches from object storage
COPY_BLOCK_BYTES = 8 << 20  # a streamed copy's block: memory held, whatever the file's size


def absolute(path: str) -> str:
    """A URI as it is, a local path made absolute (file:// included: Ray Train and this module take both)."""
    return path if "://" in path else str(Path(path).resolve())


def is_uri(path: str | os.PathLike) -> bool:
    """Whether ``path`` names object storage (``s3://...``): ``file://`` URIs and plain paths are local."""
    text = str(path)
    return "://" in text and not text.startswith("file://")


def storage_path(path: str | os.PathLike):
    """A pathlib object for ``path``: ``Path`` for a local path or ``file://`` URI, ``UPath`` for object storage."""
    text = str(path)
    if text.startswith("file://"):
        return Path(unquote(urlparse(text).path))
    if is_uri(text):
        from upath import UPath  # fsspec and the store's client (s3fs, gcsfs, adlfs) load only for a URI

        # No listing cache: a long-lived process (a sweep's driver, a notebook) must see objects written since.
        return UPath(text, use_listings_cache=False)
    return Path(text).expanduser()


def join(base: str | os.PathLike, *parts: str) -> str:
    """``base/part/...`` for a local path or a URI (``pathlib.Path`` would fold ``s3://`` into ``s3:/``)."""
    text = str(base)
    if is_uri(text):
        return "/".join([text.rstrip("/"), *(part.strip("/") for part in parts)])
    return str(storage_path(text).joinpath(*parts))


def writable_path(path: str | os.PathLike):
    """``storage_path(path)`` ready for a write: a local path made absolute with its folder created (an object store
    needs no folders)."""
    target = storage_path(path)
    if isinstance(target, Path):
        target.parent.mkdir(parents=True, exist_ok=True)
        return target.resolve()
    return target


def write_whole(path: str | os.PathLike, content: str | bytes) -> None:
    """A file a reader sees whole or not at all (text, or bytes: a Parquet or .npy file made in memory): one put on
    an object store; on a file system a staging file of the writer's own (pid and a random part: threads share a pid,
    and nodes of a shared file system may too) renamed into place."""
    target = writable_path(path)
    write = (lambda p: p.write_bytes(content)) if isinstance(content, bytes) else (lambda p: p.write_text(content))
    if is_uri(path):
        write(target)
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    write(staging)
    os.replace(staging, target)


def copy_file(source, target) -> None:
    """Copy one file (pathlib objects from ``storage_path``) without holding it in memory: a server-side copy within
    one object store, else streamed a block at a time."""
    import shutil

    if not isinstance(source, Path) and not isinstance(target, Path) and source.fs is target.fs:
        source.fs.copy(source.path, target.path)
        return
    if isinstance(target, Path):
        target.parent.mkdir(parents=True, exist_ok=True)
    with source.open("rb") as reader, target.open("wb") as writer:
        shutil.copyfileobj(reader, writer, COPY_BLOCK_BYTES)


def read_range(path, start: int, end: int) -> bytes:
    """Bytes [start, end) of a file: one ranged GET of exactly those bytes on object storage (a file opened the usual
    way reads ahead 50 MiB: a 16 MiB span fetched 66)."""
    if isinstance(path, Path):
        with path.open("rb") as f:
            f.seek(start)
            return f.read(end - start)
    return path.fs.cat_file(path.path, start=start, end=end)


def open_head(path):
    """A file opened to read its first lines (a header, a format's first record): on object storage in blocks of
    HEAD_BYTES, not the 50 MiB a default open reads ahead."""
    if isinstance(path, Path):
        return path.open("rb")
    return path.fs.open(path.path, "rb", block_size=HEAD_BYTES)


def file_identity(path) -> tuple:
    """What says a file is unchanged: (where, size, version). On a file system the version is the modification and
    change times and the inode (``touch -d`` can set an mtime back, nothing but the clock sets the ctime; a file
    replaced by another gets another inode), read from one stat, never from the content. On object storage it is the
    ETag (a hash of the content), taken from the listing ``files_under`` just made where it holds the file (no request
    per file), else asked for."""
    if isinstance(path, Path):
        stat = path.stat()
        return str(path.resolve()), stat.st_size, f"{stat.st_mtime_ns}-{stat.st_ctime_ns}-{stat.st_ino}"
    info = _LISTED.pop(path.path, None) or path.fs.info(path.path)
    return str(path), int(info.get("size") or 0), _version(info) or str(path.stat().st_mtime_ns)


def _version(info: dict) -> str | None:
    return info.get("ETag") or info.get("etag") or info.get("md5Hash")


# Object-store listings' details, by the object's path, from the last ``files_under`` that saw it: ``file_identity``
# takes each once, so a key over 10,000 shards costs their listing, not 10,000 HEAD requests.
_LISTED: dict[str, dict] = {}


def files_under(path) -> list[tuple[str, int, float]]:
    """(relative name, size in bytes, modification time in epoch seconds) of every file under a folder or prefix, in
    one listing on object storage; [] when there is nothing."""
    if isinstance(path, Path):
        if not path.is_dir():
            return []
        return [(p.relative_to(path).as_posix(), (st := p.stat()).st_size, st.st_mtime)
                for p in path.rglob("*") if p.is_file()]
    try:
        found = path.fs.find(path.path, detail=True)
    except FileNotFoundError:
        return []
    root = path.path.rstrip("/") + "/"
    out = []
    for name, info in found.items():
        if info.get("type") == "directory" or name.endswith("/"):  # a folder's marker object (pyarrow writes them)
            continue
        if _version(info):
            _LISTED[name] = info
        stamp = info.get("LastModified") or info.get("mtime") or info.get("updated") or 0
        out.append((name.removeprefix(root), int(info.get("size") or 0),
                    stamp.timestamp() if hasattr(stamp, "timestamp") else float(stamp)))
    return out


def remove_tree(path) -> None:
    """Delete a folder (or a prefix of objects) and everything under it; nothing happens if it is not there."""
    if isinstance(path, Path):
        import shutil

        shutil.rmtree(path, ignore_errors=True)
        return
    try:
        path.fs.rm(path.path, recursive=True)
    except FileNotFoundError:
        pass


@dataclass(frozen=True)
class StagedFolder:
    """A folder written on local disk and published to ``target``: the files themselves on a file system, an upload
    on object storage (libraries that write a model, a plot or a report take local paths only)."""

    local: Path  # where the files are written
    target: str  # where they are kept: str(local) on a file system

    def final(self, path: str | os.PathLike) -> str:
        """Where a file written under ``local`` is kept once published."""
        return join(self.target, Path(path).relative_to(self.local).as_posix())

    def publish(self) -> None:
        """Copy what ``local`` holds to ``target``: every file uploaded first, over the old names (a put that fails
        leaves the previous export in place, never nothing); then, in each folder published, a commit marker
        (PUBLISHED, written whole) naming the files and sizes of the new export, then the previous export's files that
        the new one does not have removed (a resumed run's model is never mixed with an earlier export's files).
        ``local_copy`` copies what a marker names, and refuses a folder whose files are not what it says."""
        if not is_uri(self.target):
            return
        place = storage_path(self.target)
        files = sorted(p for p in self.local.rglob("*") if p.is_file())
        if files:
            place.fs.put([str(p) for p in files],
                         [f"{place.path.rstrip('/')}/{p.relative_to(self.local).as_posix()}" for p in files])
        for folder in (entry for entry in self.local.iterdir() if entry.is_dir()):
            sizes = {p.relative_to(folder).as_posix(): p.stat().st_size for p in folder.rglob("*") if p.is_file()}
            write_whole(join(self.target, folder.name, PUBLISHED),
                        json.dumps({"files": sizes, "published_at": time.time()}, indent=1))
            stale = [name for name, _, _ in files_under(place / folder.name) if name not in sizes and name != PUBLISHED]
            if stale:
                place.fs.rm([f"{place.path.rstrip('/')}/{folder.name}/{name}" for name in stale])


def published_files(place) -> list[str] | None:
    """The files a folder's commit marker names (checked: each there, of the size it says), or None where the folder
    has no marker (written by another tool, or on a file system)."""
    listed = {name: size for name, size, _ in files_under(place)}
    if PUBLISHED not in listed:
        return None
    named = json.loads((place / PUBLISHED).read_text())["files"]
    wrong = [name for name, size in named.items() if listed.get(name) != size]
    if wrong:
        raise OSError(f"{place} is not the export its marker {PUBLISHED} names ({len(wrong)} file(s) missing or of "
                      f"another size, such as {wrong[0]}): a publish that failed midway; publish it again")
    return sorted(named)


@contextlib.contextmanager
def local_copy(path: str | os.PathLike):
    """A local folder holding what ``path`` holds, for a library that reads local files only (a model to load and
    log): the folder itself when local, else a temporary download removed at the end of the block."""
    place = storage_path(path)
    if isinstance(place, Path):
        yield place
        return
    with tempfile.TemporaryDirectory(prefix="raoe-copy-") as local:
        names = published_files(place) or [name for name, _, _ in files_under(place)]
        if not names:
            raise FileNotFoundError(f"nothing under {path}")
        targets = [Path(local) / name for name in names]
        for target in targets:
            target.parent.mkdir(parents=True, exist_ok=True)
        place.fs.get([f"{place.path.rstrip('/')}/{name}" for name in names], [str(t) for t in targets])
        yield Path(local)


@contextlib.contextmanager
def staged_folder(target: str | os.PathLike):
    """A StagedFolder for ``target``: the folder itself when local (created), else a temporary folder removed at
    the end of the block (call ``publish`` once its files are written)."""
    place = storage_path(target)
    if isinstance(place, Path):
        place.mkdir(parents=True, exist_ok=True)
        yield StagedFolder(place.resolve(), str(place.resolve()))
        return
    with tempfile.TemporaryDirectory(prefix="raoe-staged-") as local:
        yield StagedFolder(Path(local), str(target).rstrip("/"))
