"""Every objective's name and hyperparameters with the papers' defaults, and the named presets: what a config is
validated against (jobconfig.schema), kept free of torch so validating a config, a Ray Data task that reads one
and a job's ``--help`` do not load it. objectives.composite adds what each objective computes."""

from __future__ import annotations

from typing import Any

DEFAULTS: dict[str, dict[str, Any]] = {
    "rank_margin": {"margin": 2.0, "tau": 20.0},
    "gated_angle": {"tau": 20.0},
    "cosent": {"tau": 20.0},
    "angle": {"tau": 20.0},
    "angle_ibn": {"tau": 20.0, "positive_threshold": 0.8},
    "infonce": {"tau": 0.05},
    "hince": {"tau1": 0.05, "tau2": 0.08},
    "listmle": {"omega": 0.5, "tau": 0.05},
    "relational": {"tau": 0.05},
}

# Named recipes from the papers; a config may use one of these instead of spelling out weights.
PRESETS: dict[str, dict[str, float]] = {
    "raoe": {"rank_margin": 1.0, "gated_angle": 1.0},
    "raoe_s2": {"rank_margin": 1.0},
    "angle": {"cosent": 1.0, "angle_ibn": 1.0, "angle": 1.0},
    "cosent": {"cosent": 1.0},
    "simcse": {"infonce": 1.0},
    "hince": {"hince": 1.0},
}
