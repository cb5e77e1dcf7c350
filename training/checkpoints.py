"""Checkpoints that are whole or not used at all.

Every worker that writes into a checkpoint adds a manifest of its files (size and SHA-256) after writing them; a
checkpoint is usable when every manifest in it checks out. A resumed run takes Ray Train's latest checkpoint if it
is whole, else the newest whole one before it in the same run folder, and says which and why. (Checkpoints from
before manifests existed are taken as they are.)"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

MANIFEST = "manifest-rank{rank}.json"


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(folder: Path, rank: int, before: set[Path]) -> None:
    """List the files this rank wrote into ``folder`` (those not in ``before``), last, so a manifest exists only
    once its files are complete."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p not in before and not p.name.startswith("manifest-"))
    entries = {str(p.relative_to(folder)): [p.stat().st_size, _digest(p)] for p in files}
    (folder / MANIFEST.format(rank=rank)).write_text(json.dumps(entries, indent=1))


def problem(folder: Path) -> str | None:
    """Why ``folder`` is not a whole checkpoint (None: it is)."""
    for manifest in sorted(folder.glob("manifest-rank*.json")):
        try:
            entries = json.loads(manifest.read_text())
        except (OSError, ValueError) as exc:
            return f"{manifest.name} unreadable ({exc})"
        for name, (size, digest) in entries.items():
            path = folder / name
            if not path.is_file():
                return f"{name} is missing"
            if path.stat().st_size != size:
                return f"{name} has {path.stat().st_size} bytes, {size} were written"
            if _digest(path) != digest:
                return f"{name} does not match its checksum"
    return None


def usable(latest: Path) -> tuple[Path | None, list[str]]:
    """The checkpoint folder to resume from (``latest`` or the newest whole one before it in its run folder; None if
    there is none) and one line per checkpoint passed over."""
    notes = []
    candidates = [latest] + sorted((p for p in latest.parent.glob("checkpoint_*") if p.is_dir() and p.name < latest.name),
                                   key=lambda p: p.name, reverse=True)
    for folder in candidates:
        why = problem(folder)
        if why is None:
            return folder, notes
        notes.append(f"checkpoint {folder.name} is not whole ({why}): passed over")
    return None, notes


@contextlib.contextmanager
def resume_folder(checkpoint, rank: int):
    """A local folder of the checkpoint to resume from (None without one). On local storage a checkpoint that is
    not whole is passed over for the newest whole one before it; from remote storage it is an error."""
    if checkpoint is None:
        yield None
        return
    import pyarrow.fs

    if isinstance(checkpoint.filesystem, pyarrow.fs.LocalFileSystem):
        latest = Path(checkpoint.path)
        folder, notes = usable(latest)
        if rank == 0:
            for note in notes:
                print(f"[raoe] {note}", flush=True)
            if folder is not None and folder != latest:
                print(f"[raoe] resuming from the earlier checkpoint {folder.name}", flush=True)
        if folder is None:
            raise RuntimeError(f"no whole checkpoint to resume from in {latest.parent}: " + "; ".join(notes))
        yield str(folder)
        return
    with checkpoint.as_directory() as downloaded:
        why = problem(Path(downloaded))
        if why is not None:
            raise RuntimeError(f"checkpoint {checkpoint.path} is not whole ({why})")
        yield downloaded
