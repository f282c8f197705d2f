"""How the ``fp8`` lever changes a model: torchao's ``Float8Linear`` in place of its
``nn.Linear`` layers for the block, and the layers themselves back on exit.

Entering a block plans every ``nn.Linear`` slot of the model (each ``parent._modules[name]``
that holds one), decides which layers take part (:func:`left_out`: the layer's own
``forward``, torchao's dimension rule, the size rule), makes a *twin* per layer
(:func:`speedflags.levers._torchao.twin`: a ``Float8Linear`` sharing the layer's
parameters, buffers and hooks) and then writes the twins into the slots. Exiting writes
the layers back, and whatever the block changed on a twin's plain attributes
(``model.eval()``) back onto its layer. The planning, the part that can fail, comes first:
a failure leaves the model as it was. A twin is kept (weakly, per layer and recipe) for the
next block, so that ``@speedup`` entering every step makes no new module and a model
compiled before the block finds the same module again (dynamo guards a module's identity:
it recompiles once for the twins and once for the layers, then serves both graphs).

The root module is never swapped (its caller holds it): a model that is itself an
``nn.Linear`` has no slot, and the block converts nothing (its record says so).
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable
from typing import Any, NamedTuple

import torch
from torch import nn

from .._hardware import capabilities
from .._locks import new_lock
from . import _torchao
from ._model_lever import OFF, ModelLever
from ._model_state import original_class

__all__ = ["MIN_FEATURES", "MULTIPLE", "Fp8Config", "Fp8Lever", "left_out", "size_rule"]

# The size rule: a layer takes part when both its in and out features are at least this.
# Below it the casts of a dynamically scaled layer (input, weight and, in training, the
# output gradient, each read and written once more per call) cost about what the FP8 GEMM
# saves: torchao's per-layer table has 0.80x bf16 at 1024x2048x1024 and 1.39x at
# 4096x8192x16384, and its own size filters leave out layers of 1024 features and fewer.
MIN_FEATURES = 2048
# torchao's dimension rule: the scaled matmul takes dimensions that are multiples of 16.
MULTIPLE = 16
_FLOATING = (torch.float32, torch.bfloat16, torch.float16)

# The reasons a layer is left out, in the words the lever's record counts them under.
CONVERTED_ELSEWHERE = "converted already (an open fp8 block on a model that holds it)"
OWN_FORWARD = "a class with a forward of its own"
READ_DIRECTLY = "read directly by its parent (nn.MultiheadAttention)"
NOT_INITIALISED = "not initialised yet (a lazy module)"
NOT_FLOATING = "weights not in float32, bfloat16 or float16"
NOT_MULTIPLE = f"features not multiples of {MULTIPLE} (torchao's dimension rule)"
BELOW_SIZE = f"below the size rule (in and out features of {MIN_FEATURES} or more)"
ROOT = "the model itself (a layer is swapped in its parent; the model has none)"


def size_rule(in_features: int, out_features: int) -> str | None:
    """Why a ``Linear(in_features, out_features)`` is left out by shape, or None if it takes
    part: torchao's dimension rule (multiples of 16), then the size rule.

    Example:
        >>> from speedflags.levers._fp8_swap import size_rule
        >>> size_rule(4096, 4096) is None, size_rule(1024, 1024)
        (True, 'below the size rule (in and out features of 2048 or more)')
    """
    if in_features % MULTIPLE or out_features % MULTIPLE:
        return NOT_MULTIPLE
    if min(in_features, out_features) < MIN_FEATURES:
        return BELOW_SIZE
    return None


def left_out(layer: nn.Module, parent: nn.Module | None = None) -> str | None:
    """Why ``layer`` (an ``nn.Linear`` held by ``parent``) does not take part, or None.

    Example:
        >>> import torch
        >>> from speedflags.levers._fp8_swap import left_out
        >>> left_out(torch.nn.Linear(4096, 4096)) is None, left_out(torch.nn.Linear(4096, 8))
        (True, "features not multiples of 16 (torchao's dimension rule)")
    """
    if _torchao.is_twin(layer):
        return CONVERTED_ELSEWHERE
    if getattr(original_class(layer), "forward", None) is not nn.Linear.forward:
        return OWN_FORWARD
    if isinstance(parent, nn.MultiheadAttention):
        return READ_DIRECTLY
    weight = layer._parameters.get("weight")
    if weight is None or isinstance(weight, nn.parameter.UninitializedParameter):
        return NOT_INITIALISED
    if weight.dtype not in _FLOATING:
        return NOT_FLOATING
    return size_rule(int(weight.shape[1]), int(weight.shape[0]))


class Fp8Config(NamedTuple):
    """The ``fp8`` lever's state on a model while it is on: the recipe, how many layers
    take part, and how many were left out for each reason."""

    recipe: str
    converted: int
    left_out: tuple[tuple[str, int], ...]

    def describe(self) -> dict[str, Any]:
        return {"recipe": self.recipe, "converted": self.converted, "left_out": dict(self.left_out)}


class _Swap(NamedTuple):
    parent: nn.Module
    name: str
    layer: nn.Module
    twin: nn.Module


class Fp8State:
    """One model's ``fp8`` state: the twins in its slots now, and what they amount to."""

    __slots__ = ("__weakref__", "config", "swaps")

    def __init__(self) -> None:
        self.swaps: list[_Swap] = []
        self.config: Fp8Config | None = None


