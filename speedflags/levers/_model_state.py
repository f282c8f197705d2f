"""A model's lever state, which models are under a model lever now, and the hooks that follow
them while any is.

- :class:`ModelState`: what the model levers set on one model and what to put back. One
  per model, made on first use and kept while the model lives (:func:`model_state`).
- Which models are under a model lever now (*active*): every module of an active model is
  *claimed* by its state, so that a block on a model sharing a module with another active
  model (a model and its submodule, two models sharing an encoder) is refused before
  anything changes (:func:`claim`): the two would each give the shared module a class of
  its own, and the one that exits first would take the other's away.
- While at least one model is active, and only then, four of PyTorch's global hooks are
  registered (removed when the last active model is released, so nothing stays behind):
  the optimizer step pre-hook that frees the casts a step makes stale, the post-hook that
  renews them (:mod:`._model_casts`), and the module and parameter registration hooks that
  mark a model *dirty* when a submodule or parameter is added to one of its modules inside
  the block (``model.head = nn.Linear(...)``, ``register_parameter``): its next forward
  brings the new ones into the block.

Scope: process (the states are the models'; the registry and its lock are process-wide).
"""

from __future__ import annotations

import itertools
import sys
import weakref
from typing import Any

import torch
from torch import nn

from .._locks import new_lock
from .._tracing import is_compiling
from ..errors import InvalidValueError
from ._model_casts import Casts, is_probe, optimizer_stepped

__all__ = [
    "ModelState",
    "active_states",
    "claim",
    "fsdp_owner",
    "holding",
    "model_state",
    "original_class",
    "refusal",
    "release",
    "shadowed",
    "torchscript_part",
]


class ModelState:
    """The model levers' state of one model: what is set, and what to put back.

    Attributes:
        tag: the model's name in records (``"Net#2"``: its class and a number per process).
        model: a weak reference to the model.
        param_dtype: the compute dtype set, or None.
        channels_last: whether the convolution weights and inputs are in ``channels_last``.
        classes: module -> its own class, for each module shadowed now.
        layouts: id(weight) -> (weight, its own data), for each convolution weight in
            channels_last now: the tensor it had (its storage, offset and strides) gets the
            values back on exit.
        casts: this model's cast cache (:func:`~._model_casts.cast`), emptied whenever its
            setting changes, so that no cast outlives the block that made it.
        made: the shadow classes made for this model, by (class, role, names, config): the
            properties of a model's classes read its own cache.
        plans: (config, the model's modules and their classes) -> the class each gets, in
            order, and how many are shadow classes, for a setting met before on the same
            modules (a block entered every step plans once).
        dirty: a module or parameter was added to one of the model's modules while it was
            active: its next forward syncs the model again.
        claimed: the ids of the modules it claims while active (:func:`claim`).
    """

    __slots__ = ("__weakref__", "casts", "channels_last", "claimed", "classes", "dirty",
                 "layouts", "made", "model", "param_dtype", "plans", "tag")  # fmt: skip

    def __init__(self, model: nn.Module, tag: str) -> None:
        self.tag = tag
        self.model: weakref.ref[nn.Module] = weakref.ref(model)
        self.param_dtype: torch.dtype | None = None
        self.channels_last = False
        self.classes: dict[nn.Module, type] = {}
        self.layouts: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}
        self.casts: Casts = {}
        self.made: dict[tuple[Any, ...], type] = {}
        self.plans: dict[Any, tuple[list[type], int]] = {}
        self.dirty = False
        self.claimed: tuple[int, ...] = ()

    @property
    def on(self) -> bool:
        """Whether a model lever is set on the model now."""
        return self.param_dtype is not None or self.channels_last

    def __repr__(self) -> str:
        return (
            f"<model state {self.tag}: param_dtype={self.param_dtype}, "
            f"channels_last={self.channels_last}>"
        )


_STATES: weakref.WeakKeyDictionary[nn.Module, ModelState] = weakref.WeakKeyDictionary()
_STATES_LOCK = new_lock()
_NUMBERS = itertools.count(1)


