"""Writes PyTorch makes by itself are nobody's leak: named as torch's, never blamed on a block.

On a Hopper GPU with a recent cuDNN, PyTorch's first SDPA call in a process moves cuDNN
attention to the front of the priority order (pytorch/pytorch#185511). No CPU path makes
such a lazy write, so these tests make one the same way: a function whose code lies in a
torch module other than its setting APIs calls the setter (the file is only named, never
written). The GPU check is listed in docs/gpu_check.md.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._C as torch_C

import speedflags
from speedflags.errors import DriftWarning

C: Any = torch_C
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


def _made_in(path: str, body: str) -> Callable[[], None]:
    # a function whose frames report ``path`` as their file, as torch's own code would
    namespace: dict = {"C": C}
    exec(compile(f"def lazily():\n    {body}\n", path, "exec"), namespace)  # noqa: S102
    return namespace["lazily"]  # type: ignore[no-any-return]


TORCH_INTERNAL = os.path.join(TORCH_DIR, "nn", "functional.py")
TORCH_API = os.path.join(TORCH_DIR, "backends", "cudnn", "__init__.py")


def test_a_write_from_inside_torch_is_named_as_torchs_reached_from_the_caller() -> None:
    lazily = _made_in(TORCH_INTERNAL, "C._set_cudnn_benchmark(True)")
    try:
        with speedflags.watch() as seen:
            lazily()  # the user's call into torch
        (record,) = [r for r in seen.records if r.lever == "cudnn_benchmark"]
    finally:
        C._set_cudnn_benchmark(False)
    assert "by PyTorch itself (lazily at " in record.reason
    assert "functional.py" in record.reason
    assert "reached from test_a_write_from_inside_torch_is_named" in record.reason
    assert "test_torch_writes.py:" in record.reason


def test_a_write_through_torchs_setting_api_stays_the_callers() -> None:
    through_api = _made_in(TORCH_API, "C._set_cudnn_benchmark(True)")
    try:
        with speedflags.watch() as seen:
            through_api()
        (record,) = [r for r in seen.records if r.lever == "cudnn_benchmark"]
    finally:
        C._set_cudnn_benchmark(False)
    assert "PyTorch itself" not in record.reason
    assert record.reason.startswith("torch.backends.cudnn.benchmark set to True by ")


def test_a_block_is_not_blamed_for_torchs_own_write_and_still_restores(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lazily = _made_in(TORCH_INTERNAL, "C._set_cudnn_benchmark(False)")
    caplog.set_level(logging.INFO, logger="speedflags")
    with speedflags.watch(), warnings.catch_warnings():
        warnings.simplefilter("error")  # a DriftWarning would fail here
        with speedflags.fast_math(cudnn_benchmark=True, device="cpu", label="step"):
            lazily()
    assert torch.backends.cudnn.benchmark is False  # restored: what the block found
    (message,) = [r.getMessage() for r in caplog.records if r.name == "speedflags"]
    assert message.startswith("cudnn_benchmark was changed inside 'step' (entered at ")
    assert "by PyTorch itself, not by the block: torch.backends.cudnn.benchmark set to " in message
    record = speedflags.ledger().history[-1]
    assert (record.lever, record.action) == ("cudnn_benchmark", "restore")
    assert record.reason.startswith("changed by PyTorch itself")


def test_the_same_change_by_the_block_is_still_drift() -> None:
    with speedflags.watch(), pytest.warns(DriftWarning, match="Last written by: torch.backends"):
        with speedflags.fast_math(cudnn_benchmark=True, device="cpu"):
            torch.backends.cudnn.benchmark = False
    assert torch.backends.cudnn.benchmark is False


# --- the same write made in C++ (pytorch/pytorch#185511), where no watch can see it -------

HAS_PRIORITY = hasattr(C, "_get_sdp_priority_order")
MATH, FLASH, EFFICIENT, CUDNN = 0, 1, 2, 3  # torch.nn.attention.SDPBackend codes
needs_priority = pytest.mark.skipif(not HAS_PRIORITY, reason="no SDPA priority order here")
# the setter itself, never a watch's wrapper (the plugin may watch the whole session before
# this module is imported): a call stands for PyTorch's C++ write, which no watch sees
_set_order = getattr(C, "_set_sdp_priority_order", None)
_set_order_in_cpp = getattr(_set_order, "__wrapped__", _set_order)


def _cudnn_first() -> None:
    # what priority_order() in sdp_utils.cpp writes at the first CUDA SDPA call: its default
    # over the first four places, whatever was there
    rest = C._get_sdp_priority_order()[4:]
    _set_order_in_cpp([CUDNN, FLASH, EFFICIENT, MATH, *rest])


@needs_priority
@pytest.mark.parametrize("capability", [(9, 0), (10, 0)])
def test_cudnn_moved_first_on_hopper_is_torchs_own_write_without_a_watch(
    fake_gpu: Callable[..., None], capability: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # Mocked: a CPU build cannot show a GPU's compute capability.
    fake_gpu(capability)
    caplog.set_level(logging.INFO, logger="speedflags")
    before = C._get_sdp_priority_order()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with speedflags.fast_math(sdpa=("flash", "efficient", "math"), device="cpu"):
            _cudnn_first()  # the block's first SDPA call, on the GPU
    assert C._get_sdp_priority_order() == before  # restored all the same
    (message,) = [r.getMessage() for r in caplog.records if r.name == "speedflags"]
    # (named by the lever alone, or, when a watch runs — the suite's own plugin —, by the
    # record the watch made of it at the block's closing boundary)
    assert "by PyTorch itself, not by the block: " in message
    assert "PyTorch's first SDPA call on this GPU wrote its cuDNN-first default" in message
    assert "pytorch/pytorch#185511" in message


@needs_priority
def test_the_same_move_on_an_ampere_gpu_is_drift(fake_gpu: Callable[..., None]) -> None:
    fake_gpu((8, 0))  # Mocked, as above: PyTorch does not make this write on sm80
    with pytest.warns(DriftWarning, match="sdpa was changed inside"):
        with speedflags.fast_math(sdpa=("flash", "efficient", "math"), device="cpu"):
            _cudnn_first()


@needs_priority
def test_a_watch_records_the_cpp_move_as_torchs_at_the_next_boundary(
    fake_gpu: Callable[..., None],
) -> None:
    fake_gpu((9, 0))
    before = C._get_sdp_priority_order()
    try:
        # an order PyTorch's write changes: on a GPU machine the suite has made that write
        # already (conftest), so the order may be cuDNN-first before the test
        _set_order_in_cpp([MATH, EFFICIENT, FLASH, CUDNN, *before[4:]])
        with speedflags.watch() as seen:
            # A boundary first, where a watch that ran before this test (the suite's plugin)
            # learns that order: otherwise it still expects the cuDNN-first order it saw
            # last, and the move below brings back just that (the second GPU run's failure).
            with speedflags.fast_math(cudnn_benchmark=False, device="cpu"):
                pass
            known = len(seen.records)
            _cudnn_first()
            with speedflags.fast_math(cudnn_benchmark=False, device="cpu"):  # a boundary
                pass
    finally:
        _set_order_in_cpp(before)
    (record,) = [r for r in seen.records[known:] if r.lever == "sdpa"]
    assert record.reason.startswith("changed by PyTorch itself, around Python: PyTorch's first")


@needs_priority
def test_the_write_over_a_cudnn_first_preference_is_torchs_too(
    fake_gpu: Callable[..., None], caplog: pytest.LogCaptureFixture
) -> None:
    # Mocked GPU, as above. Seen on an H200 (PyTorch 2.11): under sdpa="cudnn" the order is
    # cudnn, math, flash, ...; PyTorch's write makes it cudnn, flash, efficient, math.
    fake_gpu((9, 0))
    caplog.set_level(logging.INFO, logger="speedflags")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with speedflags.fast_math(sdpa="cudnn", device="cpu"):
            assert C._get_sdp_priority_order()[:2] == [CUDNN, MATH]
            _cudnn_first()
    (message,) = [r.getMessage() for r in caplog.records if r.name == "speedflags"]
    assert "by PyTorch itself, not by the block: " in message


@needs_priority
def test_another_reordering_on_hopper_is_still_drift(fake_gpu: Callable[..., None]) -> None:
    fake_gpu((9, 0))  # Mocked GPU, as above
    with pytest.warns(DriftWarning, match="sdpa was changed inside"):
        with speedflags.fast_math(sdpa=("flash", "efficient", "math"), device="cpu"):
            rest = C._get_sdp_priority_order()[4:]
            _set_order_in_cpp([CUDNN, MATH, FLASH, EFFICIENT, *rest])  # not PyTorch's write


def test_a_frame_setting_sdpa_settles_pytorchs_pending_write_and_reading_never_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Mocked: the write itself needs a Hopper GPU; here a recorder stands for it.
    from speedflags.levers import sdpa

    calls: list[object] = []
    monkeypatch.setattr(sdpa, "_torch_write_pending", True)
    monkeypatch.setattr(sdpa, "_settle_torch_first_call", lambda: calls.append(sdpa.SdpaLever))
    speedflags.snapshot()
    with speedflags.fast_math(cudnn_benchmark=True, device="cpu"):
        pass
    assert calls == []  # observing, and frames without the sdpa lever, leave it pending
    with speedflags.fast_math(sdpa="math", device="cpu"):
        assert calls == [sdpa.SdpaLever]  # made before the frame read the order it restores


def test_without_cuda_in_use_the_pending_write_is_never_made() -> None:
    from speedflags.levers import sdpa

    with speedflags.fast_math(sdpa="math", device="cpu"):
        pass
    if not torch.cuda.is_available():
        assert sdpa._torch_write_pending is False  # settled for good: no CUDA, no such write
        assert not torch.cuda.is_initialized()  # type: ignore[no-untyped-call, unused-ignore]
    elif not torch.cuda.is_initialized():  # type: ignore[no-untyped-call, unused-ignore]
        assert sdpa._torch_write_pending is sdpa.HAS_PRIORITY  # waits for CUDA to be in use
