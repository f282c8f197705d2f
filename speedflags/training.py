"""The rest of a fast training loop: a GradScaler paired with the autocast dtype, the fastest
optimizer implementation, and batches moved to the device without needless syncs.

None of these change a flag; the scaler and the optimizer choices are recorded in the
ledger's history, so the audit trail says what the loop runs with.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections import abc, defaultdict
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
from torch.optim.optimizer import Optimizer  # the public path; 2.4's stubs lack torch.optim's

from ._fast_math import resolve_auto
from ._hardware import DeviceLike, capabilities, resolve_device
from ._ledger.decorate import caller_where
from ._ledger.ledger import ledger
from ._short_repr import short_repr
from .errors import InvalidTypeError, InvalidValueError
from .levers.arguments import AmpArg
from .levers.autocast import AUTO, CPU_FP16_MISSING, cpu_autocast_takes_fp16
from .levers.registry import lever_spec

__all__ = ["fast_optimizer", "grad_scaler", "to_device"]

Opt = TypeVar("Opt", bound=Optimizer)
T = TypeVar("T")


# --- GradScaler ---------------------------------------------------------------------------

# torch.amp.GradScaler (PyTorch 2.3+) takes the device type; before it, torch.cuda.amp's is the
# only one (CUDA; a disabled one passes everything through on any device).
_AMP_SCALER: Any = getattr(torch.amp, "GradScaler", None)
_CUDA_SCALER: Any = getattr(torch.cuda.amp, "GradScaler", None)


def grad_scaler(amp: AmpArg, device: DeviceLike = None, **kwargs: Any) -> Any:
    """A ``torch.amp.GradScaler`` that is enabled for fp16 and a pass-through otherwise.

    fp16 needs loss scaling: its 5-bit exponent underflows below ~6e-8, and small
    gradients flush to zero unless the loss is scaled up before ``backward()``. bf16 needs
    none: it has float32's 8-bit exponent (the same range, down to ~1e-38), so gradients
    do not underflow, and an enabled scaler with bf16 only costs time (an unscale and an
    inf/NaN check every step), can skip optimizer steps, and on some PyTorch versions fails
    (``_amp_foreach_non_finite_check_and_unscale_cuda not implemented for 'BFloat16'``).
    No autocast (``amp=False``) needs no scaler either. A disabled scaler's ``scale()``,
    ``step()`` and ``update()`` pass straight through, so one training loop serves every
    dtype. fp16 on a CPU gets an enabled scaler from PyTorch 2.3 (``torch.amp.GradScaler``);
    before, there is none for the CPU (and PyTorch 2.1's CPU autocast runs no fp16 at all).

    Args:
        amp: the autocast dtype the loop uses, as ``fast_math``'s ``amp``: ``"bf16"``,
            ``"fp16"``, ``"auto"`` (resolved for ``device`` as ``fast_math`` resolves it),
            ``torch.bfloat16``, ``torch.float16`` or ``False``.
        device: the device the loop trains on (default: CUDA if available, else CPU).
        **kwargs: passed to ``GradScaler`` (``init_scale``, ``growth_interval``, ...).

    Returns:
        A ``torch.amp.GradScaler`` for ``device``'s type (before PyTorch 2.3, which has
        none for the CPU, a ``torch.cuda.amp.GradScaler``: enabled only for CUDA); its
        choice (enabled or not, and why) is recorded in the ledger's history.

    Raises:
        InvalidValueError, InvalidTypeError: for a bad ``amp`` or ``device``.

    Example:
        >>> import torch, speedflags
        >>> scaler = speedflags.training.grad_scaler("bf16", device="cpu")
        >>> loss = torch.tensor(2.0)
        >>> scaler.is_enabled(), scaler.scale(loss) is loss
        (False, True)
        >>> speedflags.ledger().history[-1].reason
        "bf16 has float32's exponent range: no loss scaling needed"
    """
    dtype = lever_spec("amp").check("grad_scaler", amp)
    target = resolve_device(device, "grad_scaler")
    if dtype == AUTO:
        dtype, why = resolve_auto(target)
        why = f"amp='auto' chose {_dtype_name(dtype)}: {why}"
    else:
        why = ""
    if dtype is None:
        enabled, reason = False, "no autocast: float32 gradients need no loss scaling"
    elif dtype == torch.bfloat16:
        enabled, reason = False, "bf16 has float32's exponent range: no loss scaling needed"
    elif target.type == "cuda" and not torch.cuda.is_available():
        enabled, reason = False, f"fp16 on {target}, but {capabilities(target).fp16.reason}"
    elif target.type == "cpu" and not cpu_autocast_takes_fp16():
        enabled, reason = False, f"no fp16 gradients on cpu: {CPU_FP16_MISSING}"
    elif target.type == "cpu" and _AMP_SCALER is None:
        enabled, reason = False, f"PyTorch {torch.__version__} has no GradScaler for the CPU"
    else:
        enabled, reason = True, "fp16 gradients underflow without loss scaling"
    reason = f"{why}; {reason}" if why else reason
    if _AMP_SCALER is not None:
        scaler = _AMP_SCALER(target.type, enabled=enabled, **kwargs)
    else:  # disabled (any device) or CUDA: the CUDA scaler does both
        scaler = _CUDA_SCALER(enabled=enabled, **kwargs)
    ledger().note(
        "grad_scaler",
        "enabled" if enabled else "disabled",
        reason,
        after={"device": target.type, "amp": _dtype_name(dtype), "enabled": enabled},
        label=f"grad_scaler({amp!r})",
        where=caller_where(),
    )
    return scaler


def _dtype_name(dtype: torch.dtype | None) -> Any:
    return False if dtype is None else str(dtype).replace("torch.", "")


# --- optimizers ---------------------------------------------------------------------------


def fast_optimizer(cls: type[Opt], params: Iterable[Any], **kwargs: Any) -> Opt:
    """Build a ``torch.optim`` optimizer with the fastest implementation available.

    ``fused=True`` where the class has a fused kernel and every parameter is a
    floating-point tensor on a device type PyTorch fuses for (CUDA and, since PyTorch 2.4,
    CPU among them); else ``foreach=True`` where the parameters are on a device with
    multi-tensor kernels (CUDA); else PyTorch's default. A ``fused`` that the constructor
    refuses falls back to the next choice. A ``fused`` or ``foreach`` you pass yourself is
    kept as given. The choice and its reason are recorded in the ledger's history.

    Args:
        cls: the optimizer class (``torch.optim.AdamW``).
        params: parameters or parameter groups, as for ``cls`` (an iterator is consumed).
        **kwargs: the optimizer's other arguments (``lr=...``).

    Returns:
        The optimizer.

    Example:
        >>> import torch, speedflags
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = speedflags.training.fast_optimizer(torch.optim.AdamW, model.parameters(), lr=1e-3)
        >>> record = speedflags.ledger().history[-1]  # fused on a CPU from PyTorch 2.4
        >>> record.lever, record.action in ("fused", "default")
        ('optimizer', True)
        >>> bool(opt.defaults["fused"]) == (record.action == "fused")
        True
    """
    given: Any = cls
    if not (isinstance(given, type) and issubclass(given, Optimizer)):
        raise InvalidTypeError(
            f"fast_optimizer(cls={short_repr(cls)}): expected a torch.optim.Optimizer subclass"
        )
    build: Callable[..., Opt] = cls  # the subclass takes fused/foreach; Optimizer does not
    if isinstance(params, (torch.Tensor, str, bytes)) or not isinstance(params, abc.Iterable):
        # a tensor iterates over its rows: torch.optim would refuse it, less clearly
        raise InvalidTypeError(
            f"fast_optimizer(params={short_repr(params)}): expected an iterable of parameters "
            "or of parameter groups (dicts), such as model.parameters()"
        )
    params = list(params)
    tensors = _param_tensors(params)
    accepted = inspect.signature(cls).parameters
    where = caller_where()
    label = f"fast_optimizer({cls.__name__})"
    if "fused" in kwargs or "foreach" in kwargs:
        chosen = {k: kwargs[k] for k in ("fused", "foreach") if k in kwargs}
        optimizer = build(params, **kwargs)
        _note(label, where, cls, "as given", f"kept as given: {chosen}")
        return optimizer
    refused = ""
    fused_ok, why = _fused_supported(accepted, tensors, kwargs)
    if fused_ok:
        try:
            optimizer = build(params, fused=True, **kwargs)
        except (RuntimeError, ValueError, TypeError, NotImplementedError) as exc:
            refused = f"fused=True refused ({type(exc).__name__}: {exc}); "
        else:
            _note(label, where, cls, "fused", why)
            return optimizer
    else:
        refused = f"not fused: {why}; "
    foreach_ok, why = _foreach_supported(accepted, tensors)
    if foreach_ok:
        optimizer = build(params, foreach=True, **kwargs)
        _note(label, where, cls, "foreach", refused + why)
        return optimizer
    optimizer = build(params, **kwargs)
    _note(label, where, cls, "default", f"{refused}not foreach: {why}")
    return optimizer


def _param_tensors(params: list[Any]) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = []
    for item in params:
        if isinstance(item, dict):
            group = item.get("params", ())
            tensors.extend([group] if isinstance(group, torch.Tensor) else list(group))
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor):
            tensors.append(item[1])  # named parameters
        elif isinstance(item, torch.Tensor):
            tensors.append(item)
    return tensors


def _supported_devices(name: str, fallback: tuple[str, ...]) -> tuple[str, ...]:
    try:
        from torch.utils import _foreach_utils

        return tuple(getattr(_foreach_utils, name)())
    except (ImportError, AttributeError):  # pragma: no cover - older PyTorch
        return fallback


def _fused_supported(
    accepted: Any, tensors: list[torch.Tensor], kwargs: dict[str, Any]
) -> tuple[bool, str]:
    if "fused" not in accepted:
        return False, "the class has no fused implementation"
    if kwargs.get("differentiable"):
        return False, "fused kernels are not differentiable"
    if not tensors:
        return False, "no parameters"
    devices = _supported_devices("_get_fused_kernels_supported_devices", ("cuda",))
    types = sorted({t.device.type for t in tensors})
    if not all(t.device.type in devices and torch.is_floating_point(t) for t in tensors):
        return False, (
            f"fused kernels need floating-point parameters on {', '.join(devices)}; "
            f"got {', '.join(sorted({str(t.dtype) for t in tensors}))} on {', '.join(types)}"
        )
    return True, f"fused kernel for {', '.join(types)} parameters"


def _foreach_supported(accepted: Any, tensors: list[torch.Tensor]) -> tuple[bool, str]:
    if "foreach" not in accepted:
        return False, "the class has no foreach implementation"
    devices = _supported_devices("_get_foreach_kernels_supported_devices", ("cuda",))
    types = sorted({t.device.type for t in tensors})
    if not tensors or not all(t in devices for t in types):
        return False, f"multi-tensor kernels run on {', '.join(devices)}, not {', '.join(types)}"
    return True, f"multi-tensor kernels for {', '.join(types)} parameters"


def _note(label: str, where: Any, cls: type, impl: str, reason: str) -> None:
    ledger().note(
        "optimizer",
        impl,
        reason,
        after={"optimizer": cls.__name__, "implementation": impl},
        label=label,
        where=where,
    )


# --- batches ------------------------------------------------------------------------------


def to_device(batch: T, device: DeviceLike) -> T:
    """Move a tensor, or every tensor in a nested batch, to ``device``.

    Walks dicts (``OrderedDict`` and ``defaultdict`` kept), lists, tuples, namedtuples and
    dataclass instances, and rebuilds each container with its type; anything that is not a
    tensor (strings, numbers, ``None``, arrays) is left as it is. Copies to an accelerator
    use ``non_blocking=True``: the host-to-device copy is ordered on the device's stream
    before any kernel that reads it, and overlaps with host work when the source is pinned
    (``DataLoader(pin_memory=True)``). Copies to the CPU block: a non-blocking
    device-to-host copy can be read before it has landed.

    Args:
        batch: a tensor or a nested structure of them.
        device: where to move them (``"cuda"``, ``torch.device("cuda:1")``, ``"cpu"``).

    Returns:
        A structure like ``batch`` with its tensors on ``device``.

    Example:
        >>> import torch, speedflags
        >>> batch = {"x": torch.ones(2), "ids": [torch.zeros(1), "keep me"], "n": 3}
        >>> moved = speedflags.training.to_device(batch, "cpu")
        >>> moved["ids"][1], moved["n"], moved["x"].device.type
        ('keep me', 3, 'cpu')
    """
    target = resolve_device(device, "to_device")
    if target.type == "meta":
        raise InvalidValueError("to_device(device='meta'): a meta device holds no data")
    try:
        return _move(batch, target, target.type != "cpu", set())  # type: ignore[no-any-return]
    except RecursionError:
        raise InvalidValueError(
            f"to_device(batch=...): nested deeper than Python's recursion limit "
            f"({sys.getrecursionlimit()}); a batch is a shallow tree of containers"
        ) from None


def _move(obj: Any, device: torch.device, non_blocking: bool, path: set[int]) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, (str, bytes, int, float, bool)) or obj is None:
        return obj
    # the containers being walked, from the batch down to obj: met again, obj holds itself
    if id(obj) in path:
        raise InvalidValueError(
            f"to_device(batch=...): the batch contains itself (a {type(obj).__name__} that "
            "holds itself, directly or through other containers); a batch must be a tree"
        )
    path.add(id(obj))
    try:
        return _move_container(obj, device, non_blocking, path)
    finally:
        path.discard(id(obj))


def _move_container(obj: Any, device: torch.device, non_blocking: bool, path: set[int]) -> Any:
    if isinstance(obj, dict):
        items = [(k, _move(v, device, non_blocking, path)) for k, v in obj.items()]
        if isinstance(obj, defaultdict):
            return type(obj)(obj.default_factory, items)
        try:
            return type(obj)(items)
        except TypeError:  # a dict subclass with its own constructor
            return dict(items)
    if isinstance(obj, tuple):
        moved = [_move(v, device, non_blocking, path) for v in obj]
        if hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*moved)
        return tuple(moved) if type(obj) is tuple else type(obj)(moved)
    if isinstance(obj, list):
        moved_list = [_move(v, device, non_blocking, path) for v in obj]
        return moved_list if type(obj) is list else type(obj)(moved_list)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {
            f.name: _move(getattr(obj, f.name), device, non_blocking, path)
            for f in dataclasses.fields(obj)
            if f.init
        }
        return dataclasses.replace(obj, **changes)
    return obj
