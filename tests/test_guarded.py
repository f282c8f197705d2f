"""Guarded settings: read, described, put back exactly, in snapshot(), and named by watch()."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import speedflags
from speedflags._watch.writers import last_writers
from speedflags.errors import InvalidValueError
from speedflags.levers import guarded
from speedflags.levers.guarded import GUARDED, GUARDED_NAMES, SKIPPED, setting

# How user code changes each setting through torch's public API (the line the watch must
# name), and what the setting then reads as, described.
CHANGES: dict[str, tuple[Callable[[], Any], Any]] = {
    "default_dtype": (lambda: torch.set_default_dtype(torch.float64), "float64"),
    "default_device": (lambda: torch.set_default_device("meta"), "meta"),
    "cudnn_enabled": (lambda: setattr(torch.backends.cudnn, "enabled", False), False),
    "mkldnn_enabled": (lambda: setattr(torch.backends.mkldnn, "enabled", False), False),
    # on a CPU build only "ck" (besides the default) can be set; no other linalg library
    "blas_library": (lambda: torch.backends.cuda.preferred_blas_library("ck"), "Ck"),
    "linalg_library": (
        lambda: torch.backends.cuda.preferred_linalg_library("cusolver"),
        "Cusolver",
    ),
    "autocast_cache": (lambda: torch.set_autocast_cache_enabled(False), False),
    "autocast_nesting": (lambda: torch.autocast_increment_nesting(), 1),
    "grad_enabled": (lambda: torch.set_grad_enabled(False), False),
    "num_threads": (lambda: torch.set_num_threads(torch.get_num_threads() - 1), None),
}


def test_every_guarded_setting_has_a_test_and_is_here_or_says_why() -> None:
    assert set(CHANGES) == set(GUARDED_NAMES)
    for name in GUARDED_NAMES:
        if name in SKIPPED:
            assert SKIPPED[name].startswith(f"this PyTorch ({torch.__version__}) has no ")
        else:
            assert setting(name).name == name


@pytest.mark.parametrize("name", [s.name for s in GUARDED])
def test_a_change_is_read_and_put_back_exactly(name: str) -> None:
    guard = setting(name)
    change, expected = CHANGES[name]
    before = guard.read()
    _skip_what_this_build_cannot_set(name)
    change()
    try:
        changed = guard.read()
        assert changed != before
        if expected is not None:
            assert guard.describe(changed) == expected
        assert speedflags.snapshot()[name] == guard.describe(changed)
    finally:
        after = guard.restore(before, guard.read())
    assert after == before == guard.read()


def _skip_what_this_build_cannot_set(name: str) -> None:
    if name == "num_threads" and torch.get_num_threads() == 1:
        pytest.skip("one intra-op thread: nothing lower to set")
    if name == "linalg_library" and not torch.backends.cuda.is_built():
        pytest.skip("a CPU build can set no linalg library but the default (cuSOLVER, MAGMA: CUDA)")


@pytest.mark.parametrize("name", [s.name for s in GUARDED])
def test_watch_names_the_line_that_wrote_each_setting(name: str) -> None:
    _skip_what_this_build_cannot_set(name)
    guard = setting(name)
    before = guard.read()
    change, _ = CHANGES[name]
    try:
        with speedflags.watch():
            change()
            writer = last_writers()[name]
    finally:
        guard.restore(before, guard.read())
    assert "test_guarded.py:" in writer, writer


def test_snapshot_has_every_lever_and_every_guarded_setting() -> None:
    from speedflags.levers.registry import LEVER_NAMES, MODEL_LEVER_NAMES

    levers = set(LEVER_NAMES) - set(MODEL_LEVER_NAMES)  # a model lever has no process state
    assert set(speedflags.snapshot()) == levers | {s.name for s in GUARDED}
    assert speedflags.snapshot()["default_dtype"] == "float32"
    assert speedflags.snapshot()["grad_enabled"] is True


def test_an_unknown_name_is_refused_with_the_valid_ones() -> None:
    with pytest.raises(
        InvalidValueError, match=r"no guarded setting 'dtype'; valid: .*default_dtype"
    ):
        setting("dtype")


def test_a_pytorch_without_a_setting_skips_it_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Mocked: PyTorch 2.1 has no preferred-BLAS accessors; this build has them.
    monkeypatch.delattr(torch._C, "_get_blas_preferred_backend", raising=False)
    found, skipped = guarded._candidates()
    assert "blas_library" not in {s.name for s in found}
    # (PyTorch 2.1 lacks the setter too, and says so after it)
    assert skipped["blas_library"].startswith(
        f"this PyTorch ({torch.__version__}) has no _get_blas_preferred_backend"
    )


def test_the_nesting_depth_is_read_without_a_watch_seeing_it() -> None:
    # Reading the depth moves it up and back down; only torch.autocast's own two moves
    # may be recorded.
    with speedflags.watch() as seen:
        assert setting("autocast_nesting").read() == 0
        with torch.autocast("cpu"):
            assert setting("autocast_nesting").read() == 1
    moves = [(r.before, r.after) for r in seen.records if r.lever == "autocast_nesting"]
    assert moves == [(0, 1), (1, 0)]
