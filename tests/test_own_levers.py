"""A lever of one's own: ``speedflags.lever(name, read=..., write=...)`` end to end, a class
written to part of the protocol, what is refused, the type a checker reads, and the levers
an installed package declares under the entry-point group ``speedflags.levers`` (a package
made in a temporary folder: its module and a hand-written ``.dist-info`` on ``PYTHONPATH``,
in a subprocess)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
from conftest import last_seq, mypy_disagrees, needs_mypy, records_since

import speedflags
from speedflags import DriftWarning, InvalidTypeError, InvalidValueError
from speedflags.levers import registry

ROOT = Path(__file__).resolve().parent.parent
BOX: dict[str, Any] = {"size": 8}


def _read() -> int:
    return int(BOX["size"])


def _write(value: int) -> None:
    BOX["size"] = value


@pytest.fixture
def size() -> Iterator[speedflags.OwnLever[int]]:
    yield speedflags.lever("batch_size", read=_read, write=_write)
    speedflags.unregister_lever("batch_size")  # pytest runs this whatever the test did
    BOX["size"] = 8


# --- the three lines, end to end -----------------------------------------------------------


def test_the_lever_is_its_own_block_nests_and_restores(size: Any) -> None:
    with size(16) as frame:
        assert BOX["size"] == 16 and frame.levers == ("batch_size",)
        assert frame.label == "batch_size(16)"
        with size(32):
            assert BOX["size"] == 32
        assert BOX["size"] == 16
    assert BOX["size"] == 8


def test_an_exception_restores_and_propagates_unchanged(size: Any) -> None:
    with pytest.raises(KeyError, match="inside"), size(16):
        raise KeyError("inside")
    assert BOX["size"] == 8


def test_a_change_inside_the_block_is_restored_and_warned(size: Any) -> None:
    with pytest.warns(DriftWarning, match=r"batch_size was changed inside .* found 64"):
        with size(16):
            _write(64)
    assert BOX["size"] == 8


def test_the_history_records_its_set_and_restore(size: Any) -> None:
    seq = last_seq()
    with size(16):
        pass
    assert [(r.lever, r.action, r.before, r.after, r.label) for r in records_since(seq)] == [
        ("batch_size", "set", 8, 16, "batch_size(16)"),
        ("batch_size", "restore", 16, 8, "batch_size(16)"),
    ]


def test_snapshot_and_the_report_show_it(size: Any) -> None:
    assert speedflags.snapshot()["batch_size"] == 8
    with size(16):
        assert speedflags.snapshot()["batch_size"] == 16
    from speedflags.report import build_report

    assert build_report()["levers"]["batch_size"] == 8


def test_it_is_a_keyword_of_fast_math_speedup_and_schedule(size: Any) -> None:
    with speedflags.fast_math(cudnn_benchmark=True, **size.keyword(16)):
        assert BOX["size"] == 16 and torch.backends.cudnn.benchmark
    with speedflags.fast_math(batch_size=4):
        assert BOX["size"] == 4

    @speedflags.speedup(device="cpu", **size.keyword(32))
    def step() -> int:
        return _read()

    assert step() == 32 and BOX["size"] == 8
    with speedflags.Schedule({0: {"batch_size": 4}, 2: {}}) as schedule:  # type: ignore[dict-item]
        schedule.step(0)
        assert BOX["size"] == 4
        schedule.step(2)
        assert BOX["size"] == 8
    assert BOX["size"] == 8


def test_its_block_decorates_functions_generators_and_coroutines(size: Any) -> None:
    import asyncio

    @size(16)
    def call() -> int:
        return _read()

    @size(16)
    def steps() -> Iterator[int]:
        yield _read()
        yield _read()

    @size(16)
    async def coroutine() -> int:
        await asyncio.sleep(0)
        return _read()

    assert call() == 16 and BOX["size"] == 8
    seen = []
    for value in steps():
        seen.append((value, _read()))  # between steps, the consumer sees the value outside
    assert seen == [(16, 8), (16, 8)]
    assert asyncio.run(coroutine()) == 16 and BOX["size"] == 8


@pytest.mark.parametrize("fullgraph", [False, True], ids=["default", "fullgraph"])
def test_its_block_in_compiled_code_runs_eagerly_or_is_refused(size: Any, fullgraph: bool) -> None:
    torch._dynamo.reset()
    seen: list[int] = []
    probe = torch.compiler.disable(lambda: seen.append(_read()))

    def step(x: torch.Tensor) -> torch.Tensor:
        with size(16):
            probe()
            return x + 1

    compiled = torch.compile(step, backend="aot_eager", fullgraph=fullgraph)
    x = torch.ones(2)
    try:
        if fullgraph:
            with pytest.raises(speedflags.LeverInGraphError, match="batch_size=16"):
                compiled(x)
            assert seen == []
        else:
            torch.testing.assert_close(compiled(x), x + 1)
            assert seen == [16]
    finally:
        torch._dynamo.reset()
    assert BOX["size"] == 8


def test_a_thread_scope_lever_holds_in_its_thread_only() -> None:
    local = threading.local()

    def read() -> int:
        return int(getattr(local, "value", 0))

    def write(value: int) -> None:
        local.value = value

    mine = speedflags.lever("per_thread_knob", read=read, write=write, scope="thread")
    try:
        seen: list[int] = []
        with mine(3):
            other = threading.Thread(target=lambda: seen.append(read()))
            other.start()
            other.join()
            assert read() == 3
        assert seen == [0] and read() == 0
    finally:
        speedflags.unregister_lever("per_thread_knob")


def test_values_and_validate_refuse_before_anything_changes() -> None:
    mode = {"now": "fast"}
    choice = speedflags.lever(
        "kernel_choice",
        read=lambda: mode["now"],
        write=lambda value: mode.update(now=value),
        values=("fast", "exact"),
    )

    def positive(value: object) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"expected an int, got {type(value).__name__}")
        if value <= 0:
            raise ValueError("expected a positive count")
        return value

    count = speedflags.lever("chunk_count", read=_read, write=_write, validate=positive)
    try:
        with pytest.raises(InvalidValueError, match=r"kernel_choice='slow'\): .*'fast', 'exact'"):
            choice("slow")  # type: ignore[arg-type]
        with pytest.raises(InvalidValueError, match=r"chunk_count=0\): expected a positive"):
            speedflags.fast_math(chunk_count=0, cudnn_benchmark=True)
        with pytest.raises(InvalidTypeError, match=r"chunk_count='2'\): expected an int"):
            count("2")  # type: ignore[arg-type]
        assert mode["now"] == "fast" and BOX["size"] == 8
        assert not torch.backends.cudnn.benchmark
        assert registry.lever_spec("kernel_choice").values == "one of 'fast', 'exact'"
    finally:
        speedflags.unregister_lever("kernel_choice")
        speedflags.unregister_lever("chunk_count")


# --- a class written to part of the protocol -----------------------------------------------


class Knob:
    """``name``, ``read`` and ``apply``: the required members; the rest are defaults."""

    name = "knob_of_mine"
    state = 0

    def read(self) -> int:
        return self.state

    def apply(self, value: int, before: int) -> int:
        self.state = value
        return self.read()  # what read() answers after the write: the one rule


def test_a_class_with_name_read_and_apply_is_a_lever() -> None:
    knob = Knob()
    spec = speedflags.register_lever(knob)
    try:
        assert spec.lever().domain == "knob_of_mine" and spec.scope == "process"
        with speedflags.fast_math(knob_of_mine=5):
            assert knob.state == 5
            with speedflags.fast_math(knob_of_mine=7):
                assert knob.state == 7
            assert knob.state == 5
        assert knob.state == 0  # restored through apply: restore's default
        assert speedflags.register_lever(knob) is spec  # the same object again: once
    finally:
        speedflags.unregister_lever("knob_of_mine")


def test_registering_the_same_lever_again_does_nothing(size: Any) -> None:
    assert speedflags.register_lever(size) is registry.lever_spec("batch_size")
    assert registry.LEVER_NAMES.count("batch_size") == 1


# --- refused -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("domain", "owner"),
    [
        ("fp32_precision", "tf32"),
        ("cudnn_benchmark", "cudnn_benchmark"),
        ("amp:cpu", "amp"),
        ("amp:cuda", "amp"),
        ("amp:xla", "amp"),  # any device's autocast
        ("param_dtype:Linear#3", "param_dtype"),  # a model lever's, for any model
        ("memory_format:Conv2d#1", "memory_format"),
    ],
)
def test_a_domain_of_a_built_in_lever_is_refused(domain: str, owner: str) -> None:
    knob = Knob()
    knob.domain = domain  # type: ignore[attr-defined]
    with pytest.raises(InvalidValueError, match=rf"domain '{re.escape(domain)}' is {owner}'s"):
        speedflags.register_lever(knob)
    assert "knob_of_mine" not in registry.LEVER_NAMES


def test_a_domain_of_another_registered_lever_is_refused(size: Any) -> None:
    with pytest.raises(InvalidValueError, match="domain 'batch_size' is batch_size's"):
        knob = Knob()
        knob.domain = "batch_size"  # type: ignore[attr-defined]
        speedflags.register_lever(knob)


@pytest.mark.parametrize(
    ("name", "taken"),
    [
        ("tf32", "a built-in lever"),
        ("amp", "a built-in lever"),
        ("param_dtype", "a built-in lever"),
        ("device", "an argument of fast_math"),
        ("model", "an argument of fast_math"),
    ],
)
def test_a_taken_name_is_refused(name: str, taken: str) -> None:
    before = registry.REGISTRY
    with pytest.raises(
        InvalidValueError, match=rf"lever\('{name}'\): the name '{name}' is taken \({taken}\)"
    ):
        speedflags.lever(name, read=_read, write=_write)
    assert before == registry.REGISTRY


def test_a_name_registered_by_another_lever_is_refused(size: Any) -> None:
    with pytest.raises(InvalidValueError, match=r"is taken \(a registered lever\)"):
        speedflags.lever("batch_size", read=_read, write=_write)


@pytest.mark.parametrize(
    ("given", "error", "words"),
    [
        ({"read": 3}, InvalidTypeError, r"read=3 is not callable"),
        ({"write": "set"}, InvalidTypeError, r"write='set' is not callable"),
        ({"validate": 1.5}, InvalidTypeError, r"validate=1.5 is not callable"),
        ({"values": "ab"}, InvalidTypeError, r"values='ab': expected a collection"),
        ({"scope": "model"}, InvalidValueError, r"scope 'model'; valid: 'process', 'thread'"),
        ({"name": "two words"}, InvalidValueError, r"'two words' is not a keyword argument"),
        ({"name": "class"}, InvalidValueError, r"'class' is not a keyword argument"),
    ],
)
def test_a_malformed_lever_is_refused(given: dict[str, Any], error: type, words: str) -> None:
    arguments: dict[str, Any] = {"name": "malformed", "read": _read, "write": _write, **given}
    before = registry.REGISTRY
    with pytest.raises(error, match=words):
        speedflags.lever(**arguments)
    assert before == registry.REGISTRY


def test_a_read_that_raises_at_registration_is_refused() -> None:
    def broken() -> int:
        raise RuntimeError("no such setting")

    with pytest.raises(
        InvalidValueError, match=r"lever\('unreadable'\): read\(\) raised RuntimeError: no such"
    ) as refused:
        speedflags.lever("unreadable", read=broken, write=_write)
    assert isinstance(refused.value.__cause__, RuntimeError)
    assert "unreadable" not in registry.LEVER_NAMES


def test_a_read_that_answers_an_unhashable_state_is_refused() -> None:
    with pytest.raises(InvalidTypeError, match=r"read\(\) answered \[1, 2\], a list, .*hashable"):
        speedflags.lever("listed", read=lambda: [1, 2], write=_write)
    assert "listed" not in registry.LEVER_NAMES


def test_an_object_without_the_required_members_is_refused() -> None:
    class NoApply:
        name = "no_apply"

        def read(self) -> int:
            return 0

    with pytest.raises(InvalidTypeError, match=r"register_lever\('no_apply'\): .* it has no apply"):
        speedflags.register_lever(NoApply())


# --- what a type checker reads ---------------------------------------------------------------

# Each line marked "# error" must be refused by mypy; every other line must pass.
SNIPPET = """\
import torch
import speedflags
from speedflags import fast_math, speedup

