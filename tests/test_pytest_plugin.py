"""The pytest plugin, run with pytester: leak checks (off, warn, fail), the marker, bad input.

The inner sessions run in this process (pytester's inline mode), so their writers are real
flag writes; the plugin puts leaked flags back, which the conftest guard of each outer test
then checks.
"""

from __future__ import annotations

import configparser
import os
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import reset_all

import speedflags
from speedflags._ledger import own_writes as _own_writes

# inline runs import nothing anew: pytest cannot rewrite the already imported plugin, and
# says so (once the docs tests have imported it); that note is not what these tests check
PLUGIN = ("-p", "speedflags.pytest_plugin", "-W", "ignore::pytest.PytestAssertRewriteWarning")
ROOT = Path(speedflags.__file__).resolve().parent.parent

LEAKY = textwrap.dedent(
    """\
    import threading

    import pytest
    import torch

    import fastlib


    def test_clean():
        with torch.backends.cudnn.flags(enabled=torch.backends.cudnn.enabled, benchmark=True):
            assert torch.backends.cudnn.benchmark


    def test_benchmark_leak():
        torch.backends.cudnn.benchmark = True


    def test_library_leak():
        fastlib.configure()


    def test_thread_leak():
        def writer():
            torch.backends.cuda.enable_math_sdp(False)

        thread = threading.Thread(target=writer, name="sdpa-writer")
        thread.start()
        thread.join()


    def test_after_the_leaks():
        assert not torch.backends.cudnn.benchmark
        assert torch.get_float32_matmul_precision() == "highest"
        assert torch.backends.cuda.math_sdp_enabled()
    """
)
FASTLIB = textwrap.dedent(
    """\
    import torch

    def configure():
        torch.set_float32_matmul_precision("high")
    """
)


