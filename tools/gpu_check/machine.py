"""What ``make gpu-check`` records of the machine: versions, the host CPU, the GPU's clocks
and power (``nvidia-smi``), and whether speedflags is installed in the Python it runs.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
from typing import Any

from .steps import ROOT

__all__ = ["environment", "gpu_state", "install", "installed"]


def _cpu_info() -> dict[str, Any]:
    """The host CPU: model, logical cores, the instruction sets that set bf16/fp16 speed."""
    from speedflags._hardware.cpu import read_cpu_features

    features = read_cpu_features()
    return {
        "model": features.name or platform.processor() or platform.machine(),
        "logical_cores": os.cpu_count(),
        "isa": features.isa,
        "bf16": features.bf16_instructions() or "none (emulated)",
        "fp16": features.fp16_instructions() or "none (emulated)",
        "amx": features.amx_bf16 or features.amx_fp16,
    }


def _versions(*names: str) -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def _smi(fields: str) -> str | None:
    """``nvidia-smi --query-gpu=FIELDS`` for the first GPU; None without it or on failure."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        done = subprocess.run(  # noqa: S603 - a fixed command line, no shell
            [smi, f"--query-gpu={fields}", "--format=csv,noheader", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def gpu_state() -> str | None:
    """The GPU's SM clock (and its most), power draw (and limit), temperature and what
    holds its clocks back, as ``nvidia-smi`` reads them now; None without it.

    Example:
        >>> from tools.gpu_check.check import gpu_state
        >>> state = gpu_state()  # e.g. '1770 MHz, 1980 MHz, 670.52 W, 700.00 W, 61; 0x...'
        >>> state is None or isinstance(state, str)
        True
    """
    state = _smi("clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu")
    if state is None:
        return None
    reasons = _smi("clocks_event_reasons.active") or _smi("clocks_throttle_reasons.active")
    return f"{state}; clock event reasons {reasons}" if reasons else state


def environment(gpu: bool) -> dict[str, Any]:
    """The run's record of the machine: date, versions, device, host CPU, installed test
    plugins, and on a GPU machine the GPU's name, compute capability, driver and state.

    Example:
        >>> from tools.gpu_check.machine import environment
        >>> env = environment(gpu=False)
        >>> env["device"], sorted(env["host_cpu"])  # doctest: +NORMALIZE_WHITESPACE
        ('cpu', ['amx', 'bf16', 'fp16', 'isa', 'logical_cores', 'model'])
    """
    import torch

    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu_found": gpu,
        "python": f"{platform.python_version()} ({sys.executable})",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,  # type: ignore[no-untyped-call]
        "device": "cuda:0" if gpu else "cpu",
        "platform": platform.platform(),
        "host_cpu": _cpu_info(),
        "packages": _versions("pytest", "pytest-xdist", "pytest-timeout", "pytest-benchmark"),
    }
    if gpu:
        env["device_name"] = torch.cuda.get_device_name(0)
        env["compute_capability"] = list(torch.cuda.get_device_capability(0))
    query = "name,driver_version,memory.total,clocks.max.sm,power.limit"
    smi = _smi(query)
    if smi is not None:
        env["nvidia_smi"] = smi
        env["driver"] = smi.split(",")[1].strip() if "," in smi else None
    env["gpu_state_start"] = gpu_state()
    return env


def installed(python: str) -> bool:
    """Whether ``python`` has speedflags installed (its entry points: the pytest plugin).

    Example:
        >>> import sys
        >>> from tools.gpu_check.machine import installed
        >>> installed(sys.executable) in (True, False)
        True
    """
    code = "import importlib.metadata as m; m.distribution('speedflags')"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    try:
        done = subprocess.run(  # noqa: S603 - the interpreter running this check
            [python, "-c", code], capture_output=True, timeout=120, env=env, cwd=os.sep
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def install(python: str, out: str) -> str:
    """``pip install --no-deps --no-build-isolation -e .`` of this checkout with ``python``
    (its output in ``out/install.log``); what happened, in words.

    Example:
        >>> from tools.gpu_check.machine import install
        >>> install("python3", "/tmp")  # doctest: +SKIP
        'installed with pip install --no-deps --no-build-isolation -e .'
    """
    command = [python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-e", ROOT]
    with open(os.path.join(out, "install.log"), "w", encoding="utf-8") as fh:
        try:
            done = subprocess.run(  # noqa: S603 - our own interpreter, fixed arguments
                command, stdout=fh, stderr=subprocess.STDOUT, timeout=300, cwd=ROOT
            )
        except (OSError, subprocess.SubprocessError) as exc:
            return f"pip install failed ({exc}); running from PYTHONPATH"
    if done.returncode:
        return f"pip install exited {done.returncode} (install.log); running from PYTHONPATH"
    return "installed with pip install --no-deps --no-build-isolation -e ."
