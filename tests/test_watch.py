"""speedflags.watch(): every Python write to a lever's torch state is recorded with its writer.

The writers are real: PyTorch's own attributes, functions and context managers, transformers'
``enable_tf32``, a library-style module, another thread. After each test the conftest guard
checks that no flag leaked; writers here are undone with raw torch calls after watching.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import types
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Tuple

import pytest
import torch
from conftest import HAS_NEW_API, reset_all
from torch.backends.cuda import enable_flash_sdp  # imported by name before any watch starts

import speedflags
from speedflags import DriftWarning, MixedTF32APIError, _watcher, fast_math
from speedflags._own_writes import OWN_WRITES
from speedflags._watch_torch import SETTERS
from speedflags.levers import _fp32_family as family
from speedflags.levers.registry import LEVER_NAMES, REGISTRY
from speedflags.report import build_report, render_report

HERE = os.path.abspath(__file__)
SHORTHANDS = {spec.shorthand for spec in REGISTRY}


@pytest.fixture(autouse=True)
def undo() -> Iterator[None]:
    """Writers here change flags on purpose: put them back with raw torch calls."""
    yield
    reset_all()


@pytest.fixture
def unwatched() -> Iterator[None]:
    """For tests of watching itself: pause the session's watch (--speedflags-leaks) if any."""
    watcher = _watcher._WATCHER
    running = watcher.count if watcher is not None else 0
    for _ in range(running):
        watcher.stop()  # type: ignore[union-attr]
    yield
    for _ in range(running):
        watcher.start(None)  # type: ignore[union-attr]


def enable_tf32() -> Callable[[bool], None]:
    """transformers' enable_tf32, its cache cleared (5.x caches it: a second call does nothing)."""
    import_utils = pytest.importorskip("transformers.utils.import_utils")
    if not hasattr(import_utils, "enable_tf32"):
        pytest.skip("this transformers is too old to have enable_tf32")
    getattr(import_utils.enable_tf32, "cache_clear", lambda: None)()
    return import_utils.enable_tf32  # type: ignore[no-any-return]


def first_line(fn: Callable[..., Any]) -> int:
    return fn.__code__.co_firstlineno + 1  # writers are one statement, right after the def


# --- one writer per Python path ----------------------------------------------------------


def legacy_cublas() -> None:
    torch.backends.cuda.matmul.allow_tf32 = True


def legacy_cudnn() -> None:
    torch.backends.cudnn.allow_tf32 = False


def precision_function() -> None:
    torch.set_float32_matmul_precision("medium")


def benchmark_attribute() -> None:
    torch.backends.cudnn.benchmark = True


def cudnn_set_flags() -> None:
    torch.backends.cudnn.set_flags(_benchmark=True)


def cudnn_flags_block() -> None:
    with torch.backends.cudnn.flags(enabled=torch.backends.cudnn.enabled, benchmark=True):
        pass


def sdpa_enable_function() -> None:
    torch.backends.cuda.enable_math_sdp(False)


def sdpa_imported_before_watching() -> None:
    enable_flash_sdp(not torch.backends.cuda.flash_sdp_enabled())


def sdpa_kernel_block() -> None:
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        pass


def autocast_setter() -> None:
    torch.set_autocast_enabled("cpu", True)


def autocast_dtype_setter() -> None:
    torch.set_autocast_dtype("cpu", torch.float16)


def autocast_block() -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pass


def generic_node() -> None:
    torch.backends.fp32_precision = "tf32"


def cuda_all_node() -> None:
    torch.backends.cudnn.fp32_precision = "ieee"


def cuda_matmul_node() -> None:
    torch.backends.cuda.matmul.fp32_precision = "tf32"


def cudnn_conv_node() -> None:
    torch.backends.cudnn.conv.fp32_precision = "ieee"


def cudnn_rnn_node() -> None:
    torch.backends.cudnn.rnn.fp32_precision = "ieee"


def mkldnn_node() -> None:
    torch.backends.mkldnn.fp32_precision = "bf16"


def mkldnn_matmul_node() -> None:
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"


def mkldnn_conv_node() -> None:
    torch.backends.mkldnn.conv.fp32_precision = "tf32"


def mkldnn_rnn_node() -> None:
    torch.backends.mkldnn.rnn.fp32_precision = "bf16"