_STATES: weakref.WeakKeyDictionary[nn.Module, Fp8State] = weakref.WeakKeyDictionary()
# layer -> {(recipe, emulated): its twin}; a twin holds its layer's state, not the layer
_TWINS: weakref.WeakKeyDictionary[nn.Module, dict[tuple[str, bool], nn.Module]] = (
    weakref.WeakKeyDictionary()
)
_lock = new_lock()


def state_of(model: nn.Module) -> Fp8State:
    """The ``fp8`` state of ``model`` (made on first use; kept while the model lives)."""
    state = _STATES.get(model)
    if state is None:
        with _lock:
            state = _STATES.setdefault(model, Fp8State())
    return state


def _emulated(weight: torch.Tensor) -> bool:
    """Whether a layer with ``weight`` runs torchao's emulation (float8 casts, a float32
    matmul): anywhere but on a CUDA device with FP8 tensor cores."""
    if weight.device.type != "cuda":
        return True
    return not capabilities(weight.device).fp8


def _twin_of(layer: nn.Module, recipe: str) -> nn.Module:
    weight = layer._parameters["weight"]
    assert weight is not None  # noqa: S101 - left_out() refused layers without one
    key = (recipe, _emulated(weight))
    twins = _TWINS.get(layer)
    if twins is None:
        twins = _TWINS.setdefault(layer, {})
    made = twins.get(key)
    if made is None:
        made = twins[key] = _torchao.twin(layer, recipe, key[1], original_class(layer))  # type: ignore[arg-type]
    else:
        _torchao.share(made, layer)
    return made


def _plan(model: nn.Module, recipe: str) -> tuple[list[_Swap], Fp8Config]:
    """The swaps that put ``recipe``'s twins in ``model``'s slots, and the resulting state.
    Changes nothing in the model (it may make twins)."""
    swaps: list[_Swap] = []
    made: dict[int, nn.Module] = {}  # a layer held in two slots gets one twin
    reasons: dict[str, int] = {}
    seen: set[int] = set()
    if isinstance(model, nn.Linear):
        reasons[ROOT] = 1
    for parent in model.modules():
        for name, layer in parent._modules.items():
            if layer is None or not isinstance(layer, nn.Linear):
                continue
            why = left_out(layer, parent)
            if why is not None:
                if id(layer) not in seen:
                    reasons[why] = reasons.get(why, 0) + 1
                seen.add(id(layer))
                continue
            seen.add(id(layer))
            twin = made.get(id(layer))
            if twin is None:
                twin = made[id(layer)] = _twin_of(layer, recipe)
            swaps.append(_Swap(parent, name, layer, twin))
    config = Fp8Config(recipe, len(made), tuple(sorted(reasons.items())))
    return swaps, config


def _write(swaps: list[_Swap], into: bool) -> list[_Swap]:
    """Write the twins (``into``) or the layers back into their slots, all or none; return
    the swaps written (a slot the block gave another module keeps it: the user's)."""
    done: list[_Swap] = []
    try:
        _write_each(swaps, into, done)
    except BaseException:  # an interruption between two writes: none of them stays
        _write_back(done, into)
        raise
    return done


def _write_each(swaps: list[_Swap], into: bool, done: list[_Swap]) -> None:
    # (loops in functions of their own: a loop's back edge inside a ``try`` can fall outside
    # its handler on Python 3.12+, tests/test_exception_table_holes.py)
    for swap in swaps:
        slots = swap.parent._modules
        if into:
            slots[swap.name] = swap.twin
        elif slots.get(swap.name) is swap.twin:  # a module put there inside: the user's
            slots[swap.name] = swap.layer
        else:
            continue
        done.append(swap)


def _write_back(done: list[_Swap], into: bool) -> None:
    for swap in reversed(done):
        swap.parent._modules[swap.name] = swap.layer if into else swap.twin


def sync(model: nn.Module, state: Fp8State, recipe: str | None) -> None:
    """Make ``model`` compute with ``recipe``'s twins (None: with its own layers). All or
    nothing: a failure leaves the model as it was, then raises."""
    current = state.config.recipe if state.config is not None else None
    if current == recipe:
        return
    previous = state.swaps
    put_back = _write(previous, into=False) if previous else []
    try:
        swaps, planned = _plan(model, recipe) if recipe is not None else ([], None)
        _write(swaps, into=True)
    except BaseException:
        _write(put_back, into=True)  # the twins again, where they were
        raise
    for swap in previous:  # what the block did to a twin's plain attributes is the layer's
        _torchao.give_back(swap.twin, swap.layer)
    if swaps and not previous:  # twins in place: their casts need every optimizer step seen
        _torchao.hold_steps()
    elif previous and not swaps:
        _torchao.release_steps()
    state.swaps, state.config = swaps, planned


class Fp8Lever(ModelLever):
    """``fp8=True`` (or a torchao recipe name, or ``False``) on one model.

    Scope: model. Restores each ``nn.Linear`` layer into its slot (the model's own modules,
    parameters and buffers; nothing of them was replaced); see :mod:`speedflags.levers.fp8`.
    """

    name = "fp8"

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.fp8 = state_of(model)

    def configured(self, model: nn.Module) -> Hashable:
        config = self.fp8.config
        return OFF if config is None else config

    def restore(self, target: Any, current: Any) -> Hashable:
        model = self.model
        if model is None:
            return OFF
        return self._set(model, target.recipe if isinstance(target, Fp8Config) else None)

    def _set(self, model: nn.Module, value: Any) -> Hashable:
        sync(model, self.fp8, value)
        return self.configured(model)

    def describe_value(self, value: Any) -> Any:
        if isinstance(value, Fp8Config):
            return value.describe()
        return False if value is None or value is OFF else value
