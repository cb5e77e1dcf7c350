"""Export a trained model for other runtimes, each export checked against the model before it is kept.

export.formats: merged (LoRA folded into the dequantised base, a plain sentence-transformers folder in export.dtype),
onnx (that folder plus onnx/model.onnx, sentence-transformers' ONNX layout), onnx_int8 (onnx/model_qint8.onnx,
dynamic int8 quantisation) and openvino (openvino/openvino_model.xml, fp32, where the openvino package is installed).
Each export embeds the texts of the first export.sample_pairs STS-B dev pairs (eval.data_dir) beside the source
model: the per-text cosine (min and mean) and the STS-B Spearman delta must reach export.min_cosine_fp32 (fp32
merged, onnx and openvino), export.min_cosine_half (merged in bf16/fp16) or export.min_cosine_int8 (onnx_int8),
and export.max_score_delta; with eval.retrieval naming a dev-sized retrieval task, its nDCG@10 must move by at most
export.max_retrieval_delta. Exports that pass are written under output_dir/<format> and logged as
artifacts of the source model version's run (exports/<format>), their figures as version tags and in its
description; an export that fails is refused with its figures (the job then ends in error, the others kept).

  python ray_jobs/export.py --config configs/export/default.yaml --set model.source=models:/raoe-s2@champion
  python ray_jobs/export.py --config configs/tiny/export.yaml --set "export.formats=[onnx_int8]"
"""

from typing import Literal

from pydantic import Field, field_validator

import _bootstrap  # noqa: F401  (project on sys.path, safe Ray environment)
from encoders.export_formats import runs_here
from jobconfig import parse_job_args
from jobconfig.schema import RELATIVE, OutputPath, RetrievalTaskConfig, Section, TrackingConfig
from runtime.result import run_job


class ExportModel(Section):
    source: str = Field("pypi:all-minilm-l6-v2", description="the model to export: a path, pypi:<package>, HF id or "
                        "MLflow model URI (models:/raoe-s2@champion); a registry version gets the exports as artifacts")


class ExportSection(Section):
    formats: list[Literal["merged", "onnx", "onnx_int8", "openvino"]] = Field(
        default_factory=lambda: ["merged", "onnx", "onnx_int8"], description="what to write (openvino: where the "
        "openvino package is installed)")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="weights of the merged export")
    min_cosine_fp32: float = Field(0.9999, gt=0, le=1, description="least per-text cosine to the source of a float32 "
                                   "export (merged, onnx, openvino)")
    min_cosine_half: float = Field(0.999, gt=0, le=1, description="least per-text cosine of a bf16/fp16 merged export")
    min_cosine_int8: float = Field(0.99, gt=0, le=1, description="least per-text cosine of onnx_int8")
    max_score_delta: float = Field(0.5, ge=0, description="largest STS-B dev Spearman change (x100 points), either way")
    max_retrieval_delta: float = Field(0.5, ge=0, description="largest nDCG@10 change (x100 points), either way, on "
                                       "eval.retrieval when it names a task")
    sample_pairs: int = Field(500, ge=2, description="STS-B dev pairs whose texts every export embeds for the check")
    batch_size: int = Field(32, ge=1, description="texts per encoder call in the check")

    @field_validator("formats")
    @classmethod
    def _some(cls, formats: list[str]) -> list[str]:
        if not formats or len(set(formats)) != len(formats):
            raise ValueError(f"export.formats must name distinct formats, got {formats}")
        return [runs_here(fmt, "export.formats") for fmt in formats]


class ExportEval(Section):
    data_dir: str = Field("../shared/data/senteval", description="SentEval-layout root holding STS/STSBenchmark/"
                          "sts-dev.csv: the texts of the parity check")
    retrieval: RetrievalTaskConfig | None = Field(
        None, description="a dev-sized retrieval task (a BEIR folder or hf:<dataset>, at most 200,000 documents, "
        "encoded whole by the source and every export) whose nDCG@10 each export must keep within "
        "export.max_retrieval_delta; null: the STS check alone")


class ExportJobConfig(Section):
    model: ExportModel = Field(default_factory=ExportModel)
    export: ExportSection = Field(default_factory=ExportSection)
    eval: ExportEval = Field(default_factory=ExportEval)
    output_dir: OutputPath = Field("outputs/exports", validate_default=True,
                                   description="where the exports go, one folder per format; " + RELATIVE)
    tracking: TrackingConfig = Field(default_factory=lambda: TrackingConfig(experiment="raoe-export"))


class ExportRefused(RuntimeError):
    """An export whose embeddings drifted past its threshold; ``figures`` holds every export's check, ``refused``
    the formats refused."""

    def __init__(self, message: str, figures: dict, refused: list[str]):
        super().__init__(message)
        self.figures, self.refused = figures, refused


