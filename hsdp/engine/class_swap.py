"""Wrapping by class swap: the user's object stays the same object, its class becomes a subclass of both.

``ShardedModel(module)`` and ``ShardedOptimizer(model, optimizer)`` return the object they were given, its
``__class__`` swapped to ``type("Sharded" + name, (mixin, original), {})`` (as FSDP2's ``fully_shard``
does), so attributes, methods, ``isinstance`` checks and references held elsewhere keep working. One
generated class per (mixin, original) pair, cached, so that ``type(a) is type(b)`` holds for two wrapped
objects of one class.
"""

from __future__ import annotations

_CLASSES: dict[tuple[type, type], type] = {}


def swap_class(obj: object, mixin: type) -> None:
    """Make ``obj`` an instance of a subclass of ``mixin`` and its current class (its MRO: mixin first)."""
    orig = type(obj)
    key = (mixin, orig)
    if key not in _CLASSES:
        _CLASSES[key] = type(f"Sharded{orig.__name__}", (mixin, orig), {})
    obj.__class__ = _CLASSES[key]


def original_class(obj: object, mixin: type) -> type:
    """The class ``obj`` had before :func:`swap_class` added ``mixin``."""
    return next(c for c in type(obj).__mro__ if not issubclass(c, mixin))
