"""The pytest plugin's leak report: the terminal summary section no warnings setting hides,
the ``--speedflags-report`` JSON file, the test's ``def`` line, pytest-xdist, bad input.

Runs that depend on the process's warning filters (the outer suite turns speedflags warnings
into errors) or start workers run in a subprocess, as a user's suite would; the others run
inline, so their writers are real flag writes the conftest guard then checks were put back.
"""

from __future__ import annotations

import configparser
import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

import speedflags

PLUGIN = ("-p", "speedflags.pytest_plugin", "-W", "ignore::pytest.PytestAssertRewriteWarning")
ROOT = Path(speedflags.__file__).resolve().parent.parent

LEAKY = textwrap.dedent(
    """\
    import torch


    def test_clean():
        pass


    def test_benchmark_leak():
        torch.backends.cudnn.benchmark = True
    """
)
LEAK_DEF, LEAK_WRITE = 8, 9  # test_benchmark_leak's def line and its writing line
TITLE = "speedflags: 1 test left torch settings changed"


def summary_section(output: str) -> list[str]:
    """The lines of the plugin's terminal summary section, its title line first."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if "speedflags: " in line and "===" in line)
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("(--speedflags-leaks"))
    return lines[start : end + 1]


@pytest.mark.parametrize(
    ("ini", "args"),
    [
        ("addopts = --disable-pytest-warnings", ()),
        ("", ("-p", "no:warnings")),
        ("", ("-W", "ignore")),
        ("", ("-q",)),
    ],
    ids=["disable-pytest-warnings-in-addopts", "no-warnings-plugin", "W-ignore", "q"],
)
def test_the_summary_is_shown_whatever_the_warnings_settings(
    pytester: pytest.Pytester, ini: str, args: Any
) -> None:
    pytester.makeini(f"[pytest]\n{ini}\n")
    pytester.makepyfile(test_leaky=LEAKY)
    result = pytester.runpytest_subprocess(*PLUGIN, *args, "--speedflags-leaks=warn")
    result.assert_outcomes(passed=2)
    section = summary_section(result.stdout.str())
    assert TITLE in section[0]
    text = "\n".join(section)
    assert text.count("test_benchmark_leak") == 2, text  # the test (once), and its writer
    assert section[1] == f"test_leaky.py::test_benchmark_leak  (test_leaky.py:{LEAK_DEF})"
    assert "  cudnn_benchmark: False -> True" in section
    writer = f"by test_benchmark_leak at {pytester.path / 'test_leaky.py'}:{LEAK_WRITE}"
    assert f"    write: torch.backends.cudnn.benchmark set to True {writer}" in section
    assert "test_clean" not in text


def test_without_pytests_warnings_plugin_the_summary_is_the_only_report(
    pytester: pytest.Pytester,
) -> None:
    # Failed before: with -p no:warnings nothing captures the FlagLeakWarning, so Python
    # printed it raw on stderr, a second report of the leak the summary already gives.
    pytester.makepyfile(test_leaky=LEAKY)
    result = pytester.runpytest_subprocess(*PLUGIN, "-p", "no:warnings", "--speedflags-leaks=warn")
    result.assert_outcomes(passed=2)
    output = result.stdout.str() + result.stderr.str()
    assert "FlagLeakWarning" not in output, result.stderr.str()
    assert output.count("cudnn_benchmark: False -> True") == 1  # the summary's
    assert TITLE in summary_section(result.stdout.str())[0]


def test_fail_mode_has_the_section_too_and_no_leak_says_so(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_leaky=LEAKY)
    result = pytester.runpytest(*PLUGIN, "--speedflags-leaks=fail")
    result.assert_outcomes(passed=1, failed=1)
    section = summary_section(result.stdout.str())
    assert TITLE in section[0]
    assert section[-1].startswith("(--speedflags-leaks=fail: these tests failed;")
    result = pytester.runpytest(*PLUGIN, "--speedflags-leaks=fail", "-k", "clean")
    result.stdout.fnmatch_lines(["=*= speedflags: no test left torch settings changed =*="])


def test_the_location_is_the_def_line_of_a_decorated_parametrized_test(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        test_param="""
        import pytest
        import torch


        class TestInAClass:
            @pytest.mark.parametrize(
                "value",
                [True, False],
            )
            @pytest.mark.filterwarnings("default")
            def test_sets(self, value):
                torch.backends.cudnn.benchmark = value
        """
    )
    report = pytester.path / "leaks.json"
    result = pytester.runpytest(*PLUGIN, "--speedflags-leaks=fail", f"--speedflags-report={report}")
    result.assert_outcomes(passed=1, failed=1)
    (test,) = json.loads(report.read_text())["tests"]
    assert test["nodeid"] == "test_param.py::TestInAClass::test_sets[True]"
    lines = (pytester.path / "test_param.py").read_text().splitlines()
    assert lines[test["location"]["line"] - 1].strip() == "def test_sets(self, value):"
    assert test["location"] == {"path": "test_param.py", "line": 11}
    result.stdout.fnmatch_lines(
        ["test_param.py::TestInAClass::test_sets[True]  (test_param.py:11)"]
    )


def test_a_test_imported_from_another_module_is_located_where_it_is_defined(
    pytester: pytest.Pytester,
) -> None:
    # shared checks defined once and imported by several test modules (a common layout)
    pytester.makepyfile(
        shared_checks="""
        import torch


        def test_shared_leak():
            torch.backends.cudnn.benchmark = True
        """,
        test_uses_shared="""
        from shared_checks import test_shared_leak
        """,
    )
    report = pytester.path / "leaks.json"
    result = pytester.runpytest_subprocess(
        *PLUGIN, "--speedflags-leaks=warn", f"--speedflags-report={report}", "-W", "default"
    )
    result.assert_outcomes(passed=1)
    (test,) = json.loads(report.read_text())["tests"]
    assert test["nodeid"] == "test_uses_shared.py::test_shared_leak"
    assert test["location"] == {"path": "shared_checks.py", "line": 4}
    output = result.stdout.str()
    assert "test_uses_shared.py::test_shared_leak  (shared_checks.py:4)" in output
    # the warning is shown at the def too, not at the importing module's line 4
    assert "shared_checks.py:4: FlagLeakWarning" in output, output


LIBRARY = textwrap.dedent(
    """\
    import threading

    import torch

    import fastlib


    def test_library_leak():
        fastlib.configure()


    def test_thread_leak():
        thread = threading.Thread(target=torch.backends.cuda.enable_math_sdp, args=(False,))
        thread.start()
        thread.join()


    def test_clean():
        pass
    """
)
FASTLIB = "import torch\n\ndef configure():\n    torch.set_float32_matmul_precision('high')\n"


def test_the_json_report_has_the_documented_shape(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_lib=LIBRARY, fastlib=FASTLIB)
    pytester.syspathinsert()
    result = pytester.runpytest(
        *PLUGIN, "-W", "default::speedflags.pytest_plugin.FlagLeakWarning",
        "--speedflags-leaks=warn", "--speedflags-report=out/leaks.json",
        "-p", "no:cacheprovider",
    )  # fmt: skip
    assert result.ret == pytest.ExitCode.USAGE_ERROR  # no directory "out" yet
    (pytester.path / "out").mkdir()
    result = pytester.runpytest(
        *PLUGIN, "-W", "default::speedflags.pytest_plugin.FlagLeakWarning",
        "--speedflags-leaks=warn", "--speedflags-report=out/leaks.json",
    )  # fmt: skip
    result.assert_outcomes(passed=3, warnings=2)
    report = pytester.path / "out" / "leaks.json"
    result.stdout.fnmatch_lines([f"speedflags: report written to {report}"])
    document = json.loads(report.read_text())
    assert set(document) == {"format", "mode", "tests"}
    assert (document["format"], document["mode"]) == ("speedflags-leaks/1", "warn")
    library, thread = document["tests"]
    assert set(library) == {"nodeid", "location", "worker", "settings", "lines"}
    assert library["nodeid"] == "test_lib.py::test_library_leak"
    assert (library["location"], library["worker"]) == ({"path": "test_lib.py", "line": 8}, None)
    by_name: dict[str, dict[str, Any]] = {s["name"]: s for s in library["settings"]}
    precision = by_name["torch.get_float32_matmul_precision()"]
    writer = {
        "file": str(pytester.path / "fastlib.py"),
        "line": 4,
        "function": "configure",
        "thread": "MainThread",
        "text": "torch.set_float32_matmul_precision('high') by configure at "
        f"{pytester.path / 'fastlib.py'}:4",
    }
    assert precision == {
        "lever": "tf32, matmul_precision",
        "name": "torch.get_float32_matmul_precision()",
        "before": "'highest'",
        "after": "'high'",
        "writer": writer,
        "writes": [writer],
        "put_back": True,
        "problem": None,
    }
    assert by_name["torch.backends.cuda.matmul.allow_tf32"]["after"] == "True"
    assert library["lines"][:2] == [
        "  tf32, matmul_precision:",
        "    torch.backends.cuda.matmul.allow_tf32: False -> True",
    ]
    (math,) = thread["settings"]
    assert (math["lever"], math["name"], math["before"], math["after"]) == (
        "sdpa",
        "sdpa.math",
        "True",
        "False",
    )
    assert math["writer"]["function"] == "run"  # threading's: the target is torch's own
    assert math["writer"]["thread"] != "MainThread"


def test_a_report_without_leak_checks_says_off(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_ok="def test_ok():\n    pass\n")
    result = pytester.runpytest(*PLUGIN, "--speedflags-report=leaks.json")
    result.assert_outcomes(passed=1)
    assert "left torch settings changed" not in result.stdout.str()
    document = json.loads((pytester.path / "leaks.json").read_text())
    assert document == {"format": "speedflags-leaks/1", "mode": "off", "tests": []}


SENTINEL = "import pathlib\n\ndef test_runs():\n    pathlib.Path('ran').write_text('')\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--speedflags-leaks=loud",), "*--speedflags-leaks: invalid choice: 'loud'*"),
        (
            ("--speedflags-leaks=warn", "--speedflags-report=missing/leaks.json"),
            "ERROR: --speedflags-report=missing/leaks.json: the directory */missing does not exist",
        ),
        (
            ("--speedflags-leaks=warn", "--speedflags-report=adir"),
            "ERROR: --speedflags-report=adir: */adir is a directory; give a file name*",
        ),
        (("--speedflags-report=",), "ERROR: --speedflags-report: expected a file name*"),
    ],
    ids=["unknown-mode", "missing-directory", "a-directory", "empty"],
)
def test_bad_input_is_a_usage_error_before_any_test_runs(
    pytester: pytest.Pytester, args: Any, message: str
) -> None:
    pytester.mkdir("adir")
    pytester.makepyfile(test_sentinel=SENTINEL)
    result = pytester.runpytest(*PLUGIN, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])
    assert not (pytester.path / "ran").exists()


def test_pytest_xdist_workers_check_and_the_controller_merges(pytester: pytest.Pytester) -> None:
    pytest.importorskip("xdist", reason="pytest-xdist is not installed: pip install '.[test]'")
    # one file per worker (--dist loadfile), each with a leak and a test that checks that the
    # leak was put back on its own worker
    for name, leak in (("one", "torch.backends.cudnn.benchmark = True"),
                       ("two", "torch.set_float32_matmul_precision('high')")):  # fmt: skip
        pytester.makepyfile(
            **{
                f"test_{name}": f"""
                import torch

                def test_leak_{name}():
                    {leak}

                def test_after_{name}():
                    assert not torch.backends.cudnn.benchmark
                    assert torch.get_float32_matmul_precision() == "highest"
                """
            }
        )
    report = pytester.path / "leaks.json"
    result = pytester.runpytest_subprocess(
        *PLUGIN, "-n", "2", "--dist", "loadfile",
        "--speedflags-leaks=fail", f"--speedflags-report={report}",
    )  # fmt: skip
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines(["FAILED test_one.py::test_leak_one - *"], consecutive=False)
    result.stdout.fnmatch_lines(["FAILED test_two.py::test_leak_two - *"], consecutive=False)
    output = result.stdout.str()
    assert output.count("left torch settings changed") == 1  # one merged section
    section = summary_section(output)
    assert "speedflags: 2 tests left torch settings changed" in section[0]
    text = "\n".join(section)
    for name in ("one", "two"):
        assert text.count(f"test_{name}.py::test_leak_{name}  (test_{name}.py:3, worker gw") == 1
    assert "cudnn_benchmark: False -> True" in text
    assert "torch.get_float32_matmul_precision(): 'highest' -> 'high'" in text
    tests = json.loads(report.read_text())["tests"]
    assert sorted(t["nodeid"] for t in tests) == [
        "test_one.py::test_leak_one",
        "test_two.py::test_leak_two",
    ]
    assert {t["worker"] for t in tests} == {"gw0", "gw1"}  # checked on two workers


def test_the_test_extra_installs_pytest_xdist() -> None:
    # so that the xdist test runs in CI (the default leg installs the test extra) rather than
    # skipping
    setup_cfg = ROOT / "setup.cfg"
    if not setup_cfg.exists():
        pytest.skip("no setup.cfg next to the package (installed without sources)")
    config = configparser.ConfigParser()
    config.read(setup_cfg)
    assert "pytest-xdist" in config["options.extras_require"]["test"]


def test_under_w_error_a_warned_leak_fails_its_test_and_the_summary_says_so(
    pytester: pytest.Pytester,
) -> None:
    # --speedflags-leaks=warn -W error: the FlagLeakWarning, an error, fails the test. Failed
    # before: the failure showed the leak twice (raised "during handling of" the warning) and
    # the section ended "(--speedflags-leaks=warn: they passed; ...)".
    pytester.makepyfile(test_leaky=LEAKY)
    result = pytester.runpytest_subprocess(*PLUGIN, "--speedflags-leaks=warn", "-W", "error")
    result.assert_outcomes(passed=1, failed=1)
    output = result.stdout.str()
    assert "During handling of the above exception" not in output
    failures = output.split("= FAILURES =")[1].split(TITLE)[0]
    assert failures.count("cudnn_benchmark: False -> True") == 1, failures
    section = summary_section(output)
    assert section.count("  cudnn_benchmark: False -> True") == 1
    assert section[-1].startswith(
        "(--speedflags-leaks=warn: they failed (FlagLeakWarning is an error here (-W error), or "
        "a failure of their own); speedflags put every setting back"
    )
    assert "they passed" not in output


def test_in_warn_mode_the_summary_names_the_leaking_tests_that_failed(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        test_two=LEAKY + "\n\ndef test_leaks_and_fails():\n"
        "    torch.backends.cudnn.benchmark = True\n    assert False\n"
    )
    result = pytester.runpytest_subprocess(*PLUGIN, "--speedflags-leaks=warn")
    result.assert_outcomes(passed=2, failed=1)
    section = summary_section(result.stdout.str())
    assert section[-1].startswith(
        "(--speedflags-leaks=warn: 1 of them failed (FlagLeakWarning is an error here (-W error),"
        " or a failure of their own): test_two.py::test_leaks_and_fails; the others passed;"
    )