num_threads = speedflags.lever(
    "num_threads", read=torch.get_num_threads, write=torch.set_num_threads
)
with num_threads(1):
    pass
with num_threads(1) as frame:
    print(frame.label)
@num_threads(2)
def f(x: int) -> int:
    return x
y: int = f(3)
fast_math(tf32=True, **num_threads.keyword(1))
speedup(amp="bf16", **num_threads.keyword(1))
mode = speedflags.lever("mode", read=lambda: "a", write=print, values=("a", "b"))
with mode("b"):
    pass
lever: speedflags.OwnLever[int] = num_threads
num_threads("1")  # error
num_threads.keyword("1")  # error
mode(3)  # error
fast_math(num_threads=1)  # error
"""


@needs_mypy
def test_mypy_reads_the_value_type_from_read(tmp_path: Path) -> None:
    # fast_math(num_threads=1) stays refused: LeverArgs names the built-in levers; the lever's
    # own call and its keyword() are the typed paths (docs/your_own_levers.md)
    accepted, refused, output = mypy_disagrees(SNIPPET, tmp_path, "own_lever.py")
    assert not accepted, f"mypy accepted: {accepted}\n{output}"
    assert not refused, f"mypy refused: {refused}\n{output}"


# --- levers installed packages declare --------------------------------------------------------

LIBRARY = """\
import speedflags

