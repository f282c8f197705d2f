"""The ``amp`` lever: autocast on one device type, in the calling thread only.

It writes the enabled flag and the dtype that ``torch.autocast`` writes, and clears the
autocast cast cache whenever it changes them (entering, or restoring on exit), so that casts
cached under one setting (of weights an optimizer step has since changed, or in another
dtype) are never reused under the next. It leaves ``torch.autocast``'s nesting counter
alone, so the two nest freely: that counter has no getter, and one the ledger moved could not
be put back exactly after an interruption, whereas clearing the cache is harmless to repeat.
Like ``torch.autocast``, the state is thread-local: other threads, including threads started
inside a block, keep their own autocast state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from .._hardware import Capability, capabilities
from .._locks import new_lock
from ..errors import InvalidTypeError, InvalidValueError
from ._base import UNSET, Effect, SimpleLever
from .spec import MATMUL_OPS, Shorthand, declare

AUTO = "auto"
_BY_NAME = {"bf16": torch.bfloat16, "fp16": torch.float16}  # the words speedflags writes
# ...and every spelling it reads, in any case: its own, and PyTorch's dtype names
DTYPE_SPELLINGS = {
    **_BY_NAME,
    "bfloat16": torch.bfloat16,
    "torch.bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "torch.float16": torch.float16,
    "torch.half": torch.float16,
}
CHOICES = (
    "'bf16' (or 'bfloat16'), 'fp16' (or 'float16', 'half'), 'auto' (in any case), "
    "torch.bfloat16, torch.float16 or False"
)
_AMP_WORDS = {**DTYPE_SPELLINGS, AUTO: AUTO}

# None stands for "autocast off" (amp=False); "auto" is resolved per device when entered.
AmpValue = torch.dtype | str | None
AutocastState = tuple[bool, torch.dtype]


def validate_amp(value: object) -> AmpValue:
    """Normalise an ``amp=`` argument: a dtype, ``None`` for off, or ``"auto"``.

    Strings are read in any case, in speedflags' words and PyTorch's dtype names.

    Example:
        >>> from speedflags.levers.autocast import validate_amp
        >>> validate_amp("BF16"), validate_amp("bfloat16"), validate_amp("Float16")
        (torch.bfloat16, torch.bfloat16, torch.float16)
        >>> validate_amp(False) is None, validate_amp("Auto")
        (True, 'auto')
    """
    amp: AmpValue = read_half_dtype(
        value, CHOICES, "autocast runs in bf16 or fp16", "not an autocast dtype", _AMP_WORDS
    )
    return amp


def read_half_dtype(
    value: object,
    choices: str,
    refused_dtype: str,
    refused_word: str,
    words: Mapping[str, object] = DTYPE_SPELLINGS,
) -> Any:
    """A half-precision keyword's value: ``False`` (off) -> ``None``; ``torch.bfloat16`` or
    ``torch.float16`` as given; a string, in any case, as ``words`` reads it. Anything else
    is refused: another dtype with ``refused_dtype``, another string with ``refused_word``,
    each followed by the ``choices``; another type with what it got.

    ``amp=`` and ``param_dtype=`` read their values this way (``amp=`` takes ``"auto"`` too).

    Example:
        >>> from speedflags.levers.autocast import read_half_dtype
        >>> read_half_dtype("Half", "'bf16' or 'fp16'", "no", "not a half dtype")
        torch.float16
        >>> read_half_dtype("fp32", "'bf16' or 'fp16'", "no", "not a half dtype")
        Traceback (most recent call last):
        ...
        speedflags.InvalidValueError: not a half dtype; valid: 'bf16' or 'fp16'
    """
    if value is False:
        return None
    if isinstance(value, torch.dtype):
        if value in (torch.bfloat16, torch.float16):
            return value
        raise InvalidValueError(f"{refused_dtype}; valid: {choices}")
    if isinstance(value, str):
        found = words.get(value.strip().lower())
        if found is not None:
            return found
        raise InvalidValueError(f"{refused_word}; valid: {choices}")
    raise InvalidTypeError(f"expected {choices}, got {type(value).__name__}")


# Feature detection, once at import. PyTorch 2.4 made the autocast accessors device-generic
# (torch.is_autocast_enabled("cpu")). Before, each device type had its own functions, and the
# bare names (is_autocast_enabled(), set_autocast_enabled(bool)) meant CUDA.
HAS_DEVICE_GENERIC: bool = hasattr(torch, "get_autocast_dtype")
NO_DEVICE_GENERIC_NOTE = (
    f"PyTorch {torch.__version__} has no device-generic autocast getters; the per-device "
    "ones (cpu, cuda) are used"
)

# (is enabled, get dtype, set enabled, set dtype): PyTorch 2.4+, then per device type before
_GENERIC_NAMES = (
    "is_autocast_enabled",
    "get_autocast_dtype",
    "set_autocast_enabled",
    "set_autocast_dtype",
)
_PER_DEVICE_NAMES = {
    "cpu": (
        "is_autocast_cpu_enabled",
        "get_autocast_cpu_dtype",
        "set_autocast_cpu_enabled",
        "set_autocast_cpu_dtype",
    ),
    "cuda": (
        "is_autocast_enabled",
        "get_autocast_gpu_dtype",
        "set_autocast_enabled",
        "set_autocast_gpu_dtype",
    ),
}

if HAS_DEVICE_GENERIC:
    # by name: PyTorch 2.1's stubs lack the dtype pair and type the other two without a device
    _generic = [getattr(torch, name) for name in _GENERIC_NAMES]
    _is_enabled: Callable[[str], bool] = _generic[0]
    _get_dtype: Callable[[str], torch.dtype] = _generic[1]
    _set_enabled: Callable[[str, bool], None] = _generic[2]
    _set_dtype: Callable[[str, torch.dtype], None] = _generic[3]
else:  # PyTorch < 2.4: the originals, resolved here once (never the attributes at call time)
    _ACCESSORS: dict[str, tuple[Callable[..., Any], ...]] = {
        device_type: tuple(getattr(torch, name) for name in names)
        for device_type, names in _PER_DEVICE_NAMES.items()
    }

    def _is_enabled(device_type: str) -> bool:
        return bool(_ACCESSORS[device_type][0]())

    def _get_dtype(device_type: str) -> torch.dtype:
        return _ACCESSORS[device_type][1]()  # type: ignore[no-any-return]

    def _set_enabled(device_type: str, enabled: bool) -> None:
        _ACCESSORS[device_type][2](enabled)

    def _set_dtype(device_type: str, dtype: torch.dtype) -> None:
        _ACCESSORS[device_type][3](dtype)


CPU_FP16_MISSING = f"PyTorch {torch.__version__}'s CPU autocast runs bf16 only: it refuses fp16"
_cpu_fp16: bool | None = None


def cpu_autocast_takes_fp16() -> bool:
    """Whether this PyTorch's CPU autocast accepts float16 (2.1's accepts bfloat16 only).

    Asked once, the first time it matters: on a PyTorch without the device-generic API the
    CPU dtype setter is tried with float16 (it raises before changing anything when it
    refuses) and the calling thread's dtype is put back.
    """
    global _cpu_fp16
    if _cpu_fp16 is None:
        if HAS_DEVICE_GENERIC:  # 2.4+ (CI's 2.4.1 leg runs fp16 CPU autocast)
            _cpu_fp16 = True
        else:
            before = _get_dtype("cpu")
            try:
                _set_dtype("cpu", torch.float16)
            except RuntimeError:  # "AutocastCPU only support Bfloat16 ..."
                _cpu_fp16 = False
            else:
                _set_dtype("cpu", before)
                _cpu_fp16 = True
    return _cpu_fp16


class AutocastLever(SimpleLever):
    """``amp=...`` on one device type (``"cpu"`` or ``"cuda"``).

    Scope: thread. Restores the calling thread's autocast enabled flag and dtype for the
    device type, and clears the thread's autocast cast cache whenever it changes them.
    """

    name = "amp"
    scope = "thread"

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.domain = f"amp:{device_type}"

    validate = staticmethod(validate_amp)

    def read(self) -> AutocastState:
        return (_is_enabled(self.device_type), _get_dtype(self.device_type))

    # Two plain thread-local setters with no derived state: the state written is the state
    # read back, so (unlike TF32) no read-back is spent on the hot path.
    def apply(self, value: torch.dtype | None, before: AutocastState) -> AutocastState:
        return self.restore((False, before[1]) if value is None else (True, value), before)

    def restore(self, target: AutocastState, current: AutocastState) -> AutocastState:
        # apply's write too: both bring (enabled, dtype) from current to target
        changed = False
        if target[1] is not current[1]:  # dtypes are singletons; == on them is slow
            _set_dtype(self.device_type, target[1])
            changed = True
        if target[0] != current[0]:
            _set_enabled(self.device_type, target[0])
            changed = True
        if changed:
            # The cache is keyed by the source tensor alone (not the dtype), and lives until
            # cleared: a weight cast before an optimizer step, or to another dtype, must not
            # be reused after this write.
            torch.clear_autocast_cache()
        return target

    def describe(self, state: AutocastState) -> Any:
        return {"enabled": state[0], "dtype": _dtype_name(state[1])}

    def describe_value(self, value: torch.dtype | None) -> Any:
        return False if value is None else _dtype_name(value)

    def available(self, value: torch.dtype | None, device: torch.device) -> Effect:
        caps = capabilities(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            return Effect(False, f"no effect on {caps.device}: {caps.bf16.reason}")
        if value is None:
            return Effect(True, "")
        if value == torch.bfloat16:
            return _native("bf16", caps.bf16, caps.device, device)
        if device.type == "cpu" and not cpu_autocast_takes_fp16():
            return Effect(False, CPU_FP16_MISSING, unsupported=True)
        return _native("fp16", caps.fp16, caps.device, device)

    def __repr__(self) -> str:
        return f"<lever amp:{self.device_type} (thread)>"


def _native(word: str, answer: Capability, shown: str, device: torch.device) -> Effect:
    # autocast to bf16 or fp16 (``word``) on ``device``, as its capability ``answer`` says
    if answer:
        return Effect(True, "")
    why = f"{word} is not native on {shown}: {answer.reason}"
    if answer.missing_kernel:  # the instructions are there; PyTorch's kernels are not
        return Effect(False, why, unsupported=True)
    return Effect(False, why, device.type == "cpu")  # emulated: slower than fp32


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


_made: dict[str, AutocastLever] = {}
_made_lock = new_lock()


def autocast_lever(device_type: str) -> AutocastLever:
    """The ``amp`` lever for one device type (one shared instance per type)."""
    lever = _made.get(device_type)
    if lever is None:
        with _made_lock:
            lever = _made.setdefault(device_type, AutocastLever(device_type))
    return lever


def describe_amp(value: Any) -> Any:
    """``"bfloat16"`` for ``torch.bfloat16``, ``"auto"``, or ``False`` for off."""
    if value is None:
        return False
    if value == AUTO:
        return AUTO
    return _dtype_name(value)


AUTOCAST_SHORTHAND = Shorthand(
    name="autocast",
    parameter="dtype",
    default=UNSET,
    device_positional=True,
    doc="""Autocast in ``dtype`` on ``device`` for a block: ``fast_math(amp=dtype, device=device)``.

    Scope: thread (like ``torch.autocast``). Restores the thread's autocast flag and dtype.

    Example:
        >>> import torch, speedflags
        >>> with speedflags.autocast("bf16", device="cpu"):
        ...     speedflags.snapshot()["amp"]["cpu"], (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
        ({'enabled': True, 'dtype': 'bfloat16'}, torch.bfloat16)
    """,
)


DECLARED = (
    declare(
        autocast_lever,
        shorthand=AUTOCAST_SHORTHAND,
        name="amp",
        scope="thread",
        validate=validate_amp,
        describe=describe_amp,
        order=70,
        values=CHOICES,
        summary="autocast: matmuls and convolutions in bf16 or fp16, on one device type",
        accuracy="bf16: ~3e-3 relative error (8 mantissa bits); fp16: ~4e-4 (use loss scaling)",
        baseline=False,
        candidates=(torch.bfloat16, torch.float16),
        ops=MATMUL_OPS,
        # no dynamo_misses: autocast is guarded (by the tensors' dispatch keys on 2.1, by
        # the global state guard later)
    ),
)
