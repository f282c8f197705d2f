"""The part the model levers share: a lever object per model, reading and writing the
model's :class:`~speedflags.levers._model_shadow.ModelState`.

A model lever's scope is the model: its state lives in the model's modules (their classes,
its convolution weights' layout), every thread that calls the model sees it, and the ledger
keeps one stack of open frames per model and lever (the lever's ``domain`` names the model),
so blocks on two models never meet. The lever holds the model weakly: the ledger's history
names a lever by key and never keeps a model alive.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Hashable
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn

from .._locks import new_lock
from ..errors import InvalidValueError
from ._base import Scope, SimpleLever
from ._model_shadow import sync
from ._model_state import ModelState, active_states, fsdp_owner, model_state, release

__all__ = ["OFF", "OPEN_MODEL_LEVERS", "ModelLever", "OpenModelLevers"]

# A model lever's state when it is not set (states are never None: see Lever).
OFF = False
L = TypeVar("L", bound="ModelLever")


class ModelLever(SimpleLever):
    """One model lever on one model (see :mod:`speedflags.levers._model_shadow`).

    Subclasses name the :class:`ModelState` field they own (``field``) and how a state and
    a value read (``describe_value``). ``read()`` reports what the model's own class carries
    now (``type(model)``'s shadow configuration), so a class changed under a block is drift.
    """

    scope = "model"
    field: ClassVar[str] = ""
    _made: ClassVar[weakref.WeakKeyDictionary[nn.Module, ModelLever]]
    _lock: ClassVar[threading.RLock]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._made = weakref.WeakKeyDictionary()
        cls._lock = new_lock()

    def __init__(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)
        self.state: ModelState = model_state(model)
        self.domain = f"{self.name}:{self.state.tag}"

    @classmethod
    def of(cls: type[L], model: nn.Module) -> L:
        """The lever for ``model`` (one per model and lever)."""
        lever = cls._made.get(model)
        if lever is None:
            with cls._lock:
                lever = cls._made.get(model)
                if lever is None:
                    lever = cls._made[model] = cls(model)
        return lever  # type: ignore[return-value]

    @property
    def model(self) -> nn.Module | None:
        """The model (None once it was garbage-collected)."""
        return self._model()

    def configured(self, model: nn.Module) -> Hashable:
        """The value the model's own class carries now (:data:`OFF` when none)."""
        raise NotImplementedError

    def config(self, model: nn.Module) -> Any:
        """The setting the model's class carries, if it is a shadow class of this model's
        (a module taken out of another model under a lever may still carry that one's)."""
        held = type(model).__dict__
        return (
            held.get("_speedflags_config") if held.get("_speedflags_state") is self.state else None
        )

    def read(self) -> Hashable:
        model = self._model()
        if model is None:  # nothing left to restore
            return OFF
        return self.configured(model)

    def apply(self, value: Any, before: Any) -> Hashable:
        model = self._model()
        if model is None:
            return OFF
        # FSDP: a cheap check; TorchScript is refused by sync's plan, which sees every module
        refused = fsdp_owner(model)
        if refused is not None:
            raise InvalidValueError(f"{self.name} on {self.state.tag}: {refused}")
        return self._set(model, value)

    def restore(self, target: Any, current: Any) -> Hashable:
        model = self._model()
        if model is None:  # collected inside the block: nothing left to put back
            setattr(self.state, self.field, self.to_field(None))
            if not self.state.on:
                release(self.state)
            return OFF
        return self._set(model, None if target is OFF else target)

    def _set(self, model: nn.Module, value: Any) -> Hashable:
        # the state's field for ``value``, and the model synced to it; the field is put back
        # when syncing fails, so that the state never says what the model is not
        previous = getattr(self.state, self.field)
        setattr(self.state, self.field, self.to_field(value))
        try:
            sync(model, self.state)
        except BaseException:
            setattr(self.state, self.field, previous)
            raise
        return self.configured(model)

    def to_field(self, value: Any) -> Any:
        """A validated value (None: off) as the state's field holds it."""
        return value

    def describe(self, state: Any) -> Any:
        return {"model": self.state.tag, self.name: self.describe_value(state)}

    def __repr__(self) -> str:
        return f"<lever {self.name} of {self.state.tag} (model)>"


# A model's state as the leak check reads it: (tag, param_dtype, memory_format), described.
ModelEntry = tuple[str, Any, Any]


class OpenModelLevers:
    """Every model under a model lever now, as one piece of state: what the pytest plugin's
    leak check reads before and after each test (a ``param_dtype`` or ``memory_format``
    block left open changes a model that later tests may use) and puts back.

    Its state is a sorted tuple of ``(tag, param_dtype, memory_format)``, described as
    ``{"Net#3": {"param_dtype": "bfloat16", "memory_format": False}}``; restoring takes
    each model that is not in the target back to no model lever (or to the target's).

    Example:
        >>> import torch, speedflags
        >>> from speedflags.levers._model_lever import OPEN_MODEL_LEVERS as guard
        >>> before = guard.read()
        >>> spec = speedflags.fast_math(model=torch.nn.Linear(2, 2), memory_format="channels_last")
        >>> frame = spec.start()
        >>> [entry[1:] for entry in guard.read() if entry not in before]
        [(False, 'channels_last')]
        >>> frame.close()
        >>> guard.read() == before
        True
    """

    name = "model_levers"
    scope: Scope = "process"
    domain = "model levers"

    def read(self) -> Hashable:
        return tuple(sorted(_entry(state) for state in active_states()))

    def describe(self, state: Any) -> Any:
        return {
            tag: {"param_dtype": dtype, "memory_format": layout} for tag, dtype, layout in state
        }

    def restore(self, target: Any, current: Any) -> Hashable:
        wanted = {entry[0]: entry for entry in target}
        for state in active_states():
            if _entry(state) == wanted.get(state.tag):
                continue
            model = state.model()
            if model is None:
                continue
            entry = wanted.get(state.tag, (state.tag, False, False))
            state.param_dtype = _DTYPES.get(entry[1])
            state.channels_last = bool(entry[2])
            sync(model, state)
        return self.read()

    def __repr__(self) -> str:
        return "<guard of the model levers (every model)>"


_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _entry(state: ModelState) -> ModelEntry:
    dtype = state.param_dtype
    return (
        state.tag,
        str(dtype).replace("torch.", "") if dtype is not None else False,
        "channels_last" if state.channels_last else False,
    )


#: The one guard over every model's model levers.
OPEN_MODEL_LEVERS = OpenModelLevers()
