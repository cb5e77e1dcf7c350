"""The corpus as workers see it: content-ordered Arrow blocks in Ray's object store, rows taken by index, the next
micro-batch prepared in the background."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from training.plan import plan_steps
from training.rows import CorpusRows, MicroBatchFeed, content_ordered

ROOT = Path(__file__).resolve().parents[2]

ROWS = [{"text": f"sentence {i}", "negative": None if i % 3 else f"not sentence {i}"} for i in range(50)]


@pytest.fixture
def ray_here(ray_local):
    """The shared local Ray (tests/conftest.py)."""


def _corpus(rows, blocks):
    import ray

    return content_ordered(ray.data.from_items(rows, override_num_blocks=blocks).materialize())


def test_the_driver_holds_nothing_a_row_of_the_order(ray_here, monkeypatch):
    """The content order is hashed and sorted by Ray tasks: the driver gets references, the row count and the
    fingerprint (at 100M rows the keys and their argsort alone are 1.6 GB). Here the driver cannot sort at all."""
    import ray

    dataset = ray.data.from_items(ROWS, override_num_blocks=3).materialize()

    def refuse(*args, **kwargs):
        raise AssertionError("the driver sorted or concatenated per-row arrays")

    monkeypatch.setattr(np, "argsort", refuse)
    monkeypatch.setattr(np, "concatenate", refuse)
    corpus = content_ordered(dataset)
    monkeypatch.undo()
    assert isinstance(corpus.order, ray.ObjectRef) and corpus.rows == len(ROWS)
    assert corpus.fingerprint == _corpus(list(reversed(ROWS)), 2).fingerprint
    assert sorted(ray.get(corpus.order).tolist()) == list(range(len(ROWS)))


def test_the_row_order_is_a_function_of_content_not_of_reading_order(ray_here):
    """A resubmitted job may get Ray Data's blocks in another order: each index must still name the same row. The
    corpus fingerprint checkpoints record is the same too, and changes with one row changed, dropped or added."""
    first_blocks, again_blocks = _corpus(ROWS, 1), _corpus(list(reversed(ROWS)), 7)
    assert first_blocks.fingerprint == again_blocks.fingerprint and len(first_blocks.fingerprint) == 16
    changed = [*ROWS[:-1], {**ROWS[-1], "text": ROWS[-1]["text"] + "!"}]
    others = {_corpus(rows, 3).fingerprint for rows in (changed, ROWS[:-1], ROWS + ROWS[:1])}
    assert len(others) == 3 and first_blocks.fingerprint not in others
    first, again = CorpusRows(first_blocks), CorpusRows(again_blocks)
    index = np.arange(len(ROWS))
    a, b = first.take(index), again.take(index)
    assert list(a) == list(b) == ["text", "negative"]  # the sort key never reaches a batch builder
    assert a["text"].tolist() == b["text"].tolist() and sorted(a["text"]) == sorted(r["text"] for r in ROWS)
    assert a["text"].tolist() != [r["text"] for r in ROWS]  # really reordered, not read order
    negatives = dict(zip(a["text"], a["negative"]))  # a missing negative stays missing (pandas NA, as Ray Data's
    for r in ROWS:  # own pandas batches give it), which the SAN batch builder masks out
        got = negatives[r["text"]]
        assert got == r["negative"] if r["negative"] else (pd.isna(got) and not isinstance(got, str))


def test_the_feed_gives_each_micro_batch_its_plan_rows_in_training_order(ray_here):
    rows = CorpusRows(_corpus(ROWS, 3))
    plan = plan_steps(len(ROWS), world=2, global_batch=8, grad_accum=2, epochs=3)  # 6 steps an epoch, 3 epochs
    def prepare(micro_rows):  # what the loop does here: tokenise; which thread did it?
        return threading.current_thread().name, micro_rows["text"].tolist()

    for rank, start, prefetch in [(0, 0, True), (1, 0, True), (1, 7, True), (1, 0, False)]:  # a resumed worker
        feed = MicroBatchFeed(rows, plan, seed=5, rank=rank, prepare=prepare, prefetch=prefetch)  # starts mid-run
        try:
            for step in range(start, plan.total_steps):
                for micro in range(plan.grad_accum):
                    want = rows.take(plan.micro_rows(5, step, micro, rank))["text"].tolist()
                    batch = feed.next(step, micro)
                    assert batch.rows["text"].tolist() == batch.prepared[1] == want, (rank, step, micro)
                    first = (step, micro) == (start, 0)  # nothing prefetched yet
                    assert batch.prepared[0].startswith("raoe-feed") == (prefetch and not first), batch.prepared[0]
        finally:
            feed.close()
        assert feed.take_wait() > 0 and feed.take_wait() == 0.0


@pytest.mark.parametrize("lengths", [(6,), (2, 6)])
def test_ranked_lists_with_teacher_matrices_order_and_take_whatever_their_lengths(ray_here, lengths):
    """Lists all of one length come out of the teacher actor as a column Ray pickles as one-shape objects (pandas
    cannot cast it); lists of mixed lengths as ragged objects. Both order by content and come back whole."""
    import ray

    def with_teacher(batch):  # what ListTeacher returns: the sentences as given, one flat n x n matrix per list
        sims = np.empty(len(batch["sentences"]), dtype=object)
        for i, sentences in enumerate(batch["sentences"]):
            sims[i] = np.eye(len(sentences), dtype=np.float32).ravel()
        return {"sentences": batch["sentences"], "teacher_sim": sims}

    lists = [{"sentences": [f"list {i} sentence {j}" for j in range(lengths[i % len(lengths)])]} for i in range(40)]
    taken = []
    for items in (lists, lists[::-1]):
        ds = ray.data.from_items(items, override_num_blocks=3).map_batches(with_teacher, batch_format="numpy")
        rows = CorpusRows(content_ordered(ds.materialize()))
        taken.append(rows.take(np.arange(40)))
    assert [list(s) for s in taken[0]["sentences"]] == [list(s) for s in taken[1]["sentences"]]  # by content
    assert sorted(tuple(s) for s in taken[0]["sentences"]) == sorted(tuple(x["sentences"]) for x in lists)
    assert all(len(m) == len(s) ** 2 for s, m in zip(taken[0]["sentences"], taken[0]["teacher_sim"]))


def test_node_local_files_give_the_rows_the_object_store_gives_and_are_written_once(ray_here, s3_server, monkeypatch,
                                                                                    tmp_path):
    """data.node_local: the corpus written as Arrow files on shared storage (here the local S3 endpoint) and mapped
    from a node's copy takes the same rows for every index as the blocks in the object store; the worker's corpus
    holds no object reference. A second run of the same rows, read in another block split, uses the files as they
    are (no block is written again) and takes the same rows still."""
    import training.rows
    from storage.node_cache import COMPLETE
    from tests.conftest import new_bucket

    monkeypatch.setenv("RAOE_NODE_CACHE", str(tmp_path / "node"))
    in_store = _corpus(ROWS, 3)
    folder = new_bucket(s3_server, "node-local").uri(f"corpus_files/{in_store.fingerprint}")  # as training names it
    on_files = training.rows.write_files(in_store, folder)
    assert on_files.blocks == () and on_files.order is None and on_files.fingerprint == in_store.fingerprint
    index = np.random.default_rng(0).permutation(len(ROWS))
    want = CorpusRows(in_store).take(index)
    got = CorpusRows(on_files).take(index)
    assert list(got) == list(want) and got["text"].tolist() == want["text"].tolist()
    assert [None if pd.isna(v) else v for v in got["negative"]] == [None if pd.isna(v) else v for v in want["negative"]]
    copy = tmp_path / "node" / f"corpus-{in_store.fingerprint}"
    assert (copy / COMPLETE).exists() and sorted(p.name for p in copy.glob("*.arrow")) == [
        f"block-{i:06d}.arrow" for i in range(3)]

    def refuse(*args):
        raise AssertionError("a block was written again")

    monkeypatch.setattr(training.rows, "_write_block", refuse)
    again = training.rows.write_files(_corpus(list(reversed(ROWS)), 5), folder)
    assert again == on_files
    assert CorpusRows(again).take(index)["text"].tolist() == want["text"].tolist()
    monkeypatch.undo()

    # two runs writing the same corpus at once (a sweep's trials): each its own attempt, neither file mixed
    monkeypatch.setenv("RAOE_NODE_CACHE", str(tmp_path / "node-2"))
    shared, results, errors = str(tmp_path / "shared" / in_store.fingerprint), [], []

    def write(corpus):
        try:
            results.append(training.rows.write_files(corpus, shared))
        except Exception as exc:  # noqa: BLE001 - reported below, not lost in the thread
            errors.append(exc)

    writers = [threading.Thread(target=write, args=(c,)) for c in (_corpus(ROWS, 2), _corpus(ROWS, 4))]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    assert not errors and len(results) == 2 and all(r.files.startswith(shared) for r in results)
    for result in results:
        assert CorpusRows(result).take(index)["text"].tolist() == want["text"].tolist()


def test_a_node_copies_a_folder_once_whoever_asks_at_the_same_time(tmp_path, monkeypatch):
    """Every worker of a node asks for the copy as it starts: one copies (under a file lock, into a staging folder
    renamed into place), the others wait and find it; nothing half-copied stays."""
    import storage.node_cache as node_cache

    monkeypatch.setenv("RAOE_NODE_CACHE", str(tmp_path / "node"))
    source = tmp_path / "shared"
    (source / "sub").mkdir(parents=True)
    (source / "a.arrow").write_bytes(b"a" * 100_000)
    (source / "sub" / "b.npy").write_bytes(b"b" * 10)
    copies, copy_in = [], node_cache._copy_in
    monkeypatch.setattr(node_cache, "_copy_in", lambda src, target, *rest: (copies.append(target),
                                                                           copy_in(src, target, *rest)))
    got, errors = [], []

    def ask():
        try:
            got.append(node_cache.node_copy(str(source), "corpus-x"))
        except Exception as exc:  # noqa: BLE001 - reported below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(copies) == 1 and len(set(got)) == 1 and len(got) == 4
    assert (got[0] / "a.arrow").read_bytes() == b"a" * 100_000 and (got[0] / "sub" / "b.npy").read_bytes() == b"b" * 10
    assert sorted(p.name for p in (tmp_path / "node").iterdir()) == ["corpus-x", "corpus-x.lock", "corpus-x.use"]


def test_node_copies_over_the_limit_go_least_recently_used_first_never_one_in_use(tmp_path, monkeypatch):
    """RAOE_NODE_CACHE_MAX_GB: a new copy removes whole copies by least recent use until the node's fit; a copy a
    live process holds (this one's, or another's still running) stays; a removed copy is made again when asked."""
    import storage.node_cache as node_cache

    node = tmp_path / "node"
    monkeypatch.setenv("RAOE_NODE_CACHE", str(node))
    for name in "abcd":
        (tmp_path / name).mkdir()
        (tmp_path / name / "rows.arrow").write_bytes(name.encode() * 1_000_000)
    code = ("import sys; from storage.node_cache import node_copy; "
            "[node_copy(sys.argv[2] + '/' + n, 'corpus-' + n) for n in sys.argv[1]]; print('held', flush=True); "
            "sys.stdin.read()")  # asks for copies, holds them until its input ends
    env = {**os.environ, "RAOE_NODE_CACHE": str(node)}
    run = dict(env=env, cwd=ROOT, input="", check=True, capture_output=True)
    subprocess.run([sys.executable, "-c", code, "ab", str(tmp_path)], **run)
    holder = subprocess.Popen([sys.executable, "-c", code, "c", str(tmp_path)], env=env, cwd=ROOT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        now = time.time()
        for name, age in (("c", 300), ("a", 200), ("b", 100)):  # c least recently used, but in use
            os.utime(node / f"corpus-{name}.use", (now - age, now - age))
        monkeypatch.setenv("RAOE_NODE_CACHE_MAX_GB", str(2.5e6 / (1 << 30)))
        node_cache.node_copy(str(tmp_path / "d"), "corpus-d")
        assert sorted(p.name for p in node.iterdir() if p.is_dir()) == ["corpus-c", "corpus-d"]
    finally:
        holder.communicate("")
    assert node_cache.prune(0) == ["corpus-c"]  # its holder is gone; corpus-d is this process's
    subprocess.run([sys.executable, "-c", code, "a", str(tmp_path)], **run)
    assert (node / "corpus-a" / "rows.arrow").read_bytes() == b"a" * 1_000_000  # copied again, whole
