"""Guarded settings: torch state speedflags never sets for speed, but reads, watches and puts back.

A library that enters bf16 autocast in a constructor, a fixture that leaves
``torch.set_default_dtype(torch.float64)``, a test that switches deterministic algorithms on:
each changes the numbers or the kernels of everything that runs after it in the process.
The levers guard the state they set; these entries extend the same guard to the rest:
:func:`speedflags.snapshot` and the report show them, :func:`speedflags.watch` names who
wrote them, the pytest plugin catches and puts back a test's leak of any of them, and
:func:`speedflags.check_ranks` compares those that ranks must share.

Each entry has a reader (never raises: a getter that raises reads as
:class:`~speedflags.Unreadable`), a describer (JSON-friendly), a restore (for the leak
check), the ``torch._C`` setters that write it (for ``watch``) and whether ranks must
agree. Only what the running PyTorch has is guarded; :data:`SKIPPED` says why the rest is
not (never an error). The getters are PyTorch's private ``torch._C`` accessors where the
public ones warn ("experimental": the preferred BLAS library) or change state.

Scope: each entry says ``process`` or ``thread`` (read in the calling thread).

Example:
    >>> import torch
    >>> from speedflags.levers.guarded import setting
    >>> dtype = setting("default_dtype")
    >>> dtype.describe(dtype.read())
    'float32'
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
import torch._C as torch_C

from ..errors import InvalidValueError
from ._base import Scope, Unreadable

__all__ = ["GUARDED", "GUARDED_NAMES", "SKIPPED", "Setting", "guarded_snapshot", "setting"]

_C: Any = torch_C  # by its module: PyTorch 2.1's stubs do not re-export torch._C


@dataclass(eq=False, repr=False)
class Setting:
    """One guarded piece of torch state: read it, describe it, put it back.

    Attributes:
        name: its name in snapshots, reports and the leak check (``"default_dtype"``).
        scope: ``"process"`` or ``"thread"``.
        summary: what it is, in torch's words.
        setters: the ``torch._C`` functions (or ``torch`` functions) that write it, for
            :func:`speedflags.watch`: ``(owner, name, shown, call)``.
        ranks_agree: whether every rank of a distributed job must read the same.

    Example:
        >>> from speedflags.levers.guarded import setting
        >>> grad = setting("grad_enabled")
        >>> grad.scope, grad.describe(grad.read())
        ('thread', True)
    """

    name: str
    scope: Scope
    summary: str
    # the raw getter (may raise: read() is the guarded read), the writer, and the describer
    # of a readable state (describe() passes Unreadable through)
    _get: Callable[[], Any]
    _put: Callable[[Any], None]
    _describe: Callable[[Any], Any] = lambda state: state
    setters: tuple[tuple[str, str, str, bool], ...] = ()
    ranks_agree: bool = True

    @property
    def domain(self) -> str:
        """The piece of state: the setting's name (no lever shares it)."""
        return self.name

    @property
    def fast_read(self) -> Callable[[], Any]:
        """The raw getter: :meth:`read` without its guard, for a caller that reads many
        settings under one ``try`` of its own (the leak check, every test)."""
        return self._get

    def read(self) -> Hashable:
        """The state now (never raises)."""
        try:
            return self._get()  # type: ignore[no-any-return]
        except Exception as exc:
            return Unreadable.from_exception(exc)

    def restore(self, target: Any, current: Any) -> Any:
        """Write ``target`` back (if it differs) and return the state read afterwards."""
        if isinstance(target, Unreadable):
            raise ValueError(f"{self.name}: cannot restore a state that could not be read")
        if current != target:
            self._put(target)
        return self.read()

    def describe(self, state: Any) -> Any:
        """A JSON-friendly view of a state read by :meth:`read`."""
        if isinstance(state, Unreadable):
            return state
        return self._describe(state)

    def __repr__(self) -> str:
        return f"<guarded setting {self.name} ({self.scope})>"


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def _enum_name(value: Any) -> str:
    # torch._C._BlasBackend.Cublas -> "Cublas"
    return str(value).rpartition(".")[2]