PATHS: List[Tuple[Callable[[], None], str]] = [
    (legacy_cublas, "tf32"),
    (legacy_cudnn, "tf32"),
    (precision_function, "matmul_precision"),
    (benchmark_attribute, "cudnn_benchmark"),
    (cudnn_set_flags, "cudnn_benchmark"),
    (cudnn_flags_block, "cudnn_benchmark"),
    (sdpa_enable_function, "sdpa_backend"),
    (sdpa_imported_before_watching, "sdpa_backend"),
    (sdpa_kernel_block, "sdpa_backend"),
    (autocast_setter, "autocast"),
    (autocast_dtype_setter, "autocast"),
    (autocast_block, "autocast"),
]
NEW_API_PATHS: List[Tuple[Callable[[], None], str]] = [
    (generic_node, "tf32"),
    (cuda_all_node, "tf32"),
    (cuda_matmul_node, "tf32"),
    (cudnn_conv_node, "tf32"),
    (cudnn_rnn_node, "tf32"),
    (mkldnn_node, "tf32"),
    (mkldnn_matmul_node, "tf32"),
    (mkldnn_conv_node, "tf32"),
    (mkldnn_rnn_node, "tf32"),
]
ALL_PATHS = PATHS + [
    pytest.param(
        *case,
        marks=pytest.mark.skipif(not HAS_NEW_API, reason="no fp32_precision API (added in 2.9)"),
    )
    for case in NEW_API_PATHS
]


@pytest.mark.parametrize(("writer", "lever"), ALL_PATHS, ids=lambda v: getattr(v, "__name__", v))
def test_every_python_path_is_recorded_with_its_writer(
    writer: Callable[[], None], lever: str
) -> None:
    before = speedflags.snapshot()
    with speedflags.watch() as w:
        writer()
    assert speedflags.snapshot() != before or writer in (cudnn_flags_block, sdpa_kernel_block,
                                                          autocast_block)  # fmt: skip
    records = w.records
    assert records, f"{writer.__name__}: nothing recorded"
    first = records[0]
    assert first.action == "external"
    assert first.lever == lever
    assert first.lever in SHORTHANDS
    assert first.label == writer.__name__  # the writer's function name
    assert first.where == f"{HERE}:{first_line(writer)}"  # for a `with`: the with line
    assert first.thread == threading.current_thread().name
    assert first.before != first.after
    assert writer.__name__ in first.reason and first.where in first.reason


def test_a_block_records_its_entry_and_its_exit_at_the_with_line() -> None:
    with speedflags.watch() as w:
        cudnn_flags_block()
    benchmark = [(r.before, r.after, r.where) for r in w.records if r.lever == "cudnn_benchmark"]
    where = f"{HERE}:{first_line(cudnn_flags_block)}"
    assert benchmark == [(False, True, where), (True, False, where)]


def test_writes_that_change_nothing_are_not_recorded() -> None:
    with speedflags.watch() as w:
        torch.backends.cudnn.benchmark = torch.backends.cudnn.benchmark
        torch.backends.cuda.enable_math_sdp(torch.backends.cuda.math_sdp_enabled())
        torch.set_autocast_enabled("cpu", torch.is_autocast_enabled("cpu"))
    assert w.records == ()


def test_the_records_describe_the_state_like_the_levers_own_records() -> None:
    with speedflags.watch() as w:
        precision_function()
    (record,) = w.records
    assert record.before["torch.get_float32_matmul_precision()"] == "highest"
    assert record.after["torch.get_float32_matmul_precision()"] == "medium"
    assert record.reason == (
        f"torch.set_float32_matmul_precision('medium') by precision_function at "
        f"{HERE}:{first_line(precision_function)}"
    )
    assert record.seq in [r.seq for r in speedflags.ledger().history]
    assert '"action": "external"' in speedflags.ledger().to_json()


def test_transformers_enable_tf32_is_named_with_its_file_and_line() -> None:
    import_utils = pytest.importorskip("transformers.utils.import_utils")
    writer = enable_tf32()
    with speedflags.watch() as w:
        writer(True)
    assert w.records
    for record in w.records:
        assert record.lever == "tf32"
        assert record.label == "enable_tf32"
        assert record.where.startswith(import_utils.__file__ + ":")
    if HAS_NEW_API:  # transformers writes only the new API on PyTorch 2.9+
        assert w.records[0].reason.startswith("torch.backends.fp32_precision set to 'tf32'")


def test_a_library_module_is_named_where_it_writes(tmp_path: Path) -> None:
    library = load_library(tmp_path)
    with speedflags.watch() as w:
        library.configure()
    (record,) = w.records
    assert record.lever == "matmul_precision"
    assert record.label == "configure"
    assert record.where == f"{library.__file__}:4"


def test_a_writer_in_another_thread_is_recorded_with_that_thread() -> None:
    def writer() -> None:
        torch.backends.cudnn.benchmark = True

    with speedflags.watch() as w:
        thread = threading.Thread(target=writer, name="flag-writer")
        thread.start()
        thread.join()
    (record,) = w.records
    assert record.thread == "flag-writer"
    assert record.label == "writer"
    assert record.where == f"{HERE}:{first_line(writer)}"


