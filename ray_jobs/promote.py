"""Promote a registered model version to the alias `champion` only if the suite says it is better: its
average beats the current champion's by at least `margin` and no task in `guard_tasks` drops by more than
`tolerance`; otherwise it becomes `challenger`. The suite is the STS tasks of `eval` (Spearman x 100) and its
retrieval tasks (`eval.retrieval`, nDCG@10 x 100, named by task): the average runs over both kinds and a guard may
name either. The first version becomes champion (loaded and probed, no suite run); a version that does not load
is never promoted. Suite results are remembered per version and evaluation data, so a version evaluated before (by a
promotion or ray_jobs/evaluate.py) is not scored again, and a corpus is encoded once per model (its cached index).
The decision, with both score tables, is the JSON line and a tag on the version.

  python ray_jobs/promote.py --config configs/promote/sts.yaml --set registered_model=raoe-s2 [--set version=3]
"""

from pydantic import Field, model_validator

import _bootstrap  # noqa: F401  (project on sys.path, safe Ray environment)
from jobconfig import parse_job_args
from jobconfig.schema import EncoderPoolSection, EvalConfig, SharedFilesystem
from runtime.result import run_job


class PromoteJobConfig(EncoderPoolSection):
    registered_model: str = Field("raoe-s1", description="registry name (raoe-s1, raoe-s2, ...)")
    version: int | None = Field(None, ge=1, description="candidate version; null = the latest")
    margin: float = Field(0.0, ge=0, description="the candidate's average must beat the champion's by this much")
    guard_tasks: list[str] = Field(default_factory=lambda: ["STSBenchmark"], description="tasks that must not regress")
    tolerance: float = Field(0.5, ge=0, description="largest allowed drop on a guarded task (Spearman or nDCG@10, "
                             "x100)")
    eval: EvalConfig = Field(default_factory=EvalConfig)
    dim: int | None = Field(None, ge=1, description="judge candidate and champion at their leading dim embedding "
                            "dimensions, cut and renormalised (Matryoshka models served truncated); null = whole")
    shared_filesystem: SharedFilesystem = False

    @model_validator(mode="after")
    def _guards_name_suite_tasks(self):
        known = [*self.eval.tasks, *(t.task_name for t in self.eval.retrieval)]
        unknown = [t for t in self.guard_tasks if t not in known]
        if unknown:
            raise ValueError(f"guard_tasks: {unknown} not in the suite (eval.tasks and eval.retrieval names: {known})")
        return self


def main(cfg: PromoteJobConfig) -> dict:
    from encoders.devices import gpus_wanted_here
    from evaluation.encode import score_with_ray
    from evaluation.retrieval_suite import evaluate_retrieval_at, retrieval_outputs, suite_encodings
    from runtime.local_ray import ray_session
    from runtime.tracking_store import tracking_uri
    from tracking.promotion import evaluation_key, promote, suite_scores

    def suite(path: str) -> dict:
        """The STS sentences and every task's queries in one encoding pass, then each task's corpus and search."""
        encodings, tasks = suite_encodings(path, cfg.eval, cfg.encoder_pool())
        sts = score_with_ray(path, cfg.eval, pool=cfg.encoder_pool(), dim=cfg.dim, encodings=encodings)
        retrieval = evaluate_retrieval_at(path, tasks, [cfg.dim], pool=cfg.encoder_pool(), encodings=encodings,
                                          batch_size=cfg.eval.batch_size, method=cfg.eval.search.method_settings())
        return suite_scores(sts, retrieval[cfg.dim])

    tracking_uri()
    gpus_wanted_here({"gpus_per_actor": cfg.gpus_per_actor})
    with ray_session(outputs=retrieval_outputs(cfg.eval), shared_filesystem=cfg.shared_filesystem):
        result = promote(
            cfg.registered_model, cfg.version,
            suite,
            margin=cfg.margin, guard_tasks=cfg.guard_tasks, tolerance=cfg.tolerance,
            eval_key=evaluation_key(cfg.eval, cfg.dim),
        )
    verdict = "PROMOTED to champion" if result["promote"] else "kept as challenger (champion unchanged)"
    if result["reused"]:
        print(f"reused the suite results remembered for version(s) {result['reused']} (same evaluation data)")
    print(f"{cfg.registered_model} v{result['candidate_version']}: {verdict}: {result['reason']}")
    return result


if __name__ == "__main__":
    config = parse_job_args(PromoteJobConfig, __doc__)
    run_job(lambda: main(config), "promote")
