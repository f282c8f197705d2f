"""The torch side of :func:`speedflags.watch`: the setters it wraps, the states it reads,
and the frame it names as the writer.

Every Python path that writes a lever's state ends in one of a few functions of
``torch._C``: the ``torch.backends`` attributes (``cudnn.benchmark``, ``cudnn.deterministic``,
``allow_tf32``, every ``fp32_precision``, the ``cuda.matmul`` reduction flags) are
descriptors or ``__setattr__`` methods calling them, ``torch.set_float32_matmul_precision``,
``torch.use_deterministic_algorithms``, ``torch.set_deterministic_debug_mode``,
``cudnn.flags()``/``set_flags``, the SDPA ``enable_*_sdp`` functions and ``sdpa_kernel``
call them by attribute at call time, and
``torch.autocast`` calls ``torch.set_autocast_*`` (the ``torch._C`` functions themselves,
re-exported). So wrapping these names covers every path, including functions imported by
name before watching started. Verified on PyTorch 2.13 and against the 2.4 sources (the
determinism and reduction setters against 2.1's too); a setter this PyTorch lacks is skipped.

The states are the registry's lever *domains* (:func:`domains`: one per piece of torch
state, autocast once per device type), read raw through each lever's ``read()``.

Scope: this module only describes and reads; :mod:`speedflags._watch.watcher` installs and
removes the wrappers.

Example:
    >>> from speedflags._watch.setters import SETTERS
    >>> setter = SETTERS["_set_cudnn_benchmark"]
    >>> setter.lever, setter.describe((True,))
    ('cudnn_benchmark', 'torch.backends.cudnn.benchmark set to True')
    >>> SETTERS["_set_fp32_precision_setter"].describe(("generic", "all", "tf32"))
    "torch.backends.fp32_precision set to 'tf32'"
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import types
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import torch

from .._ledger.history import format_where
from .._tracing import Where
from .._warn import PACKAGE_DIR
from ..levers import _fp32_model as family
from ..levers import registry
from ..levers._base import Guard
from ..levers.guarded import GUARDED
from ..levers.registry import AUTOCAST_DEVICE_TYPES

__all__ = [
    "SETTERS",
    "Domain",
    "Setter",
    "Write",
    "domains",
    "flatten",
    "writer_frame",
]


class Setter(NamedTuple):
    """One wrapped function.

    Attributes:
        name: its name in ``owner`` (and in ``torch`` when re-exported there).
        lever: the registry name of the lever (or guarded setting) whose state it writes.
        shown: how code writes it: an attribute (``"torch.backends.cudnn.benchmark"``) or,
            with ``call``, the function called.
        call: True when code calls a function rather than assigning an attribute.
        owner: the module that holds it, ``"torch._C"`` or ``"torch"``.
    """

    name: str
    lever: str
    shown: str
    call: bool = False
    owner: str = "torch._C"  # or "torch": a Python function of the torch module

    def describe(self, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> str:
        """The write, in the words of the code that made it."""
        if kwargs:  # as called: the values in order, keywords named
            if not self.call:
                return self.describe((*args, *kwargs.values()))
            parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
            return f"{self.shown}({', '.join(parts)})"
        if self.name == "_set_fp32_precision_setter" and len(args) == 3:
            node = tuple(args[:2])
            shown = (
                family.NODE_NAMES[family.NODES.index(node)]
                if node in family.NODES
                else f"fp32_precision of {args[0]}.{args[1]}"
            )
            return f"{shown} set to {args[2]!r}"
        if self.call:
            return f"{self.shown}({', '.join(repr(a) for a in args)})"
        if self.name in _SPLITK_SETTERS and len(args) == 2:
            # 2.10+: torch passes (allow, allow_splitk); `= False` arrives as (False, True)
            shown_value = args[0] if args[1] is True else tuple(args)
            return f"{self.shown} set to {shown_value!r}"
        value = args[-1] if args else None
        return f"{self.shown} set to {value!r}"


# torch.backends.cuda.enable_<kernel>_sdp(...) calls torch._C._set_sdp_use_<kernel>
_SDPA_KERNELS = ("flash", "mem_efficient", "math", "cudnn")
# torch.backends.cuda.matmul.<flag> = ... calls torch._C._set_cublas_<flag>
_CUBLAS_REDUCTION_FLAGS = (
    "allow_fp16_reduced_precision_reduction",
    "allow_bf16_reduced_precision_reduction",
    "allow_fp16_accumulation",  # PyTorch 2.7+
)
# torch.set_autocast_<x> is torch._C.set_autocast_<x> itself, re-exported
_AUTOCAST_SETTERS = (
    "set_autocast_enabled",
    "set_autocast_dtype",
    # PyTorch < 2.4's per-device setters (still present, deprecated, in 2.13)
    "set_autocast_cpu_enabled",
    "set_autocast_cpu_dtype",
    "set_autocast_gpu_dtype",
)

_TABLE = (
    Setter("_set_cublas_allow_tf32", "tf32", family.LEGACY_MATMUL),
    Setter("_set_cudnn_allow_tf32", "tf32", family.LEGACY_CUDNN),
    # 2.13 keeps it apart from the fp32_precision tree; watched in case a version links them
    Setter("_set_onednn_allow_tf32", "tf32", "torch.backends.mkldnn.allow_tf32"),
    # every fp32_precision attribute, at every level (the node is in the arguments)
    Setter("_set_fp32_precision_setter", "tf32", "fp32_precision"),
    Setter(
        "_set_float32_matmul_precision",
        "matmul_precision",
        "torch.set_float32_matmul_precision",
        call=True,
    ),
    Setter("_set_cudnn_benchmark", "cudnn_benchmark", "torch.backends.cudnn.benchmark"),
    *(
        Setter(
            f"_set_sdp_use_{kernel}", "sdpa", f"torch.backends.cuda.enable_{kernel}_sdp", call=True
        )
        for kernel in _SDPA_KERNELS
    ),
    # shown by their torch._C names
    *(
        Setter(name, "sdpa", f"torch._C.{name}", call=True)
        for name in ("_set_sdp_use_overrideable", "_set_sdp_priority_order")
    ),
    # torch.use_deterministic_algorithms and set_deterministic_debug_mode call it by attribute
    Setter(
        "_set_deterministic_algorithms",
        "deterministic",
        "torch.use_deterministic_algorithms",
        call=True,
    ),
    Setter("_set_cudnn_deterministic", "deterministic", "torch.backends.cudnn.deterministic"),
    *(
        Setter(
            f"_set_cublas_{flag}",
            "reduced_precision_reduction",
            f"torch.backends.cuda.matmul.{flag}",
        )
        for flag in _CUBLAS_REDUCTION_FLAGS
    ),
    *(Setter(name, "amp", f"torch.{name}", call=True) for name in _AUTOCAST_SETTERS),
)

# The guarded settings' setters come with their registry entries (levers/guarded.py).
_GUARDED_SETTERS = tuple(
    Setter(name, setting.name, shown, call, owner)
    for setting in GUARDED
    for owner, name, shown, call in setting.setters
)
SETTERS: dict[str, Setter] = {setter.name: setter for setter in _TABLE + _GUARDED_SETTERS}


_SPLITK_SETTERS = frozenset(
    f"_set_cublas_allow_{dtype}_reduced_precision_reduction" for dtype in ("fp16", "bf16")
)


def _dirs(*files: str | None) -> tuple[str, ...]:
    found = set()
    for file in files:
        if file:
            found.add(os.path.dirname(file) + os.sep)
            found.add(os.path.dirname(os.path.abspath(file)) + os.sep)
    return tuple(found)


_SKIPPED_DIRS = _dirs(torch.__file__, os.path.join(PACKAGE_DIR, "__init__.py"))
_PLUMBING = frozenset(
    path
    for module in (contextlib, functools)
    for path in (module.__file__ or "", os.path.abspath(module.__file__ or ""))
)


# torch's own API for its settings: a setter called from these files is the caller's
# write (torch.backends.cudnn.benchmark = ..., torch.set_default_dtype, torch.autocast, no_grad,
# sdpa_kernel); called from anywhere else in torch, it is torch writing by itself.
_TORCH_DIRS = _dirs(torch.__file__)
_SETTING_APIS = tuple(
    base + part
    for base in _TORCH_DIRS
    for part in (
        "__init__.py",
        "backends" + os.sep,
        "amp" + os.sep,
        os.path.join("cuda", "amp") + os.sep,
        os.path.join("cpu", "amp") + os.sep,
        os.path.join("autograd", "grad_mode.py"),
        os.path.join("nn", "attention") + os.sep,
        os.path.join("utils", "_device.py"),
    )
)


def torch_writer() -> types.FrameType | None:
    """The frame of torch's own code that called a setter by itself, or None.

    That is the first frame up the calling stack outside speedflags, when it lies in torch
    but not in one of torch's setting APIs: a write PyTorch makes lazily (the first SDPA call
    on a Hopper GPU writes PyTorch's cuDNN-first default priority order,
    pytorch/pytorch#185511), which is nobody's leak.
    """
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and (
        frame.f_code.co_filename.startswith(PACKAGE_DIR) or frame.f_code.co_filename in _PLUMBING
    ):
        frame = frame.f_back
    if frame is None:
        return None
    file = frame.f_code.co_filename
    return frame if file.startswith(_TORCH_DIRS) and not file.startswith(_SETTING_APIS) else None


def writer_frame() -> types.FrameType | None:
    """The first frame of the calling stack outside torch, speedflags and the plumbing."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        file = frame.f_code.co_filename
        if not file.startswith(_SKIPPED_DIRS) and file not in _PLUMBING:
            return frame
        frame = frame.f_back
    return None


