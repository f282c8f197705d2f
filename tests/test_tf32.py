"""The tf32 and matmul_precision levers: both API families readable, never mixed, exact restore."""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import HAS_NEW_API, C, needs_new_api

import speedflags
from speedflags import MixedTF32APIError, Unreadable, fast_math, heal_tf32, tf32_status
from speedflags._measure.accuracy import relative_error
from speedflags._measure.evidence import FP32_MAX, TF32_MAX
from speedflags._measure.route import medium_route


def tf32_getters() -> dict[str, Any]:
    return speedflags.snapshot()["tf32"]


def legacy_getters_answer() -> bool:
    try:
        _ = torch.backends.cuda.matmul.allow_tf32
        _ = torch.backends.cudnn.allow_tf32
        _ = torch.get_float32_matmul_precision()
    except RuntimeError:
        return False
    return True


# PyTorch internals on the compile/autotune paths that read TF32 state, each as (module,
# function, arguments). Which ones exist, and which still read the legacy getters, changes
# between versions: on 2.13 the first two raise in a mixed state; 2.15 moved them to the new
# API but its bmm template configs still read the legacy allow_tf32. Found by import, not
# by version.
INTERNAL_READERS: list[tuple[str, str, tuple[Any, ...]]] = [
    ("torch._dynamo.graph_region_tracker", "get_global_state_key", ()),
    ("torch._inductor.select_algorithm", "create_precompile_key", ("mm", "key", [])),
    ("torch._inductor.kernel.bmm", "_bmm_shared_a_configs", (torch.float32,)),
]


def internal_readers() -> list[tuple[str, Callable[[], Any]]]:
    found = []
    for module, name, args in INTERNAL_READERS:
        try:
            fn = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
        found.append((f"{module}.{name}", lambda fn=fn, args=args: _drain(fn(*args))))
    return found


def _drain(result: Any) -> Any:
    # some readers are generators: the read happens when they are iterated
    return list(result) if inspect.isgenerator(result) else result


def compile_paths_work() -> None:
    """Call the PyTorch internals that read TF32 state (the legacy ones raise when mixed)."""
    for _, reader in internal_readers():
        reader()


# --- behaviour 2: inside tf32=True both families say TF32 and nothing raises ---------------


@needs_new_api
def test_inside_tf32_both_families_read_tf32_and_no_getter_raises() -> None:
    before = tf32_getters()
    with fast_math(tf32=True):
        assert torch.backends.cuda.matmul.allow_tf32 is True
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
        assert torch.backends.cudnn.allow_tf32 is True
        assert torch.backends.cudnn.conv.fp32_precision == "tf32"
        assert torch.backends.cudnn.rnn.fp32_precision == "tf32"
        assert torch.get_float32_matmul_precision() == "high"
        assert all(not isinstance(v, Unreadable) for v in tf32_getters().values())
        compile_paths_work()
    assert tf32_getters() == before


def test_torch_compile_runs_inside_the_tf32_block() -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ x.T).sum(dim=1)

    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(0))
    expected = step(x)
    torch._dynamo.reset()
    with fast_math(tf32=True, matmul_precision="high"):
        compiled = torch.compile(step, backend="inductor")
        got = compiled(x)
        compile_paths_work()
    torch._dynamo.reset()
    torch.testing.assert_close(got, expected)


@needs_new_api
def test_new_api_only_write_breaks_the_compile_paths(raw_tf32: None) -> None:
    # The bug speedflags exists for (seed 000/001): if no internal reader of this PyTorch
    # raises any more, the compile-path checks above no longer prove anything and
    # INTERNAL_READERS needs a reader that still uses the legacy getters.
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    raising = []
    for name, reader in internal_readers():
        try:
            reader()
        except RuntimeError as exc:
            raising.append((name, "mix of the legacy and new APIs" in str(exc)))
    assert raising, f"no internal reader of PyTorch {torch.__version__} raises when mixed"
    assert all(mixed for _, mixed in raising), raising
    with pytest.raises(RuntimeError, match="mix of the legacy and new APIs"):
        _ = torch.backends.cuda.matmul.allow_tf32


@pytest.mark.parametrize("value", [True, False])
def test_tf32_restores_every_getter_of_both_families(value: bool) -> None:
    before = tf32_getters()
    with fast_math(tf32=value):
        assert torch.backends.cuda.matmul.allow_tf32 is value
        assert torch.backends.cudnn.allow_tf32 is value
        assert legacy_getters_answer()
    assert tf32_getters() == before


