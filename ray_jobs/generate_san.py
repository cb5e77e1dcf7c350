"""Syntactically aligned negatives (SAN) for a sentence corpus: mask-and-fill with a masked LM by POS importance
(san.method: mlm, the paper's Sec. 3.1) or rewriting by a causal LM with the paper's Table 12 prompt (san.method:
llm, Appendix G), on a Ray Data actor pool. Writes every valid anchor (text, negative, negative_reason, overlap) for
ray_jobs/unsupervised.py: the paper trains SimCSE+SAN on all of Wiki1M, so a guarded anchor (too short, mostly
punctuation, unchanged, unparseable) stays in the corpus with negative null and the reason in negative_reason (also
listed in guarded.jsonl); bad input lines go to quarantine.jsonl. rows_written + rows_quarantined = rows_in and
rows_with_negative + rows_guarded = rows_written; the statistics, plot and examples cover the rows with a negative.

  python ray_jobs/generate_san.py --config configs/generate_san/snli-llm-cpu.yaml
  python ray_jobs/generate_san.py --config configs/tiny/generate_san.yaml --set san.tagging=dynamic
"""

from typing import Literal

from pydantic import Field

import _bootstrap  # noqa: F401  (project on sys.path, safe Ray environment)
from data_pipelines.san import SanConfig
from jobconfig import parse_job_args
from jobconfig.schema import RELATIVE, DataConfig, OutputPath, Section, SharedFilesystem, TrackingConfig
from runtime.result import run_job
from storage.paths import join, remove_tree, staged_folder, storage_path, writable_path


class GenerateSanJobConfig(Section):
    data: DataConfig = Field(default_factory=DataConfig, description="the sentence corpus (data.train, format, ...)")
    san: SanConfig = Field(default_factory=SanConfig)
    output_dir: OutputPath = Field("outputs/san", validate_default=True,
                                   description="where the negatives, guarded rows and plot go; " + RELATIVE)
    output_format: Literal["parquet", "jsonl"] = Field("parquet", description="parquet or jsonl")
    batch_rows: int = Field(256, ge=1, description="sentences per map_batches call")
    examples: int = Field(20, ge=0, description="anchor/negative examples logged to MLflow")
    tracking: TrackingConfig = Field(default_factory=lambda: TrackingConfig(experiment="raoe-san"))
    shared_filesystem: SharedFilesystem = False


