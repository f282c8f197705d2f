"""Shared fixtures: the leak guard every test runs under, raw-torch helpers, a faked GPU."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings

import speedflags
import speedflags._hardware as hardware
from speedflags import _warn
from speedflags._hardware import CpuFeatures, KernelTrial, cpu_features
from speedflags._hardware import cpu as hardware_cpu
from speedflags._ledger.ledger import ledger
from speedflags._measure import route
from speedflags.levers._model_lever import OPEN_MODEL_LEVERS
from speedflags.levers.reductions import ReducedPrecisionReductionLever

pytest_plugins = ["pytester"]  # the pytest plugin's tests run pytest inside pytest

settings.register_profile(
    "speedflags",
    deadline=None,  # torch calls make example times uneven; correctness is what is checked
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "speedflags"))

C: Any = torch._C
HAS_NEW_API = hasattr(torch.backends, "fp32_precision")

if torch.cuda.is_available():
    # On a GPU machine CUDA is in use from the start, and PyTorch's one-time first-call
    # write of the SDPA priority order (pytorch/pytorch#185511) is made now, as the sdpa
    # lever makes it before its first frame: the pristine state below is read after it, not
    # changed inside whichever test first sets sdpa.
    from speedflags.levers import sdpa as _sdpa_lever

    torch.cuda.init()
    _sdpa_lever._settle_torch_first_call()
needs_new_api = pytest.mark.skipif(
    not HAS_NEW_API,
    reason=f"PyTorch {torch.__version__} has no fp32_precision API (added in 2.9)",
)

# PyTorch's own answer: can oneDNN run bf16 matmuls on this CPU (AVX-512 or AMX)
ONEDNN_BF16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
needs_sdpa_kernel = pytest.mark.skipif(
    importlib.util.find_spec("torch.nn.attention") is None,
    reason=f"PyTorch {torch.__version__} has no torch.nn.attention (sdpa_kernel, SDPBackend)",
)


# Raw autocast accessors, written without speedflags. PyTorch 2.4 made them device-generic
# (torch.is_autocast_enabled("cpu")); before, each device type had its own functions and the
# bare names (torch.is_autocast_enabled(), torch.set_autocast_enabled(bool)) meant CUDA.
HAS_GENERIC_AUTOCAST = hasattr(torch, "get_autocast_dtype")
# PyTorch < 2.4: (is enabled, get dtype, set enabled, set dtype) per device type
_PER_DEVICE_AUTOCAST = {
    "cpu": ("is_autocast_cpu_enabled", "get_autocast_cpu_dtype", "set_autocast_cpu_enabled",
            "set_autocast_cpu_dtype"),
    "cuda": ("is_autocast_enabled", "get_autocast_gpu_dtype", "set_autocast_enabled",
             "set_autocast_gpu_dtype"),
}  # fmt: skip


def _old_autocast(device_type: str, index: int) -> Any:
    return getattr(torch, _PER_DEVICE_AUTOCAST[device_type][index])


def autocast_enabled(device_type: str) -> bool:
    """``torch.is_autocast_enabled(device_type)``, on every supported PyTorch."""
    if HAS_GENERIC_AUTOCAST:
        return bool(torch.is_autocast_enabled(device_type))
    return bool(_old_autocast(device_type, 0)())


def autocast_dtype(device_type: str) -> torch.dtype:
    """``torch.get_autocast_dtype(device_type)``, on every supported PyTorch."""
    if HAS_GENERIC_AUTOCAST:
        return torch.get_autocast_dtype(device_type)
    return _old_autocast(device_type, 1)()


def set_autocast_enabled(device_type: str, enabled: bool) -> None:
    """``torch.set_autocast_enabled(device_type, enabled)``, on every supported PyTorch."""
    if HAS_GENERIC_AUTOCAST:
        torch.set_autocast_enabled(device_type, enabled)
    else:
        _old_autocast(device_type, 2)(enabled)


def set_autocast_dtype(device_type: str, dtype: torch.dtype) -> None:
    """``torch.set_autocast_dtype(device_type, dtype)``, on every supported PyTorch."""
    if HAS_GENERIC_AUTOCAST:
        torch.set_autocast_dtype(device_type, dtype)
    else:
        _old_autocast(device_type, 3)(dtype)


def _cpu_autocast_takes_fp16() -> bool:
    # PyTorch 2.1's CPU dtype setter raises for float16 ("AutocastCPU only support Bfloat16"),
    # before changing anything; where it accepts it, the dtype is put back.
    before = autocast_dtype("cpu")
    try:
        set_autocast_dtype("cpu", torch.float16)
    except RuntimeError:
        return False
    set_autocast_dtype("cpu", before)
    return True


CPU_AUTOCAST_FP16 = _cpu_autocast_takes_fp16()
needs_cpu_autocast_fp16 = pytest.mark.skipif(
    not CPU_AUTOCAST_FP16,
    reason=f"PyTorch {torch.__version__}'s CPU autocast refuses fp16 (set_autocast_cpu_dtype "
    "takes bf16 only)",
)


def autocast_nesting() -> int:
    # PyTorch has no getter for the autocast nesting counter; +1 then -1 reads it.
    level = torch.autocast_increment_nesting()
    torch.autocast_decrement_nesting()
    return int(level) - 1


def _math_sdp_reduction() -> Any:
    getter = getattr(C, "_get_math_sdp_allow_fp16_bf16_reduction", None)  # PyTorch 2.5+
    return getter() if getter is not None else None


def flag_state() -> dict[str, Any]:
    """Every flag a test could leak: the levers, plus neighbours they must not touch."""
    state = speedflags.snapshot()
    state["others"] = {
        "cudnn.enabled": torch.backends.cudnn.enabled,
        "cudnn.deterministic": torch.backends.cudnn.deterministic,
        "mkldnn.enabled": torch.backends.mkldnn.enabled,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "autocast_cache": torch.is_autocast_cache_enabled(),
        "autocast_nesting": autocast_nesting(),
        "math_sdp_reduction": _math_sdp_reduction(),
        "open_frames": len(ledger().open_frames()),
        # a model left under a model lever, and the global hooks the model levers register
        # while any model is (none may stay behind once the last block closes)
        "model_levers": OPEN_MODEL_LEVERS.read(),
        "global_hooks": global_hook_counts(),
    }
    return state


def global_hook_counts() -> tuple[int, ...]:
    """How many of PyTorch's global optimizer step and module registration hooks are set."""
    from torch.nn.modules import module as module_hooks
    from torch.optim import optimizer as optimizer_hooks

    return tuple(
        len(hooks)
        for hooks in (
            optimizer_hooks._global_optimizer_pre_hooks,
            optimizer_hooks._global_optimizer_post_hooks,
            module_hooks._global_module_registration_hooks,
            module_hooks._global_parameter_registration_hooks,
            module_hooks._global_buffer_registration_hooks,
        )
    )