SETTINGS = {"workers": 1}
MADE = []

workers = speedflags.lever(
    "lib_workers",
    read=lambda: SETTINGS["workers"],
    write=lambda value: SETTINGS.update(workers=value),
)
MADE.append(workers)
"""


def _install(site: Path, entries: str, modules: dict[str, str]) -> None:
    """A package made by hand, as pip would lay it out: its modules and a ``.dist-info``
    with the entry points (``importlib.metadata`` finds it on ``sys.path``)."""
    for name, source in modules.items():
        (site / f"{name}.py").write_text(textwrap.dedent(source), encoding="utf-8")
    info = site / "my_library-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-library\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[speedflags.levers]\n{entries}\n")


def _run(site: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(site)])
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd or site,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


@pytest.fixture
def site(tmp_path: Path) -> Path:
    where = tmp_path / "site"
    where.mkdir()
    _install(where, "lib_workers = my_library:workers", {"my_library": LIBRARY})
    return where


def test_an_installed_lever_is_known_by_name_without_being_imported(site: Path) -> None:
    done = _run(site, "-W", "error", "-c", textwrap.dedent("""\
        import sys, speedflags
        assert "my_library" not in sys.modules
        with speedflags.fast_math(lib_workers=4):
            from my_library import SETTINGS, MADE
            assert SETTINGS["workers"] == 4
        assert SETTINGS["workers"] == 1 and len(MADE) == 1
        print("ok")
        """))  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_a_module_imported_first_and_loaded_through_its_entry_point_registers_once(
    site: Path,
) -> None:
    done = _run(site, "-W", "error", "-c", textwrap.dedent("""\
        import my_library, speedflags
        from speedflags.levers import registry
        assert speedflags.snapshot()["lib_workers"] == 1  # every installed lever loaded
        assert registry.LEVER_NAMES.count("lib_workers") == 1 and len(my_library.MADE) == 1
        print("ok")
        """))  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_an_installed_lever_appears_in_the_report(site: Path) -> None:
    done = _run(site, "-m", "speedflags", "report")
    assert done.returncode == 0, done.stderr
    assert re.search(r"^  lib_workers = 1$", done.stdout, re.MULTILINE), done.stdout
    done = _run(site, "-m", "speedflags", "verify", "--levers", "lib_workers")
    assert done.returncode == 2
    # known by name: refused as a lever verify cannot measure, not as an unknown name
    assert "lib_workers" in done.stderr and "unknown lever" not in done.stderr, done.stderr


def test_the_leak_check_catches_an_installed_lever_a_test_leaves_changed(site: Path) -> None:
    tests = site.parent / "tests"
    tests.mkdir()
    (tests / "test_leaks.py").write_text(textwrap.dedent("""\
        def test_leaves_it_changed():
            import my_library
            my_library.SETTINGS["workers"] = 7

        def test_sees_it_put_back():
            import my_library
            assert my_library.SETTINGS["workers"] == 1
        """))  # fmt: skip
    done = _run(
        site, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "speedflags.pytest_plugin",
        "--speedflags-leaks=fail", "test_leaks.py", cwd=tests,
    )  # fmt: skip
    assert "1 failed, 1 passed" in done.stdout, done.stdout + done.stderr
    assert "test_leaves_it_changed left torch flags changed" in done.stdout
    assert "  lib_workers: 1 -> 7" in done.stdout


def test_an_entry_that_cannot_be_loaded_is_left_out_with_a_warning(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    _install(
        site,
        "broken = broken_library:lever\nnot_a_lever = plain_library:VALUE\n"
        "lib_workers = my_library:workers\nother_name = my_library:workers",
        {
            "broken_library": "raise ImportError('a dependency is missing')\n",
            "plain_library": "VALUE = 3\n",
            "my_library": LIBRARY,
        },
    )
    done = _run(site, "-c", textwrap.dedent("""\
        import warnings, speedflags
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            snapshot = speedflags.snapshot()
        for warning in caught:
            print(warning.category.__name__, warning.message)
        print("lib_workers" in snapshot)
        try:
            speedflags.fast_math(broken=1)
        except TypeError as exc:
            print("refused:", exc)
        """))  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert re.search(
        r"InstalledLeverWarning the lever 'broken' that my-library 1.0 installs "
        r"\(broken_library:lever\) could not be loaded: ImportError: a dependency",
        out,
    )
    assert (
        "'not_a_lever' that my-library 1.0 installs (plain_library:VALUE) is not a lever made "
        "with speedflags.lever(): it is 3" in out
    )
    assert (
        "'other_name' that my-library 1.0 installs (my_library:workers) is named "
        "'lib_workers'" in out
    )
    assert "\nTrue\n" in out  # the others load
    assert re.search(
        r"refused: fast_math\(\) got an unexpected keyword argument 'broken'.*"
        r"\(the lever 'broken' .* could not be loaded",
        out,
    )


def test_a_lever_over_a_guarded_setting_is_watched_as_the_lever() -> None:
    # num_threads is a guarded setting (watched, leak-checked); a lever of one's own over it
    # takes it over: its blocks' writes are speedflags' own, never "external"
    num_threads = speedflags.lever(
        "num_threads", read=torch.get_num_threads, write=torch.set_num_threads
    )
    try:
        seq = last_seq()
        with speedflags.watch():
            with num_threads(1):
                pass
            with num_threads(1):
                pass
        actions = [(r.lever, r.action) for r in speedflags.ledger().history if r.seq > seq]
        assert ("num_threads", "external") not in actions, actions
        assert actions.count(("num_threads", "set")) == 2
    finally:
        speedflags.unregister_lever("num_threads")
