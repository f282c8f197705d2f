"""Every ``pip install`` line speedflags prints works from this repository.

speedflags is not on a package index yet: ``pip install 'speedflags[plot]'`` fails. The
messages give the form that installs from a checkout (``pip install '.[plot]'``) and name
the index form only as what it will be once speedflags is published.
"""

from __future__ import annotations

import configparser
import re
from pathlib import Path

import speedflags
from speedflags._measure import lever_files, plot_axes
from speedflags._tune import result
from speedflags._version import install_hint

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = Path(speedflags.__file__).resolve().parent
INDEX_FORM = re.compile(r"pip install '?speedflags\b")


def _extras() -> set[str]:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg", encoding="utf-8")
    return set(config["options.extras_require"])


def test_the_hint_installs_the_extra_from_this_checkout() -> None:
    hint = install_hint("plot")
    assert hint.startswith("pip install '.[plot]' in a checkout of speedflags")
    assert hint.endswith("(once it is published: pip install 'speedflags[plot]')")
    assert (ROOT / "setup.cfg").is_file() and (ROOT / "pyproject.toml").is_file()  # "." is one


def test_every_message_naming_an_extra_names_one_this_checkout_has() -> None:
    # Failed before: the messages said `pip install 'speedflags[plot]'`, which fails: the
    # package is on no index.
    messages = [plot_axes.MISSING, result.PLOT_MISSING, lever_files.YAML_MISSING]
    extras = _extras()
    for message in messages:
        (extra,) = re.findall(r"pip install '\.\[(\w+)\]'", message)
        assert extra in extras, message
        assert message.count("'speedflags[") == 1 and "once it is published: " in message


def test_no_index_form_is_given_as_the_way_to_install() -> None:
    # In the package's code and docstrings, the Makefile and the examples: the index form
    # only where it says what it will be once published.
    files = [*PACKAGE.rglob("*.py"), ROOT / "Makefile", *(ROOT / "examples").rglob("*.py")]
    found = []
    for path in files:
        text = path.read_text(encoding="utf-8")
        for match in INDEX_FORM.finditer(text):
            around = text[max(0, match.start() - 80) : match.end() + 80]
            if "published" not in around:
                line = text.count("\n", 0, match.start()) + 1
                found.append(f"{path.relative_to(ROOT)}:{line}")
    assert found == [], found
