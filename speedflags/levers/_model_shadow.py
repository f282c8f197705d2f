"""The model levers' mechanism: shadow classes, and :func:`sync`, which puts a state in place.

A model lever changes how an ``nn.Module`` computes, never what it holds. While a block is
open, each module that takes part gets a *shadow class*: a subclass of its own class, made
once per (class, role, setting) and swapped in with ``module.__class__ = ...``, the way
``torch.nn.utils.parametrize`` changes a module's class. The swap is undone on exit, so
afterwards every module has its own class again, and its parameters, buffers, ``state_dict``
and optimizer references were never replaced. What a shadow class adds:

- ``param_dtype``: a property per floating parameter that, while the model's ``forward``
  runs, returns a cast of the parameter (:mod:`._model_casts`: cached while the parameter
  is unchanged); outside ``forward`` (and while a lazy module initialises its parameters)
  the attribute is the parameter itself, so ``nn.init`` or ``model.fc.weight.copy_(...)``
  inside the block reach the parameter. Gradients flow
  through the cast to the float32 parameter. Floating inputs of a module that holds cast
  parameters are cast to the compute dtype (an input promoted by a float32 buffer would
  otherwise meet a bf16 weight). A weight computed from parameters before each call
  (``torch.nn.utils.spectral_norm``/``weight_norm``'s hook forms, ``parametrize``) is
  computed in float32 from the float32 parameters and cast where the module reads it.
- norm layers keep float32 parameters and statistics. Where their kernels take a bf16 or
  fp16 input with float32 parameters, as autocast feeds them (every built-in norm on a CPU
  whose PyTorch has the kernels, BatchNorm on CUDA), they get the activations as they come;
  otherwise (custom norms, recurrent layers, which read their weights through
  ``_flat_weights``) they run in float32 on an upcast input and their outputs come back in
  the input's dtype.
- the model's own class (the *boundary*) casts floating inputs to the compute dtype and
  floating outputs back to the inputs' dtype (``param_dtype``: the parameters' dtype when
  no input is floating), and converts 4-D floating inputs to ``channels_last``, giving 4-D
  outputs back contiguous when the inputs were (``memory_format``). Converted convolutions
  give ``state_dict()`` their weights in their own layout.
- a lazy module (``nn.LazyLinear``) before its first call initialises its parameters as
  outside the block, and the class it becomes (``nn.Linear``) is shadowed as it would be.

A module or parameter added to the model inside the block joins it at the model's next
forward (:mod:`._model_state` marks the model dirty). Under ``torch.compile``: dynamo guards
a module's class, so a model compiled before the block traces again inside it (and the
graph traced outside serves again after it). Where dynamo reads a module's parameters
without its class's properties (PyTorch before ``inline_inbuilt_nn_modules``: 2.1 to 2.4 by
default), a shadow ``forward`` runs eagerly, out of the trace
(:class:`~speedflags._tracing.KeptOut`): eager's result, without a graph.
"""

from __future__ import annotations

import copy
import copyreg
import dataclasses
import inspect
import sys
import threading
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from .._tracing import KeptOut, at_trace_time, graph_error, is_compiling, one_graph, traced_where
from ..errors import InvalidValueError, LeverInGraphError
from ._model_casts import Casts, cast
from ._model_layout import Converted, convertible, own_layout, to_channels_last, to_own_layouts
from ._model_state import (
    ModelState,
    claim,
    fsdp_owner,
    holding,
    model_state,
    original_class,
    refusal,
    release,
    shadowed,
    torchscript_part,
)

__all__ = [
    "ModelState",
    "fsdp_owner",
    "is_norm",
    "model_state",
    "refusal",
    "shadowed",
    "sync",
]

# Norm layers keep float32 parameters (BatchNorm's running statistics are float32 buffers), as
# autocast runs them.
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
# The built-in norms whose kernels may take a half-precision input with float32 parameters:
# by the forward they run (a subclass with a forward of its own is not assumed to).
_MIXED_KINDS: tuple[tuple[type, Callable[..., Any]], ...] = tuple(
    (cls, cls.forward)
    for cls in (
        nn.modules.batchnorm._BatchNorm,
        nn.modules.instancenorm._InstanceNorm,
        nn.LayerNorm,
        nn.GroupNorm,
        getattr(nn, "RMSNorm", None),
    )
    if cls is not None
)