# --- default device: thread-local since PyTorch 2.3, one process-wide context before ------

_DEVICE_CONTEXT_IS_THREAD_LOCAL = isinstance(
    getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None), threading.local
)


def _default_device() -> Any:
    # The device of the context torch.set_default_device installed (None: unset, tensors go
    # to the CPU); read raw: torch.get_default_device() allocates a tensor to resolve an index.
    # Read on every test by the leak check, so the thread-local holder is looked up once.
    if _DEVICE_HOLDER is not None:
        # the thread's own __dict__: a getattr that misses costs ~10x (an AttributeError)
        context = _DEVICE_HOLDER.__dict__.get("device_context")
    else:  # PyTorch < 2.3: the module global is the context itself, or None
        context = getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None)
    return None if context is None else context.device


_DEVICE_HOLDER: Any = torch._GLOBAL_DEVICE_CONTEXT if _DEVICE_CONTEXT_IS_THREAD_LOCAL else None  # type: ignore[attr-defined, unused-ignore]


def _device_name(device: Any) -> str | None:
    return None if device is None else str(device)


def _set_default_device(device: str | None) -> None:
    set_default_device: Any = torch.set_default_device  # untyped in PyTorch 2.1's stubs
    set_default_device(device)


# --- autocast's nesting depth: only readable by moving it and moving it back --------------

# captured at import (None where absent): a watch's wrappers never see the moves
_increment: Any = getattr(_C, "autocast_increment_nesting", None)
_decrement: Any = getattr(_C, "autocast_decrement_nesting", None)


def _nesting() -> int:
    depth = int(_increment()) - 1
    _decrement()
    return depth


def _set_nesting(depth: int) -> None:
    current = _nesting()
    while current < depth:
        current = int(_increment())
    while current > depth:
        current = int(_decrement())


# An entry for _candidates' add: the torch._C functions it needs, how to make the setting
# once they are known to exist, and its name.
_Entry = tuple[tuple[str, ...], Callable[[], Setting], str]


def _backend_enabled(backend: str) -> _Entry:
    """``torch.backends.<backend>.enabled`` (``cudnn``, ``mkldnn``): one bool per backend."""
    get, put = f"_get_{backend}_enabled", f"_set_{backend}_enabled"
    shown = f"torch.backends.{backend}.enabled"

    def make() -> Setting:
        getter = getattr(_C, get)
        return Setting(
            f"{backend}_enabled", "process", shown, lambda: bool(getter()), getattr(_C, put),
            bool, (("torch._C", put, shown, False),),
        )  # fmt: skip

    return (get, put), make, f"{backend}_enabled"


def _preferred_library(kind: str) -> _Entry:
    """``torch.backends.cuda.preferred_<kind>_library()`` (``blas``, ``linalg``): an enum."""
    get, put = f"_get_{kind}_preferred_backend", f"_set_{kind}_preferred_backend"
    shown = f"torch.backends.cuda.preferred_{kind}_library"

    def make() -> Setting:
        return Setting(
            f"{kind}_library", "process", f"{shown}()", getattr(_C, get), getattr(_C, put),
            _enum_name, (("torch._C", put, shown, True),),
        )  # fmt: skip

    return (get, put), make, f"{kind}_library"


