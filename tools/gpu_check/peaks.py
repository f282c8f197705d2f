"""Dense (no sparsity) datasheet peaks of common NVIDIA GPUs, to put measured TFLOP/s beside.

TFLOP/s for FP32 (SIMT), TF32 tensor cores, BF16/FP16 tensor cores with FP32 accumulation
and, where the GPU has them (Ada and Hopper), FP8 tensor cores with FP32 accumulation.
NVIDIA's headline figures for Ampere and Hopper count 2:4 sparsity (twice these). Sources:
the NVIDIA datasheets and architecture whitepapers, as collected in ``docs/performance.md``
("GPU: published figures").
"""

from __future__ import annotations

__all__ = ["MEASURED", "PEAKS", "measured_for", "peak_for"]

# (name fragments that must all appear in torch.cuda.get_device_name(), label, peaks)
PEAKS: tuple[tuple[tuple[str, ...], str, dict[str, float]], ...] = (
    (("H200",), "H200 SXM",
     {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9}),
    (("H100", "PCIe"), "H100 PCIe",
     {"fp32": 51.2, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0, "fp8": 1513.0}),
    (("H100",), "H100 SXM5",
     {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9}),
    (("A100",), "A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    (("L40S",), "L40S", {"fp32": 91.6, "tf32": 183.0, "bf16": 362.0, "fp16": 362.0, "fp8": 733.0}),
    (("L4",), "L4", {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0, "fp8": 242.5}),
    (("RTX 4090",), "RTX 4090",
     {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2, "fp8": 330.3}),
    (("RTX 3090",), "RTX 3090", {"fp32": 35.6, "tf32": 35.6, "bf16": 71.0, "fp16": 71.0}),
)  # fmt: skip

# The highest matmul rates published as measured (not datasheet), by label: the FP8 maxima of
# stas00/ml-engineering's matmul-FLOPS finder (compute/accelerator/README.md), the ceiling an
# FP8 matmul here can be compared with.
MEASURED: dict[str, dict[str, float]] = {
    "H100 SXM5": {"fp8": 1402.6},
    "H200 SXM": {"fp8": 1453.4},
}


def peak_for(device_name: str) -> tuple[str, dict[str, float]] | None:
    """``(label, {precision: TFLOP/s})`` for a GPU name, or None when it is not in the table.

    Example:
        >>> from tools.gpu_check.peaks import peak_for
        >>> peak_for("NVIDIA H100 80GB HBM3")[1]["bf16"]
        989.4
        >>> peak_for("NVIDIA L40S")[0], peak_for("AMD EPYC") is None
        ('L40S', True)
        >>> "fp8" in peak_for("NVIDIA A100-SXM4-80GB")[1]  # no FP8 tensor cores before Ada
        False
    """
    if not device_name:
        return None
    for fragments, label, peaks in PEAKS:
        if all(fragment in device_name for fragment in fragments):
            return label, peaks
    return None


def measured_for(label: str) -> dict[str, float]:
    """The published measured maxima (TFLOP/s by precision) for a label of :data:`PEAKS`;
    empty when none is recorded.

    Example:
        >>> from tools.gpu_check.peaks import measured_for, peak_for
        >>> measured_for(peak_for("NVIDIA H200")[0])
        {'fp8': 1453.4}
        >>> measured_for("L4")
        {}
    """
    return dict(MEASURED.get(label, {}))
