"""Unsupervised sentence embeddings on a sentence corpus (Wiki1M-style: one sentence per line, JSON lines with
`text`, Parquet, hf:<dataset>, or the sentences of a SentEval NLI folder): SimCSE (each sentence twice through
the encoder, dropout makes the positive; InfoNCE) or, with `objective.weights={hince: 1}` on a corpus with a
`negative` column from ray_jobs/generate_san.py, SimCSE+SAN (Hierarchical InfoNCE, the aligned negatives encoded
at dropout model.negative_dropout = p2). Same Ray Train loop, checkpoints and MLflow registry as Stage 1/2;
registered as raoe-unsup.

  python ray_jobs/unsupervised.py --config configs/unsupervised/minilm-snli-simcse-cpu.yaml
  python ray_jobs/unsupervised.py --config configs/tiny/unsupervised.yaml --set objective.weights="{hince: 1.0}"
"""

import _bootstrap  # noqa: F401  (project on sys.path, safe Ray environment)
from jobconfig import parse_job_args
from jobconfig.schema import UnsupervisedJobConfig
from runtime.result import run_job

if __name__ == "__main__":
    config = parse_job_args(UnsupervisedJobConfig, __doc__)

    def main() -> dict:
        from training.run import run_training

        return run_training(config)

    run_job(main, "unsupervised")
