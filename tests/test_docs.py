"""The docs site's checks fail the build on what they are there to catch (``make test`` builds the real site
with ``mkdocs build --strict``; these show that build would fail):

* a public name without a docstring, or missing from the API reference (docs/hooks/api_coverage.py), on a
  small package laid out like hsdp's;
* a link to a repository file that does not exist, and a broken link between pages (docs/hooks/repo_links.py
  and MkDocs itself), on a small site built in a subprocess as ``make docs`` builds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "hooks"))
import api_coverage  # noqa: E402  (docs/hooks is no package; griffe comes with the docs extra, in the test extra)


def _package(root: Path) -> None:
    """A package named like hsdp: two exported names (one undocumented, one with an undocumented method) and
    an integration module without ``__all__``."""
    pkg = root / "hsdp"
    (pkg / "integrations").mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent('''
        """The package."""
        from hsdp.core import Documented, undocumented
        __all__ = ["Documented", "undocumented"]
    '''))
    (pkg / "core.py").write_text(textwrap.dedent('''
        """Core."""
        class Documented:
            """A class."""
            def step(self):
                return 1
            def _private(self):
                return 2
        def undocumented():
            return 3
    '''))
    (pkg / "integrations" / "__init__.py").write_text('"""Integrations."""\n')
    (pkg / "integrations" / "framework.py").write_text(textwrap.dedent('''
        """A framework."""
        def hook():
            """Documented."""
        def _helper():
            pass
    '''))


def test_api_check_names_each_undocumented_and_unreferenced_public_name(tmp_path: Path) -> None:
    _package(tmp_path)
    reference = tmp_path / "docs" / "reference"
    reference.mkdir(parents=True)
    (reference / "api.md").write_text("# API\n\n::: hsdp.Documented\n\n::: hsdp.core.undocumented\n")
    problems = api_coverage.check(tmp_path, tmp_path / "docs")
    assert problems == [
        "hsdp.Documented.step has no docstring: write one (the API reference is generated from it)",
        "hsdp.undocumented has no docstring: write one (the API reference is generated from it)",
        "hsdp.integrations.framework.hook is public but not in the API reference: add "
        "'::: hsdp.integrations.framework.hook' to a page of docs/reference/",
    ]  # hsdp.core.undocumented renders hsdp.undocumented (the same object): that one is referenced


def test_api_check_passes_on_this_repository() -> None:
    assert api_coverage.check(ROOT, ROOT / "docs") == []


def _site(root: Path, page: str) -> subprocess.CompletedProcess[str]:
    """Build a one-page site with the repository's link hook, strict, as `make docs` does."""
    (root / "docs").mkdir(parents=True)
    (root / "examples").mkdir()
    (root / "examples" / "real.py").write_text("print('an example')\n")
    (root / "docs" / "index.md").write_text(page)
    (root / "mkdocs.yml").write_text(textwrap.dedent(f"""
        site_name: t
        strict: true
        validation: {{anchors: warn, unrecognized_links: warn}}
        hooks: [{ROOT / 'docs' / 'hooks' / 'repo_links.py'}]
    """))
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(root / "mkdocs.yml")],
                          cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_site_build_fails_on_a_broken_link_and_serves_repository_files(tmp_path: Path) -> None:
    ok = _site(tmp_path / "ok", "# Home\n\n[the example](../examples/real.py)\n")
    assert ok.returncode == 0, ok.stderr
    html = (tmp_path / "ok" / "site" / "index.html").read_text()
    assert 'href="examples/real.py"' in html  # rewritten into the site, which serves the file
    assert (tmp_path / "ok" / "site" / "examples" / "real.py").exists()

    broken = _site(tmp_path / "broken", "# Home\n\n[gone](../examples/gone.py) and [nowhere](nowhere.md)\n")
    assert broken.returncode != 0
    assert "links to examples/gone.py, which does not exist in the repository" in broken.stderr
    assert "nowhere.md" in broken.stderr
