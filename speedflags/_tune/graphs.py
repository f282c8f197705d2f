"""CUDA graphs in ``tune``: tried for a step on a GPU when the step is launch-bound.

A CUDA graph replays a step's kernels as one launch, so it pays where the GPU waits on the
host between kernels: many small kernels, each launched (and set up in Python) for longer
than it runs. A step whose kernels keep the GPU busy gains nothing from it and pays the
recording. ``tune`` judges this once, from the fp32 reference: one call under
``torch.profiler`` (CUDA activity) gives the kernels it launched and the time they ran on
the device; with the reference's median time per call (timed without the profiler) it is

- **launch-bound** when the step launches at least :data:`MIN_KERNELS` kernels and they
  keep the GPU busy for less than :data:`BUSY_SHARE` of the step's time (the rest of the
  time the GPU waits for launches);
- otherwise not, and CUDA graphs are not tried (``TuneResult.notes`` says why, with the
  figures).

When tried, ``speedup(cuda_graphs=True, **choice)`` (compiled, with inductor's
``fallback_random`` as for ``compile``) goes through the usual rules: its error against
fp32 within the budget (a step the graphs cannot run safely, such as an optimizer with a
Python float learning rate, raises and is rejected with the fix in its note), then timed
beside fp32 and the choice after three untimed calls (warm-up, recording, a replay), and
accepted only when faster than fp32 and than the choice beyond the noise. On a CPU it is
not a candidate: CUDA graphs have no effect there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["BUSY_SHARE", "MIN_KERNELS", "judge", "launch_bound"]

MIN_KERNELS = 20  # fewer launches than this cost too little to win back a recording
BUSY_SHARE = 0.5  # the GPU busy for less than this share of the step: it waits on launches


def launch_bound(kernels: int, busy_s: float, step_s: float) -> tuple[bool, str]:
    """Whether a step that launched ``kernels`` kernels, running ``busy_s`` seconds on the
    device, in ``step_s`` seconds per call, is launch-bound; and the figures, in words.

    Example:
        >>> from speedflags._tune.graphs import launch_bound
        >>> launch_bound(300, 0.0011, 0.0043)
        (True, '300 kernels keep the GPU busy 26% of the step (1.1 ms of 4.3 ms)')
        >>> launch_bound(12, 0.009, 0.010)[0], launch_bound(400, 0.009, 0.010)[0]
        (False, False)
    """
    share = busy_s / step_s if step_s > 0 else 1.0
    said = (
        f"{kernels} kernels keep the GPU busy {share:.0%} of the step "
        f"({busy_s * 1e3:.2g} ms of {step_s * 1e3:.2g} ms)"
    )
    return kernels >= MIN_KERNELS and share < BUSY_SHARE, said


def judge(step: Callable[[], Any], device: torch.device, step_s: float) -> tuple[bool, str]:
    """Run ``step()`` once under the profiler on ``device`` (CUDA) and judge it with
    :func:`launch_bound`, against its median time ``step_s``."""
    from .._measure.evidence import cuda_trace  # local: the profiler loads with it

    _, trace = cuda_trace(step, device)
    return launch_bound(len(trace.kernels), trace.kernel_s, step_s)
