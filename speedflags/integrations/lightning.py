"""``SpeedFlagsCallback``: speedflags levers per phase of a Lightning run, with a schedule.

Lightning has no TF32 option, sets ``cudnn.benchmark`` for the whole process and never
restores it, and cannot give validation a different precision. This callback applies a dict
of :func:`speedflags.fast_math` arguments per phase, through the ledger, and restores every
flag when the phase ends: ``train`` around each training batch (forward, backward and
optimizer step), ``validate`` around each validation loop (inside ``fit`` and in
``trainer.validate()``), ``test`` and ``predict`` around theirs. ``schedule={epoch: levers}``
is merged over ``train`` from that epoch on, as NequIP's ``TF32Scheduler`` does for TF32.

It works with ``lightning`` (``lightning.pytorch``) and with ``pytorch_lightning``: the class
subclasses the ``Callback`` of each one installed, so either's ``Trainer`` and
``LightningCLI`` accept it. Install with ``pip install '.[lightning]'`` in a checkout of
speedflags (``pip install 'speedflags[lightning]'`` once it is published).

The model levers (``param_dtype``, ``memory_format``) act on the ``LightningModule`` the
trainer runs: ``validate={"param_dtype": "bf16"}, train={"amp": "bf16"}`` validates with
bf16 casts of the float32 weights and trains under autocast. Its ``forward`` is the boundary
(docs/model_levers.md); a checkpoint saved in any phase is an ordinary float32 one.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import torch

from .._short_repr import short_repr, type_name
from .._version import install_hint
from ..errors import InvalidTypeError
from ._phases import (
    PhaseFrames,
    phase_levers,
    refuse_tf32_for_float64,
    schedule_entries,
    warn_stacked_autocast,
)

__all__ = ["SpeedFlagsCallback"]

EXTRA = install_hint("lightning")
PHASES = ("train", "validate", "test", "predict")


def _callback_bases() -> tuple[type, ...]:
    bases = []
    for package, module in (("lightning", "lightning.pytorch"), ("pytorch_lightning", None)):
        try:
            imported = importlib.import_module(module or package)
        except ModuleNotFoundError as exc:
            if exc.name not in (package, module):  # installed but broken: say so as it is
                raise
            continue
        bases.append(imported.Callback)
    if not bases:
        # ModuleNotFoundError (an ImportError) for what is missing, so importorskip and
        # `except ImportError` both see it
        raise ModuleNotFoundError(
            "speedflags.integrations.lightning needs Lightning (the lightning or the "
            f"pytorch_lightning package): {EXTRA}",
            name="lightning",
        )
    return tuple(bases)


_BASES = _callback_bases()
if TYPE_CHECKING:
    _Callback = object
else:
    # One class that is a Callback of each installed flavour: pytorch_lightning's Trainer and
    # CLI check isinstance against their own Callback, lightning.pytorch's against theirs.
    _Callback = _BASES[0] if len(_BASES) == 1 else type("_Callback", _BASES, {})

PhaseArg = dict[str, Any] | None
ScheduleArg = dict[int | str, bool | dict[str, Any] | None] | None


class SpeedFlagsCallback(_Callback):
    """Lightning callback: ``fast_math`` levers per phase, an epoch schedule, exact restore.

    Args:
        train: ``fast_math`` arguments held around each training batch: the forward, the
            backward and the optimizer step. (With ``amp``, an optimizer that re-runs the
            forward inside ``step()``, such as LBFGS, would reuse autocast's cached weight
            casts within the batch: autocast with Lightning's ``precision`` there.)
        validate: held for each validation loop: the sanity check and the validation inside
            ``fit``, and ``trainer.validate()``.
        test: held for ``trainer.test()``.
        predict: held for ``trainer.predict()``.

            Each phase may also hold the model levers, ``param_dtype`` and
            ``memory_format``, which act on the ``LightningModule`` (for ``train``, entered
            and left at every batch: ``memory_format`` converts the convolution weights
            each time, so give it to ``train`` only if the conversion is small beside a
            batch).
        schedule: ``{epoch: levers}``, each entry merged over ``train`` from its epoch until
            the next entry. Keys may be ints or strings (as YAML gives them). ``True`` /
            ``False`` stand for ``{"tf32": True/False}`` (NequIP's ``{0: True, 100: False}``);
            ``None`` inside an entry drops that ``train`` lever from its epoch on.
        check_ranks: under ``torch.distributed`` (DDP), check at each spec's first use that
            every rank runs with the same flags (:func:`speedflags.check_ranks`); a
            difference raises ``RankMismatchError`` on every rank.

    Every argument is validated when the callback is built (errors name the argument, the
    lever and its valid values). At the start of ``fit`` (before the sanity check) and of
    each standalone loop, ``tf32=True`` with a model that has float64 parameters is refused
    with ``InvalidValueError``, and a warning says so when Lightning's precision plugin
    (``precision="bf16-mixed"``/``"16-mixed"``) autocasts as well as an ``amp`` lever.

    Scope: as ``fast_math``: ``amp`` is thread-local (Lightning runs its hooks in one
    thread), the other levers process-wide, for the phase. Restores every flag it set when
    the batch or loop ends, and when ``fit``/``validate``/``test``/``predict`` ends, also by
    an exception or ``KeyboardInterrupt`` (``on_exception``). ``state_dict`` holds the epoch
    and schedule entry, so a fit resumed from a checkpoint continues the schedule.

    Example:
        >>> from speedflags.integrations.lightning import SpeedFlagsCallback
        >>> cb = SpeedFlagsCallback(
        ...     train={"amp": "bf16"}, validate={"amp": False}, schedule={0: True, 100: False}
        ... )
        >>> cb.levers("train", epoch=99), cb.levers("train", epoch=100)
        ({'amp': 'bf16', 'tf32': True}, {'amp': 'bf16', 'tf32': False})
        >>> cb.levers("validate")
        {'amp': False}
        >>> SpeedFlagsCallback(validate={"param_dtype": "bf16"}).levers("validate")
        {'param_dtype': 'bf16'}

        ``trainer = lightning.pytorch.Trainer(callbacks=[cb])``; in a LightningCLI config::

            trainer:
              callbacks:
                - class_path: speedflags.integrations.lightning.SpeedFlagsCallback
                  init_args:
                    train: {amp: bf16}
                    schedule: {0: true, 100: false}
    """

    def __init__(
        self,
        train: PhaseArg = None,
        validate: PhaseArg = None,
        test: PhaseArg = None,
        predict: PhaseArg = None,
        schedule: ScheduleArg = None,
        *,
        check_ranks: bool = True,
    ) -> None:
        owner = "SpeedFlagsCallback"
        given = dict(train=train, validate=validate, test=test, predict=predict)
        phases = {phase: phase_levers(owner, phase, given[phase]) for phase in PHASES}
        if not isinstance(check_ranks, bool):
            raise InvalidTypeError(
                f"{owner}(check_ranks={short_repr(check_ranks)}): expected True or False, got "
                f"{type_name(check_ranks)}"
            )
        entries = schedule_entries(owner, schedule, phases["train"])
        self._phases = PhaseFrames(owner, phases, entries, check_ranks=check_ranks)
        self._device = torch.device("cpu")
        self._epoch: int | None = None
        self._active: int | None = None  # the schedule epoch whose entry holds
        self._warned: set[str] = set()

    # --- what it does -------------------------------------------------------------------

    def levers(self, phase: str, epoch: int | None = None) -> dict[str, Any]:
        """The ``fast_math`` arguments ``phase`` applies (``train``: at ``epoch``)."""
        if phase not in PHASES:
            raise InvalidTypeError(
                f"SpeedFlagsCallback.levers(phase={short_repr(phase)}): expected one of {PHASES}"
            )
        return self._phases.levers(phase, epoch)

    @property
    def epoch(self) -> int | None:
        """The training epoch the schedule was last stepped to (``None`` before training)."""
        return self._epoch

    def __repr__(self) -> str:
        shown = [f"{p}={self._phases.phases[p]!r}" for p in PHASES if self._phases.phases[p]]
        if self._phases.schedule:
            entries = ", ".join(f"{e}: {entry!r}" for e, entry, _ in self._phases.schedule)
            shown.append(f"schedule={{{entries}}}")
        return f"SpeedFlagsCallback({', '.join(shown)})"

    # --- runs ---------------------------------------------------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._warned.clear()
        self._device = _root_device(trainer, pl_module)

    def _begin(self, trainer: Any, pl_module: Any, phases: tuple[str, ...]) -> None:
        """Before a loop's first step: refuse TF32 for float64, warn about stacked autocast."""
        self._device = _root_device(trainer, pl_module)
        uses = [(p, self._phases.levers(p)) for p in phases]
        if "train" in phases:
            uses += [(f"schedule[{e}]", merged) for e, _, merged in self._phases.schedule]
        refuse_tf32_for_float64("SpeedFlagsCallback", uses, pl_module)
        precision = str(getattr(trainer, "precision", ""))
        fresh = [(p, levers) for p, levers in uses if p not in self._warned]
        if "mixed" in precision and fresh:
            self._warned.update(p for p, _ in fresh)
            who = f"Lightning's precision plugin (precision={precision!r})"
            warn_stacked_autocast("SpeedFlagsCallback", fresh, who)

    def _switch(self, phase: str, pl_module: Any, epoch: int | None = None) -> None:
        self._phases.close_all()
        self._phases.open(phase, self._device, epoch, pl_module)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._begin(trainer, pl_module, ("train", "validate"))

    # --- training -----------------------------------------------------------------------

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        epoch = int(trainer.current_epoch)
        key = self._phases.schedule_key(epoch)
        if self._phases.schedule and (key != self._active or self._epoch is None):
            self._phases.note_switch(epoch, self._active, key)
        self._epoch, self._active = epoch, key

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        self._switch("train", pl_module, self._epoch)

    # --- evaluation loops ---------------------------------------------------------------

    def _loop_start(self, trainer: Any, pl_module: Any, phase: str) -> None:
        self._begin(trainer, pl_module, (phase,))
        self._switch(phase, pl_module)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._loop_start(trainer, pl_module, "validate")

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        self._loop_start(trainer, pl_module, "test")

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        self._loop_start(trainer, pl_module, "predict")

    # --- the end of a batch, a loop or a run, however it ends ---------------------------

    def _close_all(self, *_args: Any, **_kwargs: Any) -> None:
        self._phases.close_all()

    # on_train_epoch_end too: a batch skipped by another callback never reached batch_end
    on_train_batch_end = on_train_epoch_end = on_train_end = _close_all
    on_validation_end = on_test_end = on_predict_end = _close_all
    on_fit_end = teardown = _close_all

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # Lightning calls this for every exception, KeyboardInterrupt included, before it
        # re-raises (or exits): a restore problem must not replace the exception.
        why = f"restoring after {type(exception).__name__}"
        self._phases.close_all_quietly(why)

    # --- checkpoints --------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The epoch the schedule reached and its active entry (saved in checkpoints)."""
        return {"epoch": self._epoch, "schedule_epoch": self._active}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a checkpoint: the next epoch switches only if its entry differs."""
        self._epoch = state_dict.get("epoch")
        self._active = state_dict.get("schedule_epoch")


def _root_device(trainer: Any, pl_module: Any) -> torch.device:
    strategy = getattr(trainer, "strategy", None)
    device = getattr(strategy, "root_device", None)
    if not isinstance(device, torch.device):
        device = getattr(pl_module, "device", None)
    return device if isinstance(device, torch.device) else torch.device("cpu")
