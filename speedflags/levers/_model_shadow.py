"""What the model levers share: a model's lever state, and the classes that carry it.

A model lever changes how an ``nn.Module`` computes, never what it holds. While a block is
open, each module that takes part gets a *shadow class*: a subclass of its own class, made
once per (class, role, setting) and swapped in with ``module.__class__ = ...``, the way
``torch.nn.utils.parametrize`` changes a module's class. The swap is undone on exit, so
afterwards every module has its own class again, and its parameters, buffers, ``state_dict``
and optimizer references were never replaced. What a shadow class adds:

- ``param_dtype``: a property per floating parameter that, while the model's ``forward``
  runs, returns a cast of the parameter (cached while the parameter is unchanged, so an
  inference block casts each weight once and a training loop once per optimizer step);
  outside ``forward`` the attribute is the parameter itself, so ``nn.init`` or
  ``model.fc.weight.copy_(...)`` inside the block reach the parameter. Gradients flow
  through the cast to the float32 parameter. Floating inputs of a module that holds cast
  parameters are cast to the compute dtype (an input promoted by a float32 buffer would
  otherwise meet a bf16 weight); norm layers (and recurrent layers, which read their weights
  through ``_flat_weights``, not attributes) keep float32 parameters and run in float32 on
  an upcast input, so BatchNorm's running statistics stay float32.
- the model's own class (the *boundary*) casts floating inputs to the compute dtype and
  floating outputs back to the inputs' dtype (``param_dtype``), and converts 4-D floating
  inputs to ``channels_last`` (``memory_format``).

Under ``torch.compile``: dynamo guards a module's class, so a model compiled before the
block traces again inside it (and the graph traced outside serves again after it). Where
dynamo reads a module's parameters without its class's properties (PyTorch before
``inline_inbuilt_nn_modules``: 2.1 to 2.4 by default), a shadow ``forward`` runs eagerly,
out of the trace (:class:`~speedflags._tracing.KeptOut`): eager's result, without a graph.

``memory_format`` needs no class for the weights: it converts each 4-D convolution weight's
data to ``channels_last`` in place (``param.data = ...``: the same Parameter object) and
back to the exact strides it had, values untouched, on exit.
"""

from __future__ import annotations

import copy
import copyreg
import functools
import itertools
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from .._locks import new_lock
from .._tracing import KeptOut, at_trace_time, is_compiling

__all__ = [
    "ModelState",
    "fsdp_owner",
    "model_state",
    "shadowed",
    "sync",
]

# Norm layers keep float32 parameters and compute in float32 (BatchNorm's running statistics
# are float32 buffers that a bf16 input could not update), as autocast runs them.
_NORMS: tuple[type, ...] = tuple(
    cls
    for cls in (
        nn.modules.batchnorm._NormBase,  # BatchNorm*, InstanceNorm*, SyncBatchNorm
        nn.LayerNorm,
        nn.GroupNorm,
        getattr(nn, "RMSNorm", None),  # PyTorch 2.4+
    )
    if cls is not None
)
# Recurrent layers read their weights through ``_flat_weights`` (references taken when the
# layer is built), never through attributes: a property cannot reach them. They stay float32.
_KEPT_FLOAT: tuple[type, ...] = (nn.RNNBase,)
_CONVS: tuple[type, ...] = (nn.Conv2d, nn.ConvTranspose2d)

_ROOT, _NORM, _PARAMS = 1, 2, 4  # a shadow class's roles (bits: the root may hold parameters)
Config = tuple[torch.dtype | None, bool, torch.dtype]  # (param dtype, channels_last, own dtype)


def is_norm(module: nn.Module) -> bool:
    """Whether ``module`` keeps float32 parameters under ``param_dtype``: a norm layer (by
    type, or by a class name ending in ``Norm``, as ``LlamaRMSNorm`` and ``T5LayerNorm``)
    or a recurrent layer."""
    return isinstance(module, _NORMS + _KEPT_FLOAT) or type(module).__name__.endswith("Norm")


# --- a model's state ------------------------------------------------------------------------


