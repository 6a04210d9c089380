"""TOML -> typed dataclasses, with strict checking and `--section.key=value` overrides.

Every section of a job config is a kw_only dataclass; every field has a type annotation and a default. Unknown keys,
wrong types, non-finite numbers, files that are not UTF-8 TOML and missing files raise `ConfigError`, whose message
names the key (with a did-you-mean for typos) or the file and line. A UTF-8 byte-order mark at the start of a file
(some Windows editors write one) is skipped.

Values as a shell user expects them:
- `none` (the bare word on the command line, the string "none" in a file) unsets an optional setting, e.g.
  `--checkpoint.export_dir=none`; TOML has no null, so `to_toml` writes unset values the same way.
- Path settings (fields with `metadata=PATH`): a path given in the file is relative to the file's folder, one given
  on the command line is relative to the current folder, a default is relative to the file's folder (the current
  folder without a file); `~` is the home folder. An empty path is an error.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from app.errors import ConfigError

__all__ = ["PATH", "UNSET", "load_config", "parse_overrides", "to_dict", "to_toml"]

#: Field metadata of a path setting (see the module docstring for what it is relative to).
PATH = {"path": True}
#: The value that unsets an optional setting.
UNSET = "none"
#: What a byte-order mark decodes to; TOML does not allow one, so a file's leading one is dropped before parsing.
BYTE_ORDER_MARK = "\ufeff"


def _did_you_mean(key: str, choices) -> str:
    close = difflib.get_close_matches(key, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else f" (known: {', '.join(sorted(choices))})"


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp, key: str):
    """Check `value` (from TOML or parsed from the command line) against annotation `tp`."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        options = get_args(tp)
        if (value is None or value == UNSET) and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"`{key}` must be {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ConfigError(f"`{key}` must be one of {', '.join(map(repr, allowed))}, got {value!r}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"`{key}` must be a list, got {value!r}")
        items = get_args(tp) or (Any,)
        if origin is tuple and Ellipsis not in items:
            if len(value) != len(items):
                raise ConfigError(f"`{key}` must be a list of {len(items)} values, got {len(value)}: {value!r}")
        else:
            items = items[:1] * len(value)
        coerced = [_coerce(v, item, f"{key}[{i}]") for i, (v, item) in enumerate(zip(value, items))]
        return coerced if origin is list else tuple(coerced)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"`{key}` must be a table, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"`{key}` must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"`{key}` must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(f"`{key}` must be a finite number, got {value!r}")
            return float(value)
        raise ConfigError(f"`{key}` must be a number, got {value!r}")
    if tp is str:
        if value == UNSET:
            raise ConfigError(f"`{key}` cannot be unset: give it a value")
        if isinstance(value, str):
            return value
        raise ConfigError(f"`{key}` must be a string, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"`{key}` must be a table, got {value!r}")
        return _build(tp, value, key)
    raise ConfigError(f"`{key}` has an unsupported annotation {_type_name(tp)}")  # a bug in a config class


def _build(cls, table: dict, prefix: str):
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in table.items():
        name = f"{prefix}.{key}" if prefix else key
        if key not in fields:
            raise ConfigError(f"unknown key `{name}`{_did_you_mean(key, fields)}")
        kwargs[key] = _coerce(value, hints[key], name)
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"[{prefix}] {e}" if prefix else str(e)) from None


def _parse_scalar(text: str):
    """A command-line value: TOML syntax if it parses as a TOML value, else a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_overrides(args: list[str]) -> dict:
    """['--train.steps=3', '--model.preset=tiny'] -> {'train': {'steps': 3}, 'model': {'preset': 'tiny'}}."""
    tree: dict = {}
    for arg in args:
        if not arg.startswith("--") or "=" not in arg:
            raise ConfigError(f"override `{arg}` must look like --section.key=value")
        path, text = arg[2:].split("=", 1)
        parts = path.split(".")
        if len(parts) < 2 or not all(parts):
            raise ConfigError(f"override `{arg}` must name a section and a key: --section.key=value")
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = _parse_scalar(text)
    return tree


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _read_toml(path: Path) -> dict:
    """The table of TOML file `path`; ConfigError names the file (and the line) if it cannot be read."""
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"config file {path}: cannot read it ({e.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x}); save the file as UTF-8"
        ) from None
    try:
        return tomllib.loads(text.removeprefix(BYTE_ORDER_MARK))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None


def _absolute(value, base: Path, key: str):
    """Path setting `value` (or each of a list of them) made absolute against `base` (other values are left for
    `_coerce` to judge)."""
    if isinstance(value, list):
        return [_absolute(v, base, key) for v in value]
    if not isinstance(value, str) or value == UNSET:
        return value
    if not value:
        raise ConfigError(f"`{key}` is an empty path: give a path, or {UNSET} to unset it")
    return str((base / Path(value).expanduser()).resolve())


def _absolute_paths(cls, table: dict, base: Path, *, defaults: bool = False, prefix: str = "") -> None:
    """Make the path settings of dataclass `cls` given in `table` absolute against `base`, in place; with `defaults`,
    also write the defaults of those not given into `table`."""
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if f.metadata.get("path"):
            if f.name in table:
                table[f.name] = _absolute(table[f.name], base, key)
            elif defaults and isinstance(f.default, str):
                table[f.name] = _absolute(f.default, base, key)
        elif dataclasses.is_dataclass(hints[f.name]):
            sub = table.setdefault(f.name, {}) if defaults else table.get(f.name)
            if isinstance(sub, dict):
                _absolute_paths(hints[f.name], sub, base, defaults=defaults, prefix=f"{key}.")


def load_config(cls, path: str | Path | None, overrides: list[str] = ()):
    """Read TOML file `path` (None: defaults only), apply overrides, and build `cls`."""
    cwd = Path.cwd()
    table = _read_toml(Path(path)) if path is not None else {}
    base = Path(path).resolve().parent if path is not None else cwd
    _absolute_paths(cls, table, base)
    extra = parse_overrides(list(overrides))
    _absolute_paths(cls, extra, cwd)
    table = _merge(table, extra)
    _absolute_paths(cls, table, base, defaults=True)
    return _build(cls, table, "")


def to_dict(config) -> dict:
    return dataclasses.asdict(config)


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return repr(v)


def _toml_table(name: str, obj, lines: list[str]) -> None:
    """Append `[name]` with the scalar fields of dataclass `obj`, then its nested dataclasses as `[name.field]`."""
    lines.append(f"[{name}]")
    nested = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            nested.append((f.name, value))
        elif value is None:
            lines.append(f"{f.name} = {_toml_value(UNSET)}")
        else:
            lines.append(f"{f.name} = {_toml_value(value)}")
    lines.append("")
    for key, value in nested:
        _toml_table(f"{name}.{key}", value, lines)


def to_toml(config) -> str:
    """The resolved config as TOML (unset values as "none": TOML has no null)."""
    lines: list[str] = []
    for f in dataclasses.fields(config):
        _toml_table(f.name, getattr(config, f.name), lines)
    return "\n".join(lines)
