"""Whole checkpoints only: manifests written last, checked on resume; a checkpoint that is not whole is passed over
for the newest whole one before it (the end-to-end case: test_recovery_and_registry.py)."""

from training.checkpoints import problem, usable, write_manifest


def _checkpoint(run, name, ranks=(0,)):
    folder = run / name
    for rank in ranks:
        (folder / f"rank{rank}").mkdir(parents=True, exist_ok=True)
        before = set(folder.rglob("*"))
        (folder / f"rank{rank}" / "weights.bin").write_bytes(bytes(range(200)) * (rank + 1))
        write_manifest(folder, rank, {p for p in before if p.is_file()})
    return folder


def test_each_kind_of_damage_is_named_and_an_earlier_whole_checkpoint_is_used(tmp_path):
    run = tmp_path / "run"
    older = _checkpoint(run, "checkpoint_2026-01-01_00-00-01", ranks=(0, 1))
    latest = _checkpoint(run, "checkpoint_2026-01-01_00-00-02", ranks=(0, 1))
    assert problem(latest) is None and usable(latest) == (latest, [])
    weights = latest / "rank1" / "weights.bin"
    weights.write_bytes(weights.read_bytes()[:100])  # half-written
    assert problem(latest) == "rank1/weights.bin has 100 bytes, 400 were written"
    folder, notes = usable(latest)
    assert folder == older and "checkpoint_2026-01-01_00-00-02 is not whole" in notes[0]
    weights.write_bytes(bytes(400))  # right size, wrong bytes
    assert problem(latest) == "rank1/weights.bin does not match its checksum"
    weights.unlink()
    assert problem(latest) == "rank1/weights.bin is missing"
    (older / "manifest-rank0.json").write_text("{trunc")
    assert usable(latest)[0] is None and len(usable(latest)[1]) == 2
