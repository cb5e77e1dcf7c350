"""Rotate a model onto the principal axes of its own embeddings, so its first dimensions hold the most variance: cut
short (a Matryoshka size, eval.dims, serving's dimensions) it loses the least, and no cosine between whole
embeddings changes. The axes are fit on the vectors of one or more finished ray_jobs/embed.py runs of the model
(e.g. a query-side and a document-side run over a sample of the training data); the rotated model is the same
sentence-transformers folder with a Dense module after pooling, written to output_dir/model, to train from
(model.source, e.g. with objective.matryoshka), to evaluate (eval.dims), or to serve cut to the sizes rotate.dims
records.

  python ray_jobs/embed.py --set data.train=corpus.txt --set embed.side=none --set output_dir=outputs/emb
  python ray_jobs/rotate.py --set "rotate.embeddings=[outputs/emb]" --set output_dir=outputs/rotated
  python ray_jobs/rotate.py --config configs/tiny/rotate.yaml
"""

from pydantic import Field

import _bootstrap  # noqa: F401  (project on sys.path, safe Ray environment)
from jobconfig import parse_job_args
from jobconfig.schema import RELATIVE, CutSizes, OutputPath, Section, TrackingConfig
from runtime.result import run_job

REPORTED_DIMS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)  # the variance kept is reported at these cuts


class RotateSection(Section):
    embeddings: list[OutputPath] = Field(min_length=1, description="finished ray_jobs/embed.py output folders of one "
                                         "model (local or object storage; the model is the one their spec.json "
                                         "names); as embed's output_dir, " + RELATIVE)
    max_rows: int = Field(1_000_000, ge=1, description="embeddings read at most: whole shards in a seeded order "
                          "until this many (the fit needs more than the embedding's width)")
    seed: int = Field(0, ge=0, description="order in which shards are read when max_rows stops short of them all")
    dims: CutSizes = Field(default_factory=list, description="sizes the rotated model may be cut to, recorded as "
                            "its Matryoshka sizes (serving's dimensions); none by default (a source model's "
                            "Matryoshka sizes were cuts of its unrotated embedding); score them first with the "
                            "evaluate job's eval.dims")


class RotateJobConfig(Section):
    rotate: RotateSection
    output_dir: OutputPath = Field("outputs/rotated", validate_default=True,
                                   description="where the rotated model (model/) and its variance plot "
                                   "(variance.png) go; " + RELATIVE)
    tracking: TrackingConfig = Field(default_factory=lambda: TrackingConfig(experiment="raoe-rotate"))


def main(cfg: RotateJobConfig) -> dict:
    import time
    from dataclasses import replace

    import mlflow

    from encoders.backbone import export_encoder, load_encoder
    from encoders.model_uris import resolve_model
    from encoders.rotation import orthogonality_error, share_kept, with_rotation
    from runtime.tracking_store import ensure_experiment, tracking_uri
    from storage.paths import join, staged_folder

    started = time.time()
    source, fingerprint, shards, width = _embedded_shards(cfg.rotate.embeddings)
    too_wide = [d for d in cfg.rotate.dims if d > width]
    if too_wide:  # before any model loads or shard is read
        raise ValueError(f"rotate.dims {too_wide}: the model's embedding has {width} dimensions")
    model_path = resolve_model(source)
    _same_model(source, model_path, fingerprint)
    _rotatable(source, model_path)
    experiment_id = ensure_experiment(cfg.tracking.experiment)
    print(f"[raoe] rotate: fitting the principal axes of {source} on at most {cfg.rotate.max_rows:,} embeddings of "
          f"{len(shards)} shard(s) ...", flush=True)
    axes = _fit(shards, cfg.rotate.max_rows, cfg.rotate.seed)
    weight, variances = axes.rotation()
    dims = [d for d in REPORTED_DIMS if d < axes.dim] + [axes.dim]
    kept, kept_before = share_kept(variances, dims), share_kept(axes.variances(), dims)

    model = load_encoder(model_path)
    with_rotation(model, weight)
    # a source's Matryoshka sizes were cuts of its unrotated embedding: only the sizes asked for are recorded
    model.encoder_settings = replace(model.encoder_settings, matryoshka_dims=tuple(sorted(cfg.rotate.dims, reverse=True)))
    out = cfg.output_dir.rstrip("/")
    with staged_folder(out) as staged:  # the plot is drawn on local disk and logged from there
        export_encoder(model, staged.local / "model", {"rotation": {"fit_on": cfg.rotate.embeddings,
                                                                    "rows": axes.count, "source": source}})
        plot = _plot_variance(kept_before, kept, staged.local / "variance.png")
        staged.publish()
        result = {"model_path": join(out, "model"), "source": source, "rows": axes.count, "dim": axes.dim,
                  "variance_kept": kept, "variance_kept_before": kept_before,
                  "orthogonality_error": orthogonality_error(weight), "seconds": time.time() - started,
                  "plot": staged.final(plot)}
        with mlflow.start_run(experiment_id=experiment_id, run_name=cfg.tracking.run_name) as run:
            mlflow.log_params({"source": source, "rotate.embeddings": ",".join(cfg.rotate.embeddings),
                               "rotate.max_rows": cfg.rotate.max_rows, "rotate.seed": cfg.rotate.seed,
                               "output_dir": out})
            mlflow.log_metrics({"rows": axes.count, "orthogonality_error": result["orthogonality_error"],
                                **{f"variance_kept_at_{d}": v for d, v in kept.items()},
                                **{f"variance_kept_before_at_{d}": v for d, v in kept_before.items()}})
            mlflow.log_artifact(str(plot))
    print(f"[raoe] rotate: {axes.count:,} embeddings; the share of the variance the first d of {axes.dim} dimensions "
          "hold, rotated (before): " + ", ".join(f"{d}: {kept[d]:.1%} ({kept_before[d]:.1%})" for d in dims[:-1]),
          flush=True)
    return {**result, "run_id": run.info.run_id, "tracking_uri": tracking_uri()}


