"""What both trainer callbacks share: phase levers, an epoch schedule, the frames they hold.

A callback names its phases (``train``, ``validate``, ...). Each phase's levers are
``fast_math`` keyword arguments, validated through the lever registry when the callback is
built, with errors that name the callback's argument. :class:`PhaseFrames` builds one
:class:`~speedflags.FastMath` spec per phase, schedule entry and device (on first use, since
the device is known only once the trainer has placed the model), with the trainer's model
as ``model=`` when the phase has a model lever (``param_dtype``, ``memory_format``), and
opens and closes the ledger frames that hold them. Nothing here imports Lightning or
transformers.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .._fast_math import FastMath
from .._ledger.frame import Frame
from .._ledger.ledger import ledger
from .._short_repr import short_repr
from .._status import heal_tf32, tf32_status
from .._warn import user_stacklevel
from ..errors import InvalidTypeError, InvalidValueError, SpeedflagsError, SpeedflagsWarning
from ..levers import registry
from ..levers.registry import check_levers

__all__ = [
    "PhaseFrames",
    "heal_mixed_tf32",
    "phase_levers",
    "refuse_tf32_for_float64",
    "schedule_entries",
    "warn_stacked_autocast",
]

Levers = dict[str, Any]
# (epoch, the entry as given, the train levers with the entry merged over them)
Entry = tuple[int, Levers, Levers]


def _check(owner: str, shown: str, levers: Mapping[str, Any]) -> None:
    try:
        check_levers("fast_math", levers)
    except (InvalidValueError, InvalidTypeError) as exc:
        raise type(exc)(f"{owner}({shown}): {exc}") from None


def phase_levers(owner: str, argument: str, given: object) -> Levers:
    """Validate one phase's ``fast_math`` keyword arguments; ``None`` values are dropped.

    Raises:
        InvalidTypeError, InvalidValueError: naming ``owner``'s ``argument``, the lever and
            its valid values.
    """
    if given is None:
        return {}
    if not isinstance(given, Mapping):
        raise InvalidTypeError(
            f"{owner}({argument}={short_repr(given)}): expected a dict of fast_math arguments (for "
            f"example {{'tf32': True, 'amp': 'bf16'}}) or None, got {type(given).__name__}"
        )
    levers = dict(given)
    _check(owner, f"{argument}={short_repr(levers)}", levers)
    return {name: value for name, value in levers.items() if value is not None}


def _epoch(owner: str, key: object) -> int:
    shown = f"{owner}(schedule={{{short_repr(key)}: ...}})"
    if isinstance(key, int) and not isinstance(key, bool):
        epoch = key
    elif isinstance(key, str):  # YAML and JSON configs may give the epochs as strings
        try:
            epoch = int(key)
        except ValueError:
            raise InvalidValueError(f"{shown}: epoch {short_repr(key)} is not an integer") from None
    else:
        raise InvalidTypeError(
            f"{shown}: expected a non-negative int epoch (or its string, as YAML may give), "
            f"got {type(key).__name__}"
        )
    if epoch < 0:
        raise InvalidValueError(f"{shown}: expected a non-negative epoch, got {epoch}")
    return epoch


def schedule_entries(owner: str, schedule: object, train: Levers) -> tuple[Entry, ...]:
    """Validate ``schedule={epoch: levers}``; each entry is merged over ``train``.

    An entry is a dict of ``fast_math`` arguments, or ``True``/``False``: NequIP's
    ``TF32Scheduler`` shorthand for ``{"tf32": True/False}``. ``None`` inside an entry drops
    that ``train`` lever from the entry's epoch on.
    """
    if schedule is None:
        return ()
    if not isinstance(schedule, Mapping):
        raise InvalidTypeError(
            f"{owner}(schedule={short_repr(schedule)}): expected a dict of epoch -> "
            f"fast_math arguments (or True/False for TF32), got {type(schedule).__name__}"
        )
    entries: dict[int, Levers] = {}
    for key, value in schedule.items():
        epoch = _epoch(owner, key)
        if epoch in entries:
            raise InvalidValueError(
                f"{owner}(schedule=...): epoch {epoch} is given twice ({short_repr(key)} and "
                "another key)"
            )
        shown = f"schedule={{{short_repr(key)}: {short_repr(value)}}}"
        if isinstance(value, bool):
            entry: Levers = {"tf32": value}
        elif value is None:
            entry = {}
        elif isinstance(value, Mapping):
            entry = dict(value)
            _check(owner, shown, entry)
        else:
            raise InvalidTypeError(
                f"{owner}({shown}): expected a dict of fast_math arguments, or True/False "
                f"(TF32, as NequIP's TF32Scheduler), got {type(value).__name__}"
            )
        entries[epoch] = entry
    out = []
    for epoch in sorted(entries):
        merged = {k: v for k, v in {**train, **entries[epoch]}.items() if v is not None}
        shown = f"schedule={{{epoch}: {short_repr(entries[epoch])}}} over train={short_repr(train)}"
        _check(owner, shown, merged)
        out.append((epoch, entries[epoch], merged))
    return tuple(out)


class PhaseFrames:
    """One callback's specs (per phase, schedule entry and device) and its open frames.

    Frames are opened and closed in the thread that runs the trainer's hooks (the levers'
    scope is the ``fast_math`` scope: ``amp`` is thread-local, the rest process-wide).
    Closing restores every lever the frame set, exactly.
    """

    def __init__(
        self,
        owner: str,
        phases: Mapping[str, Levers],
        schedule: tuple[Entry, ...] = (),
        *,
        check_ranks: bool = True,
    ) -> None:
        self.owner = owner
        self.phases = dict(phases)
        self.schedule = schedule
        self._check_ranks = check_ranks
        self._specs: dict[tuple[str, int | None, str], FastMath | None] = {}
        self._frames: list[Frame] = []
        self._model_id: int | None = None  # the model the specs with model levers act on

    def __getstate__(self) -> dict[str, Any]:
        # Pickled or copied with its trainer (DDP spawn, deepcopy): specs hold locks, and
        # frames belong to this process; both are rebuilt or reopened where it lands.
        state = dict(self.__dict__)
        state["_specs"] = {}
        state["_frames"] = []
        state["_model_id"] = None
        return state

    def schedule_key(self, epoch: int | None) -> int | None:
        """The schedule epoch whose entry holds at ``epoch`` (``None``: none yet)."""
        found = None
        if epoch is not None:
            for key, _, _ in self.schedule:
                if key > epoch:
                    break
                found = key
        return found

    def levers(self, phase: str, epoch: int | None = None) -> Levers:
        """The levers ``phase`` applies (for ``train``, at ``epoch`` of the schedule)."""
        if phase == "train":
            key = self.schedule_key(epoch)
            for entry_epoch, _, merged in self.schedule:
                if entry_epoch == key:
                    return dict(merged)
        return dict(self.phases.get(phase, {}))

    def spec(
        self, phase: str, device: torch.device, epoch: int | None = None, model: Any = None
    ) -> FastMath | None:
        """The spec for ``phase`` on ``device``, built on first use; ``None`` if no levers.
        ``model``: the trainer's model, which the phase's model levers act on."""
        if model is not None and id(model) != self._model_id:
            # another model (a new fit): no spec keeps the old one alive or acts on it
            self._specs.clear()
            self._model_id = id(model)
        key = self.schedule_key(epoch) if phase == "train" else None
        cache_key = (phase, key, str(device))
        if cache_key in self._specs:
            return self._specs[cache_key]
        levers = self.levers(phase, epoch)
        spec = None
        if levers:  # a bare fast_math() would mean "the recommended levers"
            label = f"{self.owner} {phase}" + (
                f" (schedule epoch {key})" if key is not None else ""
            )
            if any(name in registry.MODEL_LEVER_NAMES for name in levers):
                if model is None:
                    raise InvalidValueError(
                        f"{self.owner}: {phase} levers {short_repr(levers)} act on the model, "
                        "and the trainer gave none"
                    )
                levers["model"] = model
            try:
                spec = FastMath(device=device, label=label, check_ranks=self._check_ranks, **levers)
            except (InvalidValueError, InvalidTypeError) as exc:
                raise type(exc)(f"{self.owner}: {phase} levers on {device}: {exc}") from None
        self._specs[cache_key] = spec
        return spec

    @property
    def open_frames(self) -> tuple[Frame, ...]:
        """The frames this callback holds open now, outermost first."""
        return tuple(self._frames)

    def open(
        self, phase: str, device: torch.device, epoch: int | None = None, model: Any = None
    ) -> Frame | None:
        """Apply ``phase``'s levers in a new frame (inside any frame already open); model
        levers act on ``model``."""
        spec = self.spec(phase, device, epoch, model)
        if spec is None:
            return None
        frame = spec.start()
        self._frames.append(frame)
        return frame

    def close(self) -> None:
        """Close the innermost open frame (if any), restoring what it found."""
        if self._frames:
            frame = self._frames[-1]
            try:
                frame.close()
            finally:  # closed (an interruption is raised once the exit is complete): forgotten
                self._frames.pop()

    def close_all(self) -> None:
        """Close every open frame, innermost first."""
        while self._frames:
            self.close()

    def close_all_quietly(self, why: str) -> None:
        """``close_all`` on an exception path: a restore problem is warned about, never raised,
        so it cannot replace the exception being handled. Every frame is still closed."""
        while self._frames:
            frame = self._frames.pop()
            try:
                frame.close()
            except SpeedflagsError as exc:
                warnings.warn(
                    f"{self.owner}: {why}: {exc}", SpeedflagsWarning, stacklevel=user_stacklevel()
                )

    def note_switch(self, epoch: int, before: int | None, after: int | None) -> None:
        """Record a schedule switch in the ledger's history, as ``Schedule.step`` does."""
        ledger().note(
            "schedule",
            "switch",
            f"epoch {epoch}: train levers of schedule epoch {after}"
            if after is not None
            else f"epoch {epoch}: train levers (no schedule entry yet)",
            before=self.levers("train", before),
            after=self.levers("train", after),
            label=self.owner,
        )