def reset_tf32_family() -> None:
    """Put both TF32 API families back to a fresh process's readings, with raw torch calls.

    Written without speedflags, so a bug in speedflags cannot hide behind its own reset.
    """
    if HAS_NEW_API:
        for backend, op in (("generic", "all"), ("cuda", "all"), ("mkldnn", "all")):
            C._set_fp32_precision_setter(backend, op, "none")
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = True
    if HAS_NEW_API:
        for backend, op in (
            ("cuda", "matmul"),
            ("mkldnn", "matmul"),
            ("mkldnn", "conv"),
            ("mkldnn", "rnn"),
        ):
            C._set_fp32_precision_setter(backend, op, "none")


def reset_all() -> None:
    reset_tf32_family()
    C._set_cudnn_benchmark(False)
    for name, enabled in PRISTINE_SDP_FLAGS.items():
        getattr(C, f"_set_sdp_use_{name}")(enabled)
    if hasattr(C, "_set_sdp_priority_order"):
        C._set_sdp_priority_order(PRISTINE_SDP_ORDER)
    C._set_deterministic_algorithms(False, warn_only=False)
    C._set_cudnn_deterministic(False)
    reductions.restore(PRISTINE_REDUCTIONS, reductions.read())
    set_autocast_enabled("cpu", False)
    set_autocast_dtype("cpu", torch.bfloat16)
    set_autocast_enabled("cuda", False)
    set_autocast_dtype("cuda", torch.float16)
    while autocast_nesting() > 0:
        torch.autocast_decrement_nesting()
    OPEN_MODEL_LEVERS.restore((), OPEN_MODEL_LEVERS.read())  # a model left under a lever
    ledger()._forget_frames()  # a test that left frames open must not poison the next ones


reductions = ReducedPrecisionReductionLever()
PRISTINE_REDUCTIONS = reductions.read()  # PyTorch's defaults: reduced precision allowed
PRISTINE_SDP_ORDER = (
    list(C._get_sdp_priority_order()) if hasattr(C, "_get_sdp_priority_order") else []
)
# Read, not assumed: PyTorch 2.4 starts with cuDNN attention off, later versions with it on.
PRISTINE_SDP_FLAGS = {
    name: bool(getattr(C, f"_get_{name}_sdp_enabled")())
    for name in ("flash", "mem_efficient", "math", "cudnn", "overrideable")
    if hasattr(C, f"_get_{name}_sdp_enabled") and hasattr(C, f"_set_sdp_use_{name}")
}


