"""Stage 2: continue from a Stage 1 model (model.init_from: a path or an MLflow URI such as models:/raoe-s1/3
or models:/raoe-s1@champion) on STS-B train with S = score / 5 and the rank-margin loss only, 10 epochs;
keep the best checkpoint by STS-B dev Spearman and register it as raoe-s2.

  python ray_jobs/stage2.py --config configs/stage2/minilm-stsb-cpu.yaml --set model.init_from=models:/raoe-s1/1
"""

import _bootstrap  # noqa: F401  (project on sys.path, safe Ray environment)
from jobconfig import parse_job_args
from jobconfig.schema import Stage2JobConfig
from runtime.result import run_job

if __name__ == "__main__":
    config = parse_job_args(Stage2JobConfig, __doc__)

    def main() -> dict:
        from training.run import run_training

        return run_training(config)

    run_job(main, "stage2")