@pytest.mark.parametrize("precision", ["highest", "high", "medium"])
def test_matmul_precision_reads_as_set_and_restores(precision: str) -> None:
    before = tf32_getters()
    with fast_math(matmul_precision=precision):
        assert torch.get_float32_matmul_precision() == precision
        assert torch.backends.cuda.matmul.allow_tf32 is (precision != "highest")
        if HAS_NEW_API:
            expected_onednn = {"highest": "none", "high": "tf32", "medium": "bf16"}[precision]
            assert torch.backends.mkldnn.matmul.fp32_precision == expected_onednn
        assert legacy_getters_answer()
    assert tf32_getters() == before


def test_medium_precision_really_routes_cpu_matmuls_through_onednn_bf16() -> None:
    # 'medium' is not only a flag: PyTorch reads it for CPU float32 matmuls (oneDNN bf16
    # fpmath). What oneDNN computes then follows the CPU: bf16 arithmetic with AMX (Intel
    # Xeons: a bf16-level error), fp32 without (AMD Zen: an fp32-level error, another kernel's
    # bits). medium_route() found which, once, by trying; this matmul (another size, other
    # inputs) must show the same. Verify's notes follow both answers (test_verify.py, faked).
    route = medium_route()
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(384, 384, generator=g), torch.randn(384, 384, generator=g)
    reference = a.double() @ b.double()
    with fast_math(matmul_precision="medium", device="cpu"):
        inside = a @ b
    error = relative_error(inside, reference)
    if route.bf16:  # the inputs rounded to bf16's 8 bits
        assert TF32_MAX < error < 1e-2, route.reason
    else:  # fp32 arithmetic (no AMX, or no oneDNN route at all)
        assert error < FP32_MAX, route.reason
        torch.testing.assert_close(inside, reference.float(), rtol=1e-4, atol=1e-4)


def test_tf32_and_precision_together_and_nested() -> None:
    before = tf32_getters()
    with fast_math(tf32=True, matmul_precision="medium"):
        assert torch.get_float32_matmul_precision() == "medium"
        with fast_math(tf32=False):
            assert torch.backends.cuda.matmul.allow_tf32 is False
            assert torch.get_float32_matmul_precision() == "highest"
            assert legacy_getters_answer()
        assert torch.get_float32_matmul_precision() == "medium"
        assert torch.backends.cuda.matmul.allow_tf32 is True
    assert tf32_getters() == before


# --- behaviour 3: a mixed process is refused before anything changes ----------------------


def _inheriting_cudnn_leaves() -> None:
    # In a fresh process cuDNN conv/rnn hold a hidden DEFAULT that follows the parent nodes;
    # after any legacy cuDNN write (earlier tests) they are explicit. 'none' inherits the
    # same way, so the mixers below read as in a fresh process (see the subprocess test).
    torch.backends.cudnn.conv.fp32_precision = "none"
    torch.backends.cudnn.rnn.fp32_precision = "none"


MIXERS: dict[str, Callable[[], None]] = {
    "cuda.matmul=tf32": lambda: setattr(torch.backends.cuda.matmul, "fp32_precision", "tf32"),
    "generic=tf32": lambda: setattr(torch.backends, "fp32_precision", "tf32"),
    "generic=ieee": lambda: (
        setattr(torch.backends, "fp32_precision", "ieee"),
        _inheriting_cudnn_leaves(),
    ),
    "generic=bf16": lambda: (
        setattr(torch.backends, "fp32_precision", "bf16"),
        _inheriting_cudnn_leaves(),
    ),
    "cuda.all=tf32": lambda: setattr(torch.backends.cudnn, "fp32_precision", "tf32"),
    "cuda.all=ieee": lambda: (
        setattr(torch.backends.cudnn, "fp32_precision", "ieee"),
        _inheriting_cudnn_leaves(),
    ),
    "cudnn.conv=ieee": lambda: setattr(torch.backends.cudnn.conv, "fp32_precision", "ieee"),
    "mkldnn.matmul=bf16": lambda: setattr(torch.backends.mkldnn.matmul, "fp32_precision", "bf16"),
    "mkldnn.matmul=tf32": lambda: setattr(torch.backends.mkldnn.matmul, "fp32_precision", "tf32"),
    "legacy on, then cuda.matmul=ieee": lambda: (
        setattr(torch.backends.cuda.matmul, "allow_tf32", True),
        setattr(torch.backends.cuda.matmul, "fp32_precision", "ieee"),
    ),
    "medium, then both matmul leaves none": lambda: (
        torch.set_float32_matmul_precision("medium"),
        setattr(torch.backends.cuda.matmul, "fp32_precision", "none"),
        setattr(torch.backends.mkldnn.matmul, "fp32_precision", "none"),
    ),
    "cudnn legacy off, then conv=tf32": lambda: (
        setattr(torch.backends.cudnn, "allow_tf32", False),
        setattr(torch.backends.cudnn.conv, "fp32_precision", "tf32"),
    ),
}


