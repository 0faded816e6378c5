"""Service configuration: a dataclass of sections, read from TOML, then
overridden from the environment.

A service config is a dataclass whose fields are section dataclasses
(``[server]``, ``[model]`` ...) holding scalars. ``PREFIX_SECTION_KEY`` in the
environment overrides ``[section] key`` (``INFERMESH_WORKER_MODEL_PATH``).
Every error names the file or variable and the key at fault.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class ConfigError(ValueError):
    """A configuration file or variable an operator must fix."""


def load_config(
    cls: type[T], path: str | Path | None, env_prefix: str, environ: Mapping[str, str] | None = None
) -> T:
    """Builds ``cls`` from defaults, then the TOML file at ``path``, then the environment."""
    environ = os.environ if environ is None else environ
    sections: dict[str, dict[str, Any]] = {}
    if path is not None:
        sections = _read_toml(Path(path))
    hints = typing.get_type_hints(cls)
    unknown = set(sections) - set(hints)
    if unknown:
        raise ConfigError(
            f"{path}: unknown section [{sorted(unknown)[0]}]; known: {', '.join(sorted(hints))}"
        )
    built = {}
    for name, section_cls in hints.items():
        origin = f"{path}: [{name}]"
        values = sections.get(name, {})
        if not isinstance(values, dict):
            raise ConfigError(f"{origin}: expected a table")
        built[name] = _build_section(
            section_cls, values, origin, f"{env_prefix}_{name}".upper(), environ
        )
    return cls(**built)


def env_names(cls: type, env_prefix: str) -> set[str]:
    """Every environment variable that overrides a key of ``cls``."""
    return {
        f"{env_prefix}_{name}_{key}".upper()
        for name, section_cls in typing.get_type_hints(cls).items()
        for key in typing.get_type_hints(section_cls)
    }


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None


def _build_section(
    cls: type, values: dict[str, Any], origin: str, env_prefix: str, environ: Mapping[str, str]
) -> Any:
    _check_renamed(cls, values, origin, env_prefix, environ)
    hints = typing.get_type_hints(cls)
    unknown = set(values) - set(hints)
    if unknown:
        raise ConfigError(
            f"{origin} {sorted(unknown)[0]}: unknown key; known: {', '.join(sorted(hints))}"
        )
    kwargs = {}
    for key, hint in hints.items():
        env_name = f"{env_prefix}_{key}".upper()
        if env_name in environ:
            kwargs[key] = _from_env(environ[env_name], hint, env_name)
        elif key in values:
            kwargs[key] = _check_type(values[key], hint, f"{origin} {key}")
    try:
        return cls(**kwargs)
    except ValueError as e:  # a section's __post_init__ rejecting a value
        raise ConfigError(f"{origin}: {e}") from None


def _scalar_type(hint: Any) -> tuple[type, bool]:
    """(type, optional) for hints such as ``int``, ``str | None``, ``list[str]``."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return args[0], True
    return hint, False


def _check_type(value: Any, hint: Any, where: str) -> Any:
    typ, optional = _scalar_type(hint)
    if value is None and optional:
        return None
    if typing.get_origin(typ) is typing.Literal:
        return _check_choice(value, typ, where)
    if typing.get_origin(typ) is list:
        item = _list_item(typ)
        if isinstance(value, list) and all(_is_a(v, item) for v in value):
            return value
        raise ConfigError(f"{where}: expected a list of {item.__name__}s, got {value!r}")
    if typing.get_origin(typ) is dict:
        if isinstance(value, dict):
            return value
        raise ConfigError(f"{where}: expected a table, got {value!r}")
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if _is_a(value, typ):
        return value
    raise ConfigError(f"{where}: expected {typ.__name__}, got {type(value).__name__} {value!r}")


def _list_item(hint: Any) -> type:
    """The item type of a ``list[str]`` or ``list[int]`` hint."""
    item: type = typing.get_args(hint)[0]
    return item


def _is_a(value: Any, typ: type) -> bool:
    """isinstance, except that a bool is no int."""
    return isinstance(value, typ) and not (typ is int and isinstance(value, bool))


def _from_env(raw: str, hint: Any, where: str) -> Any:
    typ, optional = _scalar_type(hint)
    if optional and raw == "":
        return None
    if typing.get_origin(typ) is list:
        items = [item.strip() for item in raw.split(",") if item.strip()]
        if _list_item(typ) is int:
            try:
                return [int(item) for item in items]
            except ValueError:
                raise ConfigError(
                    f"{where}: expected integers, comma-separated, got {raw!r}"
                ) from None
        return items
    if typing.get_origin(typ) is dict:
        try:
            value = json.loads(raw)
        except ValueError as e:
            raise ConfigError(f"{where}: expected a JSON object, got {raw!r} ({e})") from None
        return _check_type(value, hint, where)
    if typing.get_origin(typ) is typing.Literal:
        return _check_choice(raw, typ, where)
    if typ is bool:
        if raw.lower() in _TRUE | _FALSE:
            return raw.lower() in _TRUE
        raise ConfigError(f"{where}: expected a boolean (true/false), got {raw!r}")
    try:
        return typ(raw)
    except ValueError:
        raise ConfigError(f"{where}: expected {typ.__name__}, got {raw!r}") from None


def _check_choice(value: Any, literal: Any, where: str) -> Any:
    """A value of a ``Literal[...]`` mode type: one of its choices, else a ConfigError."""
    choices = typing.get_args(literal)
    if value not in choices:
        raise ConfigError(f"{where}: expected one of {', '.join(map(str, choices))}, got {value!r}")
    return value


def _check_renamed(
    cls: type, values: dict[str, Any], origin: str, env_prefix: str, environ: Mapping[str, str]
) -> None:
    """A section's ``RENAMED`` maps an old key to what replaced it, its ``REMOVED`` a key that
    went to why: a config still using one fails, naming file (or variable) and key, instead of
    being silently ignored."""
    gone = {
        **{old: f"{old} was renamed {new}" for old, new in getattr(cls, "RENAMED", {}).items()},
        **{old: f"{old} was removed: {why}" for old, why in getattr(cls, "REMOVED", {}).items()},
    }
    for old, message in gone.items():
        env_name = f"{env_prefix}_{old}".upper()
        if env_name in environ:
            raise ConfigError(f"{env_name}: {message}")
        if old in values:
            raise ConfigError(f"{origin} {old}: {message}")


@typing.dataclass_transform(frozen_default=True)
def section(cls: type[T]) -> type[T]:
    """Decorator for a config section: a frozen dataclass."""
    return dataclasses.dataclass(frozen=True)(cls)


@section
class MetricsSection:
    """``[metrics]`` of every service: the HTTP side port of /metrics (the gateway's has the
    per-key series its public port does not)."""

    # The address the side port listens on.
    host: str = "127.0.0.1"
    port: int = 0  # 0: no side port (several workers on one host would collide)
