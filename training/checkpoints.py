"""Checkpoints that are whole or not used at all.

Every worker that writes into a checkpoint adds a manifest of its files (size and SHA-256) after writing them; a
checkpoint is usable when every manifest in it checks out. A resumed run takes Ray Train's latest checkpoint if it
is whole, else the newest whole one before it in the same run folder, and says which and why. (Checkpoints from
before manifests existed are taken as they are.) A checkpoint that cannot be written (storage full or read-only) ends
the run with an error naming the path; the half-written folder is removed where that is possible, and Ray Train never
registers it, so the checkpoint before it stays the one a resubmitted job resumes from."""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
from datetime import datetime
from pathlib import Path

from runtime.result import root_cause
from storage.paths import storage_path

MODEL_DIR = "model"  # a checkpoint's exported encoder
PROGRESS_FILE = "progress.json"  # step, best dev and the dev curve, readable without torch or DeepSpeed

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


def refuse_other_corpus(run_folder: str, fingerprint: str, rows: int, data: str) -> None:
    """A run name resubmitted on data whose rows differ from those its checkpoints trained on is refused before any
    work: it would continue from step N on other rows (the same files changed, another data.max_rows, other data).
    Checkpoints from before fingerprints were recorded are taken as they are."""
    recorded = _recorded_corpus(run_folder)
    if recorded is None or recorded[1] in (None, fingerprint):
        return
    name, theirs = recorded
    raise ValueError(f"{run_folder} was trained on other rows than data.train={data!r} now gives ({rows} rows, "
                     f"corpus fingerprint {fingerprint}; its {name} records {theirs}): resuming would continue on other "
                     f"rows. Train on the same data, or give a new tracking.run_name to start over")


def _recorded_corpus(run_folder: str) -> tuple[str, str | None] | None:
    """(the newest checkpoint's name, the corpus fingerprint its progress records), None without a checkpoint."""
    folder = storage_path(run_folder)
    if not folder.is_dir():
        return None
    for checkpoint in sorted(folder.glob("checkpoint_*"), key=lambda p: p.name, reverse=True):
        progress = checkpoint / "progress.json"
        if checkpoint.is_dir() and progress.exists():  # beside them: Ray Train's checkpoint_manager_snapshot.json
            return checkpoint.name, json.loads(progress.read_text()).get("corpus")
    return None


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written; the message names where and why, and what to do."""


def _reason(exc: OSError) -> str:
    return f"[Errno {exc.errno}] {exc.strerror}" if exc.errno and exc.strerror else str(exc).splitlines()[0]


RESUBMIT = ("The checkpoints before it are untouched: free space or make the storage writable, then resubmit the "
            "same job (same tracking.run_name) to resume from the last one")


def write_failed(step: int, where: str, exc: OSError) -> CheckpointWriteError:
    return CheckpointWriteError(f"could not write the step {step} checkpoint to {where}: {_reason(exc)}. {RESUBMIT}")


def report_checkpoint(metrics: dict, folder: Path | None, run_folder: str, step: int, rank: int) -> None:
    """``ray.train.report`` with this rank's checkpoint part in ``folder`` (None: metrics only), under a name chosen
    here (Ray Train's own ``checkpoint_<time>`` form, which sorts by time, plus the step) so that a failed upload can
    say where it failed and rank 0 can remove the half-written folder (Ray Train uses rank 0's name for all ranks)."""
    import ray.train

    from training.in_process import active_keeper

    name = f"checkpoint_{datetime.now().strftime('%Y-%m-%d_%H-%M-%S.%f')}_step{step}"
    keeper = active_keeper()  # trainer.num_workers=0: this process keeps its checkpoints as Ray Train's controller
    try:
        if keeper is not None:
            keeper.report(metrics, folder, name)
        else:
            checkpoint = ray.train.Checkpoint.from_directory(str(folder)) if folder is not None else None
            ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=name)
    except OSError as exc:
        target = f"{run_folder}/{name}" if rank == 0 else run_folder
        if rank == 0 and "://" not in run_folder:
            shutil.rmtree(target, ignore_errors=True)
        raise write_failed(step, target, exc) from None


def storage_failure(exc: BaseException, run_folder: str) -> CheckpointWriteError | None:
    """The same error and advice when Ray Train's controller, not a worker, could not write to the run folder (its
    record of the checkpoints, rewritten after each one); None for any other failure."""
    root = root_cause(exc)
    if not isinstance(root, OSError):
        return None
    return CheckpointWriteError(
        f"could not write Ray Train's checkpoint record under {run_folder}: {str(root).splitlines()[0]}. {RESUBMIT}")