class Write(NamedTuple):
    """One write the watch saw (or a change it found at a boundary, with no ``function``)."""

    lever: str  # the record's lever name: the lever's (its fast_math keyword) or setting's
    text: str  # "torch.backends.cudnn.benchmark set to True", or what was found where
    function: str  # the writer's function name; "" for a change made around Python
    where: Where
    thread: str
    after: Hashable  # the raw state it left
    # torch's own frame when torch wrote it by itself: (function, where)
    by_torch: tuple[str, Where] | None = None

    def sentence(self) -> str:
        """``"torch.backends.fp32_precision set to 'tf32' by enable_tf32 at f.py:12"``."""
        if not self.function:
            return self.text
        at = f" at {format_where(self.where)}" if self.where else ""
        if self.by_torch is not None:
            function, where = self.by_torch
            return (
                f"{self.text} by PyTorch itself ({function} at {format_where(where)}), "
                f"reached from {self.function}{at}"
            )
        return f"{self.text} by {self.function}{at}"


class Domain(NamedTuple):
    """One piece of torch state the levers guard, and the levers that view it."""

    key: str  # the levers' domain: one piece of torch state
    thread: bool  # thread-local (autocast)
    lever: Guard  # reads it (and puts it back, for the leak check)
    name: str  # the record's lever name for a change found at a boundary (the registry's)
    views: tuple[tuple[str, str, Guard], ...]  # (registry name, snapshot prefix, lever)

    def describer(self, name: str) -> Callable[[Any], Any]:
        """How the lever (or setting) called ``name`` describes this domain's state."""
        for view_name, _, lever in self.views:
            if view_name == name:
                return lever.describe
        return self.lever.describe