def model_state(model: nn.Module) -> ModelState:
    """The state of ``model`` (made on first use; kept while the model lives)."""
    state = _STATES.get(model)
    if state is None:
        with _STATES_LOCK:
            state = _STATES.get(model)
            if state is None:
                tag = f"{original_class(model).__name__}#{next(_NUMBERS)}"
                state = _STATES[model] = ModelState(model, tag)
    return state


def original_class(module: nn.Module) -> type:
    """``type(module)``, or the class a shadow class stands in for."""
    cls = type(module)
    return getattr(cls, "_speedflags_own_class", cls)


def shadowed(module: nn.Module) -> bool:
    """Whether ``module`` has a shadow class now."""
    return "_speedflags_own_class" in type(module).__dict__


# --- what the model levers refuse ----------------------------------------------------------


def fsdp_owner(model: nn.Module) -> str | None:
    """Why another system owns the parameters of ``model`` or a submodule (FSDP's
    ``fully_shard`` or ``FullyShardedDataParallel``), or None.

    Read without importing ``torch.distributed``: a model can be sharded only once it is
    imported.
    """
    fsdp2 = [
        getattr(sys.modules.get(name), "FSDPModule", None)
        for name in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")
    ]
    fsdp1 = getattr(sys.modules.get("torch.distributed.fsdp"), "FullyShardedDataParallel", None)
    kinds = tuple(k for k in (*fsdp2, fsdp1) if isinstance(k, type))
    if not kinds:
        return None
    for name, module in model.named_modules():
        if isinstance(module, kinds):
            where = f"its submodule {name!r}" if name else "the model"
            how = (
                "FullyShardedDataParallel"
                if fsdp1 and isinstance(module, fsdp1)
                else ("fully_shard")
            )
            return (
                f"{where} is sharded by FSDP ({how}), which owns its parameters and their "
                "dtype (use FSDP's MixedPrecisionPolicy(param_dtype=...) there)"
            )
    return None


def torchscript_part(model: nn.Module) -> str | None:
    """Why ``model`` cannot take a model lever because it is (or holds) TorchScript, or None.

    A scripted or traced module runs compiled code that reads its parameters from C++, never
    through Python attributes, and its class cannot be swapped.
    """
    script = torch.jit.ScriptModule
    if isinstance(model, script):
        where = "the model"
    else:
        found = next((n for n, m in model.named_modules() if isinstance(m, script)), None)
        if found is None:
            return None
        where = f"its submodule {found!r}"
    return (
        f"{where} is a TorchScript module (torch.jit.script or torch.jit.trace), whose "
        "compiled code reads its parameters in C++, where no model lever reaches: give the "
        "module before scripting it (or script it inside the block)"
    )


def refusal(model: nn.Module) -> str | None:
    """Why no model lever can act on ``model`` (FSDP owns it, or it is TorchScript), or None."""
    return fsdp_owner(model) or torchscript_part(model)


# --- which models are under a model lever now ------------------------------------------------

_LOCK = new_lock()
_ACTIVE: dict[ModelState, None] = {}  # ordered: the order models became active
# id(module) -> the active state that claims it (by id: cheap to claim at every step; a stale
# id is harmless, as a conflict is checked against the other model's modules themselves)
_CLAIMS: dict[int, ModelState] = {}
_HANDLES: list[Any] = []  # the global hooks' handles while any state is active


def holding(state: ModelState) -> bool:
    """Whether ``state``'s model is among the active ones (its modules claimed)."""
    return state in _ACTIVE


def active_states() -> tuple[ModelState, ...]:
    """The states of the models under a model lever now, in the order they became so."""
    with _LOCK:
        return tuple(_ACTIVE)


def claim(state: ModelState, modules: list[nn.Module]) -> None:
    """Claim ``modules`` (the model's now, the model first) for ``state`` and release those
    it claimed before that are no longer among them; or raise, changing nothing, if one of
    them belongs to another model under a model lever now.

    Raises:
        InvalidValueError: naming both models and the shared module.
    """
    ids = tuple(map(id, modules))
    with _LOCK:
        if state in _ACTIVE and state.claimed == ids:
            return  # the same modules as at its last sync (a block entered every step)
        conflict = _claimed_by_another(state, modules, ids)
        if conflict is not None:
            raise InvalidValueError(_overlap(state, modules, *conflict))
        _unclaim(state, set(ids))
        for key in ids:
            _CLAIMS[key] = state
        state.claimed = ids
        if state not in _ACTIVE:
            if not _ACTIVE:
                _register_hooks()
            _ACTIVE[state] = None


