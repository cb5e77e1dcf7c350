"""The SAN paper's training configs keep SimCSE's positive dropout p = 0.1: Appendix C re-trains each base method with
its own settings and tunes only tau2 and p2 (the negatives' dropout)."""

from pathlib import Path

import pytest

from jobconfig import load_config
from jobconfig.schema import UnsupervisedJobConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["bert-base-wiki1m-san.yaml", "minilm-snli-san-cpu.yaml"])
def test_san_configs_keep_simcse_positive_dropout(name):
    cfg = load_config(UnsupervisedJobConfig, ROOT / "configs" / "unsupervised" / name)
    assert cfg.model.dropout == 0.1 and cfg.model.negative_dropout == 0.2


def test_hince_grid_tunes_only_tau2_and_p2(monkeypatch):
    from tuning.sweep import SweepSpec, grid_points, trial_config

    monkeypatch.chdir(ROOT)  # base_config is relative to the repository root
    spec = load_config(SweepSpec, ROOT / "configs" / "sweeps" / "hince-bert-base.yaml")
    assert set(spec.grid) == {"objective.hince.tau2", "model.negative_dropout"}
    for point in grid_points(spec.grid):
        assert trial_config(spec, point, "check", "/tmp/raoe-check").model.dropout == 0.1
