"""Lever settings by epoch: ``Schedule`` and its TF32-only form ``TF32Schedule``.

NequIP's ``TF32Scheduler`` trains with TF32 early and switches it off for precise
convergence; this is that idea for any lever, through the ledger: each switch closes the
frame of the previous settings (restoring what was there before the schedule) and opens one
for the new settings, and the history records every switch.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ._fast_math import FastMath
from ._hardware import DeviceLike, normalize_device
from ._ledger.ledger import ledger
from ._short_repr import set_module, short_repr, type_name
from .errors import InvalidTypeError, InvalidValueError, LedgerOrderError
from .levers import registry
from .levers.registry import check_model, lever_spec

if TYPE_CHECKING:
    from .levers.arguments import LeverArgs

__all__ = ["Schedule", "TF32Schedule"]

_LEDGER = ledger()


@set_module("speedflags")
class Schedule:
    """Lever settings that change with the epoch: ``Schedule({0: {...}, 100: {...}})``.

    ``step(epoch)`` applies the settings of the largest key not above ``epoch`` (nothing
    before the first key; an empty dict means "no levers"), through the ledger, and records
    the switch; stepping within one entry changes nothing. ``close()``, or leaving a
    ``with schedule:`` block, restores what was there before the schedule started.

    Every entry is validated when the schedule is built: epochs must be non-negative
    ints, lever names those of :func:`speedflags.fast_math`, values valid for their lever;
    so are ``device`` and ``strict``, even when every entry is empty.

    Args:
        schedule: epoch -> ``fast_math`` keyword arguments (``tf32``, ``matmul_precision``,
            ``cudnn_benchmark``, ``sdpa``, ``deterministic``, ``reduced_precision_reduction``,
            ``amp``, and with ``model=`` ``param_dtype``, ``memory_format`` and ``fp8``).
        device: the device the levers target, as in ``fast_math``.
        strict: as in ``fast_math``: refuse levers with no native effect on the device.
        model: the ``nn.Module`` the entries' model levers (``param_dtype``,
            ``memory_format``, ``fp8``) act on, as in ``fast_math``.

    Scope: as ``fast_math``: ``amp`` is thread-local (it holds in the thread that calls
    ``step``), the other levers process-wide, from one ``step`` to the next switch or to
    ``close()``. Restores every lever it set, at each switch and at ``close()``; call
    ``step`` and ``close`` outside other ``fast_math`` blocks, in one thread.

    Example:
        >>> import torch, speedflags
        >>> with speedflags.Schedule({0: dict(matmul_precision="high"), 2: {}}) as sched:
        ...     for epoch in range(3):
        ...         _ = sched.step(epoch)
        ...         print(epoch, torch.get_float32_matmul_precision())
        0 high
        1 high
        2 highest
        >>> torch.get_float32_matmul_precision()
        'highest'
    """

    _name = "Schedule"

    def __init__(
        self,
        schedule: Mapping[int, LeverArgs],
        *,
        device: DeviceLike = None,
        strict: bool = False,
        model: torch.nn.Module | None = None,
    ) -> None:
        if not isinstance(schedule, Mapping):
            raise InvalidTypeError(
                f"{self._name}({short_repr(schedule)}): expected a dict of epoch -> settings, "
                f"got {type(schedule).__name__}"
            )
        if not schedule:
            raise InvalidValueError(f"{self._name}({{}}): needs at least one epoch")
        # checked here, not only by the entries' FastMath: an empty entry builds none
        normalize_device(device, self._name)
        if not isinstance(strict, bool):
            raise InvalidTypeError(
                f"{self._name}(strict={short_repr(strict)}): expected True or False, "
                f"got {type_name(strict)}"
            )
        entries = []
        for epoch in sorted(schedule, key=_epoch_order):
            _check_epoch(self._name, epoch)
            given: object = schedule[epoch]
            if not isinstance(given, Mapping):
                raise InvalidTypeError(
                    f"{self._name}: epoch {epoch}: expected a dict of fast_math arguments, "
                    f"got {short_repr(given)}"
                )
            for name in given:
                lever_spec(name, f"{self._name}: epoch {epoch}")  # refuses unknown names
            settings: dict[str, Any] = dict(given)
            spec: FastMath | None = None
            if settings:  # fast_math() with no argument would mean "recommended levers"
                # the model goes to the entries that set a model lever (it is refused without)
                uses_model = any(lever_spec(name).per_model for name in settings)
                try:
                    spec = FastMath(
                        **settings,
                        device=device,
                        strict=strict,
                        label=f"{self._name} epoch {epoch}",
                        model=model if uses_model else None,
                    )
                except (InvalidValueError, InvalidTypeError) as exc:
                    raise type(exc)(f"{self._name}: epoch {epoch}: {exc}") from None
            entries.append((epoch, settings, spec))
        if model is not None and not any(
            name in registry.MODEL_LEVER_NAMES for _, settings, _ in entries for name in settings
        ):
            check_model(self._name, model, ())  # a non-Module, or a model no entry uses
        self._entries: tuple[tuple[int, dict[str, Any], FastMath | None], ...] = tuple(entries)
        # the spec whose frame holds now (or is being opened): set before its start(), so that
        # a start interrupted after it opened the frame is stopped by the next switch or close
        self._spec: FastMath | None = None
        self._active: int | None = None
        # True from the start of a switch until it completes: a switch interrupted half-way
        # (Ctrl-C) is made again by the next step, whatever _active still says.
        self._switching = False
        shown = ", ".join(f"{epoch}: {short_repr(settings)}" for epoch, settings, _ in entries)
        self._label = f"{self._name}({{{shown}}})"

    # --- what it holds ---------------------------------------------------------------

    @property
    def epochs(self) -> tuple[int, ...]:
        """The schedule's epochs, in order."""
        return tuple(epoch for epoch, _, _ in self._entries)

    @property
    def active(self) -> int | None:
        """The epoch key whose settings hold now, or ``None``."""
        return self._active

    def settings_at(self, epoch: int) -> dict[str, Any]:
        """The settings ``step(epoch)`` applies (empty before the first key)."""
        _check_epoch(f"{self._name}.settings_at", epoch)
        entry = self._entry(epoch)
        return {} if entry is None else dict(entry[1])

    def __repr__(self) -> str:
        return f"<speedflags {self._label}, active={self._active!r}>"

    # --- switching -------------------------------------------------------------------

    def step(self, epoch: int) -> dict[str, Any]:
        """Apply the settings for ``epoch`` (switching only when its entry changes).

        Returns:
            The settings that hold from now on (empty if none).
        """
        _check_epoch(f"{self._name}.step", epoch)
        entry = self._entry(epoch)
        key = None if entry is None else entry[0]
        caller = sys._getframe(1)
        where = (caller.f_code.co_filename, caller.f_lineno)
        if key == self._active and not self._switching:  # same entry: nothing to switch
            return {} if entry is None else dict(entry[1])
        before = self.settings_at(self._active) if self._active is not None else {}
        self._switching = True
        self._close(where)
        self._active = None
        spec = None if entry is None else entry[2]
        if spec is not None:
            self._spec = spec
            spec.start(where)
        self._active = key
        self._switching = False
        after = {} if entry is None else dict(entry[1])
        _LEDGER.note(
            "schedule",
            "switch",
            f"epoch {epoch}: settings of epoch {key}" if key is not None else f"epoch {epoch}",
            before=before,
            after=after,
            label=self._label,
            where=where,
        )
        return after

    def close(self) -> None:
        """Restore what was there before the schedule started (safe to call twice).

        An error from the ledger (``LedgerOrderError``: a block entered after the schedule's
        settings is still open) is raised once they are restored: the schedule then holds
        nothing, and the next ``step`` applies its epoch's settings again.
        """
        caller = sys._getframe(1)
        self._close((caller.f_code.co_filename, caller.f_lineno))
        self._active = None

    def _close(self, where: tuple[str, int]) -> None:
        # stopped, then forgotten: an interruption in between leaves a spec with no frame
        # open, which the next call stops again (nothing), never a frame nobody holds. A stop
        # that raised (an order error once restored) forgets it too, with the active entry:
        # nothing holds, so nothing may be reported as holding.
        spec = self._spec
        if spec is None:
            return
        try:
            spec.stop(where)
        finally:
            if not _holds(spec):
                self._spec = None
                self._active = None

    def _entry(self, epoch: int) -> tuple[int, dict[str, Any], FastMath | None] | None:
        found = None
        for entry in self._entries:
            if entry[0] > epoch:
                break
            found = entry
        return found

    def __enter__(self) -> Schedule:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        caller = sys._getframe(1)
        self._close((caller.f_code.co_filename, caller.f_lineno))
        self._active = None


