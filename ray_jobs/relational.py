"""RSE, relational sentence embeddings (rse.txt): an encoder plus a learned vector per relation, trained so that
cos(h_head + r, h_tail) / tau beats the other tails of the global batch and in-relation hard negatives (Eq. 1-2).
Triples from JSON lines / Parquet / hf: rows {head, tail, relation, negative?}, NLI pairs (entailment, contradiction
as the hard negative) and sentence corpora (same-sent), mixed with data.sources, capped and weighted per relation.
STS-B dev selects checkpoints with eval.relation_weights; the held-out triples (data.heldout per relation) give
relation prediction (MRR, Hits@1/3/10) and the relation vectors a cosine plot. The exported folder loads with
SentenceTransformer(path) and with encoders.relational.RelationalEncoder(path) for relation scores; registered as
raoe-rse.

  python ray_jobs/relational.py --config configs/tiny/relational.yaml
  python ray_jobs/relational.py --config configs/relational/minilm-snli-cpu.yaml
"""

import _bootstrap  # noqa: F401  (project on sys.path, safe Ray environment)
from jobconfig import parse_job_args
from jobconfig.schema import RelationalJobConfig
from runtime.result import run_job

if __name__ == "__main__":
    config = parse_job_args(RelationalJobConfig, __doc__)

    def main() -> dict:
        from training.run import run_training

        return run_training(config)

    run_job(main, "relational")
