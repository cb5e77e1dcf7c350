"""What every benchmark records: the machine it ran on, and where results go."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    import torch

    return {
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
    }


def write_results(name: str, payload: dict, markdown: str) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    path = RESULTS / f"{name}.md"
    path.write_text(markdown)
    return path