def domains() -> tuple[Domain, ...]:
    """From the registry: one entry per domain; thread levers once per autocast device type;
    then one per guarded setting (a view of a lever's domain where a lever of one's own writes
    it). Model levers have no process-wide state and no entry."""
    found: dict[str, Domain] = {}
    for spec in registry.specs():
        if spec.per_model:  # a model's state: nothing process-wide to watch
            continue
        device_types = AUTOCAST_DEVICE_TYPES if spec.scope == "thread" else ("cpu",)
        for device_type in device_types:
            lever = spec.lever(device_type)
            prefix = spec.name if spec.scope == "process" else f"{spec.name}.{device_type}"
            view: tuple[str, str, Guard] = (spec.name, prefix, lever)
            old = found.get(lever.domain)
            if old is None:
                found[lever.domain] = Domain(
                    lever.domain, spec.scope == "thread", lever, spec.name, (view,)
                )
            else:
                found[lever.domain] = old._replace(views=(*old.views, view))
    for setting in GUARDED:
        view = (setting.name, setting.name, setting)
        old = found.get(setting.domain)
        if old is not None:  # a lever of one's own over it (num_threads): read by the lever
            found[setting.domain] = old._replace(views=(*old.views, view))
            continue
        found[setting.domain] = Domain(
            setting.domain, setting.scope == "thread", setting, setting.name, (view,)
        )
    return tuple(found.values())


def flatten(prefix: str, value: Any, out: dict[str, Any]) -> dict[str, Any]:
    """A described state, flat, keyed as in a snapshot: ``"tf32.torch.backends.fp32_precision"``."""
    if isinstance(value, dict):
        for key, sub in value.items():
            flatten(f"{prefix}.{key}", sub, out)
    else:
        out[prefix] = value
    return out