def _candidates() -> tuple[tuple[Setting, ...], dict[str, str]]:
    found = []
    skipped: dict[str, str] = {}

    def add(needs: tuple[str, ...], make: Callable[[], Setting], name: str) -> None:
        missing = [n for n in needs if not hasattr(_C, n) and not hasattr(torch, n)]
        if missing:
            skipped[name] = f"this PyTorch ({torch.__version__}) has no {', '.join(missing)}"
        else:
            found.append(make())

    add(
        ("_set_default_dtype",),
        lambda: Setting(
            "default_dtype", "process", "torch.get_default_dtype()",
            torch.get_default_dtype, torch.set_default_dtype, _dtype_name,
            (("torch._C", "_set_default_dtype", "torch.set_default_dtype", True),
             ("torch._C", "_set_default_tensor_type", "torch.set_default_tensor_type", True)),
        ),
        "default_dtype",
    )  # fmt: skip
    add(
        ("set_default_device",),
        lambda: Setting(
            "default_device", "thread" if _DEVICE_CONTEXT_IS_THREAD_LOCAL else "process",
            "torch.set_default_device() (None: unset, the CPU)",
            _default_device, _set_default_device, _device_name,
            (("torch", "set_default_device", "torch.set_default_device", True),),
            ranks_agree=False,  # each rank's own GPU
        ),
        "default_device",
    )  # fmt: skip
    for backend in ("cudnn", "mkldnn"):
        add(*_backend_enabled(backend))
    for kind in ("blas", "linalg"):
        add(*_preferred_library(kind))
    add(
        ("is_autocast_cache_enabled", "set_autocast_cache_enabled"),
        lambda: Setting(
            "autocast_cache", "thread", "torch.is_autocast_cache_enabled()",
            lambda: bool(_C.is_autocast_cache_enabled()), _C.set_autocast_cache_enabled,
            bool,
            (("torch._C", "set_autocast_cache_enabled", "torch.set_autocast_cache_enabled",
              True),),
            ranks_agree=False,
        ),
        "autocast_cache",
    )  # fmt: skip
    add(
        ("autocast_increment_nesting", "autocast_decrement_nesting"),
        lambda: Setting(
            "autocast_nesting", "thread", "autocast's nesting depth (torch.autocast blocks open)",
            _nesting, _set_nesting, int,
            (("torch._C", "autocast_increment_nesting", "torch.autocast_increment_nesting",
              True),
             ("torch._C", "autocast_decrement_nesting", "torch.autocast_decrement_nesting",
              True)),
            ranks_agree=False,
        ),
        "autocast_nesting",
    )  # fmt: skip
    add(
        ("_set_grad_enabled",),
        lambda: Setting(
            "grad_enabled", "thread", "torch.is_grad_enabled()",
            torch.is_grad_enabled, _C._set_grad_enabled, bool,
            (("torch._C", "_set_grad_enabled", "torch.set_grad_enabled", True),),
            ranks_agree=False,
        ),
        "grad_enabled",
    )  # fmt: skip
    add(
        ("get_num_threads", "set_num_threads"),
        lambda: Setting(
            "num_threads", "process", "torch.get_num_threads() (intra-op threads)",
            torch.get_num_threads, torch.set_num_threads, int,
            (("torch._C", "set_num_threads", "torch.set_num_threads", True),),
            ranks_agree=False,  # ranks on one node often split the cores
        ),
        "num_threads",
    )  # fmt: skip
    return tuple(found), skipped


#: The guarded settings the running PyTorch has, in a fixed order.
GUARDED, SKIPPED = _candidates()
#: Every guarded setting's name, present here or not.
GUARDED_NAMES = tuple(sorted([s.name for s in GUARDED] + list(SKIPPED)))
_BY_NAME = {s.name: s for s in GUARDED}


def setting(name: str) -> Setting:
    """The guarded setting called ``name``.

    Raises:
        InvalidValueError: no such setting, or this PyTorch does not have it (says why).

    Example:
        >>> from speedflags.levers.guarded import setting
        >>> setting("cudnn_enabled").scope
        'process'
    """
    found = _BY_NAME.get(name)
    if found is not None:
        return found
    if name in SKIPPED:
        raise InvalidValueError(f"guarded setting {name!r} is not guarded here: {SKIPPED[name]}")
    raise InvalidValueError(f"no guarded setting {name!r}; valid: {', '.join(GUARDED_NAMES)}")


def guarded_snapshot() -> dict[str, Any]:
    """Every guarded setting's state now, described, by name (thread ones: the caller's).

    Example:
        >>> from speedflags.levers.guarded import guarded_snapshot
        >>> guarded_snapshot()["grad_enabled"]
        True
    """
    return {s.name: s.describe(s.read()) for s in GUARDED}
