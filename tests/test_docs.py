"""Every example in the docstrings and the README runs; the docs cite only files in the repo."""

from __future__ import annotations

import doctest
import importlib
import inspect
import pkgutil
import re
from pathlib import Path
from typing import Any

import pytest

import speedflags

MODULES = sorted(
    name
    for _, name, _ in pkgutil.walk_packages(speedflags.__path__, "speedflags.")
    if not name.endswith("__main__")
)
README = Path(__file__).resolve().parent.parent / "README.md"


class _DefinedHere(doctest.DocTestFinder):
    """doctest's finder, which also takes a public class in the module that defines it.

    ``set_module`` gives a public class the package's name, so doctest's own test (the
    class's ``__module__`` is this module) would pass it over everywhere; the class keeps
    the module that defines it as ``_module_source``.
    """

    def _from_module(self, module: Any, obj: Any) -> bool:
        # its own (a subclass defined elsewhere inherits the attribute)
        source = vars(obj).get("_module_source") if inspect.isclass(obj) else None
        if source is not None:
            return bool(source == module.__name__)
        return bool(super()._from_module(module, obj))  # type: ignore[misc]


def _run_examples(module: Any, finder: doctest.DocTestFinder) -> doctest.TestResults:
    runner = doctest.DocTestRunner(verbose=False, optionflags=doctest.ELLIPSIS)
    for test in finder.find(module, module.__name__):
        runner.run(test)
    return runner.summarize(verbose=False)


@pytest.mark.parametrize("module", MODULES)
def test_docstring_examples(module: str) -> None:
    try:
        imported = importlib.import_module(module)
    except ImportError as exc:  # an integration whose extra is not installed says which
        if "pip install '.[" not in str(exc):
            raise
        pytest.skip(str(exc))
    result = _run_examples(imported, _DefinedHere())
    assert result.failed == 0, f"{result.failed} example(s) failed in {module}"


# The repository's tools (not in the package): their examples run too, from the checkout.
TOOLS = README.parent / "tools"
TOOL_MODULES = sorted(
    ".".join(path.relative_to(README.parent).with_suffix("").parts)
    for path in TOOLS.rglob("*.py")
    if path.name not in ("__init__.py", "__main__.py")
)


@pytest.mark.parametrize("module", TOOL_MODULES)
def test_tool_docstring_examples(module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(README.parent))
    result = _run_examples(importlib.import_module(module), doctest.DocTestFinder())
    assert result.failed == 0, f"{result.failed} example(s) failed in {module}"


def test_the_package_docstring_example() -> None:
    # its own module's examples only (the classes it serves run where they are defined)
    result = _run_examples(speedflags, doctest.DocTestFinder(recurse=False))
    assert result.attempted > 0 and result.failed == 0


# The pages whose examples run as tests: the README and every page of docs/ that has one
# (the site shows them as they are tested).
EXAMPLE_PAGES = (
    README,
    *(
        page
        for page in sorted((README.parent / "docs").glob("*.md"))
        if ">>> " in page.read_text(encoding="utf-8")
    ),
)


def test_the_pages_with_examples_are_found() -> None:
    # a page that loses its examples, or a folder that is not found, fails here, not silently
    if not README.exists():
        pytest.skip("no README.md next to the tests (installed without sources)")
    names = {page.name for page in EXAMPLE_PAGES}
    assert {"README.md", "ledger.md", "getting_started.md", "model_levers.md"} <= names
    assert {"train_steps.md", "verify.md", "watch.md", "your_own_levers.md"} <= names


@pytest.mark.parametrize("page", EXAMPLE_PAGES, ids=lambda page: page.name)
def test_page_examples(page: Path) -> None:
    if not page.exists():
        pytest.skip(f"no {page.name} next to the tests (installed without sources)")
    result = doctest.testfile(str(page), module_relative=False, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


ROOT = README.parent
# Paths outside this repository that code and docs once cited. Spelled in pieces so that
# this file does not cite them itself.
OUTSIDE = ("research" + "/", "DESIGN" + ".md", ".." + "/shared", "shared" + "/research")


def _sources() -> list[Path]:
    found = [ROOT / "README.md", ROOT / "Makefile"]
    for folder, patterns in (
        ("speedflags", ("*.py",)),
        ("tests", ("*.py",)),
        ("benchmarks", ("*.py", "*.md")),
        ("docs", ("*.md",)),
    ):
        for pattern in patterns:
            found.extend(sorted((ROOT / folder).rglob(pattern)))
    here = Path(__file__).resolve()
    return [p for p in found if p.exists() and p.resolve() != here]


def _needs_sources() -> None:
    if not (ROOT / "speedflags").is_dir() or not README.exists():
        pytest.skip("no source checkout next to the tests (installed without sources)")


def test_nothing_cites_files_outside_the_repository() -> None:
    _needs_sources()
    cited = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in _sources()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if any(outside in line for outside in OUTSIDE)
    ]
    assert not cited, "cite docs/ instead:\n" + "\n".join(cited)


def test_cited_docs_exist() -> None:
    _needs_sources()
    docs = ROOT / "docs"
    missing = []
    for path in _sources():
        text = path.read_text(encoding="utf-8")
        names = set(re.findall(r"docs/([\w.-]+\.md)", text))
        if path.parent == docs:  # relative links between the docs
            names |= {
                m for m in re.findall(r"\]\(([\w.-]+\.md)(?:#[\w-]*)?\)", text) if "/" not in m
            }
        for name in names:
            if not (docs / name).is_file():
                missing.append(f"{path.relative_to(ROOT)} cites docs/{name}")
        for link in re.findall(r"\]\((\.\./[^)#\s]+)", text) if path.parent == docs else ():
            if not (docs / link).resolve().exists():
                missing.append(f"{path.relative_to(ROOT)} links {link}")
    assert not missing, "\n".join(missing)


def test_the_docs_exist_and_are_linked_from_the_readme() -> None:
    _needs_sources()
    readme = README.read_text(encoding="utf-8")
    for name in ("architecture.md", "tf32_policy.md", "performance.md", "threading.md"):
        assert f"docs/{name}" in readme, f"README.md does not link docs/{name}"
        assert (ROOT / "docs" / name).is_file(), name