def _embedded_shards(folders: list[str]) -> tuple[str, str, list[tuple[str, str]], int]:
    """(model source, its fingerprint, every non-empty (folder, shard), the embedding's width) of the embed output
    folders, from their spec and manifest alone; folders holding another model's vectors are refused by name."""
    from data_pipelines.embedding import finished_embeddings

    models, shards, width = {}, [], 0
    for folder in (f.rstrip("/") for f in folders):
        spec, manifest = finished_embeddings(folder)
        models[folder] = (spec["model"], spec["model_fingerprint"])
        shards += [(folder, s["shard"]) for s in manifest["shards"] if int(s["rows"])]
        width = max(width, int(manifest["dim"]))
    if len(set(models.values())) > 1:
        raise ValueError("rotate.embeddings hold the vectors of different models: "
                         + "; ".join(f"{f}: {m}" for f, (m, _) in models.items()))
    if not shards:
        raise ValueError("rotate.embeddings hold no embeddings")
    source, fingerprint = next(iter(models.values()))
    return source, fingerprint, shards, width


def _same_model(source: str, model_path: str, fingerprint: str) -> None:
    """Refuse embeddings made by another version of the model than the one ``source`` names now."""
    from evaluation.corpus_index import model_fingerprint

    if model_fingerprint(model_path) != fingerprint:
        raise ValueError(f"the embeddings were made by another version of {source} than the one it names now: "
                         f"embed the corpus again with this one")


def _rotatable(source: str, model_path: str) -> None:
    """Refuse, before loading it, a model whose rotation this job would get wrong: a LoRA adapter or a quantised
    base (its merged export can be rotated), an RSE model (its relation vectors would stay in the old basis)."""
    import json
    from pathlib import Path

    from encoders.backbone import adapter_base
    from encoders.model_files import RAOE_META, RELATIONS_JSON

    meta = Path(model_path) / RAOE_META
    quantized = meta.is_file() and json.loads(meta.read_text()).get("quantization", "none") != "none"
    if quantized or adapter_base(model_path):
        raise ValueError(f"{source} is a LoRA adapter or a quantised model: rotate its merged export "
                         f"(ray_jobs/export.py with export.formats=[merged])")
    if (Path(model_path) / RELATIONS_JSON).is_file():
        raise ValueError(f"{source} is a relational (RSE) model: rotating it is not supported (its relation vectors "
                         f"would stay in the old basis)")


def _fit(shards: list[tuple[str, str]], max_rows: int, seed: int):
    """The principal axes' sums over whole shards (at least one) in a seeded order, the last one cut to
    ``max_rows``."""
    import numpy as np

    from data_pipelines.embedding import shard_vectors
    from encoders.rotation import PrincipalAxes

    axes = None
    for i in np.random.default_rng(seed).permutation(len(shards)):
        vectors = shard_vectors(*shards[i])
        axes = axes or PrincipalAxes(vectors.shape[1])
        axes.add(vectors[: max_rows - axes.count])
        if axes.count >= max_rows:
            break
    if axes.count <= axes.dim:
        raise ValueError(f"rotate.embeddings hold {axes.count} embeddings (rotate.max_rows={max_rows}): a rotation "
                         f"needs more embeddings than the model has dimensions ({axes.dim})")
    return axes


def _plot_variance(before: dict[int, float], after: dict[int, float], path):
    from evaluation.figures import pyplot, save_figure

    fig, ax = pyplot().subplots(figsize=(6, 4))
    dims = list(after)
    ax.plot(dims, [before[d] for d in dims], marker="o", label="first dimensions as trained")
    ax.plot(dims, [after[d] for d in dims], marker="o", label="rotated onto the principal axes")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="dimensions kept", ylabel="share of the variance", ylim=(0, 1.02), title="Variance a cut keeps")
    ax.minorticks_off()
    ax.set_xticks(dims, [str(d) for d in dims])
    ax.legend()
    return save_figure(fig, path)


if __name__ == "__main__":
    config = parse_job_args(RotateJobConfig, __doc__)
    run_job(lambda: main(config), "rotate")
