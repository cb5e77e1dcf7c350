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


def gpu_benchmark_main(doc: str, name: str, prepare, measure, report) -> None:
    """The command line of a benchmark measured on a lent GPU machine without Ray: ``--prepare`` here (what must
    travel), ``--measure OUT`` there (``--tiny``: the same code on CPU at small sizes), ``--report OUT`` here."""
    import argparse

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prepare", action="store_true", help="write here what the GPU run reads")
    parser.add_argument("--measure", type=Path, metavar="OUT", help="measure on this machine (its GPU) into OUT")
    parser.add_argument("--report", type=Path, metavar="MEASURED", help=f"write results/{name}.* from a measurement")
    parser.add_argument("--tiny", action="store_true", help="with --measure: small sizes on CPU (a dry run)")
    args = parser.parse_args()
    if args.prepare:
        prepare()
    elif args.measure:
        measure(args.measure, args.tiny)
    elif args.report:
        report(args.report)
    else:
        parser.error("give --prepare, --measure OUT or --report MEASURED")
