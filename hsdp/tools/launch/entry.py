"""Whether a job's entry point (``script.py`` or ``-m module``) exists, checked before any process starts.

A missing script otherwise surfaces once per rank, inside torchrun's failure report: some 80 lines for a
typo. The ranks run in the launcher's working directory with the launcher's interpreter, so the answer
here is theirs. Only a certain "missing" is reported; anything this cannot judge (torchrun options placed
before the script, a module only a custom import hook provides) is left for the ranks to find.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping, Sequence
from importlib.machinery import ModuleSpec, PathFinder


def missing_entry_point(script_args: Sequence[str], env: Mapping[str, str] | None = None) -> str | None:
    """Why ``script_args`` (``script.py ...`` or ``-m module ...``) cannot start, in one line; ``None`` when
    it can or when that cannot be told without running it. ``env`` is what the ranks get on top of this
    process's environment (its ``PYTHONPATH`` is searched for modules)."""
    if not script_args:
        return None
    if script_args[0] == "-m":
        if len(script_args) < 2:
            return "-m needs a module name"
        return _missing_module(script_args[1], _search_path(env))
    if script_args[0].startswith("-"):
        return None  # torchrun options come first: the script is further on, not parsed here
    if not os.path.exists(script_args[0]):
        return f"no such script: {script_args[0]} (from {os.getcwd()})"
    return None


def _search_path(env: Mapping[str, str] | None) -> list[str]:
    # A rank's `python -m` looks in its working directory first (this process's sys.path[0] may instead be
    # the directory of the `hsdp` command), then in PYTHONPATH, then where this interpreter looks.
    extra = (env or {}).get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    return [os.getcwd(), *filter(None, extra.split(os.pathsep))]


def _missing_module(name: str, search_path: list[str]) -> str | None:
    spec = _find(name, search_path)
    if spec is None:
        return f"no module named {name!r} (for -m, from {os.getcwd()})"
    if spec.submodule_search_locations is not None and _find(f"{name}.__main__", search_path) is None:
        return f"{name!r} is a package without a __main__ module: it cannot be run with -m"
    return None


def _find(name: str, search_path: list[str]) -> ModuleSpec | None:
    """The spec of module ``name`` without importing it or its parent packages (whose ``__init__`` may be
    costly or have side effects): each package's spec gives the directories of the next name."""
    top, *rest = name.split(".")
    try:
        spec = PathFinder.find_spec(top, search_path) or importlib.util.find_spec(top)
    except (ImportError, ValueError):  # not a valid module name
        return None
    for i in range(len(rest)):
        if spec is None or spec.submodule_search_locations is None:
            return None
        spec = PathFinder.find_spec(".".join([top, *rest[:i + 1]]), spec.submodule_search_locations)
    return spec
