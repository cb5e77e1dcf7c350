"""Job start-up: seconds from `ray job submit` to the first optimizer step, on a local Ray head started here.

  python benchmarks/startup.py [--quick] [--tree PATH --label before] [--repeats 2]

Each job is submitted --repeats + 1 times to one head (`ray start --head`, loopback): the first submission is
"cold" (a new head: no cached working dir, no worker processes, Ray Data's actors not yet started), the others are
"warm" (the best of them counts: this VM's speed drifts). Jobs:

  tiny     Stage 1, configs/tiny/stage1.yaml (a tiny random BERT, 128 NLI pairs)
  student  Stage 2 on STS-B train from the offline MiniLM student (configs/stage2/minilm-stsb-cpu.yaml), 256 pairs

and each again with trainer.num_workers=0 ("in process": the job's own process trains, Ray Train's local mode, no
worker group to start; --no-in-process leaves them out), and

  empty    benchmarks/empty_train_job.py: the job's Ray session and Ray Train with raoe's trainer on one worker whose
           loop only prints the timed lines (Ray Train's floor on this head: no model, corpus or loop)

The time to the first step is cut at lines every version of raoe prints (so a checkout of an older commit, --tree,
is measured the same way): the driver's "[raoe] <stage>: N pairs" line (job started, config checked, corpus read,
validated and ordered), Ray Train's "Started training worker group" (controller and worker processes up), the
workers' "[raoe] N worker(s)" line (imports, model loaded, corpus rows mapped, every worker ready) and
"[raoe] step 1/"; the whole job ends at its JSON result line. A version that reports its own start-up (the JSON
line's "startup") adds that finer breakdown.
Results: benchmarks/results/startup.{json,md}; a --label other than "after" writes startup_<label>.json, which the
"after" run puts beside its own numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DATA = Path(os.environ.get("RAOE_DEV_DATA", ROOT.parent / "shared" / "data"))
STSB = DATA / "stsb" / "stsb-en-train.csv"

MILESTONES = (  # (name, pattern of the line that ends it), in the order they appear
    ("driver", re.compile(r"\[raoe\] stage\d: \d+ ")),
    ("worker_group", re.compile(r"Started training worker group|training in this process")),
    ("worker_setup", re.compile(r"\[raoe\] \d+ worker\(s\)")),
    ("first_step", re.compile(r"\[raoe\] step 1/")),
)


def jobs(workdir: Path, tree: Path) -> dict[str, list[str]]:
    tiny = ["python", "ray_jobs/stage1.py", "--config", "configs/tiny/stage1.yaml", "--set", "trainer.max_steps=2",
            "--set", f"eval.data_dir={workdir / 'none'}", "--set", "data.cache=false"]
    student = ["python", "ray_jobs/stage2.py", "--config", "configs/stage2/minilm-stsb-cpu.yaml",
               "--set", "model.init_from=pypi:all-minilm-l6-v2", "--set", f"data.train={STSB}",
               "--set", "data.max_rows=256", "--set", "trainer.max_steps=2", "--set", "trainer.global_batch_size=64",
               "--set", f"eval.data_dir={workdir / 'none'}", "--set", "data.cache=false"]
    empty = {"empty": ["python", "benchmarks/empty_train_job.py"]} if (tree / "benchmarks" / "empty_train_job.py"
                                                                        ).exists() else {}  # not in older trees
    return {"tiny": tiny, "student": student, **in_process_jobs(tiny, student), **empty}


def in_process_jobs(tiny: list[str], student: list[str]) -> dict[str, list[str]]:
    return {f"{name} in process": [*job, "--set", "trainer.num_workers=0"]
            for name, job in (("tiny", tiny), ("student", student))}


def submit_once(head, job: list[str], workdir: Path, name: str, tree: Path) -> dict:
    """One submission: seconds from the submit call to each milestone line, and the job's own breakdown."""
    runtime_env = {"env_vars": {"MLFLOW_TRACKING_URI": f"sqlite:///{workdir / 'startup.db'}",
                                "RAOE_MLFLOW_ARTIFACTS": str(workdir / "artifacts"), "HF_HUB_OFFLINE": "1"}}
    args = [*job, "--set", f"tracking.run_name={name}", "--set", f"trainer.storage_path={workdir / 'runs'}",
            "--set", f"output_dir={workdir / 'models'}"]
    start, seen, result, tail = time.perf_counter(), {}, None, []
    for line in head.submit(args, runtime_env, cwd=tree):
        now = time.perf_counter() - start
        tail = (tail + [line.rstrip()])[-30:]
        for milestone, pattern in MILESTONES:
            if milestone not in seen and pattern.search(line):
                seen[milestone] = now
        if line.strip().startswith('{"job"'):
            result = json.loads(line.strip())
            seen["result"] = now
    if head.returncode != 0 or "first_step" not in seen:
        print("\n".join(tail), file=sys.stderr)
        raise RuntimeError(f"submitted job {name} failed or never reached its first step")
    phases, last = {}, 0.0
    for milestone, _ in MILESTONES:  # each phase from the previous milestone seen
        if milestone in seen:
            phases[milestone] = round(seen[milestone] - last, 2)
            last = seen[milestone]
    return {"to_first_step_s": round(seen["first_step"], 2), "phases_s": phases,
            "to_result_s": round(seen["result"], 2) if "result" in seen else None,
            "job_breakdown_s": (result or {}).get("startup")}