def main(cfg: GenerateSanJobConfig) -> dict:
    import time

    import mlflow

    from data_pipelines.readers import load_configured
    from data_pipelines.san import GUARD_REASONS, corpus_table, generate_negatives, merge_stats, partial_stats, plot
    from encoders.devices import gpus_wanted_here
    from encoders.sources import resolve_model_source
    from runtime.local_ray import ray_session
    from runtime.tracking_store import ensure_experiment

    if not cfg.data.train:
        raise ValueError("data.train must name the sentence corpus")
    resolve_model_source(cfg.san.model)  # fails here, before any Ray resource, if the model cannot be found
    out = cfg.output_dir  # a local folder (made absolute by the config) or an object-store URI
    experiment_id = ensure_experiment(cfg.tracking.experiment)
    started = time.time()
    gpus_wanted_here({"san.gpus_per_actor": cfg.san.gpus_per_actor})
    with ray_session(outputs={"output_dir": cfg.output_dir}, inputs={"data.train": cfg.data.train},
                     shared_filesystem=cfg.shared_filesystem):
        ds, report = load_configured("sentences", cfg.data, join(out, "quarantine.jsonl"))
        print(f"[raoe] generating SAN negatives ({cfg.san.method}, {cfg.san.model}) for {report.rows_written} "
              f"sentences on {cfg.san.actors} actor(s) ...", flush=True)
        # Straight from the materialised corpus into the actor pool: no task in between that would need a CPU the
        # actors hold (Ray Data would wait forever, e.g. 2 actors x 0.9 CPU on 2 cores).
        # About 8 blocks an actor (every actor gets work, and the pool balances) of at most SAN_BLOCK_ROWS sentences
        # (never one block per batch: 390k of them at 100M rows); the actors take batch_rows at a time from each.
        # Materialised before the pool starts.
        ds = ds.repartition(san_blocks(report.rows_written, cfg.san.actors, cfg.batch_rows)).materialize()
        generated = generate_negatives(ds, cfg.san, cfg.batch_rows).materialize()  # in the object store, once
        # The corpus is written from the cluster, shard by shard; the driver gets counts and a few examples only.
        corpus = generated.map_batches(corpus_table, batch_format="pandas", num_cpus=0.1)
        write_corpus(corpus, join(out, "data"), cfg.output_format)
        stats = merge_stats(generated.map_batches(partial_stats, batch_format="pandas", num_cpus=0.1).take_all())
        guarded = write_guarded(corpus, join(out, "guarded.jsonl"))
        examples = [{"text": r["text"], "negative": r["negative"]} for r in
                    generated.filter(lambda row: row["guard"] is None).limit(cfg.examples).take_all()]
    seconds = time.time() - started
    counts = {"rows_in": report.rows_in, "rows_written": stats["rows"], "rows_with_negative": stats["with_negative"],
              "rows_guarded": guarded, "rows_quarantined": report.rows_quarantined}
    assert counts["rows_written"] + counts["rows_quarantined"] == counts["rows_in"]
    assert counts["rows_with_negative"] + counts["rows_guarded"] == counts["rows_written"]
    guard_counts = {r: int(stats["guards"].get(r, 0)) for r in GUARD_REASONS}
    statistics = {k: stats[k] for k in ("changed_share_by_pos", "words_by_pos", "mean_token_overlap",
                                        "overlap_histogram")}
    with staged_folder(out) as staged:  # the plot is drawn on local disk, kept beside the data and logged from there
        picture = plot(stats, staged.local / "san_changes.png")
        staged.publish()
        with mlflow.start_run(experiment_id=experiment_id, run_name=cfg.tracking.run_name) as run:
            mlflow.log_params({"data.train": cfg.data.train, **{f"san.{k}": str(v)[:500]
                                                                 for k, v in cfg.san.model_dump().items()}})
            mlflow.log_metrics({**{k: float(v) for k, v in counts.items()},
                                **{f"guarded_{k}": float(v) for k, v in guard_counts.items()},
                                "sentences_per_second": report.rows_written / seconds,
                                **({"mean_token_overlap": stats["mean_token_overlap"]}
                                   if stats["mean_token_overlap"] is not None else {})})
            mlflow.log_dict({**statistics, "guarded": guard_counts, "examples": examples}, "san_statistics.json")
            mlflow.log_artifact(str(picture))
            mlflow.log_input(_corpus_dataset(join(out, "data")), context="generated")
    return {
        **counts, "guarded": guard_counts, "output_path": join(out, "data"), "output_format": cfg.output_format,
        "guarded_path": join(out, "guarded.jsonl"), "quarantine_path": report.quarantine_path,
        "changed_share_by_pos": stats["changed_share_by_pos"], "mean_token_overlap": stats["mean_token_overlap"],
        "sentences_per_second": report.rows_written / seconds, "seconds": seconds, "plot": staged.final(picture),
        "examples": examples[:5], "run_id": run.info.run_id,
    }


SAN_BLOCK_ROWS = 50_000


def san_blocks(rows: int, actors: int, batch_rows: int) -> int:
    """How many blocks the corpus goes to the SAN actors in: about 8 an actor, each of batch_rows to SAN_BLOCK_ROWS
    sentences."""
    per_block = min(max(-(-rows // (8 * actors)), batch_rows), SAN_BLOCK_ROWS)
    return max(actors, -(-rows // per_block))


def write_corpus(corpus, folder, output_format: str) -> None:
    """The corpus (a Ray Dataset of ``corpus_table`` rows) as Parquet or JSON-lines shards under ``folder``, each
    written by the task that holds its rows; an older corpus there is replaced."""
    remove_tree(storage_path(folder))
    if output_format == "parquet":
        corpus.write_parquet(str(folder))
    else:
        corpus.write_json(str(folder), force_ascii=False)


def write_guarded(corpus, path) -> int:
    """guarded.jsonl: each anchor that kept no negative and why, streamed batch by batch; returns how many."""
    import json

    rows = 0
    with writable_path(path).open("w", encoding="utf-8") as out:
        for batch in corpus.filter(lambda row: row["negative_reason"] is not None) \
                .select_columns(["text", "negative_reason"]).iter_batches(batch_format="pyarrow"):
            for text, reason in zip(batch["text"].to_pylist(), batch["negative_reason"].to_pylist()):
                out.write(json.dumps({"text": text, "reason": reason}, ensure_ascii=False) + "\n")
                rows += 1
    return rows


def _corpus_dataset(folder):
    """The written corpus as MLflow's dataset input: its source, without reading it back."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset

    return MetaDataset(source=resolve_dataset_source(str(folder)), name="san-negatives")


if __name__ == "__main__":
    config = parse_job_args(GenerateSanJobConfig, __doc__)
    run_job(lambda: main(config), "generate_san")
