"""The command line every job shares: ``--config PATH`` and repeatable ``--set key=value``."""

from __future__ import annotations

import argparse
import sys
from typing import TypeVar

from pydantic import BaseModel

from jobconfig.loader import ConfigError, describe_keys, load_config

M = TypeVar("M", bound=BaseModel)


def keys_help(model: type[BaseModel]) -> str:
    rows = describe_keys(model)
    width = max(len(r[0]) for r in rows)
    lines = ["config keys (set in YAML or with --set key=value):"]
    for key, type_name, default, text in rows:
        lines.append(f"  {key:<{width}}  {type_name}  [default {default}]" + (f"  {text}" if text else ""))
    return "\n".join(lines)


def parse_job_args(model: type[M], description: str, argv: list[str] | None = None) -> M:
    """Parse the job command line into a validated config; on bad config print the reason and exit 2."""
    parser = argparse.ArgumentParser(
        description=description,
        epilog=keys_help(model),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", metavar="PATH", help="YAML config file (see configs/)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config key by its dotted path, e.g. --set trainer.max_steps=10 (repeatable)",
    )
    args = parser.parse_args(argv)
    try:
        return load_config(model, args.config, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