class ModelState:
    """The model levers' state of one model: what is set, and what to put back.

    Attributes:
        tag: the model's name in records (``"Net#2"``: its class and a number per process).
        param_dtype: the compute dtype set, or None.
        channels_last: whether the convolution weights and inputs are in ``channels_last``.
        classes: module -> its own class, for each module shadowed now.
        strides: id(parameter) -> (parameter, the strides it had), for each weight converted.
        own_dtype: the dtype of the model's first floating parameter (float32 usually): what
            outputs come back in when no floating input was given.
        casts: this model's cast cache (see :func:`cast`), emptied whenever its setting
            changes, so that no cast outlives the block that made it.
        made: the shadow classes made for this model, by (class, role, names, config): the
            properties of a model's classes read its own cache.
        plans: (config, the model's modules) -> the classes they get, for a setting met
            before on the same modules (a block entered every step plans once).
    """

    __slots__ = ("__weakref__", "casts", "channels_last", "classes", "made", "own_dtype",
                 "param_dtype", "plans", "strides", "tag")  # fmt: skip

    def __init__(self, model: nn.Module, tag: str) -> None:
        self.tag = tag
        self.param_dtype: torch.dtype | None = None
        self.channels_last = False
        self.classes: dict[nn.Module, type] = {}
        self.strides: dict[int, tuple[nn.Parameter, tuple[int, ...]]] = {}
        self.casts: Casts = {}
        self.made: dict[tuple[type, int, tuple[str, ...], Config], type] = {}
        self.plans: dict[Any, list[tuple[nn.Module, type]]] = {}
        self.own_dtype: torch.dtype = next(
            (p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32
        )

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


# --- casts ------------------------------------------------------------------------------------


class _Depth(threading.local):
    # > 0 while a shadowed module's forward runs in this thread (eagerly)
    n = 0


_DEPTH = _Depth()
# A model's casts: (id(parameter), dtype) -> (version, data pointer, mode, cast). Modes: 0
# made with autograd (serves every mode), 1 without (serves no_grad and inference mode), 2 in
# inference mode (serves inference mode only: inference tensors cannot be saved for backward).
Casts = dict[tuple[int, torch.dtype], tuple[int, int, int, torch.Tensor]]


def _mode(param: torch.Tensor) -> int:
    if torch.is_inference_mode_enabled():
        return 2
    return 0 if param.requires_grad and torch.is_grad_enabled() else 1


def cast(param: torch.Tensor, dtype: torch.dtype, casts: Casts) -> torch.Tensor:
    """``param`` in ``dtype``, made once and reused while ``param`` is unchanged (its version
    counter and storage: an optimizer step, ``load_state_dict`` or an in-place write renew
    it; a write through ``param.data`` is not seen, as autocast's cache does not see it)."""
    if param.dtype is dtype or not param.is_floating_point():
        return param
    if is_compiling():  # traced: the graph casts (dynamo cannot trace the cache)
        traced: torch.Tensor = param.to(dtype)  # typed: Any in PyTorch 2.1's stubs
        return traced
    key = (id(param), dtype)
    version, pointer, mode = param._version, param.data_ptr(), _mode(param)
    hit = casts.get(key)
    if hit is not None and hit[0] == version and hit[1] == pointer and hit[2] <= mode:
        return hit[3]
    made: torch.Tensor = param.to(dtype)
    casts[key] = (version, pointer, mode, made)
    return made


def _map(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``fn`` applied to each tensor in ``value`` (tensors, and tuples, lists and mappings of
    them, nested); other objects unchanged."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple):
        mapped = [_map(v, fn) for v in value]
        return type(value)(*mapped) if hasattr(value, "_fields") else type(value)(mapped)
    if isinstance(value, list):
        return [_map(v, fn) for v in value]
    if isinstance(value, Mapping):
        if type(value) is dict:
            return {k: _map(v, fn) for k, v in value.items()}
        out = copy.copy(value)  # a Mapping subclass (transformers' ModelOutput): same type
        for k, v in value.items():
            out[k] = _map(v, fn)  # type: ignore[index]
        return out
    return value


def _map_call(
    args: tuple[Any, ...], kwargs: dict[str, Any], fn: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """:func:`_map` over a call's arguments, tensors at the top level (the usual call)
    without the recursion."""
    mapped = tuple(
        fn(a) if isinstance(a, torch.Tensor) else _map(a, fn) if isinstance(a, _NESTED) else a
        for a in args
    )
    return mapped, ({k: _map(v, fn) for k, v in kwargs.items()} if kwargs else kwargs)


_NESTED = (tuple, list, Mapping)


def _first_floating(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.dtype | None:
    """The dtype of the first floating tensor among a call's arguments, or None."""
    for value in args:
        if isinstance(value, torch.Tensor):
            if value.is_floating_point():
                dtype: torch.dtype = value.dtype  # typed: 2.1's stubs give Any
                return dtype
            continue
        if isinstance(value, _NESTED):
            found = _first_in(value)
            if found is not None:
                return found
    return _first_in(kwargs) if kwargs else None


def _first_in(value: Any) -> torch.dtype | None:
    found: list[torch.dtype] = []

    def seen(t: torch.Tensor) -> torch.Tensor:
        if not found and t.is_floating_point():
            found.append(t.dtype)
        return t

    _map(value, seen)
    return found[0] if found else None


# --- shadow classes -----------------------------------------------------------------------------


@at_trace_time
def _dynamo_follows() -> bool:
    # Run for real while dynamo traces a shadow forward: whether it reads parameters through
    # the class's properties (it inlines built-in modules: inline_inbuilt_nn_modules, always
    # on in recent PyTorch, whose config then warns that the name is deprecated), and the
    # KeptOut wrapper is made (dynamo is loaded by now).
    KeptOut.prepare()
    config = sys.modules.get("torch._dynamo.config")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bool(getattr(config, "inline_inbuilt_nn_modules", False))


def _run_eagerly(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # out of the trace: the same shadow forward, now eager (is_compiling() is False here)
    return type(module).forward(module, *args, **kwargs)


_EAGER = KeptOut(_run_eagerly)


def _shadow_class(
    state: ModelState, cls: type, role: int, names: tuple[str, ...], config: Config
) -> type:
    key = (cls, role, names, config)
    made = state.made.get(key)
    if made is None:
        made = state.made[key] = _make_class(cls, role, names, config, state.casts)
    return made


def _make_class(cls: type, role: int, names: tuple[str, ...], config: Config, casts: Casts) -> type:
    dtype, channels_last, own_dtype = config
    base_forward: Callable[..., Any] = cls.forward  # type: ignore[attr-defined]
    namespace: dict[str, Any] = {
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
        "_speedflags_own_class": cls,
        "_speedflags_config": config,
    }

    if role & _PARAMS and dtype is not None:
        for name in names:
            namespace[name] = _cast_property(name, dtype, casts)
    to_own = _to(own_dtype)
    to_compute = _to(dtype) if dtype is not None else to_own
    norm, params = bool(role & _NORM and dtype is not None), bool(role & _PARAMS and dtype)

    def inner(self: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if norm:  # float32, on an upcast input
            given = _first_floating(args, kwargs)
            if given is not None and given is not own_dtype:
                args, kwargs = _map_call(args, kwargs, to_own)
                return _map(base_forward(self, *args, **kwargs), _to(given))
        elif params:
            args, kwargs = _map_call(args, kwargs, to_compute)
        return base_forward(self, *args, **kwargs)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if is_compiling() and not _dynamo_follows():
            return _EAGER.call(self, args, kwargs)
        if not role & _ROOT:
            return _counted(inner, self, args, kwargs)
        given = _first_floating(args, kwargs)
        if channels_last:
            args, kwargs = _map_call(args, kwargs, _channels_last)
        if dtype is None:
            return _counted(inner, self, args, kwargs)
        args, kwargs = _map_call(args, kwargs, to_compute)
        out = _counted(inner, self, args, kwargs)
        return _map(out, _to(given if given is not None else own_dtype))

    forward.__doc__ = base_forward.__doc__
    namespace["forward"] = forward
    namespace["__reduce_ex__"] = _reduce_as(cls)
    return type(cls.__name__, (cls,), namespace)


def _counted(
    inner: Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], Any],
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    if is_compiling():  # traced: the properties cast whenever dynamo traces them
        return inner(module, args, kwargs)
    depth = _DEPTH
    depth.n += 1
    try:
        return inner(module, args, kwargs)
    finally:
        depth.n -= 1


def _cast_property(name: str, dtype: torch.dtype, casts: Casts) -> property:
    def get(self: nn.Module) -> Any:
        param = self._parameters[name]
        if param is None or not (is_compiling() or _DEPTH.n):  # outside forward: the parameter
            return param
        return cast(param, dtype, casts)

    return property(get, doc=f"the parameter {name!r}, cast to {dtype} inside forward")


@functools.cache
def _to(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """A floating tensor in ``dtype`` (one function per dtype, made once)."""

    def convert(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.dtype is not dtype and t.is_floating_point() else t

    return convert


def _channels_last(t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 4 and t.is_floating_point():
        converted: torch.Tensor = t.contiguous(memory_format=torch.channels_last)
        return converted
    return t


def _reduce_as(cls: type) -> Callable[..., Any]:
    # Pickled (torch.save(model), copy.deepcopy) as its own class, through the standard
    # library's reconstructor: a model saved inside a block is an ordinary model, and loading
    # it needs neither a shadow class nor speedflags.
    def __reduce_ex__(self: Any, protocol: Any) -> Any:
        reduced = object.__reduce_ex__(self, protocol)
        return (copyreg._reconstructor, (cls, object, None), *reduced[2:])  # type: ignore[attr-defined]

    return __reduce_ex__


# --- putting a state in place -------------------------------------------------------------------


def _plan(modules: list[nn.Module], state: ModelState) -> list[tuple[nn.Module, type]]:
    """The class each of ``modules`` (the model's, the model first) gets for ``state``."""
    dtype, cl = state.param_dtype, state.channels_last
    config: Config = (dtype, cl, state.own_dtype)
    key = (config, tuple(map(id, modules)))
    planned = state.plans.get(key)
    if planned is not None:
        return planned
    planned = []
    for module in modules:
        cls = original_class(module)
        role = _ROOT if module is modules[0] else 0
        names: tuple[str, ...] = ()
        if dtype is not None:
            if is_norm(module):
                role |= _NORM
            else:
                names = _floating_names(module)
                if names:
                    role |= _PARAMS
        keep = role == 0 or (role == _ROOT and dtype is None and not cl)
        planned.append((module, cls if keep else _shadow_class(state, cls, role, names, config)))
    if len(state.plans) > 8:  # the model's modules keep changing: keep the latest only
        state.plans.clear()
    state.plans[key] = planned
    return planned


def _floating_names(module: nn.Module) -> tuple[str, ...]:
    params = module._parameters
    return tuple(n for n, p in params.items() if p is not None and p.is_floating_point())


def sync(model: nn.Module, state: ModelState) -> None:
    """Make ``model`` compute as ``state`` says: swap each module's class, convert the
    convolution weights. All or nothing: a failure (or an interruption) undoes what was done,
    then raises. The loops are functions of their own: a loop's back edge inside a ``try``
    can fall outside its handler on Python 3.12+ (tests/test_exception_table_holes.py)."""
    done: list[tuple[nn.Module, type]] = []
    converted: list[tuple[nn.Parameter, torch.Tensor]] = []
    classes, strides = dict(state.classes), dict(state.strides)
    modules = list(model.modules())
    try:
        _swap_classes(_plan(modules, state), state, done)
        with torch.no_grad():
            if state.channels_last:
                _to_channels_last(modules, state, converted)
            elif state.strides:
                _to_own_layout(state, converted)
    except BaseException:
        _undo(done, converted)
        state.classes, state.strides = classes, strides
        raise
    finally:
        state.casts.clear()  # no cast outlives a change of setting


def _swap_classes(
    planned: list[tuple[nn.Module, type]], state: ModelState, done: list[tuple[nn.Module, type]]
) -> None:
    for module, wanted in planned:
        previous = type(module)
        if previous is wanted:
            continue
        _set_class(module, wanted)
        done.append((module, previous))
        if "_speedflags_own_class" in wanted.__dict__:
            state.classes.setdefault(module, original_class(module))
        else:
            state.classes.pop(module, None)


def _to_channels_last(
    modules: list[nn.Module],
    state: ModelState,
    converted: list[tuple[nn.Parameter, torch.Tensor]],
) -> None:
    for module in modules:
        weight = module._parameters.get("weight") if isinstance(module, _CONVS) else None
        if weight is None or weight.dim() != 4 or id(weight) in state.strides:
            continue
        converted.append((weight, weight.data))
        state.strides[id(weight)] = (weight, tuple(weight.stride()))
        weight.data = weight.data.contiguous(memory_format=torch.channels_last)


def _to_own_layout(state: ModelState, converted: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
    for weight, stride in list(state.strides.values()):
        converted.append((weight, weight.data))
        weight.data = _restrided(weight.data, stride)
        del state.strides[id(weight)]


def _undo(
    done: list[tuple[nn.Module, type]], converted: list[tuple[nn.Parameter, torch.Tensor]]
) -> None:
    for weight, data in reversed(converted):
        weight.data = data
    for module, previous in reversed(done):
        _set_class(module, previous)


def _set_class(module: nn.Module, cls: type) -> None:
    # object's own: nn.Module.__setattr__ would spend longer than the swap on its checks
    object.__setattr__(module, "__class__", cls)


def _restrided(data: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """``data``'s values with the strides ``stride`` (a copy; the same values, bit for bit)."""
    if tuple(data.stride()) == stride:
        return data
    out = torch.empty_strided(data.shape, stride, dtype=data.dtype, device=data.device)
    out.copy_(data)
    return out