@needs_new_api
@pytest.mark.parametrize("mixer", list(MIXERS), ids=list(MIXERS))
@pytest.mark.parametrize(
    "spec",
    [
        dict(tf32=True),
        dict(tf32=False),
        dict(matmul_precision="high"),
        dict(tf32=True, amp="bf16", cudnn_benchmark=True),
    ],
    ids=["tf32", "tf32-off", "precision", "tf32+amp+benchmark"],
)
def test_mixed_state_is_refused_before_anything_changes(
    raw_tf32: None, mixer: str, spec: dict[str, Any]
) -> None:
    MIXERS[mixer]()
    assert not tf32_status().consistent
    before = speedflags.snapshot()  # includes which getters raise
    history = len(speedflags.ledger().history)
    with pytest.raises(MixedTF32APIError) as excinfo, fast_math(device="cpu", **spec):
        pytest.fail("the block must not run")
    assert speedflags.snapshot() == before
    assert len(speedflags.ledger().history) == history  # nothing was written, so nothing recorded
    message = str(excinfo.value)
    assert "heal_tf32()" in message
    assert "fp32_precision" in message  # names the setting that disagrees
    assert isinstance(excinfo.value, RuntimeError)


@needs_new_api
def test_mixed_message_names_both_settings(raw_tf32: None) -> None:
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    with pytest.raises(MixedTF32APIError) as excinfo, fast_math(tf32=True):
        pass
    message = str(excinfo.value)
    assert "torch.backends.cuda.matmul.fp32_precision is 'tf32'" in message
    assert "legacy matmul precision is 'highest'" in message
    assert "torch.backends.cuda.matmul.allow_tf32" in message


@needs_new_api
@pytest.mark.parametrize("mixer", list(MIXERS), ids=list(MIXERS))
def test_heal_then_the_same_block_works(raw_tf32: None, mixer: str) -> None:
    MIXERS[mixer]()
    effective = tf32_status().effective
    status = heal_tf32()
    assert status.consistent
    assert legacy_getters_answer()
    changed = {k for k in effective if effective[k] != status.effective[k]}
    # Only what no legacy value can express may change, and the notes must say so.
    for key in changed:
        assert any(key.split("_")[0] in note.lower() or "kept" in note for note in status.notes)
    record = speedflags.ledger().history[-1]
    assert (record.lever, record.action) == ("tf32", "heal")
    healed = tf32_getters()
    with fast_math(tf32=True, matmul_precision="high"):
        assert torch.backends.cuda.matmul.allow_tf32 is True
        assert legacy_getters_answer()
        compile_paths_work()
    assert tf32_getters() == healed


@needs_new_api
def test_heal_keeps_what_kernels_use(raw_tf32: None) -> None:
    torch.backends.cuda.matmul.fp32_precision = "tf32"  # kernels run TF32 now
    heal_tf32()
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    assert torch.backends.cuda.matmul.allow_tf32 is True
    assert torch.get_float32_matmul_precision() == "high"


def test_heal_on_a_consistent_state_writes_nothing() -> None:
    before = tf32_getters()
    status = heal_tf32()
    assert status.consistent
    assert tf32_getters() == before
    record = speedflags.ledger().history[-1]
    assert record.action == "heal"
    assert "nothing written" in record.reason


# --- what speedflags writes never leaves a mixed state ------------------------------------


@needs_new_api
@pytest.mark.parametrize(
    "setup",
    [
        lambda: (
            setattr(torch.backends, "fp32_precision", "tf32")
            or torch.set_float32_matmul_precision("high")
        ),
        lambda: torch.set_float32_matmul_precision("medium"),
        lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", True),
        lambda: setattr(torch.backends.cudnn, "allow_tf32", False),
        lambda: setattr(torch.backends.cuda.matmul, "fp32_precision", "ieee"),
    ],
    ids=["generic-tf32+high", "medium", "legacy-on", "cudnn-off", "matmul-ieee"],
)
@pytest.mark.parametrize(
    "spec",
    [
        dict(tf32=True),
        dict(tf32=False),
        dict(matmul_precision="highest"),
        dict(matmul_precision="medium"),
    ],
    ids=["on", "off", "highest", "medium"],
)
def test_consistent_starts_stay_consistent_and_restore_exactly(
    raw_tf32: None, setup: Callable[[], None], spec: dict[str, Any]
) -> None:
    setup()
    assert tf32_status().consistent, "the starting state must be consistent for this test"
    before = tf32_getters()
    with fast_math(**spec):
        assert legacy_getters_answer()
        compile_paths_work()
    assert tf32_getters() == before
    assert legacy_getters_answer()


