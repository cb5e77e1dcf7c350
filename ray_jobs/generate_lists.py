"""Ranked sentence lists by directionally controlled generation (ranking-sentences paper, Sec. 3.1, Eq. 3-4):
diverse seed sentences (k-means over the student's embeddings, clusters x per_cluster), then for each seed `steps`
sentences from a causal LM, each generated from the previous one and steered away from the one before it
(guidance scale 1 + lam; the paper's gamma 1.5 is lam 0.5), on a Ray Data actor pool. Lists stop early at an
empty, repeated or looping sentence (counted). The same run generates a few lists at lam = 0 (step-by-step
prompting) and reports the mean similarity to the seed at each position for both (the paper's Figure 1(d)).

  python ray_jobs/generate_lists.py --config configs/generate_lists/snli-smollm2-cpu.yaml
  python ray_jobs/generate_lists.py --config configs/tiny/generate_lists.yaml
"""

from pydantic import Field

import _bootstrap  # noqa: F401  (project on sys.path, safe Ray environment)
from data_pipelines.ranked import LIST_PROMPT
from jobconfig import parse_job_args
from jobconfig.schema import RELATIVE, DataConfig, OutputPath, Section, TrackingConfig, TrustRemoteCode
from runtime.result import run_job


class ListsSection(Section):
    model: str = Field("pypi:smollm2-135m-instruct", description="causal LM (HF id, path, pypi:, tiny:qwen2-lm)")
    prompt: str = Field(LIST_PROMPT, description="instruction I with {sentence} (the paper's, Appendix A)")
    steps: int = Field(32, ge=1, description="sentences generated after each seed (paper: 32)")
    lam: float = Field(0.5, ge=0, description="guidance: (1 + lam) log p(.|prev) - lam log p(.|prev2); paper gamma = "
                       "1 + lam = 1.5")
    max_new_tokens: int = Field(40, ge=1, description="tokens per generated sentence")
    seed_encoder: str = Field("pypi:all-minilm-l6-v2", description="embeds seeds for k-means and scores the lists")
    clusters: int = Field(1000, ge=1, description="k-means clusters over the candidate seeds (paper: 1000)")
    per_cluster: int = Field(20, ge=1, description="seeds drawn from each cluster (paper: 20)")
    seed: int = Field(42, description="k-means and seed sampling")
    compare_lists: int = Field(16, ge=0, description="seeds also generated at lam = 0 for the comparison")
    batch_size: int = Field(8, ge=1, description="seeds per actor call (decoded together)")
    actors: int = Field(1, ge=1, description="LM actors (scale out across nodes)")
    cpus_per_actor: float = Field(1.0, gt=0, description="CPUs an actor reserves")
    threads: int = Field(1, ge=1, description="torch threads per actor")
    trust_remote_code: TrustRemoteCode = Field(False, description="run Python code shipped with the causal LM "
                                               "or the seed encoder; off unless set")


class GenerateListsJobConfig(Section):
    data: DataConfig = Field(default_factory=DataConfig, description="the sentence corpus seeds are drawn from")
    lists: ListsSection = Field(default_factory=ListsSection)
    output_dir: OutputPath = Field("outputs/lists", validate_default=True,
                                   description="where lists.jsonl, the statistics and the plot go; " + RELATIVE)
    tracking: TrackingConfig = Field(default_factory=lambda: TrackingConfig(experiment="raoe-lists"))


def _generate(seeds: list[str], cfg: ListsSection, lam: float):
    import ray

    from data_pipelines.ranked import ListGenerator

    ds = ray.data.from_items([{"text": s} for s in seeds])
    return ds.map_batches(ListGenerator, fn_constructor_kwargs={
        "model": cfg.model, "prompt": cfg.prompt, "steps": cfg.steps, "lam": lam, "max_new_tokens": cfg.max_new_tokens,
        "threads": cfg.threads, "trust_remote_code": cfg.trust_remote_code}, batch_size=cfg.batch_size,
        compute=ray.data.ActorPoolStrategy(size=cfg.actors), num_cpus=cfg.cpus_per_actor,
        batch_format="numpy").to_pandas()


def similarity_by_position(lists: list[list[str]], encoder) -> list[float]:
    """Mean cosine of the sentence at each position to its list's seed (position 0 is the seed itself: 1)."""
    import numpy as np

    sums, counts = {}, {}
    for sentences in lists:
        emb = encoder.encode(list(sentences))
        emb = emb / np.linalg.norm(emb, axis=1, keepdims=True).clip(min=1e-12)
        for position, value in enumerate(emb @ emb[0]):
            sums[position] = sums.get(position, 0.0) + float(value)
            counts[position] = counts.get(position, 0) + 1
    return [sums[p] / counts[p] for p in sorted(sums)]