_ROOT, _NORM, _PARAMS, _LAZY, _CONV = 1, 2, 4, 8, 16  # a shadow class's roles (bits)
Config = tuple[torch.dtype | None, bool]  # (param dtype, channels_last)


class Parts(NamedTuple):
    """What a shadow class is made of besides its role."""

    cached: tuple[str, ...] = ()  # parameters read as their cached casts
    computed: tuple[str, ...] = ()  # weights computed before each call, cast where read
    mixed: tuple[str, ...] = ()  # a norm: device types whose kernels take the compute dtype


_NO_PARTS = Parts()


def is_norm(module: nn.Module) -> bool:
    """Whether ``module`` keeps float32 parameters under ``param_dtype``: a norm layer (by
    type, or by a class name ending in ``Norm``, as ``LlamaRMSNorm`` and ``T5LayerNorm``)
    or a recurrent layer."""
    return isinstance(module, _NORMS + _KEPT_FLOAT) or type(module).__name__.endswith("Norm")


# --- the norms' kernels ---------------------------------------------------------------------

# (norm kind, device type, dtype) -> whether its kernels take that dtype with float32
# parameters, forward and backward (found once per process, by trying)
_TAKES_MIXED: dict[tuple[type, str, torch.dtype], bool] = {}
_PROBES: dict[type, Callable[[], nn.Module]] = {
    kind: make
    for kind, make in (
        (nn.modules.batchnorm._BatchNorm, lambda: nn.BatchNorm2d(2)),
        (nn.modules.instancenorm._InstanceNorm, lambda: nn.InstanceNorm2d(2, affine=True)),
        (nn.LayerNorm, lambda: nn.LayerNorm(2)),
        (nn.GroupNorm, lambda: nn.GroupNorm(1, 2)),
        (getattr(nn, "RMSNorm", None), lambda: nn.RMSNorm(2)),  # type: ignore[attr-defined, unused-ignore]
    )
    if kind is not None
}


def takes_mixed(kind: type, device_type: str, dtype: torch.dtype) -> bool:
    """Whether the built-in norm ``kind`` takes a ``dtype`` input with float32 parameters on
    ``device_type``, as autocast feeds it. On CUDA, as autocast decides there: BatchNorm
    does (cuDNN's mixed kernels), LayerNorm and GroupNorm run in float32. On a CPU it is
    tried once (PyTorch 2.1 has bf16 kernels but no fp16 ones)."""
    if device_type == "cuda":
        return issubclass(kind, nn.modules.batchnorm._BatchNorm)
    if device_type != "cpu":
        return False
    key = (kind, device_type, dtype)
    found = _TAKES_MIXED.get(key)
    if found is None:
        found = _TAKES_MIXED[key] = _try_mixed(kind, dtype)
    return found


def _try_mixed(kind: type, dtype: torch.dtype) -> bool:
    make = _PROBES.get(kind)
    if make is None:
        return False
    try:
        with torch.inference_mode(False), torch.enable_grad():  # type: ignore[no-untyped-call, unused-ignore]
            norm = make()  # float32 parameters and statistics, initialised without the RNG
            x = torch.arange(16.0).reshape(2, 2, 2, 2).to(dtype).requires_grad_()
            out = norm(x)
            out.float().sum().backward()
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return out.dtype is dtype and x.grad is not None and x.grad.dtype is dtype


def _mixed_kind(module: nn.Module) -> type | None:
    cls = original_class(module)
    for kind, forward in _MIXED_KINDS:
        if isinstance(module, kind) and getattr(cls, "forward", None) is forward:
            return kind
    return None


def _mixed_devices(module: nn.Module, dtype: torch.dtype) -> tuple[str, ...]:
    kind = _mixed_kind(module)
    if kind is None:
        return ()
    tensors = (*module._parameters.values(), *module._buffers.values())
    device = next((t.device for t in tensors if t is not None), torch.device("cpu"))
    return (device.type,) if takes_mixed(kind, device.type, dtype) else ()


def _own_floating(module: nn.Module) -> torch.dtype | None:
    # a norm's own dtype, read when it is called (the model may have been cast since)
    for tensors in (module._parameters, module._buffers):
        for t in tensors.values():
            if t is not None and t.is_floating_point():
                dtype: torch.dtype = t.dtype  # typed: 2.1's stubs give Any
                return dtype
    return None


def _params_dtype(model: nn.Module) -> torch.dtype | None:
    for param in model.parameters():
        if param.is_floating_point():
            dtype: torch.dtype = param.dtype
            return dtype
    return None