def test_speedflags_own_writes_are_not_external() -> None:
    with speedflags.watch() as w:
        with fast_math(tf32=True, matmul_precision="high", cudnn_benchmark=True, amp="bf16",
                       sdpa="math", device="cpu"):  # fmt: skip
            pass
        schedule = speedflags.TF32Schedule({0: True, 1: False})
        schedule.step(0)
        schedule.step(1)
        schedule.close()
        if HAS_NEW_API:
            generic_node()  # external: mixes the two APIs
            speedflags.heal_tf32()  # speedflags' own repair: not external
    assert [r.label for r in w.records] == (["generic_node"] if HAS_NEW_API else [])
    assert OWN_WRITES.depth == 0


# --- starting, stopping, nothing left behind -----------------------------------------------


def installed() -> Dict[str, Any]:
    """Every name watch() may replace, as it is now."""
    found: Dict[str, Any] = {}
    for name in SETTERS:
        found[f"torch._C.{name}"] = getattr(torch._C, name, None)
        found[f"torch.{name}"] = getattr(torch, name, None)
    for module_name in ("torch.backends", "torch.backends.cudnn", "torch.backends.mkldnn"):
        module = sys.modules[module_name]
        for attr, value in vars(type(module)).items():
            if hasattr(value, "setter") and not isinstance(value, property):
                found[f"{module_name}.{attr}"] = value.setter
    return found


def test_stop_puts_every_original_back(unwatched: None) -> None:
    before = installed()
    w = speedflags.watch()
    assert w.start() is w
    during = installed()
    assert [k for k in before if during[k] is not before[k]], "nothing was wrapped"
    assert (
        type(torch.backends.cudnn).__dict__["benchmark"].setter
        is not before["torch.backends.cudnn.benchmark"]
    )
    w.stop()
    after = installed()
    assert all(after[k] is before[k] for k in before)


def test_speedflags_caches_no_wrapper_that_would_outlive_the_watch() -> None:
    family._PLANS.clear()
    family._TRUSTED.clear()
    family._FAST.clear()
    with speedflags.watch():
        for value in (True, False):
            with fast_math(tf32=value, matmul_precision="medium" if value else "highest"):
                pass
    cached = [fn for ops in family._TRUSTED.values() for fn, _ in ops]
    cached += [fn for _, ops in family._FAST.values() for fn, _ in ops]
    assert cached
    assert not [fn for fn in cached if hasattr(fn, "__wrapped__")]


def test_watches_nest_and_only_the_last_stop_removes_the_wrappers(unwatched: None) -> None:
    original = torch._C._set_cudnn_benchmark
    outer = speedflags.watch().start()
    with speedflags.watch() as inner:
        benchmark_attribute()
    assert torch._C._set_cudnn_benchmark is not original  # the outer watch still runs
    assert len(inner.records) == 1
    torch.backends.cudnn.benchmark = False
    outer.stop()
    outer.stop()  # stopping twice, or a watch never started, does nothing
    speedflags.watch().stop()
    assert torch._C._set_cudnn_benchmark is original
    assert [r.after for r in outer.records] == [True, False]
    assert repr(outer) == "<speedflags.watch() stopped>"


def test_starting_a_started_watch_is_refused() -> None:
    with speedflags.watch() as w, pytest.raises(RuntimeError, match="already started"):
        w.start()


def test_nothing_is_recorded_when_not_watching(unwatched: None) -> None:
    w = speedflags.watch()
    history = len(speedflags.ledger().history)
    benchmark_attribute()
    assert w.records == ()
    assert len(speedflags.ledger().history) == history


# --- changes made around Python --------------------------------------------------------------


def test_a_change_around_python_is_found_at_the_next_boundary(unwatched: None) -> None:
    # A reference to the C function taken before watching stands for C++ code: no wrapper
    # sees the call.
    unseen = torch._C._set_cudnn_benchmark
    with speedflags.watch() as w:
        with fast_math(tf32=False, label="first"):
            pass
        unseen(True)
        with fast_math(tf32=False, label="second"):
            pass
        unseen(False)
    (record,) = w.records  # the last change is after the last boundary: not seen
    assert (record.lever, record.action, record.before, record.after) == (
        "cudnn_benchmark",
        "external",
        False,
        True,
    )
    assert record.label == "unknown code"
    assert record.where == ""
    assert "between 'first' at" in record.reason and "and 'second' at" in record.reason
    assert HERE in record.reason


# --- errors and reports name the culprit -------------------------------------------------


