"""A job script run with its workers pausing after one step (training.faults.PauseAfterStep), for the fault tests:
a tiny step takes ~0.1 s, so a job would end before a fault aimed at a step (a killed driver, a stopped head) could
land; paused, the fault lands between two known steps on any machine.

  python tests/reliability/paused_job.py STEP SECONDS ray_jobs/stage1.py --config ... [--set ...]
"""

import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "ray_jobs")]

import runtime.local_ray  # noqa: E402,F401  (the job's safe local-Ray environment before anything imports ray)
import training.run  # noqa: E402
from training.faults import PauseAfterStep  # noqa: E402

step, seconds = int(sys.argv[1]), float(sys.argv[2])
sys.argv = sys.argv[3:]
train = training.run.run_training
training.run.run_training = lambda cfg, **kw: train(cfg, after_step=(PauseAfterStep(step, seconds),), **kw)
runpy.run_path(sys.argv[0], run_name="__main__")