def release(state: ModelState) -> None:
    """Release every module ``state`` claims: its model is no longer under a model lever.
    With the last active model, the global hooks go."""
    with _LOCK:
        _unclaim(state, set())
        state.claimed = ()
        if state in _ACTIVE:
            del _ACTIVE[state]
            if not _ACTIVE:
                _remove_hooks()


def _claimed_by_another(
    state: ModelState, modules: list[nn.Module], ids: tuple[int, ...]
) -> tuple[nn.Module, ModelState] | None:
    # A function of its own, called under the lock: a loop whose body ends in an `if` has a
    # back edge outside the `with`'s exception table on Python 3.12+
    # (tests/test_exception_table_holes.py)
    for module, key in zip(modules, ids, strict=True):
        other = _CLAIMS.get(key)
        if other is not None and other is not state and other.on and _holds(other, module):
            return module, other
    return None


def _unclaim(state: ModelState, kept: set[int]) -> None:
    for key in state.claimed:
        if key not in kept and _CLAIMS.get(key) is state:
            del _CLAIMS[key]


def _holds(state: ModelState, module: nn.Module) -> bool:
    # whether the other model still contains the module (it may have been taken out of it)
    model = state.model()
    return model is not None and any(m is module for m in model.modules())


def _overlap(
    state: ModelState, modules: list[nn.Module], shared: nn.Module, other: ModelState
) -> str:
    names = {id(m): n for n, m in modules[0].named_modules()} if modules else {}
    name = names.get(id(shared), "")
    which = f"its submodule {name!r} ({type(shared).__name__})" if name else "the model itself"
    settings = ", ".join(
        part
        for part in (
            f"param_dtype={str(other.param_dtype).replace('torch.', '')}"
            if other.param_dtype is not None
            else "",
            "memory_format='channels_last'" if other.channels_last else "",
        )
        if part
    )
    return (
        f"model levers on {state.tag}: {which} is also part of {other.tag}, which is under "
        f"{settings} now. Blocks on two models that share modules cannot both be open (each "
        "would give the shared modules its own class, and the first to exit would take the "
        f"other's away): put the levers on one of them (the outer model, {other.tag} or "
        f"{state.tag}), or close {other.tag}'s block first. Nothing was changed."
    )


# --- the global hooks, while any model is active ---------------------------------------------


def _module_registered(module: nn.Module, name: str, value: Any) -> None:
    # PyTorch's module and parameter registration hooks: called before the new submodule or
    # parameter lands, so the model syncs again at its next forward, not now
    state = _CLAIMS.get(id(module))
    if state is not None and state.on and _holds(state, module):
        state.dirty = True


def _before_a_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    # PyTorch's optimizer step pre-hook: the casts are stale from here on, and the graphs
    # that used them are gone after the backward; freed now, their memory serves the step's
    # own temporaries (held until the next forward, they made the CPU allocator fault in
    # fresh pages at every step: 1.5x autocast's page faults on a ResNet-18 step)
    if is_compiling() or is_probe(optimizer):  # traced: nothing to free at trace time
        return
    with _LOCK:
        for state in _ACTIVE:
            state.casts.clear()


def _register_hooks() -> None:
    from torch.nn.modules import module as module_hooks
    from torch.optim import optimizer as optimizer_hooks

    _HANDLES.append(optimizer_hooks.register_optimizer_step_pre_hook(_before_a_step))
    _HANDLES.append(optimizer_hooks.register_optimizer_step_post_hook(optimizer_stepped))
    _HANDLES.append(module_hooks.register_module_module_registration_hook(_module_registered))
    _HANDLES.append(module_hooks.register_module_parameter_registration_hook(_module_registered))


def _remove_hooks() -> None:
    while _HANDLES:
        _HANDLES.pop().remove()
