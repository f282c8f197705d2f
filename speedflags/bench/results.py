"""Results and where they came from: rows, the run's environment, and the JSON file format.

A result file says where it was measured: the device and its name, the driver, the PyTorch,
CUDA and cuDNN versions, the CPU and its thread count, the device's capabilities, and the
flag snapshot the run started from.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Any

import torch
import torch._C as torch_C  # by its module: PyTorch 2.1's stubs do not re-export torch._C

from .._hardware import capabilities, cudnn_version_or_none
from .._ledger.history import json_default
from .._measure.noise import within_noise
from .._measure.output_paths import make_parent_folder
from .._status import snapshot
from .._version import __version__

__all__ = ["FORMAT", "BenchRun", "Result", "environment"]

FORMAT = "speedflags-bench/1"


@dataclass(frozen=True)
class Result:
    """One configuration of one workload at one size (or one skipped configuration).

    ``group`` is what speedups are relative to: the results of one group share a workload,
    a device and a size, and one of them is the ``baseline``. Times are seconds per call.
    ``noise`` is the relative standard error of ``speedup``; :attr:`within_noise` says
    whether the speedup is no difference beyond it.

    Example:
        >>> from speedflags.bench.results import Result
        >>> r = Result("matmul cpu 2048", "fp32", median_s=0.2, flops=2 * 2048.0**3)
        >>> round(r.flop_per_s / 1e9, 1)
        85.9
    """

    group: str
    config: str
    workload: str = ""
    device: str = ""
    size: int | None = None
    shape: str = ""
    levers: str = ""
    baseline: bool = False
    median_s: float | None = None
    q1_s: float | None = None
    q3_s: float | None = None
    rounds: int = 0
    calls_per_round: int = 1
    pass_medians_s: tuple[float, ...] = ()
    flops: float | None = None
    rel_error: float | None = None
    error_of: str = ""
    input_sets: int = 1
    skipped: str | None = None
    notes: tuple[str, ...] = ()
    speedup: float | None = None
    pct_of_fastest: float | None = None
    # CUDA: the most memory allocated while building and running it, above what was
    # allocated before (its model, casts and activations); None on a CPU
    peak_bytes: int | None = None
    # the relative standard error of ``speedup`` (from its interleaved passes; None: unknown)
    noise: float | None = None
    # a word of the shared vocabulary where the row is not plainly in effect: "in effect,
    # emulated: slower" for a row measured once at a small size (speedflags._measure.vocabulary)
    verdict: str = ""

    @property
    def within_noise(self) -> bool:
        """Whether ``speedup`` is no difference beyond its noise (False where unknown)."""
        if self.speedup is None or self.noise is None or self.baseline:
            return False
        return within_noise(self.speedup, self.noise)

    @property
    def flop_per_s(self) -> float | None:
        if self.flops is None or not self.median_s:
            return None
        return self.flops / self.median_s

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["pass_medians_s"] = list(self.pass_medians_s)
        out["notes"] = list(self.notes)
        out["flop_per_s"] = self.flop_per_s
        out["within_noise"] = self.within_noise
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Result:
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        kwargs["pass_medians_s"] = tuple(kwargs.get("pass_medians_s") or ())
        kwargs["notes"] = tuple(kwargs.get("notes") or ())
        return cls(**kwargs)


def _nvidia_smi(index: int) -> dict[str, str]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {}
    fields = "driver_version,clocks.sm,clocks.mem,power.draw,temperature.gpu"
    try:
        out = subprocess.run(  # noqa: S603 - a fixed command line, no shell
            [exe, f"--query-gpu={fields}", "--format=csv,noheader", "-i", str(index)],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    values = [v.strip() for v in out.strip().split(",")]
    return dict(zip(fields.split(","), values, strict=True)) if len(values) == 5 else {}


def gpu_available(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()


def gpu_state(device: torch.device) -> dict[str, str]:
    """Driver version, clocks, power draw and temperature from ``nvidia-smi`` ({} if none)."""
    if not gpu_available(device):
        return {}
    given: int | None = device.index  # None for plain "cuda"
    return _nvidia_smi(given if given is not None else torch.cuda.current_device())


_CPU_FEATURES = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16")


def cpu_id(path: str = "/proc/cpuinfo") -> dict[str, Any]:
    """The CPU's family, model and the ISA features that decide bf16/fp16 speed.

    Two CPUs with the same marketing name can differ where it matters: an AMD EPYC of
    family 25 (Zen 4) does bf16 dot products at twice its fp32 rate, one of family 26
    (Zen 5) at four times MKL's. Empty where ``/proc/cpuinfo`` does not exist.

    Example:
        >>> from speedflags.bench.results import cpu_id
        >>> cpu_id("/nonexistent")
        {}
    """
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            lines = fh.read().split("\n\n")[0].splitlines()
    except OSError:
        return {}
    fields = {}
    for line in lines:
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    flags = set(fields.get("flags", "").split())
    out: dict[str, Any] = {
        k: fields[k] for k in ("vendor_id", "cpu family", "model", "stepping") if k in fields
    }
    out["features"] = [f for f in _CPU_FEATURES if f in flags]
    return out


def environment(device: torch.device) -> dict[str, Any]:
    """Where a run happens: device, versions, CPU, threads, capabilities, flag snapshot.

    Reads only; the flag snapshot is taken as the run starts.

    Example:
        >>> import torch
        >>> from speedflags.bench.results import environment
        >>> env = environment(torch.device("cpu"))
        >>> env["device"], env["torch"] == torch.__version__, "tf32" in env["flags"]
        ('cpu', True, True)
    """
    caps = capabilities(device)
    state = gpu_state(device)
    driver: str | None = state.get("driver_version")
    get_driver = getattr(torch_C, "_cuda_getDriverVersion", None)
    if driver is None and get_driver is not None and gpu_available(device):
        version = int(get_driver())
        driver = f"CUDA driver API {version // 1000}.{version % 1000 // 10}"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": caps.device,
        "device_name": caps.name,
        "driver": driver,
        "gpu_state": state,
        "cpu": capabilities("cpu").name,
        "cpu_id": cpu_id(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": cudnn_version_or_none(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "speedflags": __version__,
        "capabilities": caps.to_dict(),
        "flags": snapshot(),
    }


@dataclass
class BenchRun:
    """One ``speedflags bench`` run: where, with which settings, the results, how it ended.

    Attributes:
        environment: see :func:`environment`.
        settings: the run's settings (workloads, sizes, passes, rounds).
        results: one :class:`Result` per configuration, skipped ones included.
        interrupted: stopped early (Ctrl-C); ``results`` hold what was measured so far.
        flags_restored: every flag read as before the run once it ended.
    """

    environment: dict[str, Any]
    settings: dict[str, Any]
    results: list[Result] = field(default_factory=list)
    interrupted: bool = False
    flags_restored: bool = True

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": FORMAT, **dataclasses.asdict(self)}
        # each result in its own form (with flop_per_s), and last: the long part of the file
        del out["results"]
        out["results"] = [r.to_dict() for r in self.results]
        return out

    def save(self, path: str) -> None:
        """Write the run as JSON to ``path`` (its folder is created if needed)."""
        make_parent_folder(path)
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.to_dict(), fh, indent=2, default=json_default)
            fh.write("\n")

    @classmethod
    def load(cls, path: str) -> BenchRun:
        """Read a file written by :meth:`save`; ``ValueError`` if it is not one (any parse
        failure, nesting too deep for the parser and rows that are not results included)."""
        with open(path, encoding="utf-8") as fh:
            try:
                data = json.load(fh)
            except ValueError as exc:  # JSONDecodeError, or text that is not UTF-8
                raise ValueError(f"{path}: not JSON ({exc})") from None
            except RecursionError:
                raise ValueError(f"{path}: not JSON it can read (nested too deeply)") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{path}: not a speedflags bench result file (format {FORMAT!r})")
        try:
            results = [Result.from_dict(r) for r in data.get("results", [])]
        except (TypeError, AttributeError) as exc:  # a row that is not a result's table
            raise ValueError(f"{path}: not a speedflags bench result file (a row: {exc})") from None
        return cls(
            environment=data.get("environment", {}),
            settings=data.get("settings", {}),
            results=results,
            interrupted=bool(data.get("interrupted", False)),
            flags_restored=bool(data.get("flags_restored", True)),
        )


def describe_source(run: BenchRun) -> str:
    """One line saying where a run was measured (device, driver, versions, date)."""
    env = run.environment
    parts = [f"{env.get('device_name', '?')} ({env.get('device', '?')})"]
    if env.get("driver"):
        parts.append(f"driver {env['driver']}")
    parts.append(f"PyTorch {env.get('torch', '?')}")
    if str(env.get("device", "")).startswith("cpu"):
        parts.append(f"{env.get('threads', '?')} threads")
    parts.append(str(env.get("date", "?")))
    return ", ".join(parts)
