"""``SpeedFlagsCallback``: speedflags levers for the Hugging Face ``Trainer``'s steps and loops.

``TrainingArguments(tf32=True)`` flips TF32 for the whole process and never restores it; on
PyTorch >= 2.9 it writes only the new API (``torch.backends.fp32_precision``), which leaves
a mixed state in which any legacy read raises. This callback applies ``train`` levers around
each training step and ``evaluate`` levers around each evaluation or prediction loop, through
the ledger, and heals a mixed TF32 state when training begins.

Where the levers hold, given what ``TrainerCallback`` offers:

- ``train``: from ``on_step_begin`` to ``on_step_end``. The Trainer calls both around one
  optimizer step: the forward and backward of every micro-batch (gradient accumulation),
  the gradient clipping, ``optimizer.step()`` and the scheduler step all run in between.
- ``evaluate``: no hook runs *before* an evaluation (``on_evaluate`` and ``on_predict`` run
  after it, ``on_prediction_step`` after each batch), so the callback wraps the trainer's
  ``evaluation_loop``, which ``evaluate()`` and ``predict()`` both run, inside ``train()``
  (``eval_strategy``, ``eval_on_start``) or standalone. It finds its trainer when the
  Trainer is built with ``callbacks=[...]`` (``on_init_end``) or when ``train()`` begins;
  for a callback added later, ``callback.attach(trainer)`` does it (and warns otherwise).
- Exceptions: ``TrainerCallback`` has no exception hook, so the callback also wraps
  ``train()``: a step that raises (``KeyboardInterrupt`` included) still restores every flag
  before the exception leaves ``train()``. The evaluation wrapper restores in ``finally``.

Install with ``pip install '.[transformers]'`` in a checkout of speedflags (transformers
and accelerate; ``pip install 'speedflags[transformers]'`` once it is published).
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch

from .._short_repr import short_repr, type_name
from .._version import install_hint
from .._warn import user_stacklevel
from ..errors import InvalidTypeError, SpeedflagsWarning
from ._phases import (
    PhaseFrames,
    heal_mixed_tf32,
    phase_levers,
    refuse_tf32_for_float64,
    warn_stacked_autocast,
)

__all__ = ["SpeedFlagsCallback"]

EXTRA = install_hint("transformers")
OWNER = "SpeedFlagsCallback"

try:
    import transformers
except ModuleNotFoundError as exc:  # installed but broken: say so as it is
    if exc.name != "transformers":
        raise
    raise ModuleNotFoundError(
        f"speedflags.integrations.transformers needs Hugging Face transformers: {EXTRA}",
        name="transformers",
    ) from exc

if TYPE_CHECKING:
    _TrainerCallback = object
else:
    _TrainerCallback = transformers.TrainerCallback

_WRAPPED = "__speedflags_callback__"  # marks the trainer methods a callback wrapped
_LOOPS = ("evaluation_loop", "prediction_loop")  # prediction_loop: transformers 4.x only


class SpeedFlagsCallback(_TrainerCallback):
    """Hugging Face ``TrainerCallback``: ``fast_math`` levers for training steps and evaluation.

    Args:
        train: ``fast_math`` arguments held around each training step (forward and backward
            of each micro-batch, clipping, optimizer and scheduler step).
        evaluate: held around every evaluation and prediction loop: ``trainer.evaluate()``
            and ``trainer.predict()``, inside ``train()`` or standalone.

            Both may also hold the model levers, ``param_dtype`` and ``memory_format``,
            which act on the Trainer's model (``trainer.model``): ``evaluate={"param_dtype":
            "bf16"}`` evaluates with bf16 casts of the float32 weights, and a checkpoint the
            Trainer saves is an ordinary float32 one whatever the phase.
        check_ranks: under ``torch.distributed``, check at each spec's first use that every
            rank runs with the same flags (:func:`speedflags.check_ranks`).

    Both are validated when the callback is built (errors name the argument, the lever and
    its valid values). When training or an evaluation begins, a mixed TF32 state (what
    ``TrainingArguments(tf32=True)`` leaves on PyTorch >= 2.9) is healed with
    :func:`speedflags.heal_tf32` and a warning saying what was healed and why; ``tf32=True``
    with a float64 model is refused; and ``amp`` together with ``bf16=True``/``fp16=True``
    (accelerate's autocast) is warned about.

    Scope: as ``fast_math``: ``amp`` is thread-local (the Trainer's thread), the other levers
    process-wide, for the step or loop. Restores every flag it set at the end of each step
    and loop, and when ``train()`` ends, also by an exception; the TF32 heal is a repair and
    stays, so the process is never put back into a mixed state.

    Example:
        >>> from speedflags.integrations.transformers import SpeedFlagsCallback
        >>> cb = SpeedFlagsCallback(train={"amp": "bf16", "tf32": True}, evaluate={"amp": False})
        >>> cb.levers("train"), cb.levers("evaluate")
        ({'amp': 'bf16', 'tf32': True}, {'amp': False})
        >>> SpeedFlagsCallback(evaluate={"param_dtype": "bf16"}).levers("evaluate")
        {'param_dtype': 'bf16'}

        Then ``Trainer(model, args, callbacks=[cb], ...)``; for a trainer built without it,
        ``cb.attach(trainer)``.
    """

    def __init__(
        self,
        train: dict[str, Any] | None = None,
        evaluate: dict[str, Any] | None = None,
        *,
        check_ranks: bool = True,
    ) -> None:
        phases = {
            "train": phase_levers(OWNER, "train", train),
            "evaluate": phase_levers(OWNER, "evaluate", evaluate),
        }
        if not isinstance(check_ranks, bool):
            raise InvalidTypeError(
                f"{OWNER}(check_ranks={short_repr(check_ranks)}): expected True or False, got "
                f"{type_name(check_ranks)}"
            )
        self._phases = PhaseFrames(OWNER, phases, check_ranks=check_ranks)
        self._device = torch.device("cpu")
        self._attached = 0  # trainers whose loops this callback wraps
        self._in_loop = 0  # evaluation loops running inside a wrapper
        self._unwrapped_warned = False
        self._warned: set[str] = set()  # phases already warned about stacked autocast

    def levers(self, phase: str) -> dict[str, Any]:
        """The ``fast_math`` arguments of ``phase`` (``"train"`` or ``"evaluate"``)."""
        if phase not in ("train", "evaluate"):
            raise InvalidTypeError(
                f"{OWNER}.levers(phase={short_repr(phase)}): expected 'train' or 'evaluate'"
            )
        return self._phases.levers(phase)

    def __repr__(self) -> str:
        shown = [f"{p}={levers!r}" for p, levers in self._phases.phases.items() if levers]
        return f"{OWNER}({', '.join(shown)})"

    # --- finding and wrapping the trainer ----------------------------------------------

    def attach(self, trainer: Any) -> Any:
        """Add this callback to ``trainer`` (if it is not there) and wrap its loops.

        Needed only for a callback added after the Trainer was built
        (``trainer.add_callback``) whose first use is a standalone ``evaluate()`` or
        ``predict()``; otherwise the callback attaches itself. Idempotent.

        Returns:
            ``trainer``.
        """
        handler = getattr(trainer, "callback_handler", None)
        if handler is None or not callable(getattr(trainer, "train", None)):
            raise InvalidTypeError(
                f"{OWNER}.attach({short_repr(trainer)}): expected a transformers.Trainer, got "
                f"{type(trainer).__name__}"
            )
        if getattr(trainer.train, _WRAPPED, None) is self:
            return trainer
        if not any(cb is self for cb in handler.callbacks):
            trainer.add_callback(self)
        for name in _LOOPS:
            loop = getattr(trainer, name, None)
            if callable(loop):
                setattr(trainer, name, self._wrap_loop(trainer, loop))
        trainer.train = self._wrap_train(trainer.train)
        self._attached += 1
        return trainer

    def _wrap_loop(self, trainer: Any, loop: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(loop)
        def evaluation_loop(*args: Any, **kwargs: Any) -> Any:
            self._begin(trainer.args, trainer.model, "evaluate")
            opened = self._phases.open("evaluate", self._device, model=trainer.model) is not None
            self._in_loop += 1
            try:
                return loop(*args, **kwargs)
            finally:
                self._in_loop -= 1
                if opened:
                    self._phases.close()

        setattr(evaluation_loop, _WRAPPED, self)
        return evaluation_loop

    def _wrap_train(self, train: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(train)
        def wrapped_train(*args: Any, **kwargs: Any) -> Any:
            try:
                result = train(*args, **kwargs)
            except BaseException as exc:
                self._phases.close_all_quietly(f"restoring after {type(exc).__name__}")
                raise
            self._phases.close_all()
            return result

        setattr(wrapped_train, _WRAPPED, self)
        return wrapped_train

    def _find_trainer(self) -> None:
        # No hook receives the trainer, but every hook is called from its methods (through
        # its CallbackHandler): the nearest caller whose `self` holds this callback is it.
        frame: FrameType | None = sys._getframe(2)
        for _ in range(8):
            if frame is None:
                return
            candidate = frame.f_locals.get("self")
            handler = getattr(candidate, "callback_handler", None)
            if handler is not None and any(cb is self for cb in handler.callbacks):
                self.attach(candidate)
                return
            frame = frame.f_back

    # --- phases -------------------------------------------------------------------------

    def _begin(self, args: Any, model: Any, phase: str) -> None:
        heal_mixed_tf32(OWNER)
        device = getattr(args, "device", None)
        self._device = device if isinstance(device, torch.device) else torch.device("cpu")
        uses = [(phase, self._phases.levers(phase))]
        refuse_tf32_for_float64(OWNER, uses, model)
        mixed = [flag for flag in ("bf16", "fp16") if getattr(args, flag, False) is True]
        if mixed and phase not in self._warned:
            self._warned.add(phase)
            who = f"TrainingArguments({mixed[0]}=True) (accelerate's autocast)"
            warn_stacked_autocast(OWNER, uses, who)

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._attached:
            self._find_trainer()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._attached:
            self._find_trainer()
        self._phases.close_all()  # a retried loop (auto_find_batch_size) left its step open
        self._begin(args, kwargs.get("model"), "train")

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._phases.close_all()  # a step cut short (should_epoch_stop) never reached step_end
        self._phases.open("train", self._device, model=kwargs.get("model"))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._phases.close_all()

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._phases.close_all()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._phases.close_all()

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._in_loop or self._unwrapped_warned or not self._phases.levers("evaluate"):
            return
        self._unwrapped_warned = True
        warnings.warn(
            f"{OWNER}: this evaluation runs without the evaluate levers: the callback was "
            "added after the Trainer was built and has not seen train() yet. Call "
            "callback.attach(trainer) once, or pass it as Trainer(callbacks=[...]).",
            SpeedflagsWarning,
            stacklevel=user_stacklevel(),
        )
