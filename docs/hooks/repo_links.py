"""MkDocs hook: the pages link the repository's examples/ and benchmarks/ files the way GitHub resolves them
(``../../examples/big_model.py`` from ``docs/guides/``), and the site serves those files too.

* ``on_files`` adds every file under ``examples/`` and ``benchmarks/`` to the site at its repository path
  (results tables render as pages, plots and scripts are copied as they are).
* ``on_pre_build`` checks that every relative link of README.md names a repository file.
* ``on_page_markdown`` rewrites each link that leaves ``docs/`` for one of those files into a link inside the
  site, and logs a warning (an error under ``--strict``) for a link to a repository file that does not exist
  or is not part of the site, so a renamed result or example fails ``make docs``.

Links inside ``docs/`` are left to MkDocs, which checks them itself.
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.plugins.hsdp.repo_links")

# Repository folders served by the site, beside docs/.
SERVED = ("examples", "benchmarks")
SKIPPED_PARTS = {"__pycache__"}
LINK = re.compile(r"(\]\()([^)\s]+)((?:\s+\"[^\"]*\")?\))")
FENCE = re.compile(r"^\s*(```|~~~)")


def _repo_root(config) -> Path:
    return Path(config["config_file_path"]).resolve().parent


def on_files(files: Files, config) -> Files:
    root = _repo_root(config)
    for folder in SERVED:
        for path in sorted((root / folder).rglob("*")):
            if path.is_file() and not SKIPPED_PARTS & set(path.parts):
                rel = path.relative_to(root).as_posix()
                files.append(File(rel, str(root), config["site_dir"], config["use_directory_urls"]))
    return files


def _rewrite(target: str, page_src: Path, page_uri: str, docs_dir: Path, root: Path) -> str:
    """The site link for ``target`` (a link written in the page ``page_src``), or ``target`` unchanged."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
        return target  # a URL, an anchor in this page, or an absolute path (MkDocs warns about those)
    path, _, anchor = target.partition("#")
    resolved = Path(os.path.normpath(page_src.parent / path))
    if resolved.is_relative_to(docs_dir):
        if path and not resolved.exists():  # MkDocs may find it among the served files: GitHub would not
            log.warning("%s links to %s, which does not exist in the repository (write links as GitHub resolves "
                        "them, from the page's own folder)", page_uri, resolved.relative_to(root).as_posix())
        return target  # MkDocs checks links inside docs/ itself
    if not resolved.is_relative_to(root):
        return target
    rel = resolved.relative_to(root).as_posix()
    if not resolved.exists():
        log.warning("%s links to %s, which does not exist in the repository", page_uri, rel)
        return target
    if rel.split("/")[0] not in SERVED:
        log.warning("%s links to %s: only %s are part of the site; name other files in backticks", page_uri, rel,
                    " and ".join(f"{s}/" for s in SERVED))
        return target
    link = posixpath.relpath(rel, posixpath.dirname(page_uri) or ".")
    return link + (f"#{anchor}" if anchor else "")


def on_page_markdown(markdown: str, page, config, files: Files) -> str:
    root, docs_dir = _repo_root(config), Path(config["docs_dir"]).resolve()
    page_src = Path(page.file.abs_src_path)
    lines, fenced = [], False
    for line in markdown.split("\n"):
        if FENCE.match(line):
            fenced = not fenced
        if not fenced:
            line = LINK.sub(lambda m: m[1] + _rewrite(m[2], page_src, page.file.src_uri, docs_dir, root) + m[3],
                            line)
        lines.append(line)
    return "\n".join(lines)


def on_pre_build(config) -> None:
    """The README is not part of the site, but it links into it: each of its relative links must name a file
    of the repository (anchors are left to the pages' own check)."""
    root = _repo_root(config)
    readme = root / "README.md"
    for target in LINK.findall(readme.read_text()) if readme.exists() else []:
        path = target[1].partition("#")[0]
        if path and not re.match(r"^[a-z][a-z0-9+.-]*:", path) and not (root / path).exists():
            log.warning("README.md links to %s, which does not exist in the repository", path)