# --- mapping over inputs and outputs --------------------------------------------------------

Fn = Callable[[torch.Tensor, Any], torch.Tensor]


def _to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if t.dtype is dtype or not t.is_floating_point():
        return t
    converted: torch.Tensor = t.to(dtype)  # typed: Any in PyTorch 2.1's stubs
    return converted


def _channels_last(t: torch.Tensor, _: Any) -> torch.Tensor:
    if t.dim() == 4 and t.is_floating_point():
        converted: torch.Tensor = t.contiguous(memory_format=torch.channels_last)
        return converted
    return t


def _is_channels_last(t: torch.Tensor) -> bool:
    return bool(t.is_contiguous(memory_format=torch.channels_last)) and not t.is_contiguous()


def _contiguous(t: torch.Tensor, _: Any) -> torch.Tensor:
    if t.dim() == 4 and t.is_floating_point() and _is_channels_last(t):
        return t.contiguous()  # type: ignore[no-any-return, unused-ignore]
    return t


def _map(value: Any, fn: Fn, arg: Any) -> Any:
    """``fn(tensor, arg)`` applied to each tensor in ``value`` (tensors, and tuples, lists,
    mappings and dataclasses of them, nested); other objects unchanged."""
    if isinstance(value, torch.Tensor):
        return fn(value, arg)
    if isinstance(value, tuple):
        mapped = [_map(v, fn, arg) for v in value]
        return type(value)(*mapped) if hasattr(value, "_fields") else type(value)(mapped)
    if isinstance(value, list):
        return [_map(v, fn, arg) for v in value]
    if isinstance(value, Mapping):
        if type(value) is dict:
            return {k: _map(v, fn, arg) for k, v in value.items()}
        out = copy.copy(value)  # a Mapping subclass (transformers' ModelOutput): same type
        for k, v in value.items():
            out[k] = _map(v, fn, arg)  # type: ignore[index]
        return out
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        made = copy.copy(value)  # same type; frozen ones too
        for field in dataclasses.fields(value):
            if hasattr(value, field.name):
                object.__setattr__(made, field.name, _map(getattr(value, field.name), fn, arg))
        return made
    return value


_NESTED = (tuple, list, Mapping)


