"""Reading and writing :class:`~hsdp.apps.train.config.RunConfig`: TOML files and ``section.field=value``
overrides.

A TOML file holds any subset of the sections (``[model]``, ``[data]``, ``[optim]``, ``[train]``, ``[log]``,
``[parallel]``); missing fields keep their defaults. Overrides are applied on top, in order; their values
are TOML values (``train.steps=50``, ``data.extensions=[".txt"]``), and a bare word is a string
(``model.preset=small``). Unknown sections or fields and values of the wrong type raise ``ValueError``
naming the field and where it came from.
"""

from __future__ import annotations

import json
import os
import sys
import types
import typing
from dataclasses import fields
from typing import Any

from hsdp.apps.train.config import SECTIONS, RunConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, as a package
    import tomli as tomllib

CONFIG_NAME = "config.toml"  # the resolved configuration saved in every run directory


_SCALARS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
_LISTS = {int: "a list of integers such as [4, 2]", float: "a list of numbers such as [1, 2.5]",
          str: 'a list of strings such as [".txt"]'}


def _alternatives(hint: Any) -> tuple[Any, ...]:
    """The types of a field annotated ``A | B`` (each tried in turn), or the one type."""
    return typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)


def _kind(hint: Any) -> str:
    kinds = [_LISTS[typing.get_args(h)[0]] if typing.get_origin(h) is tuple else _SCALARS[h]
             for h in _alternatives(hint)]
    return " or ".join(kinds)


def _accepts(value: Any, hint: Any) -> tuple[bool, Any]:
    """``(whether value is one hint, value as that type)``; a list's elements are checked one by one."""
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, float(value) if ok else value
    if hint is str:
        return isinstance(value, str), value
    if typing.get_origin(hint) is tuple and isinstance(value, (list, tuple)):
        items = [_accepts(v, typing.get_args(hint)[0]) for v in value]
        return all(ok for ok, _ in items), tuple(v for _, v in items)
    return False, value


def _coerce(where: str, value: Any, hint: Any) -> Any:
    """``value`` as the field's type (the first of ``A | B`` it is); ``ValueError`` naming ``where`` and the
    types it takes when it is none of them (a list with one element of the wrong type included)."""
    for alternative in _alternatives(hint):
        ok, converted = _accepts(value, alternative)
        if ok:
            return converted
    raise ValueError(f"{where} = {value!r}: expected {_kind(hint)}")


def _hints(cls: type) -> dict[str, Any]:
    # Resolves the string annotations of `from __future__ import annotations`.
    return typing.get_type_hints(cls, {**vars(types), "ClassVar": typing.ClassVar})


def _field_names(cls: type) -> list[str]:
    return [f.name for f in fields(cls)]


def build_config(table: dict[str, Any], origin: str = "the configuration") -> RunConfig:
    """A :class:`RunConfig` from a nested ``{section: {field: value}}`` table (a parsed TOML file)."""
    unknown = sorted(set(table) - set(SECTIONS))
    if unknown:
        raise ValueError(f"unknown section [{unknown[0]}] in {origin}: use {sorted(SECTIONS)}")
    sections = {}
    for name, cls in SECTIONS.items():
        values = table.get(name, {})
        if not isinstance(values, dict):
            raise ValueError(f"{name} in {origin} must be a table [{name}], got {values!r}")
        known, hints = _field_names(cls), _hints(cls)
        extra = sorted(set(values) - set(known))
        if extra:
            raise ValueError(f"unknown field {name}.{extra[0]} in {origin}: [{name}] has {known}")
        sections[name] = cls(**{k: _coerce(f"{name}.{k}", v, hints[k]) for k, v in values.items()})
    return RunConfig(**sections)


def read_toml(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed TOML file; ``ValueError`` with the file name for a missing or malformed file."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(f"config file {os.fspath(path)!r} does not exist: check the path") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {os.fspath(path)!r} is not valid TOML: {e}") from None


def _parse_value(raw: str, hint: Any) -> Any:
    # Strings may be written bare (model.preset=small); everything else is a TOML value (a list such as
    # parallel.sharding_degree=[2,1] too; a bare word for a field that also takes a string stays that word).
    if hint is str and not raw.startswith(('"', "'")):
        return raw
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw  # a bare word for a non-string field: _coerce names the field and the type


def apply_overrides(table: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """A copy of ``table`` with each ``section.field=value`` applied in order."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in table.items()}
    for item in overrides:
        key, sep, raw = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot:
            raise ValueError(f"override {item!r}: write section.field=value, e.g. train.steps=50")
        if section not in SECTIONS:
            raise ValueError(f"override {item!r}: unknown section {section!r}, use {sorted(SECTIONS)}")
        hints = _hints(SECTIONS[section])
        if name not in hints or name == "SECTION":
            raise ValueError(f"override {item!r}: unknown field {section}.{name}, "
                             f"[{section}] has {_field_names(SECTIONS[section])}")
        out.setdefault(section, {})[name] = _parse_value(raw.strip(), hints[name])
    return out


def resolve_config(path: str | None, overrides: list[str]) -> RunConfig:
    """The configuration of one run: ``path`` (or, when resuming without one, the run directory's saved
    ``config.toml``), then ``overrides``."""
    table = read_toml(path) if path else {}
    origin = path or "the command line"
    merged = apply_overrides(table, overrides)
    probe = build_config(merged, origin)
    saved = os.path.join(probe.train.out_dir, CONFIG_NAME)
    if path is None and probe.train.resume and os.path.exists(saved):
        # Resuming continues the saved run; the command line still wins (e.g. more steps). An earlier
        # stop_after ended that session only: it must not stop the resumed one at the same step.
        base = read_toml(saved)
        base.get("train", {}).pop("stop_after", None)
        merged = apply_overrides(base, overrides)
        origin = f"{saved} and the command line"
    return build_config(merged, origin)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's
    return "[" + ", ".join(_toml_value(v) for v in value) + "]"


def to_toml(config: RunConfig) -> str:
    """Every field of ``config`` as TOML (what ``build_config(tomllib.loads(...))`` reads back)."""
    lines = []
    for name in SECTIONS:
        section = getattr(config, name)
        lines.append(f"[{name}]")
        lines += [f"{k} = {_toml_value(getattr(section, k))}" for k in _field_names(type(section))]
        lines.append("")
    return "\n".join(lines)
