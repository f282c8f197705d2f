"""The levers over float32 matmul precision, ``tf32`` and ``matmul_precision`` (process scope).

Both read, check, write and restore the same state: every getter of both TF32 API families,
one ledger stack for the two (:class:`FamilyLever`). They differ only in the target a value
asks for and in how they describe the state. ``tf32=True/False`` is TF32 for cuBLAS matmuls and
cuDNN convolutions/RNNs; the write goes through the legacy setters and is corrected through
the new ``fp32_precision`` API where needed, and a mixed starting state is refused with
:class:`~speedflags.MixedTF32APIError` before anything is changed.

``matmul_precision``: float32 matmul precision, CUDA and CPU.

``"highest"`` keeps float32 matmuls in full IEEE fp32. ``"high"`` lets cuBLAS use TF32.
``"medium"`` also lets cuBLAS use TF32 and routes CPU float32 matmuls through oneDNN with
bf16 fpmath. With AMX (Intel Xeon, Sapphire Rapids and later) oneDNN then computes in bf16:
the error is bf16-level. On CPUs without AMX (AMD Zen 3, 4 and 5 among them) oneDNN keeps
fp32 arithmetic, so the error stays at fp32 level and the gain is only the switch from MKL's
kernel to oneDNN's: measured on PyTorch 2.13 on a Zen 4 CPU, 1.07-1.20x with 1 thread and
1.1-1.4x with 2 (1024^3 and 2048^3 matmuls, ``benchmarks/RESULTS.md``). PyTorch 2.1 has no
such route: there "medium" changes no CPU kernel. The lever predicts from PyTorch's oneDNN
check and the CPU's flags; :func:`speedflags._measure.route.medium_route` finds which of the
three this CPU and PyTorch do, by trying. It is written exactly as
``torch.set_float32_matmul_precision`` would, with both TF32 API families kept readable
(``docs/tf32_policy.md``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch._ops

from .._hardware import capabilities, cpu_features
from ..errors import InvalidTypeError, InvalidValueError
from . import _fp32_model as family
from ._base import UNSET, Effect, SimpleLever, validate_bool, verified
from ._fp32_mixed import require_consistent
from ._fp32_torch import Calls, read_state, transition
from .spec import MATMUL_OPS, ON_OFF, Shorthand, declare

# (state before, value or target, state after, setter calls): a write to replay
Replay = tuple[Any, Any, family.FamilyState, Calls]
_NO_REPLAY: Replay = (None, None, (False, False, "", None), ())


class FamilyLever(SimpleLever):
    """Base of the levers whose state is every getter of both TF32 API families.

    Scope: process. Entering refuses a mixed TF32 state before anything changes;
    restoring writes back every getter's answer.

    A subclass sets ``name``, ``change`` (what a mixed state stops it doing, for the error:
    ``"change TF32"``) and ``target``.
    """

    scope = "process"
    domain = "fp32_precision"
    checks_state = True  # refuses a mixed TF32 state
    change = ""
    # (state before, value) -> the consistent state that writing the value asks for
    target: Callable[[family.FamilyState, Any], family.FamilyState]

    def read(self) -> family.FamilyState:
        return read_state()

    def check(self, state: family.FamilyState) -> None:
        require_consistent(state, self.change)

    # The last write that reached its target, per direction: (state before, value or target,
    # state after, setter calls). A frame enters and exits from the same state objects every
    # step (the ledger passes on a state equal to the last one read as that object), so the
    # same write is found by identity, without hashing 12 strings or comparing them.
    _applied = _NO_REPLAY
    _restored = _NO_REPLAY

    def apply(self, value: Any, before: family.FamilyState) -> family.FamilyState:
        last = self._applied
        if last[0] is before and last[1] is value:
            for fn, args in last[3]:
                fn(*args)
            return last[2]
        request = (self.name, before, value)
        after, target, calls = transition(request, before, self.target, before, value)
        if after is not target:
            return verified(self, "setting", target, after)  # type: ignore[no-any-return]
        if calls is not None:
            self._applied = (before, value, target, calls)
        return target

    def restore(
        self, target: family.FamilyState, current: family.FamilyState
    ) -> family.FamilyState:
        last = self._restored
        if last[0] is current and last[1] is target:
            for fn, args in last[3]:
                fn(*args)
            return last[2]
        after, wanted, calls = transition(("restore", current, target), current, _same, target)
        if after is not wanted:
            return verified(self, "restoring", target, after)  # type: ignore[no-any-return]
        if calls is not None:
            self._restored = (current, target, wanted, calls)
        return wanted


def _same(state: family.FamilyState) -> family.FamilyState:
    return state


class TF32Lever(FamilyLever):
    """``tf32=True/False``: TF32 tensor-core math for float32 matmuls and convolutions.

    Scope: process. The state read and restored is every getter of both TF32 API families.
    """

    name = "tf32"
    change = "change TF32"
    target = staticmethod(family.tf32_target)
    validate = staticmethod(validate_bool)

    def describe(self, state: family.FamilyState) -> Any:
        return family.describe_state(state)

    def available(self, value: bool, device: torch.device) -> Effect:
        caps = capabilities(device)
        if caps.tf32:
            return Effect(True, "")
        return Effect(False, f"no effect on {caps.device}: {caps.tf32.reason}")


class MatmulPrecisionLever(FamilyLever):
    """``matmul_precision="highest"|"high"|"medium"``.

    Scope: process. Shares its state with the ``tf32`` lever (one ledger stack for both).
    """

    name = "matmul_precision"
    change = "change the float32 matmul precision"
    target = staticmethod(family.precision_target)

    @staticmethod
    def validate(value: object) -> str:
        choices = ", ".join(repr(c) for c in family.MATMUL_PRECISIONS)
        if not isinstance(value, str):
            raise InvalidTypeError(f"expected one of {choices}, got {type(value).__name__}")
        if value not in family.MATMUL_PRECISIONS:
            # PyTorch itself only warns and does nothing for 'HIGH'; a silent no-op is worse
            raise InvalidValueError(f"not a matmul precision; valid: {choices}")
        return value

    def describe(self, state: family.FamilyState) -> Any:
        return family.describe_precision(state)

    def available(self, value: str, device: torch.device) -> Effect:
        caps = capabilities(device)
        if value == "highest":
            return Effect(True, "")
        if device.type == "cuda":
            if caps.tf32:
                return Effect(True, "")
            return Effect(False, f"no effect on {caps.device}: {caps.tf32.reason}")
        if value == "medium":
            if _onednn_bf16():
                amx = cpu_features().amx_bf16
                arithmetic = "AMX: bf16 arithmetic" if amx else "no AMX: the arithmetic stays fp32"
                route = "routes float32 CPU matmuls through oneDNN with bf16 fpmath"
                return Effect(True, f"{route} ({arithmetic})")
            return Effect(False, "no effect on cpu: oneDNN bf16 matmul is not available here")
        return Effect(False, "no effect on cpu: 'high' only enables TF32, which no CPU kernel uses")


def _onednn_bf16() -> bool:
    # torch._ops.ops is torch.ops; older stubs (2.4) do not re-export the latter
    probe = getattr(torch._ops.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(probe()) if probe is not None else False


TF32_SHORTHAND = Shorthand(
    name="tf32",
    parameter="enabled",
    default=True,
    doc="""TF32 on (or off) for cuBLAS matmuls and cuDNN conv/rnn: ``fast_math(tf32=enabled)``.

    Scope: process. Restores every getter of both TF32 API families.

    Example:
        >>> import torch, speedflags
        >>> with speedflags.tf32():
        ...     torch.backends.cuda.matmul.allow_tf32
        True
    """,
)


MATMUL_PRECISION_SHORTHAND = Shorthand(
    name="matmul_precision",
    parameter="value",
    default=UNSET,
    doc="""Float32 matmul precision for a block: ``fast_math(matmul_precision=value)``.

    Scope: process. Restores the legacy precision and the cuBLAS and oneDNN matmul nodes.

    Example:
        >>> import torch, speedflags
        >>> with speedflags.matmul_precision("high"):
        ...     torch.get_float32_matmul_precision()
        'high'
    """,
)


# tf32 first: the two share a state, and both are checked for a mixed TF32 state first
DECLARED = (
    declare(
        TF32Lever(),
        shorthand=TF32_SHORTHAND,
        **ON_OFF,
        order=10,
        summary="TF32 tensor cores for float32 cuBLAS matmuls and cuDNN conv/rnn",
        accuracy="TF32 keeps 10 mantissa bits: ~1e-3 relative error on float32 matmuls",
        ops=MATMUL_OPS,
        dynamo_misses=(
            "cuDNN's allow_tf32 and the cuDNN and oneDNN nodes of the fp32_precision tree "
            "(PyTorch 2.9+); cuBLAS TF32 too on PyTorch 2.1"
        ),
    ),
    declare(
        MatmulPrecisionLever(),
        shorthand=MATMUL_PRECISION_SHORTHAND,
        order=20,
        values="'highest', 'high' or 'medium'",
        summary="float32 matmul precision: TF32 on CUDA ('high'), oneDNN bf16 on CPU ('medium')",
        accuracy="'high': as tf32; 'medium': bf16-level on GPUs and AMX CPUs, else fp32-level",
        baseline="highest",
        candidates=("high", "medium"),
        ops=MATMUL_OPS,
        dynamo_misses=(
            "'high' against 'medium' (cuBLAS TF32 is on in both) and oneDNN's bf16 precision "
            "on CPUs; all of it on PyTorch 2.1"
        ),
    ),
)
