"""Griffe extension for the API reference: hsdp's docstrings are written in reStructuredText's inline style
(``:class:`~hsdp.ShardedModel```, ``literal``, a paragraph ending in ``::`` before a code block); the site
renders Markdown. Roles become code spans (``~`` keeps the last component, as Sphinx does), and ``::`` ending a
paragraph becomes ``:``; double-backtick literals are already Markdown code spans."""

from __future__ import annotations

import re

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|obj|exc|const):`(~?)([^`]+)`")
LITERAL_BLOCK = re.compile(r"(?<=\S)::$", re.MULTILINE)


def markdown(text: str) -> str:
    """``text`` with Sphinx roles as code spans and ``::`` paragraph ends as ``:``."""
    def role(m: re.Match[str]) -> str:
        target = m[2].split(".")[-1] if m[1] else m[2]
        return f"`{target}`"

    return LITERAL_BLOCK.sub(":", ROLE.sub(role, text))


class RstRoles(griffe.Extension):
    """Rewrites every docstring griffe loads, before mkdocstrings parses it."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: object) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
