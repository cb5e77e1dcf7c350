"""The export formats and whether this machine can write them: imported by job configs before anything heavy."""

from __future__ import annotations

import importlib.util

FORMATS = ("merged", "onnx", "onnx_int8", "openvino")
OPENVINO_PACKAGE = "openvino==2026.4.1"  # not a dependency of raoe: the openvino format needs it installed


def openvino_missing() -> str | None:
    """Why the ``openvino`` format cannot be written or run here (the package is not installed), or None."""
    if importlib.util.find_spec("openvino") is None:
        return f"the openvino format needs the openvino package: pip install {OPENVINO_PACKAGE}"
    return None


def runs_here(fmt: str, key: str) -> str:
    """``fmt`` when this machine can write and run it; else a ValueError naming the config ``key``."""
    if fmt == "openvino" and openvino_missing():
        raise ValueError(f"{key}: {openvino_missing()}")
    return fmt
