"""The fault matrix: every fault raoe must survive, injected from outside the code under test, with what raoe did,
steps lost, data lost and time to recover, measured here. Runs the long variants (pytest marker ``reliability``,
tests/reliability/) and the fault tests that ``make test`` runs, and writes benchmarks/results/reliability.md.

  python benchmarks/reliability.py

A benchmark, not a test: about 15 minutes here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
IN_SUITE = {  # fault tests that make test runs: what each injects and what raoe does
    "tests/training/test_exact_resume.py": (
        "a Ray Train worker SIGKILLed mid-run (2 workers, DDP; ZeRO-2 among the long variants; max_failures=2)",
        "the worker group restarts from the last checkpoint; every step's loss and the final weights equal an "
        "uninterrupted run (bit for bit)", "steps since the last checkpoint (<= eval_every)", "none"),
    "tests/training/test_recovery_and_registry.py": (
        "the latest checkpoint's weights truncated on disk, then the run resubmitted",
        "the checkpoint fails its manifest and is passed over (said in the log); resumed from the one before, "
        "the replayed step equal", "one checkpoint interval more", "none"),
    "tests/foundation/test_tracking_outage.py": (
        "a real mlflow server stopped and restarted between metric logs; an unreachable server at start",
        "metrics buffered and written on return, the outage tagged on the run; at start: a ConnectionError "
        "naming the URI before any Ray resource", "0", "none"),
    "tests/evaluation/test_concurrent_registry.py": (
        "two processes registering the same model at once, then two promoting at once",
        "distinct versions, all loadable; the champion alias ends on the better version (a promotion re-decides "
        "when the champion moved meanwhile)", "0", "none"),
    "tests/foundation/test_local_head.py": (
        "the cluster (its head stopped) after a job submitted with ray job submit --working-dir .",
        "outputs, checkpoints and registered artifacts live outside Ray's scratch copy; the registered model "
        "loads after the head is stopped", "0", "none"),
}


def pytest_run(args: list[str], junit: Path, env: dict[str, str]) -> dict[str, tuple[str, float]]:
    # -n 0: one process, as the figures were measured (make test's two xdist workers would share the 2 cores)
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", f"--junitxml={junit}", *args], cwd=ROOT, env=env)
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        failed = case.find("failure") is not None or case.find("error") is not None
        skipped = case.find("skipped") is not None
        out[f"{case.get('classname')}::{case.get('name')}"] = (
            "failed" if failed else "skipped" if skipped else "passed", float(case.get("time", 0)))
    return out


def main() -> None:
    from benchmarks.common import machine, write_results

    with tempfile.TemporaryDirectory() as tmp:
        records = Path(tmp) / "records.jsonl"
        env = {**os.environ, "RAOE_RELIABILITY_OUT": str(records), "HF_HUB_OFFLINE": "1"}
        long = pytest_run(["-m", "reliability", "tests/reliability", "tests/training/test_exact_resume.py"],
                          Path(tmp) / "long.xml", env)
        suite = pytest_run(list(IN_SUITE), Path(tmp) / "suite.xml", env)
        measured = [json.loads(x) for x in records.read_text().splitlines()] if records.exists() else []
    lines = ["# Reliability: the fault matrix", "", f"Machine: {machine()}.", "",
             "Long variants (tests/reliability, marker `reliability`): one tiny Stage 1 job (64 pairs, 8 steps of 16, "
             "a checkpoint every 2 steps, dropout 0.1) run as a user runs it; its end state compared with an "
             "uninterrupted run of the same job (same last loss to 1e-6).", "",
             "| fault | what raoe did | steps replayed | data lost | time to recover |", "|---|---|---|---|---|"]
    for m in measured:
        seconds = m.get("resubmit_seconds")
        recover = (f"{seconds:.0f} s resubmission to done (uninterrupted run {m['uninterrupted_seconds']:.0f} s)"
                   if seconds is not None else f"outage {m['outage_seconds']:.0f} s; run continued")
        did = m.get("did") or ("resumed from its checkpoint" if m["steps_replayed"] else "trained on without a restart")
        lines.append(f"| {m['fault']} | {did}; last loss {m['final_loss']:.6f} = uninterrupted "
                     f"{m['reference_loss']:.6f} | {m['steps_replayed']} | {m['data_lost']} | {recover} |")
    lines += ["", "Status of each long variant: " + ", ".join(f"{k.split('::')[-1]} {v[0]} ({v[1]:.0f} s)"
                                                          for k, v in long.items()), "",
              "Faults in `make test`:", "", "| fault | what raoe did | steps lost | data lost | test (status, time) |",
              "|---|---|---|---|---|"]
    for path, (fault, did, steps, data) in IN_SUITE.items():
        module = path.removesuffix(".py").replace("/", ".")
        cases = {k: v for k, v in suite.items() if k.startswith(module)}
        status = ", ".join(sorted({v[0] for v in cases.values()})) or "not run"
        lines.append(f"| {fault} | {did} | {steps} | {data} | `{Path(path).name}` ({status}, "
                     f"{sum(v[1] for v in cases.values()):.0f} s) |")
    lines += ["", "Also in `make test`: DeepSpeed checkpoints of ZeRO 0-3 load with torch.load(weights_only=True) and "
              "a checkpoint carrying a code-running object is refused (`test_checkpoints.py`); bad rows of every "
              "corpus kind named or quarantined (`test_bad_rows.py`); no secret reaches MLflow or the job output "
              "(`test_secrets.py`, `test_local_head.py`).", ""]
    md = "\n".join(lines)
    path = write_results("reliability", {"machine": machine(), "long": long, "suite": suite, "measured": measured}, md)
    print(md)
    print(json.dumps({"benchmark": "reliability", "results": str(path)}))


if __name__ == "__main__":
    main()
