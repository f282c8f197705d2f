"""What a user installs: the wheel and the sdist (their files, licence and metadata), the
README as a package index shows it, the Python versions claimed against those CI runs, and
the command line's output where NumPy is absent."""

from __future__ import annotations

import configparser
import importlib.util
import re
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# What the sdist must carry besides the package: its tests run from it (conftest, helpers,
# and the files they read), and a user reads the docs and runs the examples.
SDIST_FOLDERS = ("tests", "docs", "examples", "benchmarks", "tools", ".ci")
SDIST_FILES = ("LICENSE", "README.md", "Makefile", "setup.cfg", "pyproject.toml", "mkdocs.yml")
SKIPPED_PARTS = {"__pycache__", ".pytest_cache", ".benchmarks"}

needs_build = pytest.mark.skipif(
    importlib.util.find_spec("build") is None or importlib.util.find_spec("setuptools") is None,
    reason="needs the dev extra (build, setuptools): pip install -e '.[dev]'",
)


def _source_files() -> set[str]:
    """The repository's files that the sdist must hold, as sdist-relative paths."""
    found = set(SDIST_FILES)
    for folder in SDIST_FOLDERS:
        for path in (ROOT / folder).rglob("*"):
            relative = path.relative_to(ROOT)
            skipped = SKIPPED_PARTS & set(relative.parts) or path.suffix in (".pyc", ".pyo")
            if path.is_file() and not skipped:
                found.add(relative.as_posix())
    return found


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The sdist and the wheel `python -m build` makes of this tree (once per session)."""
    out = tmp_path_factory.mktemp("dist")
    result = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    sdists = list(out.glob("*.tar.gz"))
    wheels = list(out.glob("*.whl"))
    assert len(sdists) == 1 and len(wheels) == 1, sorted(p.name for p in out.iterdir())
    return {"sdist": sdists[0], "wheel": wheels[0]}


def _sdist_names(sdist: Path) -> set[str]:
    with tarfile.open(sdist) as tar:
        return {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}


@needs_build
def test_the_sdist_holds_the_licence_readme_docs_examples_and_the_whole_test_suite(
    dist: dict[str, Path],
) -> None:
    names = _sdist_names(dist["sdist"])
    missing = sorted(_source_files() - names)
    assert not missing, f"not in the sdist: {missing}"
    assert "tests/conftest.py" in names and "speedflags/py.typed" in names
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]


@needs_build
def test_the_wheel_holds_the_package_and_the_licence_and_no_tests(
    dist: dict[str, Path],
) -> None:
    with zipfile.ZipFile(dist["wheel"]) as whl:
        names = whl.namelist()
        metadata = next(whl.read(n) for n in names if n.endswith(".dist-info/METADATA"))
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    tops = {n.split("/", 1)[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"speedflags"}
    package = {n for n in names if n.startswith("speedflags/")}
    expected = {  # the modules and their stubs (_shorthands.pyi: setup.cfg's package_data)
        p.relative_to(ROOT).as_posix()
        for pattern in ("*.py", "*.pyi")
        for p in (ROOT / "speedflags").rglob(pattern)
        if "__pycache__" not in p.parts
    }
    assert expected | {"speedflags/py.typed"} == package
    # the make gpu-check harness drives the repository's suite: tools/, not the package
    assert not [n for n in names if "gpu_check" in n or n.startswith("tools/")], names
    text = metadata.decode()
    assert re.search(r"^License(-Expression)?: MIT$", text, re.MULTILINE), text[:2000]


@needs_build
def test_the_tests_run_from_the_unpacked_sdist(dist: dict[str, Path], tmp_path: Path) -> None:
    with tarfile.open(dist["sdist"]) as tar:
        # our own freshly built archive; the "data" filter where this Python has it
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(tmp_path, **safe)  # noqa: S202
    (tree,) = tmp_path.iterdir()
    # The unpacked package is the one imported there (the current directory comes first).
    where = subprocess.run(
        [sys.executable, "-c", "import speedflags; print(speedflags.__file__)"],
        cwd=tree, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    assert Path(where.stdout.strip()).resolve().is_relative_to(tree.resolve())
    # Every test module imports (conftest and helpers present), and a few files run whole.
    run = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    collected = subprocess.run(
        [*run, "--collect-only"], cwd=tree, capture_output=True, text=True, timeout=600,
        check=False,
    )  # fmt: skip
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-2000:]
    assert re.search(r"^\d+ tests collected", collected.stdout, re.MULTILINE)
    ran = subprocess.run(
        [*run, "tests/test_package.py", "tests/test_restore.py", "tests/test_fp32_model.py"],
        cwd=tree, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-2000:]
    assert " passed" in ran.stdout and " failed" not in ran.stdout


def _links(markdown: str) -> Iterator[str]:
    for match in re.finditer(r"\]\(([^)\s]+)\)|<(https?://[^>]+)>|^\[[^\]]+\]:\s*(\S+)",
                             markdown, re.MULTILINE):  # fmt: skip
        yield next(group for group in match.groups() if group)


def test_the_readme_links_resolve_on_a_package_index_page() -> None:
    # A package index shows the README alone: an anchor of a heading (#x, which GitHub makes
    # and an index may not) goes nowhere, and so does a relative link. The README links its
    # docs/ files all the same (in the repository and its source distribution they are
    # there): such a link is a file that exists and the sdist ships, and its text is its
    # path, so that a reader of the index page still sees where to look.
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    links = list(_links(readme))
    relative = [link for link in links if not link.startswith(("https://", "http://"))]
    assert all(not link.startswith("#") for link in relative), relative
    assert relative, "the README links no docs page"
    for link in relative:
        assert link.startswith("docs/") and (ROOT / link).is_file(), link
        assert f"[{link}]({link})" in readme, f"the link to {link} must show its path"
    # each part of the README ends in its page (the site's navigation reaches every page:
    # tests/test_site.py)
    for page in (
        "getting_started", "levers", "guarantees", "model_levers", "train_steps",
        "torch_compile", "pytest_plugin", "watch", "verify", "tune", "cli", "trainers",
        "distributed", "measured", "development",
    ):  # fmt: skip
        assert f"docs/{page}.md" in relative, f"the README does not link docs/{page}.md"


def test_the_readme_reads_in_five_minutes() -> None:
    # what moved out of it is on the pages it links
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 300, f"README.md has {lines} lines"


def test_the_readme_installs_from_the_repository_until_published() -> None:
    # speedflags is not on the package index yet: every install command a reader can copy
    # works from a clone (`pip install speedflags` is named only as what it will be)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    commands = [
        line.split("#", 1)[0].strip()
        for block in re.findall(r"```bash\n(.*?)```", readme, re.DOTALL)
        for line in block.splitlines()
    ]
    installs = [c for c in commands if c.startswith("pip install")]
    assert "pip install ." in installs and "pip install '.[plot]'" in installs, installs
    assert not [c for c in installs if "speedflags" in c], installs
    assert any(c.startswith("git clone") and "make run" in c for c in commands), commands


def _ci_python_versions() -> list[str]:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    run = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    legs = re.findall(r"^run_leg (\w+)$", run, re.MULTILINE)
    assert sorted(legs) == ["default", "floor", "newest", "py312"]
    versions = []
    for leg in legs:
        found = re.search(rf"^{leg.upper()}_PYTHON_VERSION := (\S+)$", makefile, re.MULTILINE)
        assert found, f"the Makefile names no Python for the {leg} leg"
        versions.append(found.group(1))
    return versions


def test_the_classifiers_list_exactly_the_python_versions_ci_runs() -> None:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg", encoding="utf-8")
    classifiers = config["metadata"]["classifiers"].split("\n")
    claimed = sorted(
        c.rsplit(":: ", 1)[1]
        for c in classifiers
        if re.match(r"Programming Language :: Python :: 3\.\d+$", c)
    )
    tested = sorted(_ci_python_versions(), key=lambda v: tuple(map(int, v.split("."))))
    assert sorted(claimed, key=lambda v: tuple(map(int, v.split(".")))) == tested
    assert config["options"]["python_requires"] == f">={tested[0]}"
    assert config["metadata"]["license"] == "MIT"


NUMPY_ABSENT = "import sys; sys.modules['numpy'] = None  # every import of numpy fails\n"


def _stderr_without_numpy(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", NUMPY_ABSENT + code],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


def test_without_numpy_torch_itself_warns() -> None:
    # The check below means something only if the warning is there to be hidden.
    assert "Failed to initialize NumPy" in _stderr_without_numpy("import torch")


@pytest.mark.parametrize(
    "code",
    [
        # python -m speedflags report
        "import runpy; sys.argv = ['speedflags', 'report']; "
        "runpy.run_module('speedflags', run_name='__main__', alter_sys=True)",
        # the `speedflags` console script (its entry point)
        "from speedflags.__main__ import main; sys.argv = ['speedflags', 'report']; main()",
    ],
    ids=["python -m speedflags", "console script"],
)
def test_the_command_line_prints_no_numpy_warning_without_numpy(code: str) -> None:
    assert "NumPy" not in _stderr_without_numpy(code)
