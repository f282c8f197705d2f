"""The leak check over the guarded settings: each leak is caught, put back and attributed;
a write PyTorch makes by itself is reported as information, never as the test's leak."""

from __future__ import annotations

import textwrap

import pytest
import torch

from speedflags.levers.guarded import GUARDED, setting

PLUGIN = ("-p", "speedflags.pytest_plugin", "-W", "ignore::pytest.PytestAssertRewriteWarning")

# One leaky line per setting (the writer the report must name), in a test file.
LEAKS: dict[str, str] = {
    "default_dtype": "torch.set_default_dtype(torch.float64)",
    "default_device": "torch.set_default_device('meta')",
    "cudnn_enabled": "torch.backends.cudnn.enabled = False",
    "mkldnn_enabled": "torch.backends.mkldnn.enabled = False",
    "blas_library": "torch.backends.cuda.preferred_blas_library('ck')",
    "linalg_library": "torch.backends.cuda.preferred_linalg_library('cusolver')",
    "autocast_cache": "torch.set_autocast_cache_enabled(False)",
    "autocast_nesting": "torch.autocast('cpu').__enter__()",
    "grad_enabled": "torch.set_grad_enabled(False)",
    "num_threads": "torch.set_num_threads(1)",
}


def _settable(name: str) -> bool:
    if name == "linalg_library":
        return bool(torch.backends.cuda.is_built())  # a CPU build sets no other library
    if name == "num_threads":
        return torch.get_num_threads() > 1
    return True


@pytest.mark.parametrize("name", [s.name for s in GUARDED])
def test_a_leak_of_each_guarded_setting_is_caught_put_back_and_attributed(
    pytester: pytest.Pytester, name: str
) -> None:
    if not _settable(name):
        pytest.skip(f"this build cannot change {name}")
    guard = setting(name)
    before = guard.read()
    pytester.makepyfile(
        test_leak=textwrap.dedent(
            f"""\
            import torch


            def test_leaks():
                {LEAKS[name]}
            """
        )
    )
    result = pytester.runpytest(*PLUGIN, "--speedflags-leaks=fail", "-p", "no:warnings")
    assert guard.read() == before  # put back by the plugin (the inner run is in-process)
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "speedflags: 1 test left torch settings changed" in out
    assert f"  {name}: " in out
    assert "test_leak.py:5" in out  # the writer's line, named by the watch


def test_a_write_pytorch_makes_by_itself_is_information_not_a_leak(
    pytester: pytest.Pytester,
) -> None:
    # No CPU path makes such a write: the test makes one from a function whose code lies in
    # torch/nn/functional.py (see tests/test_torch_writes.py).
    before = torch.backends.cudnn.benchmark
    pytester.makepyfile(
        test_torch=textwrap.dedent(
            """\
            import os
            import torch

            PATH = os.path.join(os.path.dirname(torch.__file__), "nn", "functional.py")
            NS = {"C": torch._C}
            exec(compile("def lazily():\\n    C._set_cudnn_benchmark(True)\\n", PATH, "exec"), NS)


            def test_first_call():
                NS["lazily"]()
            """
        )
    )
    try:
        result = pytester.runpytest(*PLUGIN, "--speedflags-leaks=fail")
        result.assert_outcomes(passed=1)
        out = result.stdout.str()
        assert "speedflags: no test left torch settings changed" in out
        assert "speedflags: PyTorch changed these settings by itself (not a leak" in out
        assert (
            "cudnn_benchmark: torch.backends.cudnn.benchmark set to True by PyTorch itself" in out
        )
        assert torch.backends.cudnn.benchmark is True  # left as PyTorch set it
    finally:
        torch.backends.cudnn.benchmark = before


def test_a_getter_that_raises_reads_as_unreadable_in_the_leak_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from speedflags.levers._base import Unreadable
    from speedflags.pytest_plugin import LeakGuard

    def broken() -> None:
        raise RuntimeError("no dtype today")

    guard = setting("default_dtype")
    monkeypatch.setattr(guard, "_get", broken)  # a getter PyTorch might make raise
    leaks = LeakGuard("fail")
    try:
        state = dict(zip([d.key for d in leaks.domains], leaks.read(), strict=True))
    finally:
        leaks.close()
    assert state["default_dtype"] == Unreadable("RuntimeError", "no dtype today")
    assert state["grad_enabled"] is True
