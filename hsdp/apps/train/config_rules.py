"""The checks every section of ``hsdp train``'s configuration is built from: each raises ``ValueError`` naming the
field as it is written in TOML or on the command line (``train.steps = 0: must be at least 1``) and the fix."""

from __future__ import annotations

from typing import Any, NoReturn


def fail(section: str, name: str, value: Any, why: str) -> NoReturn:
    raise ValueError(f"{section}.{name} = {value!r}: {why}")


def at_least(section: str, obj: Any, names: tuple[str, ...], low: float) -> None:
    for name in names:
        value = getattr(obj, name)
        if value < low:
            fail(section, name, value, f"must be at least {low:g}")


def one_of(section: str, name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        fail(section, name, value, f"choose one of {list(choices)}")
