"""GPU only: TF32 really changes what cuBLAS and cuDNN compute, and verify sees it.

Written before any GPU run, against PyTorch's documented behaviour and source, so that the
first run on a GPU confirms or refutes each expectation (``make gpu-check``). Every test
skips without a CUDA GPU of compute capability 8.0 or newer (TF32 needs Ampere).

The measure is the relative Frobenius error of a float32 result against float64 on the
same inputs: fp32 stays near 1e-7, TF32 (inputs rounded to 10 mantissa bits) near 3e-4.
PyTorch's CUDA notes (docs/source/notes/cuda.rst, "TensorFloat-32 (TF32) on Ampere (and
later) devices") show the same gap on a 10240² matmul (max error over mean 0.0022 with
TF32, 0.000039 without).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import speedflags
from speedflags import fast_math

HAS_NEW_API = hasattr(torch.backends, "fp32_precision")
AMPERE = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        torch.cuda.is_available() and not AMPERE, reason="TF32 needs an Ampere (sm80) GPU or newer"
    ),
]
ROOT = Path(__file__).resolve().parent.parent
FP32_MAX = 2e-5  # fp32 measures ~1e-7 to 1e-6; TF32 ~3e-4: two decades apart
TF32_MIN, TF32_MAX = 5e-5, 1.2e-3


def _gen() -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(0)


def matmul_error(n: int = 1024) -> float:
    gen = _gen()
    a = torch.randn(n, n, device="cuda", generator=gen)
    b = torch.randn(n, n, device="cuda", generator=gen)
    out = a @ b
    ref = a.double() @ b.double()
    return float((out.double() - ref).norm() / ref.norm())


def conv_error() -> float:
    gen = _gen()
    x = torch.randn(8, 64, 32, 32, device="cuda", generator=gen)
    w = torch.randn(64, 64, 3, 3, device="cuda", generator=gen) * (64 * 9) ** -0.5
    out = F.conv2d(x, w, padding=1)
    ref = F.conv2d(x.double(), w.double(), padding=1)
    return float((out.double() - ref).norm() / ref.norm())


def test_tf32_changes_cublas_matmul_error_and_is_restored_exactly() -> None:
    """``tf32=True`` makes cuBLAS round float32 matmul inputs to TF32; exit restores it.

    PyTorch: aten/src/ATen/cuda/CUDABlas.cpp picks ``CUBLAS_COMPUTE_32F_FAST_TF32`` for
    float32 GEMMs when ``float32Precision("cuda", "matmul")`` is ``"tf32"``, which the
    legacy ``allow_tf32`` setter and speedflags both write (torch/backends/cuda/__init__.py:
    ``allow_tf32`` -> ``_set_cublas_allow_tf32``). Fails if the error does not move by
    about three decades, or if any getter reads differently afterwards.
    """
    before = speedflags.snapshot()
    with fast_math(tf32=False, device="cuda"):
        off = matmul_error()
    with fast_math(tf32=True, device="cuda"):
        on = matmul_error()
        assert torch.backends.cuda.matmul.allow_tf32 is True
        if HAS_NEW_API:
            assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    assert off < FP32_MAX, f"fp32 matmul error {off:.2e}: not fp32"
    assert TF32_MIN < on < TF32_MAX, f"TF32 matmul error {on:.2e}: not TF32 (off: {off:.2e})"
    assert speedflags.snapshot() == before
    with fast_math(tf32=False, device="cuda"):
        assert matmul_error() == off  # the same kernel again: the same bits


def test_kernels_read_the_new_api_node_and_the_legacy_flag_alike(raw_tf32: None) -> None:
    """Both API families reach cuBLAS: the legacy ``allow_tf32`` flag switches TF32, and
    from PyTorch 2.9 the eager kernels follow the ``cuda.matmul.fp32_precision`` node, even
    under a stale legacy ``"high"`` (the mixed state speedflags refuses to create).

    PyTorch: torch/backends/cuda/__init__.py maps ``fp32_precision`` to
    ``_set_fp32_precision_setter("cuda", "matmul", value)``; the eager kernels read the
    resolved node (aten/src/ATen/Context.h ``float32Precision``), not the checked legacy
    getter. Raw torch writes, reset by the ``raw_tf32`` fixture.
    """
    torch.backends.cuda.matmul.allow_tf32 = True
    legacy = matmul_error()
    torch.backends.cuda.matmul.allow_tf32 = False
    assert TF32_MIN < legacy < TF32_MAX, f"legacy allow_tf32=True: error {legacy:.2e}"
    assert matmul_error() < FP32_MAX
    if not HAS_NEW_API:
        pytest.skip(f"PyTorch {torch.__version__} has no fp32_precision API (added in 2.9)")
    torch.set_float32_matmul_precision("high")  # legacy: the cuBLAS node becomes "tf32"
    legacy_high = matmul_error()
    torch.backends.cuda.matmul.fp32_precision = "ieee"  # the new API alone (now mixed)
    node_ieee = matmul_error()
    torch.backends.cuda.matmul.fp32_precision = "tf32"  # consistent again, then back
    torch.set_float32_matmul_precision("highest")
    assert TF32_MIN < legacy_high < TF32_MAX, f"precision 'high': error {legacy_high:.2e}"
    assert node_ieee < FP32_MAX, f"node 'ieee' under a stale 'high': error {node_ieee:.2e}"


def test_cudnn_conv_tf32_follows_the_lever_and_the_new_api_nodes() -> None:
    """``tf32=True`` lets cuDNN convolutions use TF32; the conv and rnn nodes read ``"tf32"``
    inside and come back on exit.

    PyTorch: ``torch.backends.cudnn.allow_tf32`` (default True) and, from 2.9,
    ``torch.backends.cudnn.conv.fp32_precision`` / ``.rnn.fp32_precision``
    (torch/backends/cudnn/__init__.py, ``_FP32Precision("cuda", "conv")``); the conv
    descriptors ask for tensor-op math with TF32 when allowed
    (aten/src/ATen/native/cudnn/Conv_v8.cpp). The error check fails if cuDNN ignored the flag
    for this 3x3, 64-channel convolution (a heuristic cuDNN could in principle change: then
    the node checks still hold and the error message says which way it went).
    """
    before = speedflags.snapshot()
    nodes_before = None
    if HAS_NEW_API:
        conv_node = torch.backends.cudnn.conv
        rnn_node = torch.backends.cudnn.rnn
        nodes_before = (conv_node.fp32_precision, rnn_node.fp32_precision)
    with fast_math(tf32=False, device="cuda"):
        off = conv_error()
        assert torch.backends.cudnn.allow_tf32 is False
    with fast_math(tf32=True, device="cuda"):
        on = conv_error()
        assert torch.backends.cudnn.allow_tf32 is True
        if HAS_NEW_API:
            assert (conv_node.fp32_precision, rnn_node.fp32_precision) == ("tf32", "tf32")
    assert speedflags.snapshot() == before
    if nodes_before is not None:
        assert (conv_node.fp32_precision, rnn_node.fp32_precision) == nodes_before
    assert off < FP32_MAX, f"conv error with TF32 off {off:.2e}: not fp32"
    assert TF32_MIN < on < TF32_MAX, f"conv error with TF32 on {on:.2e} (off {off:.2e})"


def test_verify_on_the_gpu_verifies_every_tf32_lever() -> None:
    """``verify`` measures TF32 through ``tf32`` and ``matmul_precision`` on this GPU."""
    run = speedflags.verify("cuda", levers=["tf32", "matmul_precision"])
    assert run.verdict("baseline").status == "verified", run
    for label in ("tf32=True", "matmul_precision='high'", "matmul_precision='medium'"):
        verdict = next(v for v in run.verdicts if v.label == label)
        assert verdict.status == "verified", str(run)
        assert TF32_MIN < verdict.measured["matmul_error"] < TF32_MAX
    assert run.restored and run.ok


def _verify_in_subprocess(override: str | None, tmp_path: Path) -> tuple[int, Any, str]:
    out = tmp_path / "verify.json"
    env = {k: v for k, v in os.environ.items() if k != "NVIDIA_TF32_OVERRIDE"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    if override is not None:
        env["NVIDIA_TF32_OVERRIDE"] = override
    done = subprocess.run(
        [sys.executable, "-m", "speedflags", "verify", "--device", "cuda", "--levers",
         "tf32,matmul_precision", "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=300, cwd=ROOT,
    )  # fmt: skip
    data = json.loads(out.read_text()) if out.exists() else {}
    return done.returncode, data, done.stdout + done.stderr


def test_verify_reports_tf32_not_in_effect_under_nvidia_tf32_override(tmp_path: Path) -> None:
    """``NVIDIA_TF32_OVERRIDE=0`` makes cuBLAS and cuDNN ignore TF32 while ``allow_tf32``
    reads True; ``verify`` must measure fp32-level error, say "requested but not in effect",
    name the variable, and exit with status 1.

    The variable is NVIDIA's (cuBLAS and cuDNN documentation, "NVIDIA_TF32_OVERRIDE");
    PyTorch's getters cannot see it. Run in a subprocess: the libraries read it when they
    load, so it must be set before CUDA starts.
    """
    rc, data, output = _verify_in_subprocess("0", tmp_path)
    verdicts = {v["label"]: v for v in data.get("verdicts", [])}
    tf32 = verdicts.get("tf32=True")
    assert tf32 is not None, output
    assert tf32["status"] == "requested but not in effect", output
    assert "NVIDIA_TF32_OVERRIDE=0" in tf32["reason"], output
    assert tf32["measured"]["matmul_error"] < FP32_MAX, output
    assert rc == 1, output


def test_verify_without_the_override_exits_zero(tmp_path: Path) -> None:
    """The control for the test above: the same subprocess without the variable verifies."""
    rc, data, output = _verify_in_subprocess(None, tmp_path)
    statuses = {v["label"]: v["status"] for v in data.get("verdicts", [])}
    assert statuses.get("tf32=True") == "verified", output
    assert rc == 0, output