def _diff(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for key in sorted(set(a) | set(b), key=str):
            out += _diff(a.get(key), b.get(key), f"{path}.{key}" if path else str(key))
        return out
    return [] if a == b else [f"{path}: {a!r} -> {b!r}"]


_PRISTINE: dict[str, Any] = {}


@pytest.fixture(autouse=True)
def no_flag_leaks() -> Iterator[None]:
    """Fail any test that leaves a flag changed (and put the flags back for the next test)."""
    if not _PRISTINE:
        _PRISTINE.update(flag_state())
    before = flag_state()
    _warn._forget()  # each test sees its own once-per-cause warnings
    yield
    after = flag_state()
    if after != before:
        changes = _diff(before, after)
        reset_all()
        pytest.fail("test leaked flag changes:\n  " + "\n  ".join(changes), pytrace=False)


@pytest.fixture
def raw_tf32() -> Iterator[None]:
    """For tests that write TF32 flags with raw torch calls: reset them afterwards."""
    yield
    reset_tf32_family()


# What pytest-xdist sets in a worker's environment. A session a test starts (pytester) is no
# worker, but inherits them when this suite runs under xdist (the GPU machine's run):
# pytest-benchmark then believes xdist is on and warns so, an error under -W error.
_XDIST_WORKER_VARIABLES = (
    "PYTEST_XDIST_WORKER",
    "PYTEST_XDIST_WORKER_COUNT",
    "PYTEST_XDIST_TESTRUNUID",
)


@pytest.fixture
def pytester(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """pytest's own, with the inner sessions run as a plain pytest is (not as xdist workers)."""
    for name in _XDIST_WORKER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return pytester


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """Pretend a CUDA GPU of a given compute capability is present.

    A CPU build of PyTorch cannot show a GPU's compute capability, so only what
    ``speedflags.capabilities`` asks is faked; every flag is still PyTorch's real one.
    """

    def install(capability: tuple[int, int] = (8, 0), name: str = "NVIDIA A100-SXM4-80GB") -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)
        monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
        monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91002)
        # a CUDA wheel ships the flash kernel; this CPU wheel does not
        monkeypatch.setattr(
            torch.backends.cuda, "is_flash_attention_available", lambda: True, raising=False
        )
        hardware._clear_cache()

    yield install
    hardware._clear_cache()


# CPUs a test can pretend to run on. CI runs on both kinds: AMD EPYCs without AMX (AVX2-only
# Zen 3, AVX512-BF16 Zen 4/5) and Intel Xeons with AMX-BF16, AMX-FP16 and AVX512-FP16.
AMX_XEON = CpuFeatures(
    name="Intel(R) Xeon(R) Platinum 8481C (faked)",
    isa="AVX512",
    avx512_bf16=True,
    amx_bf16=True,
    amx_fp16=True,
    avx512_fp16=True,
)
ZEN4 = CpuFeatures(name="AMD EPYC 9B14 (faked)", isa="AVX512", avx512_bf16=True)
ZEN3 = CpuFeatures(name="AMD EPYC 7B13 (faked)", isa="AVX2")
# What PyTorch 2.1.2 answers on any CPU (measured there): no CPU float16 matmul, no bfloat16
# mse_loss; everything else runs.
TORCH_2_1_KERNELS = {
    torch.float16: KernelTrial(
        "float16", (("matmul", "\"addmm_impl_cpu_\" not implemented for 'Half'"),)
    ),
    torch.bfloat16: KernelTrial(
        "bfloat16", (("mse_loss", "\"mse_cpu\" not implemented for 'BFloat16'"),)
    ),
}
# What a PyTorch with every CPU kernel answers (2.13 does).
ALL_KERNELS = {
    torch.float16: KernelTrial("float16"),
    torch.bfloat16: KernelTrial("bfloat16"),
}
FAKED_ROUTE = "faked for a test: "
MEDIUM_ROUTES = {
    "bf16": "oneDNN computes in bf16 on this CPU (AMX)",
    "fp32": "oneDNN keeps fp32 arithmetic on this CPU (no AMX)",
    "none": "no oneDNN route for 'medium' here",
}


