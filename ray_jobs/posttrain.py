"""ListMLE post-training on ranked sentence lists (ranking-sentences paper, Eq. 5-8): for every list, the student's
cosine matrix divided by objective.listmle.tau is ranked row by row by the refined targets (omega) of a teacher's
similarity matrix (posttrain.teacher; default the start model, frozen). Lists from ray_jobs/generate_lists.py or any
JSON lines file of {"sentences": [seed, x1, x2, ...]}. Same Ray Train loop, checkpoints and registry as the other
training jobs; registered as raoe-lists.

  python ray_jobs/posttrain.py --config configs/tiny/posttrain.yaml
  python ray_jobs/posttrain.py --config configs/posttrain/minilm-lists-cpu.yaml \
      --set model.init_from=models:/raoe-s1@champion
"""

import _bootstrap  # noqa: F401  (project on sys.path, safe Ray environment)
from jobconfig import parse_job_args
from jobconfig.schema import PosttrainJobConfig
from runtime.result import run_job

if __name__ == "__main__":
    config = parse_job_args(PosttrainJobConfig, __doc__)

    def main() -> dict:
        from training.run import run_training

        return run_training(config)

    run_job(main, "posttrain")
