"""The lever registry: the one list of levers that everything else reads.

Each :class:`LeverSpec` says what a lever is called (its ``fast_math`` keyword and the name
of its single-lever shorthand), which values it accepts and how a bad one is refused, its
scope, which :class:`~speedflags.levers._base.Lever` reads, writes and describes its torch
state, its "off" value and the values worth trying when tuning. ``fast_math``, ``@speedup``,
``Schedule``, the report, the bench configurations, the rank check, ``watch``, the pytest
plugin, the integrations and ``tune`` all derive their lever lists from :data:`REGISTRY`;
the lever sets built from it (the baseline, a snapshot) are in
:mod:`speedflags.levers.lever_sets`.

Adding a lever means one module with its ``Lever`` class and one entry here.

Example:
    >>> from speedflags.levers.registry import LEVER_NAMES, lever_spec
    >>> LEVER_NAMES  # doctest: +NORMALIZE_WHITESPACE
    ('tf32', 'matmul_precision', 'cudnn_benchmark', 'sdpa', 'deterministic',
     'reduced_precision_reduction', 'amp', 'param_dtype', 'memory_format')
    >>> spec = lever_spec("amp")
    >>> spec.shorthand, spec.scope, spec.check("fast_math", "bf16")
    ('autocast', 'thread', torch.bfloat16)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._short_repr import short_repr
from ..errors import InvalidTypeError, InvalidValueError
from ._base import UNSET, DeviceLever, Effect, Scope
from ._model_shadow import fsdp_owner
from .arguments import lever_annotations
from .autocast import AUTO, AutocastLever, validate_amp
from .cudnn import CudnnBenchmarkLever
from .deterministic import BENCHMARK_CONTRADICTS, WARN, DeterministicLever
from .memory_format import MemoryFormatLever, memory_format_effect, validate_memory_format
from .param_dtype import (
    ParamDtypeLever,
    describe_param_dtype,
    param_dtype_effect,
    validate_param_dtype,
)
from .precision import MatmulPrecisionLever, TF32Lever
from .reductions import ReducedPrecisionReductionLever
from .sdpa import BACKENDS, SdpaLever

__all__ = [
    "LEVER_NAMES",
    "MODEL_LEVER_NAMES",
    "REGISTRY",
    "LeverSpec",
    "check_levers",
    "check_model",
    "lever_spec",
]

# The device types whose thread-local state a snapshot describes.
AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class LeverSpec:
    """One lever, as every part of speedflags sees it.

    Attributes:
        name: the ``fast_math`` keyword (``"tf32"``); also ``Lever.name`` and the one name
            the lever goes by everywhere else: the ledger's history (speedflags' own writes
            and, under ``watch``, everyone else's), snapshots, warnings and the leak report.
        shorthand: the name of the single-lever function (``speedflags.sdpa_backend``;
            empty: none).
        scope: ``"process"`` (C++-global flags), ``"thread"`` (autocast) or ``"model"``
            (the model levers, given with ``model=``: their state is one model's).
        values: the accepted values, in words (for errors and help).
        annotation: the keyword's type, for ``fast_math``'s run-time signature (from
            :class:`~speedflags.levers.arguments.LeverArgs`, what type checkers read).
        validate: normalises a value or raises ``InvalidValueError`` / ``InvalidTypeError``
            saying what is wrong (without saying where: :meth:`check` adds that).
        make: the :class:`~speedflags.levers._base.DeviceLever` that reads, writes and
            describes the state, per device type (process levers ignore the device type),
            or, for a model lever, per model.
        summary: what the lever switches, one line.
        accuracy: what it costs in accuracy, one line.
        baseline: the value that means "off" (plain fp32 eager); ``UNSET`` when the lever
            has no off value (the SDPA dispatcher's default is every backend).
        candidates: the values ``tune`` tries, in order.
        ops: words in the names of the torch functions whose kernels the lever changes
            (``"conv"``); ``tune`` skips the lever for a step that calls none of them.
            Empty: any step.
        dynamo_misses: the part of the lever's state that ``torch.compile`` does not guard
            on some supported PyTorch, in words (empty: dynamo guards all of it, on every
            version). A graph traced under one state of such a lever would serve another,
            so compiled callables read these levers themselves
            (:mod:`speedflags._compile.lever_state`; ``docs/compile.md``).
    """

    name: str
    shorthand: str
    scope: Scope
    values: str
    annotation: Any
    validate: Callable[[object], Any]
    make: Callable[[Any], DeviceLever]
    summary: str
    accuracy: str
    baseline: Any = UNSET
    candidates: tuple[Any, ...] = ()
    ops: tuple[str, ...] = ()
    dynamo_misses: str = ""
    # a model lever's ``available`` (it depends on the device, not on a model)
    model_effect: Callable[[Any, torch.device], Effect] | None = None

    def lever(self, device_type: str = "cpu", model: Any = None) -> DeviceLever:
        """The lever object for ``device_type`` (one shared instance per type), or for
        ``model`` (a model lever: one instance per model)."""
        if self.scope == "model":
            if model is None:
                raise InvalidValueError(f"{self.name}: a model lever needs model=")
            return self.make(model)
        return self.make(device_type)

    def effect(self, value: Any, device: torch.device) -> Effect:
        """Whether ``value`` (validated) has an effect on ``device``, and why (not)."""
        if self.model_effect is not None:
            return self.model_effect(value, device)
        return self.lever(device.type).available(value, device)

    @property
    def per_model(self) -> bool:
        """Whether this is a model lever (given with ``model=``; no process-wide state)."""
        return self.scope == "model"

    def check(self, call: str, value: object, argument: str | None = None) -> Any:
        """``validate`` with the error saying where: ``"fast_math(amp='bf17'): ..."``."""
        shown = argument or self.name
        try:
            return self.validate(value)
        except InvalidValueError as exc:
            raise InvalidValueError(f"{call}({shown}={short_repr(value)}): {exc}") from None
        except InvalidTypeError as exc:
            raise InvalidTypeError(f"{call}({shown}={short_repr(value)}): {exc}") from None

    def describe_value(self, value: Any) -> Any:
        """A JSON-friendly view of a validated value (``torch.bfloat16`` -> ``"bfloat16"``)."""
        if self.scope == "thread":
            if value is None:
                return False
            if value == AUTO:
                return AUTO
            return str(value).replace("torch.", "")
        if self.name == "param_dtype":
            return describe_param_dtype(value)
        if self.scope == "model":
            return False if value is None else value
        return self.lever().describe_value(value)

    def current(self, device_type: str = "cpu") -> Any:
        """The lever's torch state now, described (never raises; a model lever has no state
        outside a model: ``None``)."""
        if self.per_model:
            return None
        lever = self.lever(device_type)
        return lever.describe(lever.read())

    @property
    def has_baseline(self) -> bool:
        """Whether the lever has an "off" value (plain fp32 eager)."""
        return self.baseline is not UNSET


_PROCESS_LEVERS: dict[str, DeviceLever] = {
    "tf32": TF32Lever(),
    "matmul_precision": MatmulPrecisionLever(),
    "cudnn_benchmark": CudnnBenchmarkLever(),
    "sdpa": SdpaLever(),
    "deterministic": DeterministicLever(),
    "reduced_precision_reduction": ReducedPrecisionReductionLever(),
}
_autocast: dict[str, AutocastLever] = {}
_autocast_lock = threading.Lock()


def _process_lever(name: str) -> Callable[[str], DeviceLever]:
    lever = _PROCESS_LEVERS[name]
    return lambda device_type: lever


def autocast_lever(device_type: str) -> AutocastLever:
    """The ``amp`` lever for one device type (one shared instance per type)."""
    lever = _autocast.get(device_type)
    if lever is None:
        with _autocast_lock:
            lever = _autocast.setdefault(device_type, AutocastLever(device_type))
    return lever


# one type per lever, written once in arguments.LeverArgs (what mypy checks callers against)
_ANNOTATIONS = lever_annotations()
_BACKEND_CHOICES = ", ".join(repr(b) for b in BACKENDS)
# matmuls (mm, addmm, bmm, ...), convolutions, recurrent layers and attention: the kernels
# TF32, matmul precision and autocast change
_MATMUL_OPS = ("mm", "matmul", "linear", "einsum", "conv", "lstm", "gru", "rnn", "scaled_dot")
# the cuBLAS GEMMs (no convolutions: cuDNN never reads the reduction flags)
_GEMM_OPS = ("mm", "matmul", "linear", "einsum", "lstm", "gru", "rnn", "scaled_dot")

# Application order: TF32 before matmul precision (they share state and both are checked
# for a mixed TF32 state first), autocast last.
REGISTRY: tuple[LeverSpec, ...] = (
    LeverSpec(
        name="tf32",
        shorthand="tf32",
        scope="process",
        values="True or False",
        annotation=_ANNOTATIONS["tf32"],
        validate=TF32Lever.validate,
        make=_process_lever("tf32"),
        summary="TF32 tensor cores for float32 cuBLAS matmuls and cuDNN conv/rnn",
        accuracy="TF32 keeps 10 mantissa bits: ~1e-3 relative error on float32 matmuls",
        baseline=False,
        candidates=(True,),
        ops=_MATMUL_OPS,
        dynamo_misses=(
            "cuDNN's allow_tf32 and the cuDNN and oneDNN nodes of the fp32_precision tree "
            "(PyTorch 2.9+); cuBLAS TF32 too on PyTorch 2.1"
        ),
    ),
    LeverSpec(
        name="matmul_precision",
        shorthand="matmul_precision",
        scope="process",
        values="'highest', 'high' or 'medium'",
        annotation=_ANNOTATIONS["matmul_precision"],
        validate=MatmulPrecisionLever.validate,
        make=_process_lever("matmul_precision"),
        summary="float32 matmul precision: TF32 on CUDA ('high'), oneDNN bf16 on CPU ('medium')",
        accuracy="'high': as tf32; 'medium': bf16-level on GPUs and AMX CPUs, else fp32-level",
        baseline="highest",
        candidates=("high", "medium"),
        ops=_MATMUL_OPS,
        dynamo_misses=(
            "'high' against 'medium' (cuBLAS TF32 is on in both) and oneDNN's bf16 precision "
            "on CPUs; all of it on PyTorch 2.1"
        ),
    ),
    LeverSpec(
        name="cudnn_benchmark",
        shorthand="cudnn_benchmark",
        scope="process",
        values="True or False",
        annotation=_ANNOTATIONS["cudnn_benchmark"],
        validate=CudnnBenchmarkLever.validate,
        make=_process_lever("cudnn_benchmark"),
        summary="cuDNN times its convolution algorithms per input shape",
        accuracy="none in principle; the chosen algorithm may differ run to run",
        baseline=False,
        candidates=(True,),
        ops=("conv",),
        dynamo_misses="all of it",
    ),
    LeverSpec(
        name="sdpa",
        shorthand="sdpa_backend",
        scope="process",
        values=f"a backend ({_BACKEND_CHOICES}) or an ordered sequence of them",
        annotation=_ANNOTATIONS["sdpa"],
        validate=SdpaLever.validate,
        make=_process_lever("sdpa"),
        summary="preferred scaled_dot_product_attention kernels (math kept as the fallback)",
        accuracy="kernel-dependent, usually within fp16/bf16 rounding of the math kernel",
        candidates=tuple((b,) for b in BACKENDS if b != "math"),
        ops=("scaled_dot_product",),
        dynamo_misses="all of it: the enabled kernels and their priority order",
    ),
    LeverSpec(
        name="deterministic",
        shorthand="deterministic",
        scope="process",
        values=f"True, False or {WARN!r}",
        annotation=_ANNOTATIONS["deterministic"],
        validate=DeterministicLever.validate,
        make=_process_lever("deterministic"),
        summary=(
            "torch.use_deterministic_algorithms (True: errors on a nondeterministic op; "
            "'warn': warns) plus cudnn.deterministic; never faster, often slower"
        ),
        accuracy="none (the same precision, reproducible run to run); often slower",
        # off: PyTorch's default and plain eager's; never a tune candidate (it never pays)
        baseline=False,
        dynamo_misses="cudnn.deterministic; the warn-only mode too on PyTorch 2.1",
    ),
    LeverSpec(
        name="reduced_precision_reduction",
        shorthand="reduced_precision_reduction",
        scope="process",
        values="True or False",
        annotation=_ANNOTATIONS["reduced_precision_reduction"],
        validate=ReducedPrecisionReductionLever.validate,
        make=_process_lever("reduced_precision_reduction"),
        summary=(
            "cuBLAS may reduce fp16/bf16 GEMMs in fp16/bf16 (True, PyTorch's default) or "
            "only in fp32 (False, which also turns off allow_fp16_accumulation); CUDA only"
        ),
        accuracy=(
            "True: fp16/bf16 GEMM partial sums rounded to fp16/bf16 (split-K), error growing "
            "with the reduction length; False: fp32 reductions"
        ),
        # off: fp32 reductions, the accurate path (as tf32=False is, though PyTorch's own
        # default is True); tune measures True on top of it
        baseline=False,
        candidates=(True,),
        ops=_GEMM_OPS,
        dynamo_misses=(
            "allow_fp16_accumulation and the split-K part; the fp16 and bf16 reduction flags "
            "too on PyTorch 2.1"
        ),
    ),
    LeverSpec(
        name="amp",
        shorthand="autocast",
        scope="thread",
        values="'bf16', 'fp16', 'auto' (any case; also 'bfloat16', 'float16', 'half'), "
        "torch.bfloat16, torch.float16 or False",
        annotation=_ANNOTATIONS["amp"],
        validate=validate_amp,
        make=autocast_lever,
        summary="autocast: matmuls and convolutions in bf16 or fp16, on one device type",
        accuracy="bf16: ~3e-3 relative error (8 mantissa bits); fp16: ~4e-4 (use loss scaling)",
        baseline=False,
        candidates=(torch.bfloat16, torch.float16),
        ops=_MATMUL_OPS,
        # no dynamo_misses: autocast is guarded (by the tensors' dispatch keys on 2.1, by
        # the global state guard later)
    ),
    LeverSpec(
        name="param_dtype",
        shorthand="",
        scope="model",
        values="'bf16' (or 'bfloat16'), 'fp16' (or 'float16', 'half') in any case, torch.bfloat16, "
        "torch.float16 or False (with model=)",
        annotation=_ANNOTATIONS["param_dtype"],
        validate=validate_param_dtype,
        make=ParamDtypeLever.of,
        model_effect=param_dtype_effect,
        summary=(
            "the model computes with bf16/fp16 casts of its float32 parameters, made once per "
            "parameter version (norm layers stay float32); the parameters stay the parameters"
        ),
        accuracy=(
            "as amp: bf16 ~3e-3, fp16 ~4e-4 relative error; float32 master weights keep small "
            "updates; costs a cast copy of each parameter (2 bytes each)"
        ),
        baseline=False,
        candidates=(torch.bfloat16, torch.float16),
        ops=_MATMUL_OPS,
        # no dynamo_misses: dynamo guards a module's class (the shadow classes)
    ),
    LeverSpec(
        name="memory_format",
        shorthand="",
        scope="model",
        values="'channels_last', torch.channels_last or False (with model=)",
        annotation=_ANNOTATIONS["memory_format"],
        validate=validate_memory_format,
        make=MemoryFormatLever.of,
        model_effect=memory_format_effect,
        summary=(
            "the model's 4-D convolution weights and 4-D inputs in channels_last (NHWC), the "
            "layout cuDNN's and oneDNN's fastest convolutions take"
        ),
        accuracy="none in principle (a different convolution kernel may round differently)",
        baseline=False,
        candidates=("channels_last",),
        ops=("conv",),
        # no dynamo_misses: dynamo guards the weights' strides and the model's class
    ),
)

LEVER_NAMES: tuple[str, ...] = tuple(spec.name for spec in REGISTRY)
_BY_NAME: dict[str, LeverSpec] = {spec.name: spec for spec in REGISTRY}
PROCESS_LEVERS: Mapping[str, DeviceLever] = _PROCESS_LEVERS
MODEL_LEVER_NAMES: tuple[str, ...] = tuple(spec.name for spec in REGISTRY if spec.per_model)


def lever_spec(name: object, call: str = "speedflags") -> LeverSpec:
    """The registry entry for the ``fast_math`` keyword ``name``.

    Raises:
        InvalidValueError: ``name`` is not a lever; the message lists the valid ones.

    Example:
        >>> from speedflags.levers.registry import lever_spec
        >>> lever_spec("tf32").scope
        'process'
    """
    spec = _BY_NAME.get(name) if isinstance(name, str) else None
    if spec is None:
        raise InvalidValueError(f"{call}: unknown lever {short_repr(name)}; valid: {valid_names()}")
    return spec


def valid_names() -> str:
    """The lever keywords, sorted and comma-separated (for error messages)."""
    return ", ".join(sorted(LEVER_NAMES))


def check_levers(call: str, given: Mapping[str, object]) -> tuple[tuple[str, Any], ...]:
    """Validate ``fast_math``-style lever arguments; return ``(name, value)`` in order.

    ``None`` means "leave unchanged" and is dropped (so is ``UNSET``, its old public
    spelling). An unknown name raises ``InvalidTypeError`` (like any unexpected keyword
    argument) listing the valid ones; a bad value raises what :meth:`LeverSpec.check`
    raises; ``tf32`` and ``matmul_precision`` asking for opposite cuBLAS TF32 settings raise
    ``InvalidValueError``, and so do ``deterministic=True`` and ``cudnn_benchmark=True``
    (nested, one block inside the other's, the inner one's enter is refused the same way: the
    levers' own check, ``deterministic.refuse_nested``).

    Example:
        >>> from speedflags.levers.registry import check_levers
        >>> check_levers("fast_math", {"amp": "bf16", "tf32": True, "sdpa": None})
        (('tf32', True), ('amp', torch.bfloat16))
    """
    unknown = [name for name in given if name not in _BY_NAME]
    if unknown:
        raise InvalidTypeError(
            f"{call}() got an unexpected keyword argument {short_repr(unknown[0])}; the levers are "
            f"{valid_names()}, and the other arguments are keyword-only"
        )
    checked = tuple(
        (spec.name, spec.check(call, given[spec.name]))
        for spec in REGISTRY
        if given.get(spec.name, UNSET) is not UNSET and given[spec.name] is not None
    )
    _refuse_contradictions(call, dict(checked))
    return checked


def check_model(call: str, model: object, levers: Sequence[tuple[str, Any]]) -> None:
    """Refuse a ``model=`` that the checked ``levers`` cannot take: a model lever without a
    model, a model that is not an ``nn.Module`` or whose parameters another system owns
    (FSDP), or a model given with no model lever.

    Example:
        >>> import torch
        >>> from speedflags.levers.registry import check_model
        >>> check_model("fast_math", torch.nn.Linear(2, 2), (("param_dtype", torch.bfloat16),))
    """
    wanted = [name for name, _ in levers if _BY_NAME[name].per_model]
    if model is None:
        if wanted:
            raise InvalidValueError(
                f"{call}({wanted[0]}=...): {wanted[0]} acts on one model: give it as model=, "
                f"e.g. {call}(model=net, {wanted[0]}=...)"
            )
        return
    if not isinstance(model, torch.nn.Module):
        raise InvalidTypeError(
            f"{call}(model={short_repr(model)}): expected a torch.nn.Module, got "
            f"{type(model).__name__}"
        )
    if not wanted:
        raise InvalidValueError(
            f"{call}(model={type(model).__name__}): model= is for the model levers "
            f"({', '.join(MODEL_LEVER_NAMES)}), and none was given"
        )
    owner = fsdp_owner(model)
    if owner is not None:
        raise InvalidValueError(f"{call}(model={type(model).__name__}, {wanted[0]}=...): {owner}")


def shown_levers(given: Mapping[str, object]) -> list[str]:
    """``name=value`` for each lever argument given (``None`` too), in registry order: how a
    call's label shows them.

    Example:
        >>> from speedflags.levers.registry import shown_levers
        >>> shown_levers({"amp": "bf16", "tf32": True})
        ['tf32=True', "amp='bf16'"]
    """
    return [
        f"{spec.name}={given[spec.name]!r}"
        for spec in REGISTRY
        if given.get(spec.name, UNSET) is not UNSET
    ]


def _refuse_contradictions(call: str, values: Mapping[str, Any]) -> None:
    if values.get("deterministic") is True and values.get("cudnn_benchmark") is True:
        raise InvalidValueError(
            f"{call}(deterministic=True, cudnn_benchmark=True): contradictory: "
            f"{BENCHMARK_CONTRADICTS}; use cudnn_benchmark=False, or leave "
            "one of them out"
        )
    tf32 = values.get("tf32")
    precision = values.get("matmul_precision")
    if tf32 is None or precision is None or tf32 == (precision != "highest"):
        return
    fix = "tf32=True" if precision != "highest" else "matmul_precision='high' or 'medium'"
    raise InvalidValueError(
        f"{call}(tf32={tf32!r}, matmul_precision={precision!r}): contradictory: matmul "
        f"precision {precision!r} turns cuBLAS TF32 {'on' if precision != 'highest' else 'off'}; "
        f"use {fix}, or leave one of them out"
    )
