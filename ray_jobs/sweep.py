"""Grid-search training hyperparameters with Ray Tune (each trial a Ray Train run of Stage 1 or 2), select by
STS-B dev Spearman, log the sweep to MLflow (parent run, one child run per trial, table and heat map), register
the best trial's model. Rerunning the same sweep name resumes it (finished trials are not rerun).

  python ray_jobs/sweep.py --config configs/sweeps/raoe-bert-base.yaml
  ray job submit --working-dir . -- python ray_jobs/sweep.py --config configs/tiny/sweep.yaml
"""

import _bootstrap  # noqa: F401  (project on sys.path, safe Ray environment)
from jobconfig import parse_job_args
from runtime.result import run_job
from tuning.sweep import SweepSpec

if __name__ == "__main__":
    import sys

    spec = parse_job_args(SweepSpec, __doc__)
    spec_path = sys.argv[sys.argv.index("--config") + 1] if "--config" in sys.argv else None

    def main() -> dict:
        from tuning.sweep import run_sweep

        result = run_sweep(spec, spec_path)
        print(f"{'trial':<40}{'dev Spearman':>14}")
        for row in result["trials"]:
            name = ", ".join(f"{k.split('.')[-1]}={row[k]}" for k in spec.grid)
            value = row["best_stsb_dev_spearman"]
            print(f"{name:<40}{'-' if value is None else f'{value:.2f}':>14}")
        print(f"best: {result['best_config']} -> {result['best_metric']}")
        return result

    run_job(main, "sweep")