@needs_new_api
def test_cudnn_off_under_a_tf32_parent_gets_an_explicit_ieee(raw_tf32: None) -> None:
    # With generic='tf32' the legacy cudnn setter alone would leave conv/rnn inheriting
    # 'tf32' while allow_tf32 says False: the mixed state speedflags must correct.
    torch.set_float32_matmul_precision("high")
    torch.backends.fp32_precision = "tf32"
    assert tf32_status().consistent
    with fast_math(tf32=False):
        assert torch.backends.cudnn.allow_tf32 is False
        assert torch.backends.cudnn.conv.fp32_precision == "ieee"
        assert torch.backends.cudnn.rnn.fp32_precision == "ieee"
        assert legacy_getters_answer()


FRESH_PROCESS_SCRIPT = r"""
import torch, speedflags
torch.backends.fp32_precision = "ieee"   # conv/rnn still DEFAULT here: they follow -> mixed
if speedflags.tf32_status().consistent:
    # Some builds give cuDNN's conv and rnn nodes a value of their own ('tf32') before any
    # write (PyTorch 2.11's CUDA build, measured on an H200): they do not follow the root,
    # nothing is mixed, and a block enters and restores exactly.
    status = speedflags.tf32_status()
    assert status.new["torch.backends.cudnn.conv.fp32_precision"] == "tf32", status
    before = speedflags.snapshot()
    with speedflags.fast_math(tf32=True):
        assert torch.backends.cuda.matmul.allow_tf32
    assert speedflags.snapshot() == before
    print("ok")
    raise SystemExit(0)
before = speedflags.snapshot()
try:
    with speedflags.fast_math(tf32=True):
        raise SystemExit("entered a mixed state")
except speedflags.MixedTF32APIError:
    pass
assert speedflags.snapshot() == before
speedflags.heal_tf32()
healed = speedflags.snapshot()
with speedflags.fast_math(tf32=True):
    torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()
assert speedflags.snapshot() == healed
print("ok")
"""


@needs_new_api
def test_fresh_process_default_cudnn_follows_the_root_and_is_refused() -> None:
    import subprocess

    result = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")


def test_env_overrides_are_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
    monkeypatch.delenv("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", raising=False)
    status = tf32_status()
    assert status.env == {"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": None, "NVIDIA_TF32_OVERRIDE": "0"}
    assert any("NVIDIA_TF32_OVERRIDE=0" in note for note in status.notes)


def test_status_and_snapshot_never_raise_in_a_mixed_state(raw_tf32: None) -> None:
    if not HAS_NEW_API:
        pytest.skip(f"PyTorch {torch.__version__} cannot be mixed: it has only the legacy API")
    torch.backends.fp32_precision = "bf16"
    status = tf32_status()
    assert not status.consistent
    assert status.conflicts
    snap = speedflags.snapshot()["tf32"]
    raising = [k for k, v in snap.items() if isinstance(v, Unreadable)]
    assert "torch.get_float32_matmul_precision()" in raising
    assert all("mix of the legacy and new APIs" in snap[k].message for k in raising)


def test_legacy_only_pytorch_is_handled_by_the_legacy_api(monkeypatch: pytest.MonkeyPatch) -> None:
    # Simulates a PyTorch without the fp32_precision API (before 2.9), which this CPU
    # wheel cannot be: speedflags must then read and write the legacy API alone.
    from speedflags.levers import _fp32_torch as family_io
    from speedflags.levers._fp32_model import F_NODES

    monkeypatch.setattr(family_io, "HAS_NEW_API", False)
    state = family_io.read_state()
    assert state[F_NODES] is None
    legacy = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
    )
    with fast_math(tf32=True, matmul_precision="medium"):
        assert torch.backends.cuda.matmul.allow_tf32 is True
        assert torch.get_float32_matmul_precision() == "medium"
    with fast_math(tf32=False):
        assert torch.get_float32_matmul_precision() == "highest"
    assert (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
    ) == legacy
    assert tf32_status().api == "legacy"
    monkeypatch.undo()
    # The legacy setters leave explicit leaves behind on a real 2.9+ PyTorch; put the
    # nodes back so the leak guard sees the process as it was.
    if HAS_NEW_API:
        C._set_fp32_precision_setter("cuda", "matmul", "none")
        C._set_fp32_precision_setter("mkldnn", "matmul", "none")


