"""The retrieval recipe end to end, through `ray job submit` on a local head as a user runs it:

  evaluate the student and the teacher  ->  mine query groups of 8 with the student
  (configs/retrieval/mine-snli-minilm-cpu.yaml)  ->  score them with the teacher (configs/annotate/groups-mpnet.yaml)
  ->  train groups of 8 with query/document prompts, InfoNCE + KL distillation, Matryoshka 384/256/128/64
  (configs/retrieval/stage1-distill-mined-cpu.yaml)  ->  evaluate again, at each Matryoshka size

Mining: SNLI dev's (premise, entailment hypothesis) pairs, each premise's contradiction and neutral hypotheses its
first negatives, the rest mined among SNLI dev's entailment hypotheses. Evaluation: the
offline BEIR tasks of scripts/make_beir_sets.py (SNLI *test* premises retrieving their entailments among 9,639
hypotheses, STS-B dev sentence 1 retrieving sentence 2 among 1,467) and the STS tasks the development data holds
(STS12 and STS-B dev; the other five of the seven are not there). Nothing of SNLI test is trained on. Then the
step time in process (MiniLM, this CPU): groups of 8 against pairs, Matryoshka against without.
Results: ``benchmarks/results/retrieval_recipe.{json,md}`` (with --skip-jobs, ``retrieval_recipe_steps.{json,md}``).

  python benchmarks/retrieval_recipe.py [--max-rows 0] [--skip-jobs] [--baselines-from results.json] [--rotate]
                                        [--train-set KEY=VALUE ... --name NAME]

--baselines-from takes the student's and the teacher's rows from an earlier full run's JSON instead of evaluating
them again (about 19 of the run's 47 minutes here): the evaluation code and data must be those of that run.
--rotate rotates the student onto the principal axes of its embeddings of SNLI dev's sentences first
(ray_jobs/embed.py, ray_jobs/rotate.py), evaluates it so, and trains from it; results in
``retrieval_recipe_rotated.{json,md}``, without the step times.
--train-set KEY=VALUE (repeatable) runs a one-off variant: the training job gets ``--set KEY=VALUE`` after the
recipe's own settings, and the results (``--name NAME``) record it, without the step times.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import machine, write_results  # noqa: E402
from runtime.local_head import LocalHead, head_env  # noqa: E402
from scripts.demo import find_data_dir, submit  # noqa: E402
from scripts.make_beir_sets import make_sets  # noqa: E402

STUDENT, TEACHER = "pypi:all-minilm-l6-v2", "pypi:all-mpnet-base-v2"
MINE, SCORE = "configs/retrieval/mine-snli-minilm-cpu.yaml", "configs/annotate/groups-mpnet.yaml"
TRAIN = "configs/retrieval/stage1-distill-mined-cpu.yaml"
DIMS = [256, 128, 64]  # the student's whole embedding is 384
TASKS = ("snli-test", "stsb-dev")  # the folders make_sets writes by default, by name
STEP_QUERIES, TIMED_STEPS, OBJECTIVE_REPEATS = 32, 6, 30
MATRYOSHKA = ((384, 1.0), (256, 1.0), (128, 1.0), (64, 1.0))
STEP_SETTINGS = {"pairs": (1, ()), "groups of 8": (8, ()), "groups of 8, Matryoshka": (8, MATRYOSHKA)}  # group size, dims


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-rows", type=int, default=0, help="cap on SNLI dev rows read for mining (0: all)")
    parser.add_argument("--skip-jobs", action="store_true", help="only the in-process step timings (written to "
                        "retrieval_recipe_steps.{json,md}, beside the last full run's)")
    parser.add_argument("--baselines-from", type=Path, help="an earlier run's retrieval_recipe.json: its student and "
                        "teacher rows are reused, not evaluated again")
    parser.add_argument("--rotate", action="store_true", help="train from the student rotated onto its principal "
                        "axes (fit on SNLI dev's sentences), evaluated before training too; no step times")
    parser.add_argument("--train-set", action="append", default=[], metavar="KEY=VALUE",
                        help="a one-off variant: passed to the training job as --set KEY=VALUE after the recipe's own "
                        "(repeatable); recorded in the results, which then need --name")
    parser.add_argument("--name", help="the results' file name under benchmarks/results/ (default retrieval_recipe, "
                        "or retrieval_recipe_rotated with --rotate)")
    args = parser.parse_args()
    if args.train_set and not args.name:
        parser.error("--train-set is a variant of the recipe: give its results a --name of their own")
    bad = [s for s in args.train_set if "=" not in s]
    if bad:
        parser.error(f"--train-set takes KEY=VALUE, got {bad[0]!r}")
    earlier = _baselines(args.baselines_from) if args.baselines_from else None
    jobs = {} if args.skip_jobs else run_jobs(args.max_rows, earlier["results"] if earlier else None, args.rotate,
                                              args.train_set)
    if earlier:
        jobs["baselines_from"] = {"file": str(args.baselines_from), "machine": earlier.get("machine")}
    steps = {} if args.rotate or args.train_set else step_times()
    if args.skip_jobs:
        report_steps(steps)
        return
    report(jobs, steps, args.name or ("retrieval_recipe_rotated" if args.rotate else "retrieval_recipe"))


def _baselines(path: Path) -> dict:
    """An earlier full run's JSON, checked before any job runs: its student and teacher rows must cover every task
    and Matryoshka size this run reports, and be its own evaluations, not rows it reused in turn."""
    earlier = json.loads(path.read_text())
    results = earlier.get("results", {})
    if earlier.get("baselines_from"):
        raise SystemExit(f"{path}: its student and teacher rows were reused from {earlier['baselines_from']['file']}: "
                         "pass the run that evaluated them")
    missing = [name for name in ("teacher", "student", "student_dims") if name not in results]
    missing += [f"student_dims.{d}" for d in ["384", *map(str, DIMS)] if d not in results.get("student_dims", {})]
    scored = [("teacher", results.get("teacher", {}))] + [(f"student_dims.{d}", row) for d, row in
                                                         results.get("student_dims", {}).items()]
    missing += [f"{name}.{key}" for name, row in scored for key in (*TASKS, "sts_avg") if key not in row]
    if missing:
        raise SystemExit(f"{path} lacks {missing}: run the recipe without --baselines-from")
    return earlier


def run_jobs(max_rows: int, baselines: dict | None = None, rotate: bool = False, train_sets: list[str] = ()) -> dict:
    data = find_data_dir()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        env = head_env({"HF_HUB_OFFLINE": "1", "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}",
                        "RAOE_MLFLOW_ARTIFACTS": str(tmp / "artifacts"), "RAOE_CACHE": str(tmp / "cache")})
        beir = make_sets(data, tmp / "beir")
        evaluate = ["ray_jobs/evaluate.py", "--config", "configs/retrieval/evaluate.yaml",
                    "--set", f"eval.data_dir={data / 'senteval'}",
                    "--set", "eval.tasks=[STS12, STSBenchmark]", "--set", "eval.stsb_split=dev",
                    "--set", f"output_dir={tmp / 'eval'}",
                    "--set", f"eval.retrieval=[{', '.join(str(p) for p in beir.values())}]"]
        dims = ["--set", f"eval.dims=[{', '.join(map(str, DIMS))}]"]
        cap = ["--set", f"data.max_rows={max_rows}"] if max_rows else []
        out, seconds = {"tasks": list(beir), "baselines": baselines, "train_sets": list(train_sets)}, {}

        def timed(name, job_args):
            started = time.time()
            out[name] = submit(head, env, job_args)
            seconds[name] = time.time() - started

        with LocalHead(env) as head:
            if not baselines:
                timed("student", evaluate + dims + ["--set", f"model.source={STUDENT}"])
                timed("teacher", evaluate + ["--set", f"model.source={TEACHER}"])
            timed("mine", ["ray_jobs/mine_negatives.py", "--config", MINE, "--set", f"data.train={data / 'snli'}",
                           "--set", f"output_dir={tmp / 'mined'}", *cap])
            timed("score", ["ray_jobs/annotate.py", "--config", SCORE, "--set", f"data.train={tmp / 'mined' / 'data'}",
                            "--set", f"output_dir={tmp / 'scored'}"])
            start = STUDENT
            if rotate:  # the student's axes on SNLI dev's sentences (the training texts), then scored as it is
                timed("embed", ["ray_jobs/embed.py", "--config", "configs/embed/default.yaml", "--set",
                                f"data.train={data / 'snli'}", "--set", "data.split=dev", "--set", "embed.side=none",
                                "--set", f"output_dir={tmp / 'embedded'}", "--set", "embed.batch_size=128"])
                timed("rotate", ["ray_jobs/rotate.py", "--set", f"rotate.embeddings=[{tmp / 'embedded'}]",
                                 "--set", f"output_dir={tmp / 'rotated'}"])
                start = out["rotate"]["model_path"]
                timed("rotated", evaluate + dims + ["--set", f"model.source={start}"])
            timed("train", ["ray_jobs/stage1.py", "--config", TRAIN, "--set", f"data.train={tmp / 'scored' / 'data'}",
                            "--set", f"model.source={start}",
                            "--set", f"eval.data_dir={data / 'senteval'}", "--set", f"trainer.storage_path={tmp / 'runs'}",
                            "--set", f"output_dir={tmp / 'models'}", *[a for s in train_sets for a in ("--set", s)]])
            timed("trained", evaluate + dims + ["--set", f"model.source={out['train']['model_uri']}"])
        out["seconds"] = seconds
        return out


def step_times() -> dict:
    """The recipe's step on this CPU (MiniLM, 32 queries, one worker, no Ray) in each of STEP_SETTINGS: pairs
    (group_size 1: each query's positive, in-batch negatives only), groups of 8, and groups of 8 with Matryoshka at
    384/256/128/64. Seconds a step (the median of TIMED_STEPS after one untimed), Matryoshka's cost as the median of
    each round's ratio (so drift between rounds cancels), and the objective's forward and backward alone, the only
    part of the step that Matryoshka changes."""
    import numpy as np

    groups = _snli_groups(STEP_QUERIES * (TIMED_STEPS + 1))
    rows = {k: np.array(v + [None], dtype=object)[:-1] for k, v in groups.items()}
    times = _steps_in_turn({name: _step_runner(rows, *setting) for name, setting in STEP_SETTINGS.items()})
    ratios = [m / g for m, g in zip(times["groups of 8, Matryoshka"][1:], times["groups of 8"][1:])]
    return {"seconds": {name: float(np.median(t[1:])) for name, t in times.items()},
            "matryoshka_ratio": float(np.median(ratios)),
            "objective_ms": {name: 1000 * _objective_seconds(*setting) for name, setting in STEP_SETTINGS.items()}}


def _step_runner(rows: dict, group_size: int, dims: tuple):
    """(stepper, strategy, feed) of one setting, on its own copy of the student."""
    import torch

    from encoders.backbone import build_encoder
    from encoders.sources import resolve_model_source
    from jobconfig.schema import TrainerConfig
    from training.kinds import TRAINING_KINDS, BatchContext
    from training.plan import plan_steps
    from training.rows import InMemoryRows
    from training.step import Stepper
    from training.strategy import TorchStrategy

    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    kind = TRAINING_KINDS["groups"]
    model = build_encoder(resolve_model_source(STUDENT), max_length=48,
                          prompts={"query": "query: ", "document": "passage: "}).train()
    plan = plan_steps(len(rows["query"]), world=1, global_batch=STEP_QUERIES, max_steps=TIMED_STEPS + 1)
    strategy = TorchStrategy(model, TrainerConfig(lr=2e-5, global_batch_size=STEP_QUERIES), plan, 1)
    batches = BatchContext(strategy.module, model, torch.device("cpu"), length_buckets=2, sides=kind.sides,
                           group_size=group_size, fields=("teacher_scores",) if group_size > 1 else ())
    stepper = Stepper(plan, 42, kind, batches, strategy, _composite(group_size, dims), 0)
    return stepper, strategy, stepper.feed(InMemoryRows(rows), prefetch=False)


def _steps_in_turn(runners: dict) -> dict[str, list[float]]:
    """Seconds of each optimizer step, the settings taking one step each a round, each round starting one setting
    later (no setting always first or always after the same one), so this VM's drift falls on all alike."""
    names, times = list(runners), {name: [] for name in runners}
    for step in range(TIMED_STEPS + 1):
        for name in names[step % len(names):] + names[:step % len(names)]:
            stepper, strategy, feed = runners[name]
            started = time.perf_counter()
            stepper(feed, step)
            strategy.step()
            times[name].append(time.perf_counter() - started)
    for _, _, feed in runners.values():
        feed.close()
    return times


def _composite(group_size: int, dims: tuple):
    from objectives.composite import CompositeObjective

    weights = {"infonce": 1.0, "distill_kl": 1.0} if group_size > 1 else {"infonce": 1.0}
    return CompositeObjective(weights, {"distill_kl": {"tau": 0.05, "teacher_tau": 0.05}}, dims)


def _objective_seconds(group_size: int, dims: tuple) -> float:
    """Median seconds of the composite's forward and backward on a step's embeddings (32 queries, their positives
    and group_size - 1 negatives each, 384 dimensions, teacher scores with groups), random: the step's arithmetic."""
    import numpy as np
    import torch

    from objectives.composite import EmbeddingBatch

    composite, generator = _composite(group_size, dims), torch.Generator().manual_seed(0)
    negatives = STEP_QUERIES * (group_size - 1)
    times = []
    for _ in range(OBJECTIVE_REPEATS):
        fields = {"emb1": torch.randn(STEP_QUERIES, 384, generator=generator, requires_grad=True),
                  "emb2": torch.randn(STEP_QUERIES, 384, generator=generator, requires_grad=True),
                  "ids1": torch.arange(STEP_QUERIES), "ids2": torch.arange(STEP_QUERIES, 2 * STEP_QUERIES)}
        if negatives:
            fields |= {"emb_neg": torch.randn(negatives, 384, generator=generator, requires_grad=True),
                       "ids_neg": torch.arange(2 * STEP_QUERIES, 2 * STEP_QUERIES + negatives),
                       "teacher_scores": torch.rand(STEP_QUERIES, group_size, generator=generator)}
        started = time.perf_counter()
        share, _ = composite(EmbeddingBatch(**fields))
        share.backward()
        times.append(time.perf_counter() - started)
    return float(np.median(times))


def _snli_groups(count: int) -> dict[str, list]:
    """SNLI dev premises as query groups (their entailment the positive, the contradiction and neutral of other
    premises as negatives, cycled to 7), with made-up teacher scores: a step's shape, not its data."""
    snli = find_data_dir() / "snli"
    s1, s2, labels = ((snli / f"{name}.dev").read_text(encoding="utf-8").splitlines() for name in ("s1", "s2", "labels"))
    by_premise: dict[str, dict] = {}
    for a, b, label in zip(s1, s2, labels):
        group = by_premise.setdefault(a, {"positives": [], "negatives": []})
        group["positives" if label == "entailment" else "negatives"].append(b)
    chosen = [(q, g) for q, g in by_premise.items() if g["positives"] and g["negatives"]][:count]
    out = {"query": [], "positives": [], "negatives": [], "positive_scores": [], "negative_scores": []}
    for query, group in chosen:
        negatives = (group["negatives"] * 7)[:7]
        for key, value in (("query", query), ("positives", group["positives"]), ("negatives", negatives),
                           ("positive_scores", [0.8] * len(group["positives"])),
                           ("negative_scores", [0.3] * len(negatives))):
            out[key].append(value)
    return out


def report(jobs: dict, steps: dict, name: str = "retrieval_recipe") -> None:
    lines = ["# The retrieval recipe: query groups of 8, prompts, distillation from a teacher, Matryoshka", ""]
    payload = {"machine": machine(), "student": STUDENT, "teacher": TEACHER, **steps}
    if jobs:
        tasks = jobs["tasks"]
        table = _rows(jobs)
        payload |= {"results": table, "mining": {k: jobs["mine"][k] for k in (
            "rows_in", "pairs_in", "corpus_rows", "rows_written", "negatives_written", "rows_without_negative",
            "candidates_dropped_by_margin", "labelled_negatives_written")}, "training": jobs["train"]["metrics"],
            "job_seconds": jobs["seconds"]} | ({"baselines_from": jobs["baselines_from"]} if jobs.get("baselines_from")
                                          else {})
        if jobs.get("train_sets"):
            payload["train_sets"] = jobs["train_sets"]
        if "rotate" in jobs:
            payload["rotation"] = {k: jobs["rotate"][k] for k in ("rows", "variance_kept", "variance_kept_before")}
        snli = tasks[0]
        student, teacher = table["student"][snli]["ndcg@10"], table["teacher"][snli]["ndcg@10"]
        trained = table["trained"][snli]["ndcg@10"]
        closed = (trained - student) / (teacher - student) if teacher != student else float("nan")
        payload["gap_closed"] = closed
        lines += ["SNLI dev (premise -> entailment) query groups of 7 negatives each: the premise's own contradiction "
                  f"and neutral hypotheses first (mining.labelled_negatives), the rest mined by `{STUDENT}` among SNLI "
                  "dev's entailment hypotheses (top 30, relative margin 0.05 below the positive); `" + TEACHER
                  + "` scores every (premise, text) pair, and the student trains one epoch on groups of 8 (32 "
                  "premises a step) with query/document prompts, InfoNCE + KL distillation (teacher_tau 0.05) at "
                  "384/256/128/64 dimensions (Matryoshka). Evaluated on SNLI *test* and STS-B dev retrieval and STS "
                  "(the average of STS12 and STS-B dev Spearman: the development data holds no other of the 7 tasks), "
                  f"never trained on. {os.cpu_count()} CPUs, every job through `ray job submit` on a local head.", "",
                  "| model | dims | " + " | ".join(f"{t} nDCG@10 | {t} Recall@10" for t in tasks)
                  + " | STS avg (STS12, STS-B dev) |", "|---|---|" + "---|---|" * len(tasks) + "---|"]
        rotated = {"student, rotated": table["rotated_dims"]} if "rotated_dims" in table else {}
        for model, by_dim in {"student": table["student_dims"], **rotated, "trained": table["trained_dims"],
                              "teacher": {"768": table["teacher"]}}.items():
            for dim, scores in by_dim.items():
                cells = [f"{100 * scores[t]['ndcg@10']:.2f} | {100 * scores[t]['recall@10']:.2f}" for t in tasks]
                lines.append(f"| {model} | {dim} | " + " | ".join(cells) + f" | {scores['sts_avg']:.2f} |")
        m = payload["mining"]
        lines += ["", f"SNLI-test nDCG@10: student {100 * student:.2f}, trained {100 * trained:.2f}, teacher "
                  f"{100 * teacher:.2f}: {100 * closed:.0f}% of the student-teacher gap closed.", "",
                  f"Mining: {m['rows_in']:,} rows read, {m['pairs_in']:,} (query, positive) pairs, corpus "
                  f"{m['corpus_rows']:,} texts, {m['rows_written']:,} groups with {m['negatives_written']:,} negatives, "
                  f"{m['rows_without_negative']:,} pairs without a negative, {m['labelled_negatives_written']:,} "
                  "of the negatives labelled (the premise's own contradiction or neutral hypotheses). Training: "
                  f"{jobs['train']['metrics']['steps']} steps.", "",
                  "Seconds (each job's wall time through ray job submit): "
                  + ", ".join(f"{k} {v:.0f}" for k, v in jobs["seconds"].items()) + "."]
        if jobs.get("train_sets"):
            lines += ["", f"A one-off variant of the recipe: the training job ({TRAIN}) given "
                      + ", ".join(f"`--set {s}`" for s in jobs["train_sets"]) + " after the recipe's own settings."]
        if jobs.get("baselines_from"):
            lines += ["", "The student's and the teacher's rows are an earlier full run's (--baselines-from "
                      f"{jobs['baselines_from']['file']}), with the same evaluation code and data; that run's machine: "
                      f"{jobs['baselines_from']['machine']}."]
        if rotated:
            kept = jobs["rotate"]
            lines += ["", "Rotated: before training, the student was rotated onto the principal axes of its own "
                      f"embeddings of SNLI dev's {kept['rows']:,} distinct sentences (ray_jobs/embed.py, "
                      "ray_jobs/rotate.py), and trained from there. The share of the variance its first 128 of 384 "
                      f"dimensions hold: {100 * kept['variance_kept']['128']:.1f}% rotated, "
                      f"{100 * kept['variance_kept_before']['128']:.1f}% before."]
    if steps:
        lines += step_lines(steps)
    print(write_results(name, payload, "\n".join(lines) + "\n").read_text())


def report_steps(steps: dict) -> None:
    """--skip-jobs: the step times alone, beside the last full run's results."""
    lines = ["# The retrieval recipe's step time", *step_lines(steps)]
    payload = {"machine": machine(), "student": STUDENT, **steps}
    print(write_results("retrieval_recipe_steps", payload, "\n".join(lines) + "\n").read_text())


def step_lines(steps: dict) -> list[str]:
    """The step-time table and what Matryoshka costs, in the step and in the objective alone."""
    seconds, objective = steps["seconds"], steps["objective_ms"]
    lines = ["", f"Step time in process (MiniLM, {STEP_QUERIES} queries a step, one worker, this CPU; the settings "
             f"take their steps in turn, median of {TIMED_STEPS} rounds), and the objective's forward and backward "
             f"alone on a step's embeddings (median of {OBJECTIVE_REPEATS}):", "",
             "| step | seconds | against pairs | objective ms |", "|---|---|---|---|"]
    for name, value in seconds.items():
        lines.append(f"| {name} | {value:.2f} | {value / seconds['pairs']:.2f}x | {objective[name]:.1f} |")
    extra_ms = objective["groups of 8, Matryoshka"] - objective["groups of 8"]
    lines.append(f"\nMatryoshka costs {100 * (steps['matryoshka_ratio'] - 1):+.1f}% on the step of groups of 8 (the "
                 f"median of each round's ratio); the objective at four sizes takes {extra_ms:.1f} ms more than at "
                 f"one, {100 * extra_ms / 1000 / seconds['groups of 8']:.1f}% of that step. The rest of the step is the "
                 "encoder's passes, which Matryoshka does not change: what the ratio shows beyond the objective is "
                 "this machine's noise.")
    return lines


def _rows(jobs: dict) -> dict:
    """Per model and size: each task's metrics and the STS average (x100)."""
    def scored(result, dim=None):
        part = result if dim is None else result["dims"][str(dim)]
        sts = [v for k, v in part["metrics"].items() if k != "avg" and v is not None]
        return {**part["retrieval"], "sts_avg": sum(sts) / len(sts)}

    reused = jobs.get("baselines")
    table = {k: reused[k] for k in ("teacher", "student", "student_dims")} if reused else \
        {"teacher": scored(jobs["teacher"])}
    for name in [n for n in ("student", "rotated", "trained") if n in jobs and not (reused and n == "student")]:
        table[name] = scored(jobs[name])
        table[f"{name}_dims"] = {"384": table[name], **{str(d): scored(jobs[name], d) for d in DIMS}}
    return table


if __name__ == "__main__":
    main()