def _map_call(
    args: tuple[Any, ...], kwargs: dict[str, Any], fn: Fn, arg: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """:func:`_map` over a call's arguments, tensors at the top level (the usual call)
    without the recursion."""
    mapped = tuple(
        fn(a, arg)
        if isinstance(a, torch.Tensor)
        else _map(a, fn, arg)
        if isinstance(a, _NESTED)
        else a
        for a in args
    )
    return mapped, ({k: _map(v, fn, arg) for k, v in kwargs.items()} if kwargs else kwargs)


def _first_floating(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The first floating tensor among a call's arguments, or None."""
    for value in args:
        if isinstance(value, torch.Tensor):
            if value.is_floating_point():
                return value
            continue
        if isinstance(value, _NESTED):
            found = _first_in(value)
            if found is not None:
                return found
    return _first_in(kwargs) if kwargs else None


def _first_in(value: Any) -> torch.Tensor | None:
    found: list[torch.Tensor] = []

    def seen(t: torch.Tensor, _: Any) -> torch.Tensor:
        if not found and t.is_floating_point():
            found.append(t)
        return t

    _map(value, seen, None)
    return found[0] if found else None


# --- shadow classes -----------------------------------------------------------------------------


class _Depth(threading.local):
    # > 0 while a shadowed module's forward runs in this thread (eagerly)
    n = 0


_DEPTH = _Depth()


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
        follows = bool(getattr(config, "inline_inbuilt_nn_modules", False))
    if not follows and one_graph():  # torch.export, fullgraph=True: nothing may run eagerly
        raise graph_error(
            LeverInGraphError(
                f"a model under param_dtype or memory_format in one graph ("
                f"{_where(traced_where())}): PyTorch "
                f"{torch.__version__}'s dynamo reads a module's parameters without its class "
                "(inline_inbuilt_nn_modules is off), so the model runs eagerly inside the "
                "block, which a full graph (torch.export, fullgraph=True) cannot. Export or "
                "compile with fullgraph=True outside the block, or without fullgraph inside it."
            )
        )
    return follows


def _where(where: tuple[str, int] | None) -> str:
    return f"{where[0]}:{where[1]}" if where else "traced code"


def _run_eagerly(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # out of the trace: the same shadow forward, now eager (is_compiling() is False here)
    return type(module).forward(module, *args, **kwargs)


_EAGER = KeptOut(_run_eagerly)


def _shadow_class(state: ModelState, cls: type, role: int, parts: Parts, config: Config) -> type:
    key = (cls, role, parts, config)
    made = state.made.get(key)
    if made is None:
        made = state.made[key] = _make_class(cls, role, parts, config, state)
    return made


def _make_class(cls: type, role: int, parts: Parts, config: Config, state: ModelState) -> type:
    dtype, channels_last = config
    base_forward: Callable[..., Any] = cls.forward  # type: ignore[attr-defined]
    namespace: dict[str, Any] = {
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
        "_speedflags_own_class": cls,
        "_speedflags_config": config,
        "_speedflags_state": state,
    }
    norm = bool(role & _NORM and dtype is not None)
    params = bool(role & _PARAMS and dtype is not None)
    if params and dtype is not None:
        for name in parts.cached:
            namespace[name] = _cast_property(name, dtype, state.casts)
        for name in parts.computed:
            namespace[name] = _computed_property(cls, name, dtype)
        # torch.jit.trace compiles a module's properties unless told not to
        unused = getattr(cls, "__jit_unused_properties__", [])
        namespace["__jit_unused_properties__"] = [*unused, *parts.cached, *parts.computed]
    if role & _LAZY:
        initialize = cls.initialize_parameters  # type: ignore[attr-defined]
        namespace["initialize_parameters"] = _outside_forward(initialize)
        become = cls.cls_to_become  # type: ignore[attr-defined]
        namespace["cls_to_become"] = _shadow_class(state, become, role & ~_LAZY, parts, config)
    if role & _CONV:
        namespace["_save_to_state_dict"] = _saved_in_own_layout(cls, state)
    mixed = parts.mixed

    def inner(self: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if norm:
            x = _first_floating(args, kwargs)
            if x is not None:
                own = _own_floating(self)
                if (
                    own is not None
                    and x.dtype is not own
                    and not (own is torch.float32 and x.dtype is dtype and x.device.type in mixed)
                ):  # float32 on an upcast input, the output back in the input's dtype
                    args, kwargs = _map_call(args, kwargs, _to, own)
                    return _map(base_forward(self, *args, **kwargs), _to, x.dtype)
        elif params:
            args, kwargs = _map_call(args, kwargs, _to, dtype)
        return base_forward(self, *args, **kwargs)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if is_compiling():
            if not _dynamo_follows():
                return _EAGER.call(self, args, kwargs)
        elif state.dirty:  # a module or parameter was added inside the block
            _refresh(state)
        if not role & _ROOT:
            return _counted(inner, self, args, kwargs)
        first = _first_floating(args, kwargs)
        back_contiguous = False
        if channels_last:
            back_contiguous = first is not None and not _is_channels_last(first)
            args, kwargs = _map_call(args, kwargs, _channels_last, None)
        if dtype is None:
            out = _counted(inner, self, args, kwargs)
        else:
            args, kwargs = _map_call(args, kwargs, _to, dtype)
            out = _counted(inner, self, args, kwargs)
            back = first.dtype if first is not None else _params_dtype(self)
            if back is not None:
                out = _map(out, _to, back)
        return _map(out, _contiguous, None) if back_contiguous else out

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


def _outside_forward(fn: Callable[..., Any]) -> Callable[..., Any]:
    # a lazy module initialises its parameters in a forward pre-hook, where its attributes
    # must be the parameters (nn.init writes them), whatever forward is running around it
    def call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        depth = _DEPTH
        saved, depth.n = depth.n, 0
        try:
            return fn(self, *args, **kwargs)
        finally:
            depth.n = saved

    call.__name__ = getattr(fn, "__name__", "initialize_parameters")
    call.__doc__ = fn.__doc__
    return call


def _cast_property(name: str, dtype: torch.dtype, casts: Casts) -> property:
    def get(self: nn.Module) -> Any:
        params = self._parameters
        if name not in params:  # deleted inside the block: an attribute like any other
            if name in self.__dict__:
                return self.__dict__[name]
            raise AttributeError(name)  # Python then asks nn.Module.__getattr__
        param = params[name]
        if param is None or not (is_compiling() or _DEPTH.n):  # outside forward: the parameter
            return param
        return cast(param, dtype, casts)

    def put(self: nn.Module, value: Any) -> None:
        self.__dict__[name] = value  # reached only for a name that is no parameter now

    return property(get, put, doc=f"the parameter {name!r}, cast to {dtype} inside forward")


def _computed_property(cls: type, name: str, dtype: torch.dtype) -> property:
    # a weight computed before each call: by a forward pre-hook into the instance's __dict__
    # (spectral_norm, weight_norm), or by parametrize's property on the class
    base = inspect.getattr_static(cls, name, None)
    base = base if isinstance(base, property) else None

    def get(self: nn.Module) -> Any:
        if base is not None:
            value = base.__get__(self, type(self))
        elif name in self.__dict__:
            value = self.__dict__[name]
        else:
            raise AttributeError(name)
        if not (is_compiling() or _DEPTH.n) or not isinstance(value, torch.Tensor):
            return value
        return _to(value, dtype)  # a new weight at every call: cast each time, never kept

    def put(self: nn.Module, value: Any) -> None:
        if base is not None:
            base.__set__(self, value)
        else:
            self.__dict__[name] = value

    def delete(self: nn.Module) -> None:
        if base is not None:
            base.__delete__(self)
        elif name in self.__dict__:
            del self.__dict__[name]
        else:
            raise AttributeError(name)

    return property(get, put, delete, doc=f"{name!r}, computed, cast to {dtype} inside forward")


def _saved_in_own_layout(cls: type, state: ModelState) -> Callable[..., None]:
    base = cls._save_to_state_dict  # type: ignore[attr-defined]

    def _save_to_state_dict(
        self: nn.Module, destination: Any, prefix: str, keep_vars: bool
    ) -> None:
        base(self, destination, prefix, keep_vars)
        weight = self._parameters.get("weight")
        key = prefix + "weight"
        if not keep_vars and weight is not None and key in destination:
            destination[key] = own_layout(state, weight, destination[key])

    return _save_to_state_dict


def _reduce_as(cls: type) -> Callable[..., Any]:
    # Pickled (torch.save(model), copy.deepcopy) as its own class, through the standard
    # library's reconstructor: a model saved inside a block is an ordinary model, and loading
    # it needs neither a shadow class nor speedflags.
    def __reduce_ex__(self: Any, protocol: Any) -> Any:
        reduced = object.__reduce_ex__(self, protocol)
        return (copyreg._reconstructor, (cls, object, None), *reduced[2:])  # type: ignore[attr-defined]

    return __reduce_ex__


# --- planning: the class each module gets --------------------------------------------------------

_LazyMixin = nn.modules.lazy.LazyModuleMixin


def _plan(modules: list[nn.Module], state: ModelState) -> tuple[list[type], int]:
    """The class each of ``modules`` (the model's, the model first) gets for ``state``, and
    how many of them are shadow classes.

    Raises:
        InvalidValueError: a module is TorchScript (nothing has changed yet).
    """
    config: Config = (state.param_dtype, state.channels_last)
    key = (config, tuple(map(id, modules)), tuple(map(type, modules)))
    found = state.plans.get(key)
    if found is not None:
        return found
    if any(isinstance(m, torch.jit.ScriptModule) for m in modules):
        raise InvalidValueError(f"model levers on {state.tag}: {torchscript_part(modules[0])}")
    dtype = state.param_dtype
    kept = _parametrizations(modules)
    planned = []
    for module in modules:
        cls = original_class(module)
        role = _ROOT if module is modules[0] else 0
        parts = _NO_PARTS
        if dtype is not None and id(module) not in kept:
            if is_norm(module):
                role |= _NORM
                parts = Parts(mixed=_mixed_devices(module, dtype))
            else:
                computed, sources = _computed_names(module)
                names = tuple(n for n in _floating_names(module) if n not in sources)
                if names or computed:
                    role |= _PARAMS
                    parts = Parts(names, computed)
            lazy = isinstance(module, _LazyMixin) and module.has_uninitialized_params()
            if (
                lazy
                and getattr(cls, "cls_to_become", None) is not None
                and role & (_NORM | _PARAMS)
            ):
                role |= _LAZY
        if state.channels_last and convertible(module) is not None:
            role |= _CONV
        keep = role == 0 or (role == _ROOT and dtype is None and not state.channels_last)
        planned.append(cls if keep else _shadow_class(state, cls, role, parts, config))
    if len(state.plans) > 8:  # the model's modules keep changing: keep the latest only
        state.plans.clear()
    shadows = sum("_speedflags_own_class" in c.__dict__ for c in planned)
    state.plans[key] = (planned, shadows)
    return planned, shadows


def _floating_names(module: nn.Module) -> tuple[str, ...]:
    params = module._parameters
    return tuple(n for n, p in params.items() if p is not None and p.is_floating_point())


def _computed_names(module: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The weights ``module`` computes before each call, and the parameters they come from."""
    computed: list[str] = []
    sources: list[str] = []
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, SpectralNorm):
            computed.append(hook.name)
            sources.append(hook.name + "_orig")
        elif isinstance(hook, WeightNorm):
            computed.append(hook.name)
            sources += (hook.name + "_g", hook.name + "_v")
    if parametrize.is_parametrized(module):
        computed += [str(name) for name in module.parametrizations]  # type: ignore[union-attr, unused-ignore]
    return tuple(computed), tuple(sources)


def _parametrizations(modules: list[nn.Module]) -> frozenset[int]:
    # parametrize's ParametrizationLists and what they hold compute a weight from float32
    # parameters; the parametrized module casts the weight where it reads it
    lists = [m for m in modules if isinstance(m, parametrize.ParametrizationList)]
    return frozenset(id(sub) for held in lists for sub in held.modules())


# --- putting a state in place -------------------------------------------------------------------


def sync(model: nn.Module, state: ModelState) -> None:
    """Make ``model`` compute as ``state`` says: swap each module's class, convert the
    convolution weights, claim its modules while a lever is set (release them once none
    is). All or nothing: a failure (or an interruption) undoes what was done, then raises.
    The loops are functions of their own: a loop's back edge inside a ``try`` can fall
    outside its handler on Python 3.12+ (tests/test_exception_table_holes.py)."""
    done: list[tuple[nn.Module, type]] = []
    converted: Converted = []
    layouts = dict(state.layouts)
    modules = list(model.modules())
    was_holding = holding(state)
    state.dirty = False
    try:
        planned, shadows = _plan(modules, state)
        if state.on:
            claim(state, modules)
        _swap_classes(modules, planned, state, done)
        if len(state.classes) > shadows:
            _put_back_strays(modules, state, done)
        if state.channels_last:
            to_channels_last(modules, state, converted)
        elif state.layouts:
            to_own_layouts(state, converted)
    except BaseException:
        _undo(done, converted)
        state.layouts = layouts
        _recount(modules, state)
        if not was_holding:
            release(state)
        raise
    finally:
        state.casts.clear()  # no cast outlives a change of setting
    if not state.on:
        release(state)


def _refresh(state: ModelState) -> None:
    # a module or parameter was added to the model inside the block: bring it in
    model = state.model()
    if model is not None and state.on:
        sync(model, state)


def _swap_classes(
    modules: list[nn.Module],
    planned: list[type],
    state: ModelState,
    done: list[tuple[nn.Module, type]],
) -> None:
    for module, wanted in zip(modules, planned, strict=True):
        previous = type(module)
        if previous is wanted:
            continue
        _set_class(module, wanted)
        done.append((module, previous))
        if "_speedflags_own_class" in wanted.__dict__:
            state.classes.setdefault(module, original_class(module))
        else:
            state.classes.pop(module, None)


def _put_back_strays(
    modules: list[nn.Module], state: ModelState, done: list[tuple[nn.Module, type]]
) -> None:
    # modules taken out of the model inside the block get their own classes back
    ids = {id(m) for m in modules}
    for module, own in list(state.classes.items()):
        if id(module) not in ids:
            done.append((module, type(module)))
            _set_class(module, own)
            del state.classes[module]


def _recount(modules: list[nn.Module], state: ModelState) -> None:
    # after an undo: the classes map says what each module has again
    for module in modules:
        if shadowed(module):
            state.classes.setdefault(module, original_class(module))
        else:
            state.classes.pop(module, None)


def _undo(done: list[tuple[nn.Module, type]], converted: Converted) -> None:
    for weight, data in reversed(converted):
        weight.data = data
    for module, previous in reversed(done):
        _set_class(module, previous)


def _set_class(module: nn.Module, cls: type) -> None:
    # object's own: nn.Module.__setattr__ would spend longer than the swap on its checks
    object.__setattr__(module, "__class__", cls)
