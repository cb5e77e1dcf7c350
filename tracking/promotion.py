"""Promotion: move the registry alias ``champion`` to a candidate version only when the suite says it is
better: its average beats the champion's by at least ``margin`` and no guarded task drops by more than
``tolerance``. Otherwise the candidate gets ``challenger``. A version that does not load is never promoted.
The suite is the STS tasks (Spearman x 100) and the retrieval tasks (nDCG@10 x 100, by task name): the average
runs over all of them, and a guard may name either kind.

Suite results are remembered on each version (tags ``sts_results`` and ``sts_results.key``, the key naming the
evaluation data and settings), so a version already evaluated on the same data is not encoded again; with no
champion yet the first loadable version is promoted without running the suite at all."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from encoders.backbone import inference_embeddings, load_encoder
from encoders.model_uris import download_model
from storage.paths import absolute

CHAMPION, CHALLENGER = "champion", "challenger"
RESULTS_TAG, KEY_TAG = "sts_results", "sts_results.key"


def task_content(task) -> str | list[str]:
    """A retrieval task's data as scored: its queries', qrels' and corpus's content digests (a regenerated folder at
    the same path is other data), or a hub dataset's cached revision."""
    from storage.digests import content_digests, hub_revision
    from storage.paths import storage_path

    if task.source.startswith("hf:"):
        return hub_revision(task.source.removeprefix("hf:"), repo_type="dataset") or task.source
    root = storage_path(task.source)
    files = [root / "queries.jsonl", root / "qrels" / f"{task.split}.tsv", root / "corpus.jsonl"]
    return content_digests([f for f in files if f.exists()])  # a missing file fails the scoring, not the key


def evaluation_key(eval_cfg, dim: int | None = None) -> str:
    """What makes two suite results comparable: the data (a local path resolved, a URI as it is: ``Path`` would make
    ``s3://b/x`` into ``s3:/b/x`` under the job's working folder, another on every submission), tasks, STS-B split
    and pair cap, the retrieval tasks (with their files' content and scoring rules, and an approximate search's
    settings), and the embedding size scored (a Matryoshka model's leading ``dim``, or the whole)."""
    spec = {"data_dir": absolute(str(eval_cfg.data_dir)), "tasks": list(eval_cfg.tasks),
            "stsb_split": eval_cfg.stsb_split, "max_pairs": eval_cfg.max_pairs}
    if dim is not None:
        spec["dim"] = dim
    retrieval = getattr(eval_cfg, "retrieval", None)
    if retrieval:
        spec["retrieval"] = [{"source": t.source if t.source.startswith("hf:") else absolute(t.source),
                              "split": t.split, "name": t.task_name, "max_queries": t.max_queries,
                              "ignore_identical_ids": t.ignore_identical_ids, "content": task_content(t)}
                             for t in retrieval]
        search = getattr(eval_cfg, "search", None)
        if search is not None and search.method != "exact":  # approximate scores compare only with their own kind
            spec["search"] = search.model_dump(exclude={"recall_queries"})  # what changes the scores
    return hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


RETRIEVAL_METRIC = "ndcg@10"  # what a retrieval task contributes to the suite (x 100, like Spearman x 100)


def suite_scores(sts: dict[str, float | None], retrieval: dict[str, dict[str, float]] | None = None
                 ) -> dict[str, float | None]:
    """One table for promotion: each STS task, each retrieval task's nDCG@10 x 100, and their average."""
    scores = {k: v for k, v in sts.items() if k != "avg"}
    for task, values in (retrieval or {}).items():
        if task in scores:
            raise ValueError(f"retrieval task {task!r} has the name of an STS task: give it another name")
        scores[task] = 100.0 * values[RETRIEVAL_METRIC]
    present = [v for v in scores.values() if v is not None]
    scores["avg"] = sum(present) / len(present) if present else None
    return scores


