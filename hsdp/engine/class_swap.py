"""Wrapping by class swap: the user's object stays the same object, its class becomes a subclass of both.

``ShardedModel(module)`` and ``ShardedOptimizer(model, optimizer)`` return the object they were given, its
``__class__`` swapped to ``type("Sharded" + name, (mixin, original), {})`` (as FSDP2's ``fully_shard``
does), so attributes, methods, ``isinstance`` checks and references held elsewhere keep working. One
generated class per (mixin, original) pair, cached, so that ``type(a) is type(b)`` holds for two wrapped
objects of one class.

[Note: class extensions] Some frameworks' models carry methods that read every parameter as one plain tensor
on one process (Hugging Face's and PEFT's ``save_pretrained``); on a sharded model they need a version that
gathers first. The engine names no framework: :func:`register_extensions` (called by the package root,
``hsdp/__init__.py``) maps a framework class, as ``"package:ClassName"``, to the
``"module:Class"`` that overrides those methods. A swap of an instance of such a class puts the extension
between the mixin and the original class (the mixin's methods still come first); the extension's module is
imported only then, when the framework is loaded anyway.
"""

from __future__ import annotations

import importlib

_CLASSES: dict[tuple[type, type], type] = {}
_EXTENSIONS: dict[str, str] = {}  # "transformers:PreTrainedModel" -> "hsdp.integrations.hf_folder:PreTrainedSave"
_EXTENSION_CLASSES: set[type] = set()  # the extensions mixed in so far: never an object's original class


def register_extensions(extensions: dict[str, str]) -> None:
    """Add ``{"package:ClassName": "module:Class"}`` entries (see [Note: class extensions])."""
    _EXTENSIONS.update(extensions)


def swap_class(obj: object, mixin: type) -> None:
    """Make ``obj`` an instance of a subclass of ``mixin`` and its current class (its MRO: mixin first)."""
    orig = type(obj)
    key = (mixin, orig)
    if key not in _CLASSES:
        _CLASSES[key] = type(f"Sharded{orig.__name__}", (mixin, *_extensions_of(orig), orig), {})
    obj.__class__ = _CLASSES[key]


def original_class(obj: object, mixin: type) -> type:
    """The class ``obj`` had before :func:`swap_class` added ``mixin``."""
    return next(c for c in type(obj).__mro__ if not issubclass(c, mixin) and c not in _EXTENSION_CLASSES)


def _extensions_of(cls: type) -> list[type]:
    found: list[type] = []
    for base in cls.__mro__:
        target = _EXTENSIONS.get(f"{base.__module__.partition('.')[0]}:{base.__name__}")
        if target is not None:
            module, _, name = target.partition(":")
            extension = getattr(importlib.import_module(module), name)
            _EXTENSION_CLASSES.add(extension)
            if extension not in found:
                found.append(extension)
    return found
