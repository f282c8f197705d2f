"""The ``deterministic`` lever: deterministic algorithms (with their warn-only mode) and
``torch.backends.cudnn.deterministic``, as one piece of state.

``True`` is ``torch.use_deterministic_algorithms(True)`` (an operation with no deterministic
implementation raises) plus ``cudnn.deterministic = True``; ``"warn"`` is
``use_deterministic_algorithms(True, warn_only=True)`` (it warns instead) plus
``cudnn.deterministic = True``; ``False`` switches all three off. The state read and restored
is the three getters together, so whatever combination a block finds (``warn_only`` left on
with the mode off, ``cudnn.deterministic`` on alone) is the combination it puts back.

It is written through the ``torch._C`` setters the public paths end in:
``torch.use_deterministic_algorithms`` and ``torch.set_deterministic_debug_mode`` call
``torch._C._set_deterministic_algorithms(mode, warn_only=...)``, and
``torch.backends.cudnn.deterministic`` (and ``cudnn.flags()``) call
``torch._C._set_cudnn_deterministic``. PyTorch 2.1 to 2.13 have the same four accessors.
Left alone: ``torch.utils.deterministic.fill_uninitialized_memory`` (2.2+) and
``torch.backends.mkldnn.deterministic`` (2.7+), and the ``CUBLAS_WORKSPACE_CONFIG``
environment variable that deterministic cuBLAS needs on CUDA (read once by cuBLAS; a process
setting, not a flag).

It never makes anything faster: deterministic kernels are often slower, so ``tune`` never
tries it (no candidates).
"""

from __future__ import annotations

from typing import Any

import torch
import torch._C as torch_C

from ..errors import InvalidTypeError, InvalidValueError
from ._base import Effect, SimpleLever, verified
from .spec import Shorthand, declare

_C: Any = torch_C  # by its module: PyTorch 2.1's stubs do not re-export torch._C

WARN = "warn"
Mode = bool | str
# (use_deterministic_algorithms, warn_only, cudnn.deterministic)
State = tuple[bool, bool, bool]

TARGETS: dict[Mode, State] = {
    True: (True, False, True),
    WARN: (True, True, True),
    False: (False, False, False),
}
GETTERS = (
    "torch.are_deterministic_algorithms_enabled()",
    "torch.is_deterministic_algorithms_warn_only_enabled()",
    "torch.backends.cudnn.deterministic",
)


# Why deterministic=True and cudnn_benchmark=True are refused together: in one spec (the
# registry's check) and nested, one block's inside the other's (the levers' own, at enter)
BENCHMARK_CONTRADICTS = (
    "cuDNN benchmarking times algorithms per shape and may pick a different one each run, "
    "which deterministic=True promises not to"
)


def refuse_nested(entering: str, found: str, fix: str) -> None:
    """Refuse to enter ``entering`` (``"deterministic=True"`` or ``"cudnn_benchmark=True"``)
    while ``found`` holds, as one spec with both is refused (nothing is changed: the frame is
    rolled back)."""
    raise InvalidValueError(
        f"{entering} entered while {found} (set by an open block, or by code outside "
        f"speedflags): contradictory, as fast_math(deterministic=True, cudnn_benchmark=True) "
        f"is: {BENCHMARK_CONTRADICTS}; {fix}"
    )


def validate_mode(value: object) -> Mode:
    """``True``, ``False`` or ``"warn"``; else an error naming the valid choices."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        if value == WARN:
            return WARN
        raise InvalidValueError(f"not a deterministic mode; valid: True, False, {WARN!r}")
    raise InvalidTypeError(f"expected True, False or {WARN!r}, got {type(value).__name__}")


class DeterministicLever(SimpleLever):
    """``deterministic=True|False|"warn"``: deterministic algorithms and cuDNN determinism.

    Scope: process. Restores all three getters exactly (the mode, its warn-only flag and
    ``torch.backends.cudnn.deterministic``), whatever combination was found.
    """

    name = "deterministic"
    scope = "process"
    domain = "deterministic"

    validate = staticmethod(validate_mode)

    def read(self) -> State:
        return (
            bool(_C._get_deterministic_algorithms()),
            bool(_C._get_deterministic_algorithms_warn_only()),
            bool(_C._get_cudnn_deterministic()),
        )

    def apply(self, value: Mode, before: State) -> State:
        if value is True and _C._get_cudnn_benchmark():
            refuse_nested(
                "deterministic=True",
                "torch.backends.cudnn.benchmark is True",
                "set cudnn_benchmark=False in the same block, or use deterministic='warn'",
            )
        return self._write(TARGETS[value], before, "apply")

    def restore(self, target: State, current: State) -> State:
        return self._write(target, current, "restore")

    def _write(self, target: State, current: State, action: str) -> State:
        if current == target:
            return target
        mode, warn_only, cudnn = target
        if current[:2] != (mode, warn_only):
            _C._set_deterministic_algorithms(mode, warn_only=warn_only)
        if current[2] != cudnn:
            _C._set_cudnn_deterministic(cudnn)
        return verified(self, action, target, self.read())  # type: ignore[no-any-return]

    def describe(self, state: Any) -> Any:
        if isinstance(state, tuple) and len(state) == len(GETTERS):
            return dict(zip(GETTERS, state, strict=True))
        return state

    def available(self, value: Mode, device: torch.device) -> Effect:
        if value is False:
            return Effect(True, "")
        if device.type == "cuda":
            return Effect(True, "deterministic kernels are often slower")
        return Effect(
            True,
            f"deterministic algorithms apply on {device.type} too (cudnn.deterministic only on "
            "CUDA); deterministic kernels are often slower",
        )


DETERMINISTIC_SHORTHAND = Shorthand(
    name="deterministic",
    parameter="mode",
    default=True,
    doc="""Deterministic algorithms for a block: ``fast_math(deterministic=mode)``.

    ``True``: ``torch.use_deterministic_algorithms(True)`` (an operation with no deterministic
    implementation raises) and ``torch.backends.cudnn.deterministic = True``; ``"warn"``: the
    same in warn-only mode (it warns instead); ``False``: all of it off. Often slower, never
    faster. Refused together with ``cudnn_benchmark=True``: in one spec, and entered while
    ``torch.backends.cudnn.benchmark`` is on (inside a ``cudnn_benchmark=True`` block), as
    ``cudnn_benchmark=True`` is while deterministic algorithms are on.

    Scope: process. Restores the deterministic mode, its warn-only flag and
    ``cudnn.deterministic`` exactly as found.

    Example:
        >>> import torch, speedflags
        >>> with speedflags.deterministic("warn"):
        ...     torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic
        (True, True)
        >>> torch.are_deterministic_algorithms_enabled()
        False
    """,
)


DECLARED = (
    declare(
        DeterministicLever(),
        shorthand=DETERMINISTIC_SHORTHAND,
        order=50,
        values=f"True, False or {WARN!r}",
        summary=(
            "torch.use_deterministic_algorithms (True: errors on a nondeterministic op; "
            "'warn': warns) plus cudnn.deterministic; never faster, often slower"
        ),
        accuracy="none (the same precision, reproducible run to run); often slower",
        # off: PyTorch's default and plain eager's; never a tune candidate (it never pays)
        baseline=False,
        dynamo_misses="cudnn.deterministic; the warn-only mode too on PyTorch 2.1",
    ),
)
