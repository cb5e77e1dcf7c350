"""YAML + ``--set dotted.key=value`` -> a validated pydantic config, with errors that name the key.

Nothing here touches Ray or MLflow: a bad config is rejected before any resource is taken.
"""

from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    """Bad configuration; the message names every offending key."""


def _model_class(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel inside an annotation such as ``X``, ``X | None``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_class(arg)
        if found is not None:
            return found
    return None


def _is_mapping(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    return origin is dict or any(_is_mapping(a) for a in typing.get_args(annotation))


def _unknown_key(path: str, allowed: list[str]) -> ConfigError:
    parent, _, leaf = path.rpartition(".")
    close = difflib.get_close_matches(leaf, allowed, n=1)
    hint = f"; did you mean {(parent + '.' if parent else '') + close[0]!r}?" if close else ""
    return ConfigError(f"unknown key {path!r}{hint} allowed keys here: {', '.join(sorted(allowed))}")


def check_key(model: type[BaseModel], dotted: str) -> None:
    """Raise ConfigError if ``dotted`` is not a key of ``model`` (free-form mappings accept any sub-key)."""
    current: type[BaseModel] | None = model
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        fields = current.model_fields
        if part not in fields:
            raise _unknown_key(".".join(parts[: i + 1]), list(fields))
        annotation = fields[part].annotation
        if _is_mapping(annotation):
            return
        current = _model_class(annotation)
        if current is None:
            if i != len(parts) - 1:
                raise ConfigError(f"key {'.'.join(parts[: i + 1])!r} is a value, not a section; cannot set {dotted!r}")
            return


def parse_override(text: str) -> tuple[str, Any]:
    """``a.b=value`` -> ("a.b", value parsed as YAML: numbers, booleans, null, lists)."""
    if "=" not in text:
        raise ConfigError(f"--set expects key=value, got {text!r}")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"--set expects key=value, got {text!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def apply_override(data: dict[str, Any], dotted: str, value: Any) -> None:
    node = data
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {} if child is None else child
            if not isinstance(child, dict):
                raise ConfigError(f"cannot set {dotted!r}: {part!r} holds a value, not a section")
            node[part] = child
        node = child
    node[parts[-1]] = value


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"config file {str(path)!r} is not valid YAML{where}: {getattr(exc, 'problem', exc)}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of keys, not {type(data).__name__}")
    return data


def _describe_errors(model: type[BaseModel], exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            parent = err["loc"][:-1]
            section: Any = model
            for p in parent:
                if isinstance(p, int):  # an item of a list of sections (data.sources[0]): same section class
                    continue
                section = _model_class(section.model_fields[p].annotation) if section else None
            allowed = list(section.model_fields) if section else []
            lines.append(str(_unknown_key(key, allowed)))
        else:
            got = err.get("input")
            shown = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"{key}: {err['msg']}{shown}")
    return "invalid config:\n  " + "\n  ".join(lines)


def _defaults(model: type[BaseModel]) -> dict[str, Any]:
    """The defaults of every field that has one, as plain data."""
    data = {}
    for name, field in model.model_fields.items():
        if field.is_required():
            continue
        value = field.get_default(call_default_factory=True)
        data[name] = value.model_dump() if isinstance(value, BaseModel) else value
    return data


def _merge(model: type[BaseModel] | None, base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """YAML over defaults: sections merge key by key; a mapping-valued key (e.g. weights) is replaced whole."""
    out = dict(base)
    for key, value in update.items():
        field = model.model_fields.get(key) if model else None
        sub = _model_class(field.annotation) if field is not None and not _is_mapping(field.annotation) else None
        if sub is not None and isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(sub, out[key], value)
        else:
            out[key] = value
    return out


def load_config(model: type[M], path: str | Path | None = None, overrides: list[str] | None = None) -> M:
    """Defaults, then the YAML at ``path`` (optional), then ``--set`` overrides in order; validated into ``model``."""
    data = _merge(model, _defaults(model), read_yaml(path) if path else {})
    for text in overrides or []:
        key, value = parse_override(text)
        check_key(model, key)
        apply_override(data, key, value)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_describe_errors(model, exc)) from None


def describe_keys(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, help) for every leaf key, for ``--help``."""
    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        sub = _model_class(field.annotation)
        if sub is not None and not _is_mapping(field.annotation):
            rows.extend(describe_keys(sub, key + "."))
            continue
        type_name = _type_name(field.annotation)
        default = "required" if field.is_required() else repr(field.get_default(call_default_factory=True))
        rows.append((key, type_name, default, field.description or ""))
    return rows


def _type_name(annotation: Any) -> str:
    if typing.get_origin(annotation) is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(annotation))
    args = typing.get_args(annotation)
    if args and typing.get_origin(annotation) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " | ".join(_type_name(a) for a in args)
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation)).replace("typing.", "")
