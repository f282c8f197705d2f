"""Why a lever that the device supports and the flags show on is not in effect.

Each finder gets the lever, its value and the probe's :class:`~.probes.Observation` (with
what the flags read inside the frame) and returns the causes it can name, most likely first:
environment overrides that the CUDA libraries obey and no getter shows
(``NVIDIA_TF32_OVERRIDE=0``, ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1``), a mixed TF32 state, a
disabled cuDNN or oneDNN, a kernel that refuses the inputs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from .._hardware import capabilities
from .probes import Observation

__all__ = ["environment_block", "find"]

NVIDIA_OVERRIDE = "NVIDIA_TF32_OVERRIDE"
TORCH_OVERRIDE = "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"
_TF32_LEVERS = ("tf32", "matmul_precision")


def _tf32_hardware(device: torch.device) -> bool:
    caps = capabilities(device)
    cc = caps.compute_capability
    return device.type == "cuda" and cc is not None and cc >= (8, 0) and torch.version.hip is None


def environment_block(name: str, device: torch.device) -> str | None:
    """The environment override that alone keeps ``name`` from working here, or None.

    ``speedflags.capabilities`` answers "no TF32" under ``NVIDIA_TF32_OVERRIDE=0``, but the
    hardware can: ``verify`` still measures, and reports the override as the cause.

    Example:
        >>> import torch
        >>> from speedflags._measure.causes import environment_block
        >>> environment_block("tf32", torch.device("cpu")) is None
        True
    """
    if name not in _TF32_LEVERS or os.environ.get(NVIDIA_OVERRIDE) != "0":
        return None
    if not _tf32_hardware(device):
        return None
    return _nvidia_override()


def _nvidia_override() -> str:
    return (
        f"{NVIDIA_OVERRIDE}=0 is set: cuBLAS and cuDNN never use TF32, whatever PyTorch's flags "
        "say (no getter shows it)"
    )


def _tf32_state(inside: dict[str, Any], node: str, what: str) -> list[str]:
    found = []
    if inside.get("tf32_consistent") is False:
        conflicts = "; ".join(inside.get("tf32_conflicts") or []) or "the two API families disagree"
        found.append(f"a mixed TF32 state inside the block: {conflicts}")
    if inside.get("tf32_effective", {}).get(node) is False:
        found.append(f"the flags read {what} off inside the block (tf32_status().effective)")
    return found


def _tf32(name: str, value: Any, obs: Observation, device: torch.device) -> list[str]:
    found = []
    if os.environ.get(NVIDIA_OVERRIDE) == "0":
        found.append(_nvidia_override())
    found += _tf32_state(obs.inside, "cublas_matmul_tf32", "cuBLAS TF32")
    return found


def _conv_tf32(inside: dict[str, Any]) -> list[str]:
    found = []
    if os.environ.get(NVIDIA_OVERRIDE) == "0":
        found.append(_nvidia_override())
    if inside.get("cudnn_enabled") is False:
        found.append("cuDNN is disabled (torch.backends.cudnn.enabled is False)")
    found += _tf32_state(inside, "cudnn_conv_tf32", "cuDNN conv TF32")
    return found


def conv_note(obs: Observation) -> str:
    """A note when ``tf32=True`` left convolutions in fp32 while matmuls used TF32."""
    if obs.measured.get("conv_in_effect", True):
        return ""
    causes = _conv_tf32(obs.inside) or [
        "cuDNN chose a kernel without TF32 for this convolution (a heuristic choice)"
    ]
    return "conv stayed fp32: " + "; ".join(causes)


def _baseline(name: str, value: Any, obs: Observation, device: torch.device) -> list[str]:
    found = []
    if os.environ.get(TORCH_OVERRIDE) == "1":
        found.append(
            f"{TORCH_OVERRIDE}=1 is set: on PyTorch versions that read it on every matmul, "
            "cuBLAS uses TF32 whatever the flags say"
        )
    if os.environ.get(NVIDIA_OVERRIDE) not in (None, "0"):
        found.append(f"{NVIDIA_OVERRIDE}={os.environ[NVIDIA_OVERRIDE]} is set")
    inside = obs.inside
    if inside.get("tf32_effective", {}).get("cublas_matmul_tf32"):
        found.append("the flags read cuBLAS TF32 on inside the baseline frame")
    if inside.get("tf32_effective", {}).get("onednn_matmul_bf16"):
        found.append("the flags read oneDNN matmul bf16 on inside the baseline frame")
    return found


def _precision(name: str, value: Any, obs: Observation, device: torch.device) -> list[str]:
    if device.type != "cpu":
        return _tf32(name, value, obs, device)
    found = []
    if obs.inside.get("mkldnn_enabled") is False:
        found.append("oneDNN is disabled (torch.backends.mkldnn.enabled is False)")
    return found + _tf32_state(obs.inside, "onednn_matmul_bf16", "oneDNN matmul bf16")


def _cudnn_benchmark(name: str, value: Any, obs: Observation, device: torch.device) -> list[str]:
    found = []
    if obs.inside.get("cudnn_enabled") is False:
        found.append("cuDNN is disabled (torch.backends.cudnn.enabled is False)")
    if obs.inside.get("cudnn_deterministic"):
        found.append(
            "torch.backends.cudnn.deterministic is True: cuDNN may have few algorithms to try"
        )
    return found


def _sdpa(name: str, value: Any, obs: Observation, device: torch.device) -> list[str]:
    refusal = obs.inside.get("refusal")
    return [refusal] if refusal else []


def _amp(name: str, value: Any, obs: Observation, device: torch.device) -> list[str]:
    if obs.inside.get("autocast") is False:
        return ["torch.is_autocast_enabled() reads False inside the block"]
    return []


_FINDERS: dict[str, Callable[[str, Any, Observation, torch.device], list[str]]] = {
    "baseline": _baseline,
    "tf32": _tf32,
    "matmul_precision": _precision,
    "cudnn_benchmark": _cudnn_benchmark,
    "sdpa": _sdpa,
    "amp": _amp,
}


def find(name: str, value: Any, obs: Observation, device: torch.device) -> str:
    """The causes found for ``name=value`` not being in effect, or a sentence saying none was.

    Example:
        >>> import torch
        >>> from speedflags._measure.causes import find
        >>> from speedflags._measure.probes import Observation
        >>> obs = Observation(False, "", inside={"cudnn_enabled": False})
        >>> find("cudnn_benchmark", True, obs, torch.device("cuda"))
        'cuDNN is disabled (torch.backends.cudnn.enabled is False)'
    """
    finder = _FINDERS.get(name)
    found = finder(name, value, obs, device) if finder is not None else []
    if found:
        return "; ".join(dict.fromkeys(found))
    return "no cause found: the flags read as asked, yet the measurement shows no effect"