@pytest.mark.skipif(not HAS_NEW_API, reason="a legacy-only PyTorch cannot be mixed")
def test_mixed_tf32_error_names_the_writer() -> None:
    import_utils = pytest.importorskip("transformers.utils.import_utils")
    writer = enable_tf32()
    with speedflags.watch():
        writer(True)
        with pytest.raises(MixedTF32APIError) as excinfo, fast_math(tf32=True):
            pass
        status = speedflags.tf32_status()
    message = str(excinfo.value)
    assert "Last written by: torch.backends.fp32_precision set to 'tf32' by enable_tf32 at " in (
        message
    )
    assert f"{import_utils.__file__}:" in message
    assert status.last_written_by is not None
    assert status.last_written_by.startswith("torch.backends.fp32_precision set to 'tf32' by")
    assert status.to_dict()["last_written_by"] == status.last_written_by


@pytest.mark.skipif(not HAS_NEW_API, reason="a legacy-only PyTorch cannot be mixed")
def test_mixed_tf32_error_says_how_to_find_the_writer_when_not_watching(unwatched: None) -> None:
    generic_node()
    with pytest.raises(MixedTF32APIError, match=r"speedflags\.watch\(\)"), fast_math(tf32=True):
        pass


def test_drift_warning_names_the_writer() -> None:
    with speedflags.watch(), pytest.warns(DriftWarning) as caught:
        with fast_math(cudnn_benchmark=True):
            torch.backends.cudnn.benchmark = False
            line = sys._getframe().f_lineno - 1
    message = str(caught[0].message)
    assert f"torch.backends.cudnn.benchmark set to False by {sys._getframe().f_code.co_name}" in (
        message
    )
    assert f"{HERE}:{line}" in message


def test_a_last_writer_is_forgotten_once_the_state_changes_unseen(
    tmp_path: Path, unwatched: None
) -> None:
    library = load_library(tmp_path)
    with speedflags.watch():
        library.configure()
        assert "by configure at" in (speedflags.tf32_status().last_written_by or "")
    torch.set_float32_matmul_precision("highest")  # not watching now
    assert speedflags.tf32_status().last_written_by is None


def test_report_has_a_last_written_by_column(tmp_path: Path) -> None:
    library = load_library(tmp_path)
    with speedflags.watch():
        library.configure()
        benchmark_attribute()
        report = build_report("cpu")
    writers = report["last_written_by"]
    assert writers["cudnn_benchmark"].endswith(f"by benchmark_attribute at {HERE}:"
                                               f"{first_line(benchmark_attribute)}")  # fmt: skip
    assert writers["matmul_precision.torch.get_float32_matmul_precision()"].startswith(
        "torch.set_float32_matmul_precision('high') by configure at "
    )
    text = render_report(report)
    assert "last written by" in text
    line = next(x for x in text.splitlines() if x.strip().startswith("cudnn_benchmark ="))
    assert f"by benchmark_attribute at {HERE}:" in line


def load_library(tmp_path: Path) -> types.ModuleType:
    """A library-style module that sets the matmul precision when configured (line 4)."""
    source = textwrap.dedent(
        """\
        import torch

        def configure():
            torch.set_float32_matmul_precision("high")
        """
    )
    path = tmp_path / "fastlib.py"
    path.write_text(source)
    module = types.ModuleType("fastlib")
    module.__file__ = str(path)
    exec(compile(source, str(path), "exec"), module.__dict__)  # noqa: S102 - the test's own file
    return module


# --- the registry, the environment, the import ---------------------------------------------


def test_every_wrapped_setter_names_a_registry_lever() -> None:
    assert {setter.lever for setter in SETTERS.values()} <= set(LEVER_NAMES)
    assert {setter.lever for setter in SETTERS.values()} == set(LEVER_NAMES)


def run_python(code: str, **env: str) -> str:
    environment = {k: v for k, v in os.environ.items() if k != "SPEEDFLAGS_WATCH"}
    environment.update(env)
    environment["PYTHONPATH"] = os.pathsep.join(
        [str(Path(speedflags.__file__).parent.parent), environment.get("PYTHONPATH", "")]
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=environment, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


WATCHED_AT_IMPORT = """
import sys, torch, speedflags
torch.backends.cudnn.benchmark = True
print([(r.lever, r.action, r.label) for r in speedflags.ledger().history])
print(sorted(m for m in ("pytest", "transformers") if m in sys.modules))
"""


def test_speedflags_watch_env_starts_watching_at_import() -> None:
    out = run_python(WATCHED_AT_IMPORT, SPEEDFLAGS_WATCH="1").splitlines()
    assert out == ["[('cudnn_benchmark', 'external', '<module>')]", "[]"]


def test_without_the_env_nothing_is_watched_and_no_extra_is_imported() -> None:
    out = run_python(WATCHED_AT_IMPORT).splitlines()
    assert out == ["[]", "[]"]
