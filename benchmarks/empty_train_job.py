"""An empty training job, submitted by benchmarks/startup.py as raoe's jobs are: the job's Ray session, then Ray Train
with raoe's own trainer (training.run._ray_trainer: its process group, the same worker env) on one 1-CPU worker whose
loop only prints the lines the benchmark times. What it takes to its "first step" is Ray Train's floor on this head:
the controller and worker processes, no model, no corpus, none of raoe's loop.

  python benchmarks/empty_train_job.py
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def empty_loop(config: dict) -> None:
    print("[raoe] 1 worker(s) ready (an empty loop: nothing imported, loaded or mapped)", flush=True)
    print("[raoe] step 1/1 (nothing trained)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", action="append", default=[], help="accepted and ignored: the benchmark passes raoe "
                        "jobs' keys (run name, output folders) to every job it submits")
    parser.parse_args()
    started = time.time()
    import ray.train

    from runtime.local_ray import ray_session
    from training.process_group import ProcessGroupConfig
    from training.run import _ray_trainer, _worker_env

    with ray_session(), tempfile.TemporaryDirectory() as tmp:
        print("[raoe] stage0: 0 rows (an empty Ray Train run)", flush=True)
        trainer = _ray_trainer(
            empty_loop, train_loop_config={}, backend_config=ProcessGroupConfig(backend="gloo"),
            scaling_config=ray.train.ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1}),
            run_config=ray.train.RunConfig(name=f"empty-{int(started)}", storage_path=tmp,
                                           worker_runtime_env={"env_vars": _worker_env()}))
        trainer.fit()
    print(f"[raoe] empty run done in {time.time() - started:.1f} s", flush=True)


if __name__ == "__main__":
    main()