def measure(tree: Path, repeats: int, in_process: bool = True, only: set[str] | None = None) -> dict:
    from runtime.local_head import LocalHead, head_env

    out = {}
    with tempfile.TemporaryDirectory() as tmp, LocalHead(head_env()) as head:
        workdir = Path(tmp)
        for label, job in jobs(workdir, tree).items():
            if (label.endswith("in process") and not in_process) or (only and label not in only):
                continue
            runs = []
            for attempt in range(repeats + 1):
                print(f"[bench] {label} submission {attempt + 1}/{repeats + 1} ...", flush=True)
                runs.append(submit_once(head, job, workdir, f"{label}-{attempt}", tree))
                print(f"[bench] {label}: {runs[-1]}", flush=True)
            warm = min(runs[1:], key=lambda r: r["to_first_step_s"])
            out[label] = {"cold": runs[0], "warm": warm, "warm_runs_s": [r["to_first_step_s"] for r in runs[1:]]}
    return out


def _seconds(value: float | None) -> str:
    return f"{value:.1f} s" if value is not None else "not timed"


def markdown(after: dict, before: dict | None, machine: dict) -> str:
    goals = {"tiny": 15.0, "tiny in process": 15.0, "student": 20.0, "student in process": 20.0, "empty": None}
    lines = ["# Job start-up: `ray job submit` to the first optimizer step", "",
             f"Machine: {machine}. A local head (`ray start --head`, 2 CPUs, loopback); cold = the head's first "
             "submission, warm = the best later one. Phases end at lines every version prints (see the script).", "",
             "| job | | cold | warm | driver | worker group | worker set-up | first step | goal (warm) | whole job (warm) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for label, goal in goals.items():
        for name, data in (("before", (before or {}).get(label)), ("after", after.get(label))):
            if not data:
                continue
            p = data["warm"]["phases_s"]
            lines.append(f"| {label} | {name} | {data['cold']['to_first_step_s']:.1f} s | "
                         f"{data['warm']['to_first_step_s']:.1f} s | {p.get('driver', 0):.1f} | "
                         f"{p.get('worker_group', 0):.1f} | {p.get('worker_setup', 0):.1f} | "
                         f"{p.get('first_step', 0):.1f} | {f'<= {goal:g} s' if goal else 'none: the floor'} | "
                         f"{_seconds(data['warm'].get('to_result_s'))} |")
    lines += ["", "in process: the same job with `trainer.num_workers=0` (the job's own process trains, Ray Train's local "
              "mode: no controller or worker process to start); its 'worker group' phase ends at its 'training in this "
              "process' line. empty: `benchmarks/empty_train_job.py`, Ray Train with raoe's trainer on one worker "
              "whose loop only prints the timed lines: what a Ray Train job costs on this head before any of raoe's "
              "work.", ""]
    for label in goals:
        breakdown = (after.get(label) or {}).get("warm", {}).get("job_breakdown_s")
        if breakdown:
            lines.append(f"{label}, warm, as the job reports it (s): "
                         + ", ".join(f"{k} {v:.2f}" for k, v in breakdown.items()) + ".")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose jobs are submitted (default: this)")
    parser.add_argument("--label", default="after", help="'after' writes startup.{json,md}; others startup_<label>.json")
    parser.add_argument("--repeats", type=int, default=2, help="warm submissions per job (the best counts)")
    parser.add_argument("--quick", action="store_true", help="one warm submission per job")
    parser.add_argument("--no-in-process", action="store_true", help="leave out the trainer.num_workers=0 jobs (a "
                        "tree from before they existed)")
    parser.add_argument("--only", default="", help="comma-separated jobs to submit (e.g. 'tiny,empty'; default: all)")
    args = parser.parse_args()
    only = {name.strip() for name in args.only.split(",") if name.strip()}
    if not STSB.exists():
        sys.exit(f"needs STS-B train at {STSB} (set RAOE_DEV_DATA)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from benchmarks.common import RESULTS, machine, write_results

    results = measure(args.tree.resolve(), 1 if args.quick else args.repeats, not args.no_in_process, only)
    if args.label != "after":
        RESULTS.mkdir(parents=True, exist_ok=True)
        path = RESULTS / f"startup_{args.label}.json"
        path.write_text(json.dumps({"machine": machine(), "tree": str(args.tree), **results}, indent=2) + "\n")
        print(json.dumps({"benchmark": "startup", "label": args.label, "results": str(path), **results}))
        return
    before_file = RESULTS / "startup_before.json"
    before = json.loads(before_file.read_text()) if before_file.exists() else None
    md = markdown(results, before, machine())
    path = write_results("startup", {"machine": machine(), "before": before, "after": results}, md)
    print(md)
    print(json.dumps({"benchmark": "startup", "results": str(path), **results}))


if __name__ == "__main__":
    main()
