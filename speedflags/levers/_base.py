"""The Lever protocol: what the ledger needs to know about one reversible setting (and
``UNSET``, "leave this lever alone").

A lever reads, writes and restores one piece of PyTorch state. The ledger never imports a
concrete lever; it works through :class:`Lever` only, so any object that follows it (a fake
lever over a dict, in tests) is a lever to the ledger. :class:`DeviceLever` adds what
``fast_math``'s plans ask of torch's levers: whether a value has an effect on a device.

State values returned by :meth:`Lever.read` are hashable and compared with ``==``; they are
internal (tuples) and turned into JSON-friendly values by :meth:`Lever.describe`.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol, runtime_checkable

from .._short_repr import set_module

if TYPE_CHECKING:  # torch-free at run time: the pure fp32 model imports Unreadable from here
    import torch

Scope = Literal["process", "thread", "model"]


class _Unset(enum.Enum):
    # A one-member enum (PEP 484 singleton idiom) so type checkers can narrow on it;
    # ``None`` cannot serve, because some levers accept falsy values (amp=False).
    UNSET = "UNSET"

    def __repr__(self) -> str:
        return "UNSET"


UNSET = _Unset.UNSET


@set_module("speedflags")
class Unreadable:
    """The value of a PyTorch getter that raises instead of answering.

    PyTorch's legacy TF32 getters raise ``RuntimeError`` when the legacy and new APIs
    disagree; :func:`speedflags.snapshot` reports such a getter with this value instead of
    raising. Two ``Unreadable`` values are equal when the same error type and message
    would be raised.

    Example:
        >>> from speedflags.levers._base import Unreadable
        >>> Unreadable("RuntimeError", "mix of the legacy and new APIs")
        <raises RuntimeError: mix of the legacy and new APIs>
    """

    __slots__ = ("error", "message")

    def __init__(self, error: str, message: str) -> None:
        self.error = error
        self.message = message

    @classmethod
    def from_exception(cls, exc: BaseException) -> Unreadable:
        # PyTorch appends a C++ traceback on some builds; the first line carries the meaning.
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return cls(type(exc).__name__, message)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Unreadable):
            return NotImplemented
        return (self.error, self.message) == (other.error, other.message)

    def __hash__(self) -> int:
        return hash((Unreadable, self.error, self.message))

    def __repr__(self) -> str:
        return f"<raises {self.error}: {self.message}>"

    def to_json(self) -> dict[str, str]:
        """A JSON-friendly form: ``{"raises": "RuntimeError", "message": ...}``."""
        return {"raises": self.error, "message": self.message}


class Effect(NamedTuple):
    """Whether a lever value changes what kernels do on a device, and why (not)."""

    effective: bool
    reason: str
    slow: bool = False  # the lever works but makes things slower (fp16 autocast on a CPU)
    # this PyTorch refuses the value on the device (fp16 CPU autocast on 2.1): never applied
    unsupported: bool = False
    # with unsupported: a block asking for it is refused (LeverUnavailableError) rather than
    # entered without it: what is missing is an install the user can fix (fp8 without torchao)
    refused: bool = False


@runtime_checkable
class Guard(Protocol):
    """What the watch and the leak check need of a piece of torch state: a lever, or a
    guarded setting (:mod:`speedflags.levers.guarded`) that speedflags only reads and puts
    back."""

    @property
    def name(self) -> str: ...

    @property
    def scope(self) -> Scope: ...

    @property
    def domain(self) -> str: ...

    def read(self) -> Hashable:
        """The current state. Never raises."""
        ...

    def restore(self, target: Any, current: Any) -> Hashable:
        """Bring the state from ``current`` back to ``target``; return the state read afterwards."""
        ...

    def describe(self, state: Any) -> Any:
        """A JSON-friendly view of ``state`` for snapshots, reports and history records."""
        ...


@runtime_checkable
class Lever(Guard, Protocol):
    """One reversible setting: a :class:`Guard` that speedflags also writes. What the
    ledger needs of a lever, and all it knows of one.

    Attributes:
        name: the ``fast_math`` argument it implements (``"tf32"``); its name in records.
        scope: ``"process"`` for C++-global flags, ``"thread"`` for thread-local ones,
            ``"model"`` for one model's state (a frame stack per model: see the model
            levers).
        domain: the piece of state it reads and writes. Levers that share state (``tf32``
            and ``matmul_precision``) share a domain, so the ledger keeps one stack of open
            frames for both.

    States (what :meth:`read` returns) are hashable, compared with ``==``, never ``None``.

    Example:
        >>> from speedflags.levers._base import Lever
        >>> class DictLever:  # a lever over a dict: enough for the ledger
        ...     name = domain = "knob"
        ...     scope = "process"
        ...     checks_state = False
        ...     def __init__(self): self.state = {"knob": 0}
        ...     def read(self): return self.state["knob"]
        ...     def check(self, state): pass
        ...     def apply(self, value, before): self.state["knob"] = value; return self.read()
        ...     def restore(self, target, current): return self.apply(target, current)
        ...     def describe(self, state): return state
        ...     def describe_value(self, value): return value
        >>> isinstance(DictLever(), Lever)
        True
    """

    @property
    def checks_state(self) -> bool:
        """True if check() can refuse (the ledger skips the call otherwise)."""
        ...

    def check(self, state: Any) -> None:
        """Raise if no write may start from ``state`` (a mixed TF32 state). Changes nothing,
        and depends on ``state`` alone: the ledger does not check again a state equal to one
        that passed."""
        ...

    def apply(self, value: Any, before: Any) -> Hashable:
        """Write ``value`` on top of ``before``; return the state read afterwards."""
        ...

    def describe_value(self, value: Any) -> Any:
        """A JSON-friendly view of a requested value."""
        ...


@runtime_checkable
class DeviceLever(Lever, Protocol):
    """One of torch's levers, as ``fast_math``'s plans and ``tune`` see it: a :class:`Lever`
    that also says whether a value changes what kernels do on a device."""

    def available(self, value: Any, device: torch.device) -> Effect:
        """Whether ``value`` has an effect on ``device``, with the reason."""
        ...


class SimpleLever:
    """Shared defaults for levers whose state is one plain value."""

    name: str = ""
    scope: Scope = "process"
    domain: str = ""
    checks_state: bool = False

    def check(self, state: Any) -> None:
        return None

    def describe(self, state: Any) -> Any:
        return state

    def describe_value(self, value: Any) -> Any:
        return value

    def __repr__(self) -> str:
        return f"<lever {self.name} ({self.scope})>"


def validate_bool(value: object) -> bool:
    """``value`` if it is ``True`` or ``False``; else ``InvalidTypeError`` naming its type."""
    if not isinstance(value, bool):
        from .._short_repr import type_name  # local: keep this module free of import cycles
        from ..errors import InvalidTypeError

        raise InvalidTypeError(f"expected True or False, got {type_name(value)}")
    return value


def verified(lever: SimpleLever, action: str, wanted: Any, got: Any) -> Any:
    """Return ``got`` if it equals ``wanted``; else raise ``StateMismatchError`` naming both."""
    if got == wanted:
        return got
    import torch  # local: keep this module importable without torch

    from ..errors import StateMismatchError  # local: keep this module free of import cycles

    raise StateMismatchError(
        f"{action} {lever.name}: speedflags wrote {lever.describe(wanted)!r} but PyTorch "
        f"{torch.__version__} reports {lever.describe(got)!r}"
    )
