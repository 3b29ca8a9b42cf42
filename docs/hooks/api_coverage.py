"""MkDocs hook: every public name has a docstring and a place in the API reference.

The public names are ``hsdp.__all__`` and, for each module of ``hsdp.integrations`` (a package counts as one
module), its ``__all__`` or, without one, the classes and functions it defines whose names do not start with
``_``. Each must

* have a docstring of its own, and so must every public method and property that hsdp defines on a public
  class (a method overriding a framework's, e.g. a Lightning strategy hook, may keep the framework's), and
* be rendered by a ``::: identifier`` block of a page under ``docs/reference/`` (an identifier naming the same
  object through another path, e.g. a re-export, counts).

Anything missing is logged as a warning, which ``mkdocs build --strict`` (``make docs``) turns into a failed
build. The code is read statically with griffe, as mkdocstrings reads it: nothing is imported, so the check
needs neither torch nor the frameworks.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import griffe

log = logging.getLogger("mkdocs.plugins.hsdp.api_coverage")

PACKAGE = "hsdp"
INTEGRATIONS = "hsdp.integrations"
REFERENCE_DIR = "reference"
DIRECTIVE = re.compile(r"^:::\s+([\w.]+)", re.MULTILINE)


def public_names(package: griffe.Module) -> list[str]:
    """The dotted paths that must be documented: ``hsdp.__all__`` and the integrations' public names."""
    names = [f"{PACKAGE}.{n}" for n in _exports(package)]
    for module in package[INTEGRATIONS.split(".", 1)[1]].modules.values():
        exported = _exports(module)
        if exported is None:  # no __all__: what the module itself defines
            exported = [n for n, m in module.members.items()
                        if not n.startswith("_") and not m.is_alias and (m.is_class or m.is_function)]
        names += [f"{module.path}.{n}" for n in exported]
    return names


def _exports(module: griffe.Module) -> list[str] | None:
    if module.exports is None:
        return None
    return [e if isinstance(e, str) else e.name for e in module.exports]


def _target(obj: griffe.Object | griffe.Alias) -> griffe.Object | griffe.Alias:
    try:
        return obj.final_target if obj.is_alias else obj
    except (griffe.AliasResolutionError, griffe.CyclicAliasError):
        return obj


def undocumented(package: griffe.Module, names: list[str]) -> list[str]:
    """Each public name, or public member hsdp defines on a public class, without a docstring."""
    missing = []
    for name in names:
        obj = _target(package[name.split(".", 1)[1]])
        if not obj.docstring:
            missing.append(name)
        if obj.is_class:
            missing += [f"{name}.{m}" for m in _undocumented_members(obj)]
    return missing


def _undocumented_members(cls: griffe.Class) -> list[str]:
    out = []
    for member_name, member in cls.members.items():
        if member_name.startswith("_") or member.is_alias or not (member.is_function or member.is_attribute):
            continue
        if member.is_attribute and "property" not in member.labels:
            continue  # plain attributes are described in the class docstring
        if member.docstring or _inherits_doc(cls, member_name):
            continue
        out.append(member_name)
    return out


def _inherits_doc(cls: griffe.Class, member_name: str) -> bool:
    """A base class documents the member, or may define it: a base outside hsdp (torch, Lightning,
    transformers) is not loaded, and an override of one of its hooks keeps the framework's docs."""
    for base in cls.resolved_bases:
        found = base.all_members.get(member_name)
        if found is not None and _target(found).docstring:
            return True
    return _has_external_base(cls)


def _has_external_base(cls: griffe.Class) -> bool:
    resolved = cls.resolved_bases
    return len(resolved) < len(cls.bases) or any(_has_external_base(b) for b in resolved)


def referenced(docs_dir: Path, package: griffe.Module) -> set[str]:
    """The canonical paths of every object a ``::: identifier`` block of the reference pages renders."""
    paths = set()
    for page in sorted((docs_dir / REFERENCE_DIR).glob("*.md")):
        for ident in DIRECTIVE.findall(page.read_text()):
            if ident == PACKAGE or not ident.startswith(f"{PACKAGE}."):
                continue
            try:
                paths.add(_target(package[ident.split(".", 1)[1]]).path)
            except KeyError:
                log.warning("docs/%s/%s: ::: %s names nothing in %s", REFERENCE_DIR, page.name, ident, PACKAGE)
    return paths


def check(root: Path, docs_dir: Path) -> list[str]:
    """Every problem found, one line each (empty: all public names documented and referenced)."""
    package = griffe.load(PACKAGE, search_paths=[str(root)], try_relative_path=False, resolve_aliases=True,
                          resolve_external=False)
    names = public_names(package)
    problems = [f"{n} has no docstring: write one (the API reference is generated from it)"
                for n in undocumented(package, names)]
    shown = referenced(docs_dir, package)
    problems += [f"{n} is public but not in the API reference: add '::: {n}' to a page of docs/{REFERENCE_DIR}/"
                 for n in names if _target(package[n.split(".", 1)[1]]).path not in shown]
    return problems


def on_pre_build(config) -> None:
    root = Path(config["config_file_path"]).resolve().parent
    for problem in check(root, Path(config["docs_dir"]).resolve()):
        log.warning(problem)