def main(cfg: ExportJobConfig) -> dict:
    import shutil
    import tempfile
    from pathlib import Path

    from encoders.backbone import load_encoder
    from encoders.export import load_export, save_merged, save_onnx, save_openvino, trace_onnx
    from encoders.model_uris import resolve_alias, resolve_model
    from evaluation.parity import parity, source_embeddings
    from evaluation.sts import load_task
    from storage.paths import join, remove_tree, staged_folder, storage_path

    # an alias is pinned once: the version exported is the version its exports are logged on, however long this takes
    source = resolve_alias(cfg.model.source) if cfg.model.source.startswith("models:/") else cfg.model.source
    model_path = resolve_model(source)  # fails here if it cannot be found
    pairs = load_task(cfg.eval.data_dir, "STSBenchmark", "dev")
    if pairs is None:
        raise FileNotFoundError(f"eval.data_dir={cfg.eval.data_dir!r} holds no STS/STSBenchmark/sts-dev.csv: the "
                                f"parity check embeds its texts")
    pairs = pairs.head(cfg.export.sample_pairs)
    e = cfg.export
    print(f"[raoe] export {cfg.model.source}: {', '.join(e.formats)}; parity on {len(pairs.gold)} STS-B dev pairs",
          flush=True)
    dev = None
    if cfg.eval.retrieval is not None:
        from evaluation.retrieval import read_dev_set

        task = cfg.eval.retrieval
        dev = read_dev_set(task.source, task.split, task.task_name, task.max_queries,
                           ignore_identical_ids=task.ignore_identical_ids, key="eval.retrieval")
        print(f"[raoe] and nDCG@10 on {task.task_name}: {len(dev.task.query_ids)} queries, "
              f"{len(dev.corpus_ids)} documents", flush=True)
    reference = source_embeddings(load_encoder(model_path), pairs, e.batch_size, dev)
    figures, refused = {}, {}
    with tempfile.TemporaryDirectory(prefix="raoe-export-") as scratch:
        scratch = Path(scratch)
        graphs = {"onnx", "onnx_int8", "openvino"} & set(e.formats)
        merged_fp32 = save_merged(model_path, scratch / "merged-fp32") if graphs or e.dtype == "float32" else None
        traced = trace_onnx(merged_fp32, scratch / "trace") if graphs else None  # traced once, in any format order
        built = {}
        for fmt in e.formats:
            if fmt == "merged":
                built[fmt] = merged_fp32 if e.dtype == "float32" else save_merged(model_path, scratch / fmt, e.dtype)
            elif fmt == "onnx":
                built[fmt] = save_onnx(merged_fp32, scratch / fmt, traced=traced)
            elif fmt == "openvino":
                built[fmt] = save_openvino(merged_fp32, scratch / fmt, traced=traced)
            else:
                built[fmt] = save_onnx(merged_fp32, scratch / fmt, int8=True, traced=traced)
            check = parity(reference, load_export(built[fmt], fmt), pairs, e.batch_size, dev)
            figures[fmt] = {key: value for key, value in check.as_dict().items() if value is not None}
            figures[fmt]["min_cosine_required"] = _least_cosine(fmt, e)
            retrieval = "" if check.retrieval_delta is None else \
                f", nDCG@10 {check.retrieval_score:.2f} ({check.retrieval_delta:+.2f})"
            print(f"[raoe] {fmt}: cosine min {check.min_cosine:.6f} mean {check.mean_cosine:.6f}, STS-B dev "
                  f"{check.score:.2f} ({check.score_delta:+.2f}){retrieval}, {check.texts_per_s:.0f} texts/s",
                  flush=True)
            if drift(figures[fmt], e):
                refused[fmt] = figures[fmt]
        kept = [fmt for fmt in e.formats if fmt not in refused]
        with staged_folder(cfg.output_dir) as staged:
            for fmt in kept:
                target = staged.local / fmt
                if target.exists():
                    shutil.rmtree(target)
                shutil.copytree(built[fmt], target)
            staged.publish()
            paths = {fmt: staged.final(staged.local / fmt) for fmt in kept}
            for fmt in refused:  # an earlier run's export of a format refused now is not left as if it passed
                remove_tree(storage_path(join(cfg.output_dir, fmt)))
            logged = _log(cfg, source, {fmt: staged.local / fmt for fmt in kept}, figures, refused, reference)
    exports = {fmt: {"path": paths[fmt], **figures[fmt]} for fmt in kept}
    if refused:
        listed = "; ".join(f"{fmt}: {', '.join(drift(f, e))}" for fmt, f in refused.items())
        kept_note = f". Kept: {', '.join(kept)} under {cfg.output_dir}" if kept else ""
        raise ExportRefused(f"export refused, its embeddings drifted from the source: {listed}{kept_note}", figures,
                            sorted(refused))
    return {"model": cfg.model.source, "source_texts_per_s": reference.texts_per_s,
            "source_sts_score": reference.score, "exports": exports, **logged,
            **({"source_retrieval_score": reference.retrieval_score} if dev is not None else {})}


