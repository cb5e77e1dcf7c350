"""The config system of every job: YAML under configs/, ``--set`` overrides, pydantic validation."""

from jobconfig.cli import parse_job_args
from jobconfig.loader import ConfigError, load_config

__all__ = ["ConfigError", "load_config", "parse_job_args"]
