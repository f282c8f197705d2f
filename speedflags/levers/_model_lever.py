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

from torch import nn

from .._locks import new_lock
from ..errors import InvalidValueError
from ._base import SimpleLever
from ._model_shadow import ModelState, fsdp_owner, model_state, sync

__all__ = ["OFF", "ModelLever"]

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

    def read(self) -> Hashable:
        model = self._model()
        if model is None:  # nothing left to restore
            return OFF
        return self.configured(model)

    def apply(self, value: Any, before: Any) -> Hashable:
        model = self._model()
        if model is None:
            return OFF
        owner = fsdp_owner(model)
        if owner is not None:
            raise InvalidValueError(f"{self.name} on {self.state.tag}: {owner}")
        return self._set(model, value)

    def restore(self, target: Any, current: Any) -> Hashable:
        model = self._model()
        if model is None:
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