def remembered_scores(client, name: str, version, key: str | None) -> dict[str, float | None] | None:
    """A version's suite results logged earlier under the same evaluation key, or None."""
    if key is None:
        return None
    tags = client.get_model_version(name, str(version)).tags
    return json.loads(tags[RESULTS_TAG]) if tags.get(KEY_TAG) == key and RESULTS_TAG in tags else None


def set_version_tag(client, name: str, version, key: str, value: str, tries: int = 5) -> None:
    """``set_model_version_tag`` that survives a concurrent writer: MLflow's SQL store inserts a new tag, so two
    processes tagging the same version at once make one fail on the unique key; writing again updates the tag."""
    for attempt in range(tries):
        try:
            client.set_model_version_tag(name, str(version), key, value)
            return
        except Exception as exc:  # noqa: BLE001 - MlflowException wrapping sqlalchemy's IntegrityError
            if "UNIQUE constraint" not in str(exc) or attempt == tries - 1:
                raise
            time.sleep(0.05 * (attempt + 1))


def remember_scores(client, name: str, version, key: str | None, scores: dict[str, float | None]) -> None:
    set_version_tag(client, name, version, RESULTS_TAG, json.dumps(scores))
    if key is not None:
        set_version_tag(client, name, version, KEY_TAG, key)


def load_probe(path: str) -> None:
    """The cheapest proof a version works: it loads as training exported it and encodes a sentence."""
    inference_embeddings(load_encoder(path), ["a man plays music."])


@dataclass
class Decision:
    promote: bool
    reason: str
    candidate: dict[str, float | None]
    champion: dict[str, float | None] | None = None
    deltas: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def decide(candidate: dict[str, float | None], champion: dict[str, float | None] | None, *, margin: float = 0.0,
           guard_tasks: list[str] | tuple[str, ...] = (), tolerance: float = 0.0) -> Decision:
    """Compare suite results (task -> Spearman x100, with 'avg'); pure, so every rule is testable."""
    if champion is None:
        return Decision(True, "no champion yet: the first version becomes champion", candidate)
    deltas = {t: candidate[t] - champion[t] for t in candidate
              if candidate.get(t) is not None and champion.get(t) is not None}
    if "avg" not in deltas:
        return Decision(False, "no common tasks to compare on", candidate, champion, deltas)
    drops = [f"{t} drops {-deltas[t]:.2f} > {tolerance:.2f}" for t in guard_tasks
             if t in deltas and deltas[t] < -tolerance]
    if drops:
        return Decision(False, "guarded task(s) regress: " + "; ".join(drops), candidate, champion, deltas)
    if deltas["avg"] < margin:
        return Decision(False, f"average {deltas['avg']:+.2f} is below the margin {margin:.2f}", candidate, champion,
                        deltas)
    if deltas["avg"] <= 0:
        return Decision(False, f"average {deltas['avg']:+.2f} does not improve on the champion", candidate, champion,
                        deltas)
    return Decision(True, f"average {deltas['avg']:+.2f} >= margin {margin:.2f}", candidate, champion, deltas)


PROMOTION_SETTLE_S = 2.0  # longer than a concurrent promotion takes from its last check to its alias write


