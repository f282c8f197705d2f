"""speedflags.watch(): every Python write to a lever's torch state is recorded with its writer.

The writers are real: PyTorch's own attributes, functions and context managers, transformers'
``enable_tf32``, a library-style module, another thread. After each test the conftest guard
checks that no flag leaked; writers here are undone with raw torch calls after watching.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _watch_helpers import enable_tf32, first_line, load_library, undo  # noqa: F401 - fixture
from conftest import (
    HAS_GENERIC_AUTOCAST,
    HAS_NEW_API,
    autocast_enabled,
    needs_sdpa_kernel,
    set_autocast_enabled,
)
from torch.backends.cuda import enable_flash_sdp  # imported by name before any watch starts

import speedflags
from speedflags import fast_math
from speedflags._ledger.own_writes import OWN_WRITES
from speedflags._watch.setters import SETTERS
from speedflags.levers.guarded import GUARDED
from speedflags.levers.registry import LEVER_NAMES, MODEL_LEVER_NAMES, REGISTRY

HERE = os.path.abspath(__file__)
NAMES = {spec.name for spec in REGISTRY}


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


# PyTorch < 2.4's per-device setters: the API there (deprecated since, still present)
def autocast_cpu_setter() -> None:
    torch.set_autocast_cpu_enabled(True)


def autocast_gpu_dtype_setter() -> None:
    torch.set_autocast_gpu_dtype(torch.bfloat16)


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


needs_generic_autocast = pytest.mark.skipif(
    not HAS_GENERIC_AUTOCAST,
    reason=f"PyTorch {torch.__version__} has no device-generic torch.set_autocast_enabled("
    "device_type, enabled) or torch.set_autocast_dtype (added in 2.4)",
)
# torch 2.4+ warns on each call of the per-device setters; they are still what they wrap
old_autocast_api = pytest.mark.filterwarnings(
    "ignore:torch.set_autocast_(cpu|gpu)_.* is deprecated:DeprecationWarning"
)

PATHS: list[Any] = [
    (legacy_cublas, "tf32"),
    (legacy_cudnn, "tf32"),
    (precision_function, "matmul_precision"),
    (benchmark_attribute, "cudnn_benchmark"),
    (cudnn_set_flags, "cudnn_benchmark"),
    (cudnn_flags_block, "cudnn_benchmark"),
    (sdpa_enable_function, "sdpa"),
    (sdpa_imported_before_watching, "sdpa"),
    pytest.param(sdpa_kernel_block, "sdpa", marks=needs_sdpa_kernel),
    pytest.param(autocast_setter, "amp", marks=needs_generic_autocast),
    pytest.param(autocast_dtype_setter, "amp", marks=needs_generic_autocast),
    pytest.param(autocast_cpu_setter, "amp", marks=old_autocast_api),
    pytest.param(autocast_gpu_dtype_setter, "amp", marks=old_autocast_api),
    (autocast_block, "amp"),
]
NEW_API_PATHS: list[tuple[Callable[[], None], str]] = [
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
    assert first.lever in NAMES  # the lever's one name, as in speedflags' own records
    assert first.label == writer.__name__  # the writer's function name
    assert first.where == f"{HERE}:{first_line(writer)}"  # for a `with`: the with line
    assert first.thread == threading.current_thread().name
    assert first.before != first.after
    assert writer.__name__ in first.reason and first.where in first.reason


def test_a_block_records_its_entry_and_its_exit_at_the_with_line() -> None:
    with speedflags.watch() as w:
        cudnn_flags_block()
    benchmark = [(r.before, r.after, r.where) for r in w.records if r.lever == "cudnn_benchmark"]
    line = first_line(cudnn_flags_block)
    where = f"{HERE}:{line}"
    # PEP 626 (Python 3.10): a with block's exit is reported at the with's line
    assert benchmark == [(False, True, where), (True, False, where)]


@needs_generic_autocast  # the per-device setters before it take no keywords
def test_a_call_with_keywords_is_shown_as_made() -> None:
    with speedflags.watch() as w:
        torch.set_autocast_enabled(device_type="cpu", enabled=True)
    assert w.records[0].reason.startswith(
        "torch.set_autocast_enabled(device_type='cpu', enabled=True) by "
    )


def test_writes_that_change_nothing_are_not_recorded() -> None:
    with speedflags.watch() as w:
        torch.backends.cudnn.benchmark = torch.backends.cudnn.benchmark
        torch.backends.cuda.enable_math_sdp(torch.backends.cuda.math_sdp_enabled())
        set_autocast_enabled("cpu", autocast_enabled("cpu"))  # torch's, by attribute
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
        thread.join(30)
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
        with fast_math(cudnn_benchmark=False):  # a boundary: would find unexplained changes
            pass
    assert [r.label for r in w.records] == (["generic_node"] if HAS_NEW_API else [])
    assert OWN_WRITES.depth == 0


def test_a_lever_has_one_name_in_own_external_and_unexplained_records() -> None:
    # Failed before: speedflags' own writes were recorded as "amp"/"sdpa", the same torch
    # state written by anyone else as "autocast"/"sdpa_backend" (the shorthands' names).
    start = speedflags.ledger().history[-1].seq if speedflags.ledger().history else 0
    with speedflags.watch() as w:
        with fast_math(amp="bf16", sdpa="math", device="cpu"):
            pass
        autocast_block()  # set and put back by torch.autocast: external records
        sdpa_enable_function()  # external, through Python
        torch._C._set_sdp_use_math.__wrapped__(True)  # unseen: found at the next boundary
        with fast_math(cudnn_benchmark=False):
            pass
    records = [r for r in speedflags.ledger().history if r.seq > start]
    own = {r.lever for r in records if r.action in ("set", "restore")}
    external = [r.lever for r in records if r.action == "external"]
    unexplained = [r.lever for r in w.records if r.label == "unknown code"]
    assert own >= {"amp", "sdpa"}
    assert "amp" in external and external.count("sdpa") == 2
    assert unexplained == ["sdpa"]
    assert not {"autocast", "sdpa_backend"} & {*own, *external}


def test_every_wrapped_setter_names_a_registry_lever_or_guarded_setting() -> None:
    guarded = {s.name for s in GUARDED}
    process_and_thread = set(LEVER_NAMES) - set(MODEL_LEVER_NAMES)  # a model's: no setter
    assert {setter.lever for setter in SETTERS.values()} == process_and_thread | guarded


@pytest.mark.parametrize("subpackage", ["", "_ledger", "_watch", "levers"])
def test_the_writer_is_never_a_frame_inside_speedflags(subpackage: str) -> None:
    # A write that passes through any speedflags module (top level or a subpackage) is
    # attributed to the first frame outside the package: here, this test.
    from speedflags._watch.setters import writer_frame

    inside = Path(speedflags.__file__).resolve().parent / subpackage / "_a_module.py"
    namespace: dict = {"writer_frame": writer_frame}
    code = compile("def relay():\n    return writer_frame()\n", str(inside), "exec")
    exec(code, namespace)  # noqa: S102 - a function whose file is inside the package
    frame = namespace["relay"]()
    assert frame is not None and frame.f_code is sys._getframe().f_code