@pytest.fixture
def fake_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """Pretend the host CPU is another one: ``fake_cpu(AMX_XEON, TORCH_2_1_KERNELS)``.

    A CPU cannot show instructions it lacks, and one PyTorch cannot show what another's
    kernels do, so only the answers speedflags found are faked, in the caches the product
    keeps them in: the instruction sets, the dtype trials (``kernels``: dtype -> KernelTrial,
    the rest stay real) and, with ``medium``, what matmul_precision="medium" does there
    (``"bf16"``: AMX; ``"fp32"``: oneDNN without AMX; ``"none"``: no oneDNN route) and,
    with ``onednn_bf16``, PyTorch's oneDNN bf16 check (False on an AVX2 CPU). Every
    flag is PyTorch's real one, and so is the arithmetic (bf16 and fp16 emulated where the
    instructions are missing: slower, same results).
    """

    def install(
        features: CpuFeatures,
        kernels: Mapping[torch.dtype, KernelTrial] = {},
        medium: str | None = None,
        onednn_bf16: bool | None = None,
    ) -> None:
        if onednn_bf16 is not None:  # PyTorch's own check: AVX-512 (or AMX) for oneDNN bf16
            from speedflags.levers import precision

            monkeypatch.setattr(precision, "_onednn_bf16", lambda: onednn_bf16)
        monkeypatch.setitem(hardware_cpu._cache, "features", features)
        for dtype, trial in kernels.items():
            monkeypatch.setitem(hardware_cpu._cache, dtype, trial)
        if medium is not None:
            said = f"{FAKED_ROUTE}{MEDIUM_ROUTES[medium]}"
            monkeypatch.setitem(route._cache, "cpu", route.MediumRoute(medium, said))
        hardware._clear_cache()

    yield install
    hardware._clear_cache()


@pytest.fixture
def cpu_with_bf16(fake_cpu: Callable[..., None]) -> None:
    """Pretend the host CPU has bf16 instructions (AVX512-BF16), for tests of what speedflags
    decides on such a CPU (which levers have an effect, what tune tries).

    Whether the machine running the tests has them varies (CI machines include AVX2-only
    EPYCs): this CPU's instruction sets with AVX512-BF16 added (``fake_cpu``), the oneDNN
    bf16 probe that matmul_precision="medium" asks and, where this CPU or this PyTorch has
    no oneDNN route for "medium" (AVX2; PyTorch 2.1), that route as an AVX512-BF16 CPU
    without AMX has it. Every flag is PyTorch's real one, and so is the bf16 arithmetic
    (emulated where the instructions are missing).
    """
    medium = None if route.medium_route().effective else "fp32"
    features = dataclasses.replace(cpu_features(), avx512_bf16=True)
    fake_cpu(features, medium=medium, onednn_bf16=True)


@pytest.fixture
def fresh_history() -> None:
    ledger().clear_history()


def last_seq() -> int:
    """The history's last ``seq`` (the ring is bounded: an index would not do)."""
    history = speedflags.ledger().history
    return history[-1].seq if history else 0


def records_since(seq: int) -> list[speedflags.FlagRecord]:
    """The ledger's own records after ``seq`` (a running watch also records torch's own
    writes, action "external")."""
    return [r for r in speedflags.ledger().history if r.seq > seq and r.action != "external"]


# --- what a type checker says ------------------------------------------------------------

needs_mypy = pytest.mark.skipif(
    importlib.util.find_spec("mypy") is None,
    reason="needs mypy (the dev extra: pip install -e '.[dev]')",
)


def mypy_disagrees(snippet: str, folder: Any, name: str) -> tuple[list[str], list[str], str]:
    """Run mypy, with the project's settings (strict), on ``snippet`` written to ``folder /
    name``: the lines marked ``# error`` that it accepted, the others that it refused, and
    its output."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    path = Path(folder) / name
    path.write_text(snippet, encoding="utf-8")
    # from the repository's root, so that pyproject.toml's mypy settings apply; the file
    # named on the command line replaces the configured `files`
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary", "--show-error-codes", str(path)],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    # by the file's name: mypy may print the path another way (relative, or as its cache saw)
    reported = {
        int(found.group(1))
        for line in result.stdout.splitlines()
        if (found := re.search(rf"(?:^|[/\\]){re.escape(name)}:(\d+): error:", line))
    }
    lines = snippet.splitlines()
    expected = {n for n, text in enumerate(lines, 1) if text.endswith("# error")}
    accepted = [lines[n - 1] for n in sorted(expected - reported)]
    refused = [lines[n - 1] for n in sorted(reported - expected)]
    return accepted, refused, result.stdout + result.stderr


def run_example(name: str, cwd: Path, *lines: str) -> str:
    """Run ``examples/<name> --smoke`` in its own process, in ``cwd``, with this checkout
    first on ``PYTHONPATH``; its output, once it has exited 0, left ``cwd`` empty and
    printed each of ``lines`` and that every flag ended as it began."""
    example = Path(__file__).resolve().parent.parent / "examples" / name
    env = dict(os.environ, PYTHONPATH=str(example.parent.parent), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, str(example), "--smoke"], cwd=cwd, env=env, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert not list(cwd.iterdir()), "the example left files in its working directory"
    for line in (*lines, "flags as found at the start: yes"):
        assert line in done.stdout, done.stdout
    return done.stdout
