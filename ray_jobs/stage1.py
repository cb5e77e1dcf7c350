"""Stage 1: train a sentence encoder on NLI pairs with their similarity S (the RAOE composite by default:
rank margin I=2 + gated angle, tau=20, global batch 512, 5 epochs, lr 5e-5, seed 42) on Ray Train, keep the
best checkpoint by STS-B dev Spearman, and register it in MLflow as raoe-s1.

  python ray_jobs/stage1.py --config configs/stage1/minilm-snli-cpu.yaml [--set trainer.num_workers=2 ...]
  ray job submit --working-dir . -- python ray_jobs/stage1.py --config configs/stage1/bert-base.yaml
"""

import _bootstrap  # noqa: F401  (project on sys.path, safe Ray environment)
from jobconfig import parse_job_args
from jobconfig.schema import TrainJobConfig
from runtime.result import run_job

if __name__ == "__main__":
    config = parse_job_args(TrainJobConfig, __doc__)

    def main() -> dict:
        from training.run import run_training

        return run_training(config)

    run_job(main, "stage1")