def _plot(curves: dict[str, list[float]], path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for label, values in curves.items():
        ax.plot(range(len(values)), values, marker="o", markersize=3, label=label)
    ax.set(xlabel="position in the list (0 = seed)", ylabel="mean cosine to the seed",
           title="Similarity to the seed by position")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(cfg: GenerateListsJobConfig) -> dict:
    import json
    import time
    from pathlib import Path

    import mlflow

    from data_pipelines.ranked import kmeans_seeds
    from data_pipelines.readers import load_configured
    from data_pipelines.teachers import TeacherConfig, TeacherEncoder
    from encoders.sources import resolve_model_source
    from runtime.local_ray import ray_session
    from runtime.tracking_store import ensure_experiment

    if not cfg.data.train:
        raise ValueError("data.train must name the sentence corpus the seeds come from")
    resolve_model_source(cfg.lists.model)  # fails here, before any Ray resource, if the LM cannot be found
    encoder = TeacherEncoder(TeacherConfig(name="seed", source=cfg.lists.seed_encoder, batch_size=64,
                                           trust_remote_code=cfg.lists.trust_remote_code))
    out = Path(cfg.output_dir).resolve()
    experiment_id = ensure_experiment(cfg.tracking.experiment)
    started = time.time()
    with ray_session():
        ds, report = load_configured("sentences", cfg.data, out / "quarantine.jsonl")
        texts = [r["text"] for r in ds.take_all()]
        chosen = kmeans_seeds(encoder.encode(texts), cfg.lists.clusters, cfg.lists.per_cluster, cfg.lists.seed)
        seeds = [texts[i] for i in chosen]
        print(f"[raoe] {len(seeds)} seeds from {len(texts)} sentences (k-means, {cfg.lists.clusters} clusters x "
              f"{cfg.lists.per_cluster}); generating {cfg.lists.steps} sentences each at lam {cfg.lists.lam} ...",
              flush=True)
        generated = _generate(seeds, cfg.lists, cfg.lists.lam)
        baseline = _generate(seeds[: cfg.lists.compare_lists], cfg.lists, 0.0) if cfg.lists.compare_lists else None
    seconds = time.time() - started
    lists = [list(x) for x in generated["sentences"]]
    written = [x for x in lists if len(x) >= 2]
    reasons = generated["stopped"].dropna().value_counts().to_dict()
    (out / "data").mkdir(parents=True, exist_ok=True)
    with open(out / "data" / "lists.jsonl", "w", encoding="utf-8") as f:
        for sentences in written:
            f.write(json.dumps({"sentences": sentences}, ensure_ascii=False) + "\n")
    compared = min(cfg.lists.compare_lists, len(lists))
    curves = {f"lam {cfg.lists.lam} (directional)": similarity_by_position(lists[:compared] or written, encoder)}
    if baseline is not None:
        curves["lam 0 (step-by-step prompting)"] = similarity_by_position([list(x) for x in baseline["sentences"]],
                                                                          encoder)
    picture = _plot(curves, out / "similarity_by_position.png")
    counts = {"seeds": len(seeds), "lists_written": len(written), "lists_without_sentences": len(lists) - len(written),
              "lists_stopped_early": int(generated["stopped"].notna().sum()),
              "sentences": sum(len(x) for x in written)}
    with mlflow.start_run(experiment_id=experiment_id, run_name=cfg.tracking.run_name) as run:
        mlflow.log_params({"data.train": cfg.data.train, **{f"lists.{k}": str(v)[:500]
                                                             for k, v in cfg.lists.model_dump().items()}})
        mlflow.log_metrics({**{k: float(v) for k, v in counts.items()}, "seconds": seconds})
        mlflow.log_dict({"similarity_by_position": curves, "stopped": reasons, "examples": written[:5]},
                        "lists_statistics.json")
        mlflow.log_artifact(str(picture))
    return {**counts, "stopped": reasons, "rows_in": report.rows_in, "rows_quarantined": report.rows_quarantined,
            "output_path": str(out / "data"), "similarity_by_position": curves, "plot": str(picture),
            "seconds": seconds, "examples": written[:2], "run_id": run.info.run_id}


if __name__ == "__main__":
    config = parse_job_args(GenerateListsJobConfig, __doc__)
    run_job(lambda: main(config), "generate_lists")