@set_module("speedflags")
class TF32Schedule(Schedule):
    """TF32 by epoch, NequIP's semantics: ``TF32Schedule({0: True, 100: False})``.

    Fast early (TF32 on), precise at the end (TF32 off): ``Schedule`` with
    ``{epoch: {"tf32": value}}`` entries. Values must be ``True`` or ``False``.

    Scope: process (TF32 is process-wide), from one ``step`` to the next switch or to
    ``close()``. Restores both TF32 API families exactly, at each switch and at
    ``close()``.

    Example:
        >>> import torch, speedflags
        >>> sched = speedflags.TF32Schedule({0: True, 100: False})
        >>> for epoch in (0, 99, 100):
        ...     _ = sched.step(epoch)
        ...     print(epoch, torch.backends.cuda.matmul.allow_tf32)
        0 True
        99 True
        100 False
        >>> sched.close()
    """

    _name = "TF32Schedule"

    def __init__(
        self, schedule: Mapping[int, bool], *, device: DeviceLike = None, strict: bool = False
    ) -> None:
        if not isinstance(schedule, Mapping):
            raise InvalidTypeError(
                f"TF32Schedule({short_repr(schedule)}): expected a dict of epoch -> True/False, "
                f"got {type(schedule).__name__}"
            )
        for epoch, value in schedule.items():
            if not isinstance(value, bool):
                raise InvalidTypeError(
                    f"TF32Schedule: epoch {short_repr(epoch)}: expected True or False, "
                    f"got {short_repr(value)}"
                )
        super().__init__(
            {epoch: {"tf32": value} for epoch, value in schedule.items()},
            device=device,
            strict=strict,
        )


def _holds(spec: FastMath) -> bool:
    # whether ``spec`` still has a frame open in this thread (a stop refused before it closed
    # one: a signal handler inside the ledger)
    try:
        return not _LEDGER.innermost(spec).closed
    except LedgerOrderError:
        return False


def _epoch_order(epoch: object) -> tuple[int, Any]:
    # sorts valid epochs numerically and puts anything else first, to be reported
    if isinstance(epoch, int) and not isinstance(epoch, bool):
        return (1, epoch)
    return (0, 0)


def _check_epoch(where: str, epoch: object) -> None:
    if isinstance(epoch, bool) or not isinstance(epoch, int):
        raise InvalidTypeError(
            f"{where}: epoch {short_repr(epoch)}: expected a non-negative int, "
            f"got {type(epoch).__name__}"
        )
    if epoch < 0:
        raise InvalidValueError(f"{where}: epoch {epoch}: expected a non-negative int")
