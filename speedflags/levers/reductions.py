"""The ``reduced_precision_reduction`` lever: whether cuBLAS may reduce fp16 and bf16 GEMMs in
their own precision (``torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction``,
``allow_bf16_reduced_precision_reduction`` and, where PyTorch has it,
``allow_fp16_accumulation``).

``True`` allows reduced-precision reductions for both dtypes (PyTorch's default): cuBLAS may
pick kernels (split-K among them) that sum partial products in fp16/bf16, faster on some
shapes, less accurate on long reductions. ``False`` asks for fp32 reductions everywhere:
both flags off and, where it exists, full fp16 accumulation off too (it is the extreme of the
same trade). ``True`` leaves ``allow_fp16_accumulation`` as found: it is a separate, heavier
choice that this lever never turns on.

The state read and restored is every one of these getters the running PyTorch has:

- PyTorch before ~2.10: each getter returns one bool; the setter takes one bool.
- PyTorch ~2.10+ (pytorch/pytorch#164766): each getter returns ``(allow_reduced_precision,
  allow_splitk)`` and the setter takes both, positionally (no keywords). ``allow_splitk=False``
  (no split-K at all) is refused while reduced precision is allowed, so ``True`` writes
  ``(True, True)`` and ``False`` keeps the ``allow_splitk`` found.
- ``allow_fp16_accumulation`` (PyTorch 2.7+, pytorch/pytorch#144441): read and restored where
  present, ``None`` in the state where absent (never written there).

The torch paths end in the setters written here: the ``torch.backends.cuda.matmul``
attributes' ``__setattr__`` calls ``torch._C._set_cublas_allow_fp16_reduced_precision_reduction``,
``..._bf16_...`` and ``_set_cublas_allow_fp16_accumulation`` by attribute. All of them are
plain process-wide flags, settable (and so restorable) on a CPU-only build, where they have no
effect: CPU GEMMs (MKL, oneDNN) never read them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch._C as torch_C

from .._hardware import capabilities
from ._base import Effect, SimpleLever, validate_bool, verified
from .spec import ON_OFF, Shorthand, declare

_C: Any = torch_C  # by its module: PyTorch 2.1's stubs do not re-export torch._C

# (allow_reduced_precision, allow_splitk); allow_splitk is None where PyTorch has no split-K flag
Pair = tuple[bool, bool | None]
# (fp16, bf16, allow_fp16_accumulation or None where PyTorch lacks it)
State = tuple[Pair, Pair, bool | None]

_MATMUL = "torch.backends.cuda.matmul."
_DTYPES = ("fp16", "bf16")


# resolved once: read_state() runs twice per frame, and once per call of a compiled step
_GET_FP16: Any = _C._get_cublas_allow_fp16_reduced_precision_reduction
_GET_BF16: Any = _C._get_cublas_allow_bf16_reduced_precision_reduction
_GET_ACCUMULATION: Any = getattr(_C, "_get_cublas_allow_fp16_accumulation", None)


def _pair(got: Any) -> Pair:
    if isinstance(got, tuple):
        return bool(got[0]), bool(got[1])
    return bool(got), None


def _write_pair(dtype: str, pair: Pair) -> None:
    setter = getattr(_C, f"_set_cublas_allow_{dtype}_reduced_precision_reduction")
    if pair[1] is None:
        setter(pair[0])
    else:
        setter(pair[0], pair[1])  # positional: the binding takes no keywords


def read_state() -> State:
    """The lever's raw state now (every getter this PyTorch has)."""
    accumulation = None if _GET_ACCUMULATION is None else bool(_GET_ACCUMULATION())
    return _pair(_GET_FP16()), _pair(_GET_BF16()), accumulation


def target_state(value: bool, before: State) -> State:
    """The state ``value`` asks for, on top of ``before``."""
    fp16, bf16, accumulation = before
    if value:
        # allow_splitk=False is refused while reduced precision is allowed
        return (
            (True, None if fp16[1] is None else True),
            (True, None if bf16[1] is None else True),
            accumulation,
        )
    return (False, fp16[1]), (False, bf16[1]), (None if accumulation is None else False)