@pytest.mark.skipif(
    HAS_NEW_API,
    reason=f"PyTorch {torch.__version__} has the fp32_precision API; "
    "test_legacy_only_pytorch_is_handled_by_the_legacy_api simulates a build without it",
)
def test_on_a_legacy_only_build_everything_uses_the_legacy_api_alone(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status = tf32_status()
    assert (status.api, status.consistent, status.new, status.conflicts) == (
        "legacy",
        True,
        None,
        (),
    )
    assert set(tf32_getters()) == {
        "torch.backends.cuda.matmul.allow_tf32",
        "torch.backends.cudnn.allow_tf32",
        "torch.get_float32_matmul_precision()",
    }
    before = tf32_getters()
    with fast_math(tf32=True, matmul_precision="medium"):
        assert torch.backends.cuda.matmul.allow_tf32 is True
        assert torch.get_float32_matmul_precision() == "medium"
        assert tf32_status().effective["onednn_matmul_bf16"] is True
    with fast_math(tf32=False):
        assert torch.backends.cudnn.allow_tf32 is False
    assert tf32_getters() == before
    assert heal_tf32().consistent
    assert speedflags.ledger().history[-1].reason == "already consistent: nothing written"
    from speedflags.__main__ import main

    assert main(["report", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "TF32 API: legacy — legacy only" in out
    assert re.search(r"fp32_precision API +no +PyTorch \S+ has the legacy TF32 API only", out)


def test_torch_utils_benchmark_imports_inside_the_block(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch.utils.benchmark.utils.compile reads get_float32_matmul_precision() at import
    # (2.13; the new API's getter on 2.15).
    try:
        importlib.import_module("torch.utils.benchmark")
    except ModuleNotFoundError as exc:  # PyTorch 2.4's benchmark utilities import NumPy
        pytest.skip(f"PyTorch {torch.__version__}: torch.utils.benchmark needs {exc.name}")
    monkeypatch.delitem(sys.modules, "torch.utils.benchmark.utils.compile", raising=False)
    with fast_math(tf32=True):
        importlib.import_module("torch.utils.benchmark.utils.compile")


# --- values newer PyTorch accepts: 'bfx9' on cuBLAS matmul (2.15+) ----------------------------


def set_bfx9_or_skip() -> None:
    """Write cuda.matmul='bfx9' through the new API, or skip where PyTorch refuses it."""
    if not HAS_NEW_API:
        pytest.skip(f"PyTorch {torch.__version__} has no fp32_precision API (added in 2.9)")
    try:
        torch.backends.cuda.matmul.fp32_precision = "bfx9"
    except RuntimeError as exc:
        pytest.skip(f"PyTorch {torch.__version__} does not accept 'bfx9' for cuBLAS: {exc}")


def test_bfx9_is_kept_by_tf32_off_replaced_by_highest_and_restored(raw_tf32: None) -> None:
    set_bfx9_or_skip()
    assert tf32_status().consistent  # the legacy API reads it as 'not TF32'
    assert any("'bfx9'" in note for note in tf32_status().notes)
    before = tf32_getters()
    with fast_math(tf32=True):
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
        assert legacy_getters_answer()
    assert tf32_getters() == before
    with fast_math(tf32=False):  # bfx9 is not TF32: nothing to switch off
        assert torch.backends.cuda.matmul.fp32_precision == "bfx9"
    with fast_math(matmul_precision="highest"):  # as set_float32_matmul_precision('highest')
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
        assert (
            torch.backends.mkldnn.matmul.fp32_precision
            == before["torch.backends.mkldnn.matmul.fp32_precision"]
        )
        assert legacy_getters_answer()
    assert tf32_getters() == before


def test_bfx9_under_a_legacy_high_is_refused_and_healed(raw_tf32: None) -> None:
    torch.set_float32_matmul_precision("high")
    set_bfx9_or_skip()
    assert not tf32_status().consistent
    with pytest.raises(MixedTF32APIError, match="'bfx9'"), fast_math(tf32=True):
        pytest.fail("the block must not run")
    status = heal_tf32()
    assert status.consistent
    assert torch.backends.cuda.matmul.fp32_precision == "bfx9"  # what kernels used is kept
    assert torch.get_float32_matmul_precision() == "highest"