@pytest.fixture
def leaky(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(test_leaky=LEAKY, fastlib=FASTLIB)
    pytester.syspathinsert()
    return pytester


def test_off_by_default_nothing_is_checked_or_watched(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import torch
        from speedflags._ledger import own_writes as _own_writes

        def test_leak():
            assert _own_writes.WATCHER is None or _own_writes.WATCHER.count == 1
            torch.backends.cudnn.benchmark = True

        def test_next():
            assert torch.backends.cudnn.benchmark  # leaked: nobody put it back
            torch.backends.cudnn.benchmark = False
        """
    )
    outer_watching = _own_writes.WATCHER is not None  # this suite itself may run in fail mode
    result = pytester.runpytest(*PLUGIN)
    result.assert_outcomes(passed=2)
    assert "speedflags" not in result.stdout.str()
    assert (_own_writes.WATCHER is not None) == outer_watching


def test_fail_mode_fails_each_leaking_test_naming_lever_values_and_writer(
    leaky: pytest.Pytester,
) -> None:
    result = leaky.runpytest(*PLUGIN, "--speedflags-leaks=fail")
    result.assert_outcomes(passed=2, failed=3)
    test_file = leaky.path / "test_leaky.py"
    result.stdout.fnmatch_lines(
        [
            "*test_leaky.py::test_benchmark_leak left torch flags changed "
            "(--speedflags-leaks=fail); speedflags put them back:",
            "  cudnn_benchmark: False -> True",
            "    write: torch.backends.cudnn.benchmark set to True by test_benchmark_leak at "
            f"{test_file}:15",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "*test_library_leak left torch flags changed*",
            "  tf32, matmul_precision:",
            "    torch.get_float32_matmul_precision(): 'highest' -> 'high'",
            "*write: torch.set_float32_matmul_precision('high') by configure at "
            f"{leaky.path / 'fastlib.py'}:4",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "*test_thread_leak left torch flags changed*",
            "  sdpa:",
            "    math: True -> False",
            "    write: torch.backends.cuda.enable_math_sdp(False) by writer at "
            f"{test_file}:24 (thread 'sdpa-writer')",
        ]
    )
    result.stdout.fnmatch_lines(["FAILED test_leaky.py::test_benchmark_leak - *"])


def test_fail_mode_names_transformers_enable_tf32(pytester: pytest.Pytester) -> None:
    import_utils = pytest.importorskip("transformers.utils.import_utils")
    if not hasattr(import_utils, "enable_tf32"):
        pytest.skip("this transformers is too old to have enable_tf32")
    pytester.makepyfile(
        """
        from transformers.utils import import_utils

        def test_trainer_setup():
            getattr(import_utils.enable_tf32, "cache_clear", lambda: None)()  # 5.x caches it
            import_utils.enable_tf32(True)  # what TrainingArguments(tf32=True) calls
        """
    )
    result = pytester.runpytest(*PLUGIN, "--speedflags-leaks=fail")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*write: torch.*enable_tf32 at *transformers*import_utils.py:*"], consecutive=False
    )


def test_warn_mode_warns_puts_back_and_passes(leaky: pytest.Pytester) -> None:
    # (this suite turns speedflags warnings into errors; the inner session must not)
    show = ("-W", "default::speedflags.pytest_plugin.FlagLeakWarning")
    result = leaky.runpytest(*PLUGIN, *show, "--speedflags-leaks=warn")
    result.assert_outcomes(passed=5, warnings=3)
    result.stdout.fnmatch_lines(
        [
            "*FlagLeakWarning: test_leaky.py::test_benchmark_leak left torch flags changed "
            "(--speedflags-leaks=warn)*",
        ]
    )
    assert "test_after_the_leaks" not in result.stdout.str()  # it passed: the state was clean


def test_warn_mode_turned_into_errors_fails_the_test(leaky: pytest.Pytester) -> None:
    result = leaky.runpytest("-W", "error", *PLUGIN, "--speedflags-leaks=warn")
    result.assert_outcomes(passed=2, failed=3)


def test_the_ini_option_turns_it_on(leaky: pytest.Pytester) -> None:
    leaky.makeini("[pytest]\nspeedflags_leaks = fail\n")
    result = leaky.runpytest(*PLUGIN)
    result.assert_outcomes(passed=2, failed=3)
    result = leaky.runpytest(*PLUGIN, "--speedflags-leaks=off")  # the command line wins
    reset_all()  # off: nobody put the leaked flags back
    result.assert_outcomes(passed=4, failed=1)  # test_after_the_leaks sees the leaks


def test_a_leak_in_a_fixture_teardown_is_caught(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        import torch

        @pytest.fixture
        def careless():
            yield
            torch.backends.cudnn.benchmark = True

        def test_uses_it(careless):
            pass
        """
    )
    result = pytester.runpytest(*PLUGIN, "--speedflags-leaks=fail")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*write: torch.backends.cudnn.benchmark set to True by careless*"])


OPEN_BLOCKS = textwrap.dedent(
    """\
    import torch
    from torch import nn

    import speedflags

    NET = nn.Linear(2, 2)


    def test_leaves_a_model_block_open():
        speedflags.fast_math(model=NET, param_dtype="bf16").__enter__()


    def test_leaves_a_process_block_open():
        speedflags.fast_math(cudnn_benchmark=True).__enter__()


    def test_after():
        assert type(NET) is nn.Linear
        assert NET(torch.ones(1, 2)).dtype == torch.float32
        assert not torch.backends.cudnn.benchmark
    """
)


@pytest.fixture
def forget_open_frames() -> Iterator[None]:
    # the inner session runs in this process: the blocks it left open stay on the ledger
    yield
    speedflags.ledger()._forget_frames()


def test_a_block_left_open_is_caught_put_back_and_named_model_levers_too(
    pytester: pytest.Pytester, forget_open_frames: None
) -> None:
    # Failed before: a model left under param_dtype passed under --speedflags-leaks=fail and
    # later tests got the changed model; and a block left open was written by "unknown".
    pytester.makepyfile(test_blocks=OPEN_BLOCKS)
    result = pytester.runpytest(*PLUGIN, "--speedflags-leaks=fail")
    result.assert_outcomes(failed=2, passed=1)
    test_file = pytester.path / "test_blocks.py"
    result.stdout.fnmatch_lines(
        [
            "*test_blocks.py::test_leaves_a_model_block_open left torch flags changed*",
            "  param_dtype, memory_format:",
            "    Linear#*.param_dtype: False -> 'bfloat16'",
            "    write: the speedflags block fast_math(param_dtype='bf16', model=Linear) on "
            f"Linear#*, entered at {test_file}:10 and never exited (still open)",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "*test_blocks.py::test_leaves_a_process_block_open left torch flags changed*",
            "  cudnn_benchmark: False -> True",
            "    write: the speedflags block fast_math(cudnn_benchmark=True), entered at "
            f"{test_file}:14 and never exited (still open)",
        ]
    )
    assert "unknown: no write through Python was seen" not in result.stdout.str()


def test_the_put_back_is_recorded_on_the_ledger(leaky: pytest.Pytester) -> None:
    leaky.runpytest(*PLUGIN, "--speedflags-leaks=fail", "-k", "benchmark_leak")
    record = speedflags.ledger().history[-1]
    assert (record.lever, record.action, record.before, record.after) == (
        "cudnn_benchmark",
        "restore",
        True,
        False,
    )
    assert record.label.startswith("pytest --speedflags-leaks: put back after ")


def test_the_marker_runs_the_test_under_fast_math(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        import torch

        pytestmark = pytest.mark.speedflags(cudnn_benchmark=False, matmul_precision="high")

        @pytest.mark.speedflags(cudnn_benchmark=True, amp="bf16", device="cpu")
        def test_marked():
            assert torch.backends.cudnn.benchmark  # the closest mark wins
            assert torch.get_float32_matmul_precision() == "high"  # the module's mark
            assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16  # autocast

        def test_module_mark_only():
            assert not torch.backends.cudnn.benchmark
            assert torch.get_float32_matmul_precision() == "high"

        def test_after():
            assert torch.get_float32_matmul_precision() == "high"  # still the module mark
        """
    )
    result = pytester.runpytest(*PLUGIN, "--strict-markers", "--speedflags-leaks=fail")
    result.assert_outcomes(passed=3)


def test_the_marker_works_with_leak_checks_off(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        import torch

        @pytest.mark.speedflags(cudnn_benchmark=True)
        def test_marked():
            assert torch.backends.cudnn.benchmark

        def test_after():
            assert not torch.backends.cudnn.benchmark
        """
    )
    pytester.runpytest(*PLUGIN, "--strict-markers").assert_outcomes(passed=2)


@pytest.mark.parametrize(
    ("mark", "message"),
    [
        ("tf33=True", "*unexpected keyword argument 'tf33'; the levers are amp, *"),
        ("tf32='yes'", "*fast_math(tf32='yes'): expected True or False, got str*"),
        ("True", "*takes lever keyword arguments only*"),
    ],
)
def test_a_bad_marker_makes_the_test_an_error(
    pytester: pytest.Pytester, mark: str, message: str
) -> None:
    pytester.makepyfile(
        f"""
        import pytest

        @pytest.mark.speedflags({mark})
        def test_marked():
            pass
        """
    )
    result = pytester.runpytest(*PLUGIN, "--strict-markers")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([message])


def test_an_unknown_leaks_value_is_a_usage_error(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest(*PLUGIN, "--speedflags-leaks=loud")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--speedflags-leaks: invalid choice: 'loud'*off*warn*fail*"])


def test_an_unknown_ini_value_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nspeedflags_leaks = loud\n")
    result = pytester.runpytest(*PLUGIN)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*speedflags_leaks = 'loud': expected one of off, warn, fail*"])


def test_setup_cfg_declares_the_pytest11_entry_point() -> None:
    setup_cfg = ROOT / "setup.cfg"
    if not setup_cfg.exists():
        pytest.skip("no setup.cfg next to the package (installed without sources)")
    config = configparser.ConfigParser()
    config.read(setup_cfg)
    pytest11 = config["options.entry_points"]["pytest11"]
    entries = dict(
        (part.strip() for part in line.split("=", 1)) for line in pytest11.splitlines() if line
    )
    assert entries == {"speedflags": "speedflags.pytest_plugin"}
    assert "transformers" in config["options.extras_require"]["test"]


def test_installed_and_named_with_p_it_registers_once(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Installing makes the module the entry point "speedflags"; an explicit
    # "-p speedflags.pytest_plugin" then names the same module again. A dist-info on the
    # path stands for the installation (this environment may not have it installed).
    site = pytester.mkdir("site")
    info = site / "speedflags_fake-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: speedflags-fake\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[pytest11]\nspeedflags = speedflags.pytest_plugin\n")
    path = os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path)
    pytester.makepyfile(
        """
        import torch

        def test_leak():
            torch.backends.cudnn.benchmark = True
        """
    )
    for args in ((), PLUGIN, ("-p", "speedflags")):
        result = pytester.runpytest_subprocess(*args, "--speedflags-leaks=fail")
        assert "already registered" not in result.stderr.str(), args
        result.assert_outcomes(failed=1)
