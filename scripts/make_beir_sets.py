"""Retrieval tasks in the BEIR layout from the development data (../shared/data), for evaluation on a machine without
a hub. Deterministic; each folder holds corpus.jsonl, queries.jsonl and qrels/test.tsv.

- snli-<split>: each distinct premise of SNLI <split> is a query; its entailment hypotheses are relevant among every
  distinct hypothesis of the split (the corpus).
- stsb-<split>: each distinct STS-B sentence 1 is a query; sentence 2 is relevant where the pair scores at least 4;
  the corpus is every distinct sentence 2 of the split.

  python scripts/make_beir_sets.py [--data ../shared/data] [--out outputs/beir] [--queries N]
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def write_beir(folder: Path, queries: dict[str, str], corpus: dict[str, str], qrels: dict[str, dict[str, int]]) -> Path:
    """A BEIR folder: corpus.jsonl ({_id, title, text}), queries.jsonl ({_id, text}), qrels/test.tsv."""
    (folder / "qrels").mkdir(parents=True, exist_ok=True)
    with open(folder / "corpus.jsonl", "w", encoding="utf-8") as f:
        for doc_id, text in corpus.items():
            f.write(json.dumps({"_id": doc_id, "title": "", "text": text}) + "\n")
    with open(folder / "queries.jsonl", "w", encoding="utf-8") as f:
        for qid, text in queries.items():
            f.write(json.dumps({"_id": qid, "text": text}) + "\n")
    with open(folder / "qrels" / "test.tsv", "w", encoding="utf-8") as f:
        f.write("query-id\tcorpus-id\tscore\n")
        for qid, docs in qrels.items():
            for doc_id, score in docs.items():
                f.write(f"{qid}\t{doc_id}\t{score}\n")
    return folder


def from_pairs(pairs: list[tuple[str, str, bool]]) -> tuple[dict, dict, dict]:
    """(query text, candidate text, relevant) rows -> queries, corpus (every candidate) and qrels, ids in first-seen
    order; queries without a relevant candidate are left out."""
    query_ids: dict[str, str] = {}
    doc_ids: dict[str, str] = {}
    qrels: dict[str, dict[str, int]] = {}
    for query, candidate, relevant in pairs:
        doc = doc_ids.setdefault(candidate, f"d{len(doc_ids)}")
        if relevant:
            qid = query_ids.setdefault(query, f"q{len(query_ids)}")
            qrels.setdefault(qid, {})[doc] = 1
    return ({q: t for t, q in query_ids.items()}, {d: t for t, d in doc_ids.items()}, qrels)


def snli_pairs(data: Path, split: str) -> list[tuple[str, str, bool]]:
    folder = data / "snli"
    premises = (folder / f"s1.{split}").read_text(encoding="utf-8").splitlines()
    hypotheses = (folder / f"s2.{split}").read_text(encoding="utf-8").splitlines()
    labels = (folder / f"labels.{split}").read_text(encoding="utf-8").splitlines()
    return [(p.strip(), h.strip(), label.strip() == "entailment") for p, h, label in zip(premises, hypotheses, labels)]


def stsb_pairs(data: Path, split: str) -> list[tuple[str, str, bool]]:
    with open(data / "stsb" / f"stsb-en-{split}.csv", encoding="utf-8", newline="") as f:
        return [(s1.strip(), s2.strip(), float(score) >= 4.0) for s1, s2, score in csv.reader(f)]


def first_queries(pairs: list[tuple[str, str, bool]], n: int | None) -> list[tuple[str, str, bool]]:
    """The rows of the first ``n`` distinct queries (all rows when ``n`` is None): a smaller task whose corpus is
    every candidate of those queries, so its documents are as hard to tell apart as in the whole split."""
    if n is None:
        return pairs
    kept: set[str] = set()
    for query, _, _ in pairs:
        if len(kept) == n:
            break
        kept.add(query)
    return [row for row in pairs if row[0] in kept]


def make_sets(data: Path, out: Path, splits=(("snli", "test"), ("stsb", "dev")), queries: int | None = None
              ) -> dict[str, Path]:
    """The BEIR folders under ``out`` (written once; an existing folder is kept), by task name; with ``queries``,
    each built from its split's first that many queries (named <source>-<split>-first<queries>)."""
    readers = {"snli": snli_pairs, "stsb": stsb_pairs}
    made = {}
    for source, split in splits:
        folder = out / (f"{source}-{split}" if queries is None else f"{source}-{split}-first{queries}")
        if not (folder / "qrels" / "test.tsv").exists():
            task_queries, corpus, qrels = from_pairs(first_queries(readers[source](data, split), queries))
            write_beir(folder, task_queries, corpus, qrels)
            print(f"{folder}: {len(task_queries)} queries, {len(corpus)} documents, "
                  f"{sum(len(d) for d in qrels.values())} relevant pairs")
        made[folder.name] = folder
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data", help="the development data")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "beir", help="where the BEIR folders go")
    parser.add_argument("--queries", type=int, default=None, help="build each set from its first N queries only")
    args = parser.parse_args()
    make_sets(args.data, args.out, queries=args.queries)


if __name__ == "__main__":
    main()
