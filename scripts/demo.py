"""`make demo`: raoe's main path end to end on this machine, through `ray job submit` like a user would.

A local Ray head (127.0.0.1), a local MLflow store, the offline MiniLM student and teachers, SNLI dev+test and
STS from DATA_DIR (default ../shared/data):

  annotate (teachers score NLI pairs)  ->  evaluate student  ->  Stage 1  ->  evaluate S1
  ->  Stage 2 (from models:/raoe-s1/<v>)  ->  evaluate S2  ->  promote S1 and S2  ->  tables

Each evaluation scores STS and two offline retrieval tasks in the BEIR layout built from the same data
(scripts/make_beir_sets.py: SNLI test premises retrieving their entailments, STS-B dev sentence 1 retrieving
sentence 2 where the pair scores at least 4).

To finish in minutes on 2 cores it subsamples (SIZES below) and says so as it starts; each knob is an environment
variable, 0 takes all: DEMO_NLI_PAIRS pairs per SNLI split (a seeded sample) are annotated and train Stage 1,
DEMO_STSB_PAIRS of the 5,749 STS-B train pairs (seeded) train Stage 2, one epoch each at batch 64, Stage 2 at lr 2e-5
(configs/stage2/minilm-stsb-cpu.yaml: the paper's 5e-5 is for batch 512 and is unstable here), each on one worker in
the job's own process (trainer.num_workers=0: on one machine a Ray Train worker process adds start-up and nothing
the demo shows; the same training, docs/training.md#in-the-jobs-own-process); every STS task, and
STS-B dev during training, is scored on its first DEMO_EVAL_PAIRS pairs; each retrieval task is built from the first
DEMO_QUERIES queries of its split with every candidate of those queries as the corpus. The promotions score the
evaluations' suite, so they reuse what the evaluations measured. The full-size Stage 1 config is
configs/stage1/minilm-snli-cpu.yaml.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runtime.local_head import VENV_BIN, LocalHead, head_env  # noqa: E402
from scripts.make_beir_sets import make_sets  # noqa: E402

# What the demo subsamples to finish in about 10 minutes on 2 cores (environment variables; 0 takes all).
SIZES = {"DEMO_NLI_PAIRS": 300, "DEMO_STSB_PAIRS": 1000, "DEMO_EVAL_PAIRS": 300, "DEMO_QUERIES": 300}
TASKS = ["STS12", "STS13", "STS14", "STS15", "STS16", "STSBenchmark", "SICKRelatedness", "avg"]


def find_data_dir() -> Path:
    base = Path(os.environ.get("DATA_DIR", ROOT.parent / "shared" / "data")).resolve()
    if not (base / "senteval" / "STS").exists() or not (base / "snli").exists():
        sys.exit(f"demo: need {base}/senteval/STS and {base}/snli (SentEval layout, see ../shared/data/README.md); "
                 f"set DATA_DIR to such a folder")
    return base


def submit(head: LocalHead, env: dict[str, str], job_args: list[str]) -> dict:
    """`ray job submit --working-dir .` a job, stream its output, return its JSON result line."""
    runtime_env = {"env_vars": {k: env[k] for k in ("MLFLOW_TRACKING_URI", "RAOE_MLFLOW_ARTIFACTS", "HF_HUB_OFFLINE",
                                                    "RAOE_CACHE", "MLFLOW_DISABLE_TELEMETRY") if k in env}}
    print("$ ray job submit --working-dir . -- python " + " ".join(job_args), flush=True)
    result, tail = None, []
    for line in head.submit(["python", *job_args], runtime_env, cwd=ROOT):
        text = line.strip()
        tail = (tail + [text])[-40:]
        if text.startswith('{"job"'):
            result = json.loads(text)
        elif text.startswith(("[raoe]", "scoring", "encoding", "raoe-", "task", "STS", "SICK", "avg")) or \
                "[raoe]" in text:
            print("   " + text.split("[0m ")[-1], flush=True)
    if not result or result.get("status") != "ok":
        print("\n".join(tail), file=sys.stderr)
        sys.exit(f"demo: job {job_args[0]} failed: {result.get('error') if result else 'no result line'}")
    return result


def main() -> None:
    started = time.time()
    data = find_data_dir()
    sizes = {knob: int(os.environ.get(knob, default)) or None for knob, default in SIZES.items()}  # 0: all
    nli_pairs, stsb_pairs, eval_pairs, queries = sizes.values()
    out = (ROOT / "outputs" / "demo").resolve()
    shutil.rmtree(out, ignore_errors=True)
    env = head_env({"HF_HUB_OFFLINE": "1"})
    env.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{ROOT / 'mlflow.db'}")
    env.setdefault("RAOE_MLFLOW_ARTIFACTS", str(ROOT / "mlartifacts"))
    senteval = data / "senteval"
    beir = make_sets(data, out / "beir", queries=queries)  # absolute paths: jobs run in Ray's copy of the repo
    # the evaluations and the promotions score one suite (so promotion reuses what the evaluations measured),
    # with the whole machine for one encoder actor
    suite = ["--set", f"eval.data_dir={senteval}", "--set", "eval.stsb_split=dev", "--set", "eval.batch_size=128",
             "--set", f"eval.retrieval=[{', '.join(str(p) for p in beir.values())}]", "--set", "cpus_per_actor=2",
             *(["--set", f"eval.max_pairs={eval_pairs}"] if eval_pairs else [])]
    evaluate = ["ray_jobs/evaluate.py", "--config", "configs/evaluate/sts.yaml", *suite, "--set", f"output_dir={out}/eval"]
    print(f"demo: data {data}; subsampled (each knob: 0 takes all): {nli_pairs or 'all'} NLI pairs per SNLI split "
          f"(DEMO_NLI_PAIRS), {stsb_pairs or 'all'} STS-B train pairs (DEMO_STSB_PAIRS), the first "
          f"{eval_pairs or 'all'} pairs of each STS task and of STS-B dev in training (DEMO_EVAL_PAIRS), retrieval "
          f"tasks of the first {queries or 'all'} queries (DEMO_QUERIES); Stage 1 and 2 train on one worker in the "
          f"job's own process (trainer.num_workers=0)", flush=True)
    scores, steps = {}, [
        "annotate SNLI dev+test with the two teachers", "evaluate the student as shipped", "Stage 1 (RAOE)",
        "evaluate S1", "Stage 2 (STS-B)", "evaluate S2", "promote S1 and S2",
    ]

    began: list[float] = []  # when each step began, for the time table at the end

    def step(i: int) -> None:
        began.append(time.time())
        print(f"\n[demo {i}/{len(steps)}] {steps[i - 1]}  ({time.time() - started:.0f} s)", flush=True)

    with LocalHead(env) as head:
        print(f"demo: Ray head at {head.address} (127.0.0.1 only)", flush=True)
        step(1)
        annotated = submit(head, env, [
            "ray_jobs/annotate.py", "--config", "configs/annotate/snli-dev-test.yaml",
            "--set", f"data.train={data / 'snli'}", *(["--set", f"data.max_rows={nli_pairs}"] if nli_pairs else []),
            "--set", f"output_dir={out}/annotated", "--set", "tracking.run_name=demo-annotate",
            "--set", "data.shuffle_seed=0",
        ])
        step(2)
        scores["student (as shipped)"] = submit(head, env, evaluate + ["--set", "model.source=pypi:all-minilm-l6-v2"])
        step(3)
        common = ["--set", f"eval.data_dir={senteval}", "--set", f"trainer.storage_path={out}/runs",
                  "--set", f"output_dir={out}/models", "--set", "trainer.epochs=1", "--set", "trainer.global_batch_size=64",
                  "--set", "trainer.num_workers=0",
                  "--set", "trainer.eval_every=5", "--set", "data.shuffle_seed=0",
                  *(["--set", f"eval.max_pairs={eval_pairs}"] if eval_pairs else [])]
        s1 = submit(head, env, ["ray_jobs/stage1.py", "--config", "configs/stage1/minilm-snli-cpu.yaml",
                                "--set", f"data.train={annotated['output_path']}", *common])
        step(4)
        scores["S1 " + s1["model_uri"]] = submit(head, env, evaluate + ["--set", f"model.source={s1['model_uri']}"])
        step(5)
        subsample = ["--set", f"data.max_rows={stsb_pairs}"] if stsb_pairs else []
        s2 = submit(head, env, ["ray_jobs/stage2.py", "--config", "configs/stage2/minilm-stsb-cpu.yaml",
                                "--set", f"model.init_from={s1['model_uri']}", *subsample,
                                "--set", f"data.train={data / 'stsb' / 'stsb-en-train.csv'}", *common])
        step(6)
        scores["S2 " + s2["model_uri"]] = submit(head, env, evaluate + ["--set", f"model.source={s2['model_uri']}"])
        step(7)
        decisions = [submit(head, env, ["ray_jobs/promote.py", "--config", "configs/promote/sts.yaml",
                                        "--set", f"registered_model={r['registered_model']}",
                                        "--set", f"version={r['version']}", *suite])
                     for r in (s1, s2)]

    sampled = f"the first {eval_pairs} pairs of each task" if eval_pairs else "every pair"
    print(f"\nSTS Spearman x100 (SentEval 'all' on {sampled}; STSBenchmark = dev split; tasks without files are "
          f"absent)\n")
    widths = [max(8, len(t) + 2) for t in TASKS]
    print(f"{'model':<26}" + "".join(f"{t:>{w}}" for t, w in zip(TASKS, widths)))
    for name, result in scores.items():
        cells = [result["metrics"].get(t) for t in TASKS]
        print(f"{name:<26}" + "".join(f"{'-' if v is None else f'{v:.2f}':>{w}}" for v, w in zip(cells, widths)))
    student = scores["student (as shipped)"]["metrics"]
    for name, result in list(scores.items())[1:]:  # what moved: each trained model minus the student, per task
        cells = [None if result["metrics"].get(t) is None or student.get(t) is None
                 else result["metrics"][t] - student[t] for t in TASKS]
        label = name.split()[0] + " - student"
        print(f"{label:<26}" + "".join(f"{'-' if v is None else f'{v:+.2f}':>{w}}" for v, w in zip(cells, widths)))
    built = f"the first {queries} queries of each split, all their candidates" if queries else "each whole split"
    print(f"\nretrieval (exact search; x100; {built}): nDCG@10 / Recall@10\n")
    print(f"{'model':<26}" + "".join(f"{t:>24}" for t in beir))
    for name, result in scores.items():
        cells = [result["retrieval"][t] for t in beir]
        print(f"{name:<26}" + "".join(f"{100 * c['ndcg@10']:>14.2f} / {100 * c['recall@10']:>5.2f}" for c in cells))
    print(f"\nS1: {s1['metrics']['steps']} steps, best STS-B dev "
          f"{s1['metrics']['best_stsb_dev_spearman']:.2f}; S2: {s2['metrics']['steps']} steps, best "
          f"{s2['metrics']['best_stsb_dev_spearman']:.2f}")
    for d in decisions:
        print(f"promotion {d['registered_model']} v{d['candidate_version']}: "
              f"{'champion' if d['promote'] else 'challenger'} ({d['reason']})")
    print(f"\nMLflow: {env['MLFLOW_TRACKING_URI']}  (open with: {VENV_BIN / 'mlflow'} ui --backend-store-uri "
          f"{env['MLFLOW_TRACKING_URI']} --host 127.0.0.1)")
    ended = time.time()
    print("\nwhere the time went (each job from `ray job submit` to its result line):")
    names = ["build the retrieval sets, start the Ray head", *steps[:-1], steps[-1] + ", stop the head, tables"]
    for name, start, end in zip(names, [started, *began], [*began, ended]):
        print(f"  {end - start:6.0f} s  {name}")
    print(f"demo finished in {ended - started:.0f} s")


if __name__ == "__main__":
    main()
