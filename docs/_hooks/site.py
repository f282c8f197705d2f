"""MkDocs hooks for the documentation site (mkdocs.yml's ``hooks:``).

The site is built from docs/ and from three things outside it, so that each lives in one
place and reads right both on the site and in the repository:

- the README is the landing page (``index.md``);
- ``benchmarks/RESULTS.md`` is the page of every measurement (``results.md``), and the raw
  result files ``benchmarks/results/*.json`` are served beside the figures (``measured/``);
- the figures that ``benchmarks/plot_results.py`` made (``make docs`` makes them first) are
  served under ``measured/``.

Links keep their repository form in the sources (``docs/x.md`` in the README,
``../benchmarks/RESULTS.md`` in a docs page, as GitHub and a source checkout resolve them)
and are rewritten to the site's paths here. A link to a repository file that the site does
not serve is left as it is, so that ``mkdocs build --strict`` fails on it.
"""

from __future__ import annotations

import os
import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
# benchmarks/plot_results.py --out: the Makefile's FIGURES, or another folder (the tests')
FIGURES = Path(os.environ.get("SPEEDFLAGS_DOCS_FIGURES") or ROOT / "build" / "docs-figures")
LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)(\))")
# where each page comes from in the repository (the pages of docs/ are docs/<src_uri>)
_SOURCES: dict[str, str] = {"index.md": "README.md", "results.md": "benchmarks/RESULTS.md"}


def site_path(repo_path: str) -> str | None:
    """The site's path for a repository file the site serves, or None."""
    if repo_path.startswith("docs/"):
        return repo_path.removeprefix("docs/")
    if repo_path == "README.md":
        return "index.md"
    if repo_path == "benchmarks/RESULTS.md":
        return "results.md"
    if repo_path.startswith("benchmarks/results/") and repo_path.endswith(".json"):
        return "measured/" + repo_path.removeprefix("benchmarks/results/")
    return None


def on_files(files: Files, *, config: Any) -> Files:
    files.append(File.generated(config, "index.md", abs_src_path=str(ROOT / "README.md")))
    results = ROOT / "benchmarks" / "RESULTS.md"
    files.append(File.generated(config, "results.md", abs_src_path=str(results)))
    for raw in sorted((ROOT / "benchmarks" / "results").glob("*.json")):
        files.append(File.generated(config, f"measured/{raw.name}", abs_src_path=str(raw)))
    figures = sorted(FIGURES.glob("*.png"))
    if not figures:
        raise PluginError(
            f"no figures in {FIGURES}: `make docs` draws them first "
            f"(python benchmarks/plot_results.py --out {FIGURES})"
        )
    for figure in figures:
        files.append(File.generated(config, f"measured/{figure.name}", abs_src_path=str(figure)))
    return files


def on_page_markdown(markdown: str, *, page: Any, config: Any, files: Files) -> str:
    src_uri = page.file.src_uri
    source = _SOURCES.get(src_uri, f"docs/{src_uri}")
    here = posixpath.dirname(source)

    def rewrite(match: re.Match[str]) -> str:
        target = match.group(2)
        if "://" in target or target.startswith(("#", "mailto:")):
            return match.group(0)
        path, hash_, anchor = target.partition("#")
        repo_path = posixpath.normpath(posixpath.join(here, path))
        mapped = site_path(repo_path)
        if mapped is None:
            return match.group(0)
        relative = posixpath.relpath(mapped, posixpath.dirname(src_uri) or ".")
        return f"{match.group(1)}{relative}{hash_}{anchor}{match.group(3)}"

    return LINK.sub(rewrite, markdown)