def drift(figures: dict, e: ExportSection) -> list[str]:
    """What an export's figures miss (empty: it passes), each with its figure and threshold."""
    missed = []
    if figures["min_cosine"] < figures["min_cosine_required"]:
        missed.append(f"min cosine {figures['min_cosine']:.6f} (needs {figures['min_cosine_required']})")
    if abs(figures["score_delta"]) > e.max_score_delta:
        missed.append(f"STS-B delta {figures['score_delta']:+.3f} (at most {e.max_score_delta})")
    if "retrieval_delta" in figures and abs(figures["retrieval_delta"]) > e.max_retrieval_delta:
        missed.append(f"nDCG@10 delta {figures['retrieval_delta']:+.3f} (at most {e.max_retrieval_delta})")
    return missed


def _least_cosine(fmt: str, e: ExportSection) -> float:
    if fmt == "onnx_int8":
        return e.min_cosine_int8
    return e.min_cosine_half if fmt == "merged" and e.dtype != "float32" else e.min_cosine_fp32


def _log(cfg: ExportJobConfig, source: str, folders: dict, figures: dict, refused: dict, reference) -> dict:
    """Artifacts and figures: on the registry version's run when the source is one (tags and description too),
    else on a run of its own. ``source``: the model source with its alias pinned to a version."""
    import mlflow
    from mlflow import MlflowClient

    from runtime.tracking_store import ensure_experiment, tracking_uri
    from tracking.promotion import set_version_tag

    client = MlflowClient()
    version = None
    if source.startswith("models:/"):
        name, version = source.removeprefix("models:/").split("/", 1)
        held = client.get_model_version(name, version)
        run_id = held.run_id or held.tags.get("run_id")  # MLflow 3 may register a logged model outside any run
    if version is None or not run_id:
        with mlflow.start_run(experiment_id=ensure_experiment(cfg.tracking.experiment),
                              run_name=cfg.tracking.run_name) as run:
            mlflow.log_param("model.source", source)
            run_id = run.info.run_id
    for fmt, folder in folders.items():
        client.log_artifacts(run_id, str(folder), artifact_path=f"exports/{fmt}")
        for key, value in figures[fmt].items():
            client.log_metric(run_id, f"export_{fmt}_{key}", float(value))
    if version is not None:
        for fmt in folders:
            for key in PARITY_TAGS:
                if key in figures[fmt]:
                    set_version_tag(client, name, version, f"export.{fmt}.{key}", f"{figures[fmt][key]:.6g}")
                elif f"export.{fmt}.{key}" in held.tags:  # an earlier run's retrieval delta, not checked now
                    client.delete_model_version_tag(name, version, f"export.{fmt}.{key}")
        for fmt in refused:  # an earlier run's figures of a format refused now would read as passing
            for key in PARITY_TAGS:
                if f"export.{fmt}.{key}" in held.tags:
                    client.delete_model_version_tag(name, version, f"export.{fmt}.{key}")
        card = _parity_card(folders, figures, reference, run_id)
        client.update_model_version(name, version, description=with_section(held.description or "", card))
    return {"run_id": run_id, "tracking_uri": tracking_uri(), **({"model_version": source} if version else {})}


PARITY_TAGS = ("min_cosine", "mean_cosine", "score_delta", "retrieval_delta", "texts_per_s")


def with_section(description: str, card: str) -> str:
    """The model card with its "## Exports" section replaced by ``card`` (added at the end the first time); the
    sections before and after it stay."""
    import re

    section = re.compile(r"^## Exports\n.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)
    if section.search(description):
        return section.sub(lambda _: card.strip() + "\n\n", description, count=1).strip()
    return (description.rstrip() + "\n\n" + card.strip()).strip()


def _parity_card(folders: dict, figures: dict, reference, run_id: str) -> str:
    retrieval = reference.retrieval_score is not None
    lines = ["## Exports", "", f"Checked on {len(reference.texts)} STS-B dev texts against the source "
             f"(STS-B dev {reference.score:.2f}"
             + (f", nDCG@10 {reference.retrieval_score:.2f} on the retrieval task" if retrieval else "")
             + f", {reference.texts_per_s:.0f} texts/s here); artifacts under runs:/{run_id}/exports/<format>.", "",
             "| format | min cosine | mean cosine | STS-B delta |" + (" nDCG@10 delta |" if retrieval else "")
             + " texts/s |", "|---|---|---|---|" + ("---|" if retrieval else "") + "---|"]
    lines += [f"| {fmt} | {figures[fmt]['min_cosine']:.6f} | {figures[fmt]['mean_cosine']:.6f} | "
              f"{figures[fmt]['score_delta']:+.3f} |"
              + (f" {figures[fmt]['retrieval_delta']:+.3f} |" if retrieval else "")
              + f" {figures[fmt]['texts_per_s']:.0f} |" for fmt in folders]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    config = parse_job_args(ExportJobConfig, __doc__)
    run_job(lambda: main(config), "export")
