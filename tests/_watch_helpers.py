"""What the watch() tests share: undoing their writers, pausing the session's watch."""

from __future__ import annotations

import textwrap
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import reset_all

from speedflags._watch import watcher as _watcher


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
