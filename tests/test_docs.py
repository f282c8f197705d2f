"""Every example in the docstrings and the README runs, under the leak guard."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
from pathlib import Path

import pytest

import speedflags

MODULES = sorted(
    name
    for _, name, _ in pkgutil.walk_packages(speedflags.__path__, "speedflags.")
    if not name.endswith("__main__")
)
README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.mark.parametrize("module", MODULES)
def test_docstring_examples(module: str) -> None:
    try:
        imported = importlib.import_module(module)
    except ImportError as exc:  # an integration whose extra is not installed says which
        if "pip install 'speedflags[" not in str(exc):
            raise
        pytest.skip(str(exc))
    result = doctest.testmod(imported, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} example(s) failed in {module}"


def test_readme_examples() -> None:
    if not README.exists():
        pytest.skip("no README.md next to the tests (installed without sources)")
    result = doctest.testfile(str(README), module_relative=False, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