def refuse_tf32_for_float64(owner: str, uses: Iterable[tuple[str, Levers]], model: Any) -> None:
    """Refuse ``tf32=True`` for a model with float64 parameters (NequIP's sanity check).

    TF32 changes only float32 matmuls and convolutions: with a float64 model it does nothing,
    while the configuration says the run trades precision for TF32 speed.

    Raises:
        InvalidValueError: naming the arguments that ask for TF32 and the float64 parameters.
    """
    asking = [argument for argument, levers in uses if levers.get("tf32") is True]
    named = getattr(model, "named_parameters", None)
    if not asking or not callable(named):
        return
    float64 = [name for name, param in named() if param.dtype == torch.float64]
    if not float64:
        return
    shown = ", ".join(float64[:3]) + (f" and {len(float64) - 3} more" if len(float64) > 3 else "")
    raise InvalidValueError(
        f"{owner}: {' and '.join(asking)} set tf32=True, but the model has float64 parameters "
        f"({shown}). TF32 only changes float32 matmuls and convolutions, so with a float64 "
        "model it does nothing while the configuration claims TF32 speed and precision. "
        "Train in float32, or drop tf32=True. Nothing was changed."
    )


def warn_stacked_autocast(owner: str, uses: Iterable[tuple[str, Levers]], who: str) -> None:
    """Warn that ``who`` (the trainer's own mixed precision) autocasts as well as ``amp``."""
    with_amp = [
        f"{argument} has amp={levers['amp']!r}" for argument, levers in uses if "amp" in levers
    ]
    if with_amp:
        warnings.warn(
            f"{owner}: {who} already autocasts the forward pass, and {', '.join(with_amp)}: "
            "the two stack (inside the forward the trainer's autocast wins; around it, in the "
            "backward and the optimizer step, speedflags' does). Use one: drop amp from the "
            "callback, or use the trainer's full-precision setting.",
            SpeedflagsWarning,
            stacklevel=user_stacklevel(),
        )


def heal_mixed_tf32(owner: str) -> bool:
    """Heal a mixed TF32 state (``speedflags.heal_tf32``) and warn what was healed and why.

    Returns:
        Whether there was anything to heal.
    """
    status = tf32_status()
    if status.consistent:
        return False
    healed = heal_tf32()
    tf32_on = [name for name, on in healed.effective.items() if on] or ["nothing"]
    notes = f" ({'; '.join(healed.notes)})" if healed.notes else ""
    warnings.warn(
        f"{owner}: healed a mixed TF32 state: {'; '.join(status.conflicts)}. In that state "
        "any legacy read, such as torch.get_float32_matmul_precision() in a model or in "
        "inductor, raises 'mix of the legacy and new APIs'; TrainingArguments(tf32=...) "
        "leaves it on PyTorch >= 2.9 (transformers' enable_tf32 sets only "
        "torch.backends.fp32_precision). speedflags.heal_tf32() kept what kernels use now "
        f"(on: {', '.join(tf32_on)}) and made the legacy flags agree{notes}. The heal is a "
        "repair: it stays after training.",
        SpeedflagsWarning,
        stacklevel=user_stacklevel(),
    )
    return True