def promote(registered_model: str, candidate_version: int | None, evaluate: Callable[[str], dict[str, float | None]],
            *, margin: float = 0.0, guard_tasks: list[str] | tuple[str, ...] = (), tolerance: float = 0.0,
            eval_key: str | None = None, probe: Callable[[str], None] = load_probe) -> dict:
    """Evaluate candidate and champion with ``evaluate(local_model_path)`` (or reuse results remembered under
    ``eval_key``), decide, move the alias, record it. Without a champion only ``probe`` runs. If the champion
    changed while deciding (a concurrent promotion), the decision is taken again against the new one."""
    from mlflow import MlflowClient

    client = MlflowClient()
    if candidate_version is None:
        versions = client.search_model_versions(f"name = '{registered_model}'")
        if not versions:
            raise ValueError(f"registered model {registered_model!r} has no versions")
        candidate_version = max(int(v.version) for v in versions)
    out: dict[str, Any] = {"registered_model": registered_model, "candidate_version": int(candidate_version),
                           "evaluated": [], "reused": []}
    for attempt in range(5):  # another promotion may move the alias meanwhile: decide again against the new one
        champion_version = _champion(client, registered_model)
        result = _decide_once(client, registered_model, int(candidate_version), champion_version, evaluate, out,
                              margin=margin, guard_tasks=guard_tasks, tolerance=tolerance, eval_key=eval_key,
                              probe=probe)
        if result is None:  # did not load: never promoted, nothing moved
            return out
        if _champion(client, registered_model) != champion_version and attempt < 4:
            continue
        decision = result
        alias = CHAMPION if decision.promote else CHALLENGER
        client.set_registered_model_alias(registered_model, alias, str(candidate_version))
        if not decision.promote:
            break
        # A promotion that decided against the same champion at the same time may write the alias after this one:
        # look again once its write would have landed, and decide against whatever holds the alias then.
        time.sleep(PROMOTION_SETTLE_S)
        if _champion(client, registered_model) == int(candidate_version):
            break
    _record(client, registered_model, candidate_version, decision, champion_version)
    after = int(candidate_version) if decision.promote else champion_version
    return {**out, **decision.as_dict(), "champion_version_before": champion_version, "alias": alias,
            "champion_version_after": after}


def _champion(client, name: str) -> int | None:
    from mlflow.exceptions import MlflowException

    try:
        return int(client.get_model_version_by_alias(name, CHAMPION).version)
    except MlflowException:
        return None


def _decide_once(client, registered_model: str, candidate_version: int, champion_version: int | None, evaluate,
                 out: dict[str, Any], *, margin, guard_tasks, tolerance, eval_key, probe) -> Decision | None:
    """The decision against ``champion_version``; None (and ``out`` filled) when the candidate does not load."""
    def scores_of(version) -> dict[str, float | None]:
        known = remembered_scores(client, registered_model, version, eval_key)
        if known is not None:
            out["reused"].append(int(version))
            return known
        scores = evaluate(download_model(f"models:/{registered_model}/{version}"))
        out["evaluated"].append(int(version))
        remember_scores(client, registered_model, version, eval_key, scores)
        return scores

    try:  # loads and encodes before any alias moves
        if champion_version is None:
            probe(download_model(f"models:/{registered_model}/{candidate_version}"))
            candidate_scores = remembered_scores(client, registered_model, candidate_version, eval_key) or {}
        else:
            candidate_scores = scores_of(candidate_version)
    except Exception as exc:  # noqa: BLE001 - any failure to load or encode means: not promotable
        decision = Decision(False, f"candidate does not load or encode: {type(exc).__name__}: {exc}", {})
        _record(client, registered_model, candidate_version, decision)
        out.update(decision.as_dict(), champion_version_before=champion_version, champion_version_after=champion_version)
        return None
    if champion_version == candidate_version:
        return Decision(False, "candidate already is the champion", candidate_scores, candidate_scores, {})
    champion_scores = scores_of(champion_version) if champion_version is not None else None
    decision = decide(candidate_scores, champion_scores, margin=margin, guard_tasks=guard_tasks, tolerance=tolerance)
    if champion_version is None:
        decision.reason += " (loaded and encoded; nothing to compare with, so the suite was not run)"
    return decision


def _record(client, name: str, version, decision: Decision, champion_version: int | None = None) -> None:
    """The decision and the comparison table as version tags, and as an artifact on the version's run."""
    set_version_tag(client, name, version, "promotion.decision", "promoted" if decision.promote else "kept")
    set_version_tag(client, name, version, "promotion.reason", decision.reason[:5000])
    set_version_tag(client, name, version, "promotion.vs_version", str(champion_version))
    run_id = client.get_model_version(name, str(version)).run_id
    if run_id:
        client.log_text(run_id, json.dumps(decision.as_dict(), indent=2), f"promotion/v{version}.json")