class ReducedPrecisionReductionLever(SimpleLever):
    """``reduced_precision_reduction=True/False``: cuBLAS reductions in fp16/bf16, or fp32.

    Scope: process. Restores both reduction flags (with their split-K part where PyTorch has
    it) and ``allow_fp16_accumulation`` where PyTorch has it, exactly as found.
    """

    name = "reduced_precision_reduction"
    scope = "process"
    domain = "reduced_precision_reduction"

    validate = staticmethod(validate_bool)

    def read(self) -> State:
        return read_state()

    def apply(self, value: bool, before: State) -> State:
        return self._write(target_state(value, before), before, "apply")

    def restore(self, target: State, current: State) -> State:
        return self._write(target, current, "restore")

    def _write(self, target: State, current: State, action: str) -> State:
        if current == target:
            return target
        for dtype, want, now in zip(_DTYPES, target[:2], current[:2], strict=True):
            if now != want:
                _write_pair(dtype, want)
        if target[2] is not None and current[2] != target[2]:
            _C._set_cublas_allow_fp16_accumulation(target[2])
        return verified(self, action, target, self.read())  # type: ignore[no-any-return]

    def describe(self, state: Any) -> Any:
        if not (isinstance(state, tuple) and len(state) == 3):
            return state
        out: dict[str, Any] = {}
        for dtype, (allow, splitk) in zip(_DTYPES, state[:2], strict=True):
            name = f"{_MATMUL}allow_{dtype}_reduced_precision_reduction"
            out[name] = allow
            if splitk is not None:
                out[f"{name}_split_k"] = splitk
        if state[2] is not None:
            out[f"{_MATMUL}allow_fp16_accumulation"] = state[2]
        return out

    def available(self, value: bool, device: torch.device) -> Effect:
        if device.type != "cuda":
            return Effect(
                False,
                f"no effect on {device}: the cuBLAS reduction flags apply to fp16/bf16 GEMMs on "
                "CUDA devices; CPU GEMMs (MKL, oneDNN) never read them",
            )
        if not torch.cuda.is_available():
            caps = capabilities(device)
            return Effect(False, f"no effect on {caps.device}: {caps.fp16.reason}")
        if value:
            return Effect(True, "only fp16/bf16 GEMMs (autocast or half-precision tensors)")
        return Effect(True, "fp32 reductions can be slower (split-K kernels)")


REDUCED_PRECISION_REDUCTION_SHORTHAND = Shorthand(
    name="reduced_precision_reduction",
    parameter="enabled",
    default=True,
    doc="""cuBLAS reductions of fp16/bf16 GEMMs in reduced precision (``True``, PyTorch's default)
    or in fp32 (``False``): ``fast_math(reduced_precision_reduction=enabled)``.

    Writes ``torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction`` and
    ``allow_bf16_reduced_precision_reduction``; ``False`` also turns
    ``allow_fp16_accumulation`` off where PyTorch has it. No effect on a CPU.

    Scope: process. Restores both flags (with their split-K part where PyTorch has one) and
    ``allow_fp16_accumulation`` exactly as found.

    Example:
        >>> import torch, speedflags
        >>> with speedflags.reduced_precision_reduction(False):
        ...     torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        False
        >>> torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        True
    """,
)


# the cuBLAS GEMMs (no convolutions: cuDNN never reads the reduction flags)
GEMM_OPS = ("mm", "matmul", "linear", "einsum", "lstm", "gru", "rnn", "scaled_dot")
DECLARED = (
    declare(
        ReducedPrecisionReductionLever(),
        shorthand=REDUCED_PRECISION_REDUCTION_SHORTHAND,
        # off: fp32 reductions, the accurate path (as tf32=False is, though PyTorch's own
        # default is True); tune measures True on top of it
        **ON_OFF,
        order=60,
        summary=(
            "cuBLAS may reduce fp16/bf16 GEMMs in fp16/bf16 (True, PyTorch's default) or "
            "only in fp32 (False, which also turns off allow_fp16_accumulation); CUDA only"
        ),
        accuracy=(
            "True: fp16/bf16 GEMM partial sums rounded to fp16/bf16 (split-K), error growing "
            "with the reduction length; False: fp32 reductions"
        ),
        ops=GEMM_OPS,
        dynamo_misses=(
            "allow_fp16_accumulation and the split-K part; the fp16 and bf16 reduction flags "
            "too on PyTorch 2.1"
        ),
    ),
)
