"""Batch embedding throughput: raoe's embed job against sentence-transformers' ``encode`` in one process, on the same
texts and model, in the same run.

  python benchmarks/embed.py [--sentences 0]

Texts: SNLI test's distinct sentences (premises and hypotheses; ``--sentences`` caps them), written as 8 text files so
the job has shards to spread; the MiniLM student, batch 64, no normalisation. sentence-transformers encodes in this
process with every core (the ceiling: no Ray, nothing written); raoe runs the embed job in-process on a local Ray,
first with one actor holding every CPU, then with two actors of 1 CPU each, then (where the openvino package is
installed) one actor encoding with the model's OpenVINO export, built within that run; its time counted from the pool's start
(actors started, model loaded, every shard read, encoded and written as Parquet and .npy). The vectors are compared
with sentence-transformers' row by row. Results: ``benchmarks/results/embed.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "ray_jobs"))

from benchmarks.common import machine, write_results  # noqa: E402
from encoders.export_formats import openvino_missing  # noqa: E402

SNLI = ROOT.parent / "shared" / "data" / "snli"
MODEL = "pypi:all-minilm-l6-v2"
FILES, BATCH = 8, 64


def snli_sentences(limit: int) -> list[str]:
    texts = [line.strip() for name in ("s1.test", "s2.test") for line in
             (SNLI / name).read_text(encoding="utf-8").splitlines() if line.strip()]
    texts = list(dict.fromkeys(texts))
    return texts[:limit] if limit else texts


def run_raoe(corpus: Path, out: Path, actors: int, cpus: float, runtime: str = "torch") -> dict:
    import embed

    cfg = embed.EmbedJobConfig(model={"source": MODEL}, data={"train": str(corpus)}, output_dir=str(out),
                               actors=actors, cpus_per_actor=cpus, embed={"batch_size": BATCH, "runtime": runtime},
                               tracking={"experiment": "bench-embed"})
    return embed.main(cfg)


def raoe_vectors(out: Path, texts_by_id: dict[str, str]) -> dict[str, "object"]:
    import numpy as np
    import pyarrow.dataset as ds

    table = ds.dataset(str(out / "data"), format="parquet").to_table()
    emb = np.stack(table["embedding"].to_numpy(zero_copy_only=False))
    return {texts_by_id[i]: e for i, e in zip(table["id"].to_pylist(), emb)}


def _cosines(vectors: dict, texts: list[str], reference) -> "object":
    import numpy as np

    return np.array([float(vectors[t] @ r / (np.linalg.norm(vectors[t]) * np.linalg.norm(r)))
                     for t, r in zip(texts, reference)])


def main() -> None:

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sentences", type=int, default=0, help="cap on SNLI test's distinct sentences (0: all)")
    args = parser.parse_args()
    texts = snli_sentences(args.sentences)
    cpus = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp / 'mlflow.db'}"
        os.environ["RAOE_MLFLOW_ARTIFACTS"] = str(tmp / "artifacts")
        os.environ["RAOE_CACHE"] = str(tmp / "cache")  # the OpenVINO export is built within the run it serves
        corpus, by_id = tmp / "corpus", {}
        corpus.mkdir()
        for f in range(FILES):
            part = texts[f::FILES]
            (corpus / f"part-{f}.txt").write_text("\n".join(part) + "\n", encoding="utf-8")
            by_id.update({f"part-{f}.txt:{i + 1}": t for i, t in enumerate(part)})

        from sentence_transformers import SentenceTransformer

        from encoders.model_uris import resolve_model

        model = SentenceTransformer(resolve_model(MODEL), device="cpu")
        started = time.time()
        reference = model.encode(texts, batch_size=BATCH)
        st_seconds = time.time() - started
        del model
        one = run_raoe(corpus, tmp / "one", 1, float(cpus))
        cosines = _cosines(raoe_vectors(tmp / "one", by_id), texts, reference)
        import ray

        ray.shutdown()  # the next pool starts on a fresh local Ray, as a new job would
        two = run_raoe(corpus, tmp / "two", 2, 1.0)
        openvino = None if openvino_missing() else run_raoe(corpus, tmp / "openvino", 1, float(cpus), "openvino")
        openvino_cosines = None if openvino is None else _cosines(raoe_vectors(tmp / "openvino", by_id), texts,
                                                                  reference)
    n, st_rate = len(texts), len(texts) / st_seconds
    table = {"sentence-transformers encode (in process, the ceiling)": {"seconds": st_seconds, "rows_per_s": st_rate,
                                                                        "steady": st_rate},
             f"raoe embed, 1 actor x {cpus} CPUs": {"seconds": one["encode_seconds"], "rows_per_s": one["rows_per_s"],
                                                    "steady": one["rows_per_actor_s"]},
             "raoe embed, 2 actors x 1 CPU": {"seconds": two["encode_seconds"], "rows_per_s": two["rows_per_s"],
                                              "steady": 2 * two["rows_per_actor_s"]}}
    if openvino is not None:
        table[f"raoe embed, 1 actor x {cpus} CPUs, embed.runtime openvino (its export built in the run)"] = {
            "seconds": openvino["encode_seconds"], "rows_per_s": openvino["rows_per_s"],
            "steady": openvino["rows_per_actor_s"]}
    payload = {"machine": machine(), "sentences": n, "files": FILES, "batch_size": BATCH, "model": MODEL,
               "results": table, "min_cosine_vs_sentence_transformers": float(cosines.min()),
               "mean_cosine_vs_sentence_transformers": float(cosines.mean()),
               "openvino_min_cosine_vs_sentence_transformers": None if openvino is None else float(openvino_cosines.min())}
    lines = ["# Batch embedding throughput", "",
             f"SNLI test's {n:,} distinct sentences in {FILES} text files; `{MODEL}`, batch {BATCH}; {cpus} CPUs. "
             "raoe's time runs from the actor pool's start (actors, model load, reading, encoding, writing Parquet "
             "and .npy); sentence-transformers encodes in this process and writes nothing.", "",
             "| tool | seconds | rows/s | vs sentence-transformers | rows/s once started (actors' own time) | vs |",
             "|---|---|---|---|---|---|"]
    for name, row in table.items():
        lines.append(f"| {name} | {row['seconds']:.1f} | {row['rows_per_s']:.1f} | {row['rows_per_s'] / st_rate:.2f}x | "
                     f"{row['steady']:.1f} | {row['steady'] / st_rate:.2f}x |")
    lines += ["", "- Once started: the rows over the summed time the actors spent on their shards (reading, encoding, "
              "writing), times the actors; the wall figure adds the actors' start and model load.",
              f"- Vectors against sentence-transformers': cosine min {cosines.min():.6f}, mean {cosines.mean():.6f}"
              + ("." if openvino is None else f"; with the OpenVINO export, min {openvino_cosines.min():.6f}."),
              "- Target (issue 40): at least 0.9x sentence-transformers on one actor, near linear in actors (on this "
              "machine two actors share its two cores, so two actors cannot beat one holding both)."]
    print(write_results("embed", payload, "\n".join(lines) + "\n").read_text())


if __name__ == "__main__":
    main()
