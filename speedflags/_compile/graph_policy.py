"""What ``@speedup(cuda_graphs=True)`` decides without recording anything (testable on a CPU).

The recording and replaying are torch.compile's own: inductor's CUDA graph trees
(``mode="reduce-overhead"``, ``options={"triton.cudagraphs": True}``). What users trip on
around them is decided here, apart from any capture, so that each rule runs and is tested
on a machine without a GPU:

- **The option.** ``cuda_graphs`` is ``True`` or ``False`` (:func:`cuda_graphs_option`);
  :func:`graph_options` turns the step's ``compile=`` options into the same with CUDA graphs
  on, and refuses what contradicts them (another backend than inductor, a mode or option that
  turns them off) when the decorator is built.
- **The device** (:func:`unavailable`): CUDA graphs record CUDA kernel launches; on a CPU, or
  where CUDA is not available, the option has no effect and the step runs as it would without
  it (recorded; ``strict=True`` refuses).
- **Shapes** (:class:`ShapeBudget`): CUDA graph trees record one graph per distinct input
  shape (and per value of a Python number argument, which dynamo specialises), each holding
  its own memory. The first :data:`SHAPE_LIMIT` distinct signatures of the step's arguments
  are graphed; a call with another signature after that runs eagerly, without recording,
  while the signatures already recorded keep replaying their graphs.
- **Learning rates** (:func:`rate_problems`): a Python float learning rate in an optimizer's
  param group is guarded by dynamo, so each new value a scheduler writes compiles the step
  again (and a graph recorded with a value baked in would replay it). A learning rate kept as
  a tensor on the parameters' device is read from device memory at every replay: PyTorch's
  schedulers fill it in place (2.13, measured; the compiled-optimizer recipe asks for 2.3) or,
  on 2.1, write a new tensor (copied in before each replay; its OneCycleLR and
  ReduceLROnPlateau write a float, refused at the next call). The step
  count of Adam-like optimizers is already a tensor; dynamo moves it to the parameters'
  device (``capturable``) when it traces the optimizer step.
- **Outputs** (:func:`keep_outputs`): a replay writes its outputs into the graph's memory,
  which the next replay overwrites; each tensor a graphed call returns is copied out.
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Callable, Hashable, Mapping, MutableMapping, Sequence
from typing import Any

import torch

from .._hardware import missing_cuda
from .._short_repr import short_repr, type_name
from ..errors import InvalidTypeError, InvalidValueError

__all__ = [
    "SHAPE_LIMIT",
    "ShapeBudget",
    "argument_names",
    "cuda_graphs_option",
    "describe_signatures",
    "graph_options",
    "keep_outputs",
    "number_arguments",
    "rate_problems",
    "signature",
    "unavailable",
]

# Distinct input signatures a step records graphs for: the same bound as dynamo's recompile
# limit and inductor's ``cudagraph_dynamic_shape_warn_limit`` (8 by default in both).
SHAPE_LIMIT = 8
_DEPTH = 3  # how deep into the arguments' lists, tuples and dicts a signature looks
_CUDAGRAPHS = "triton.cudagraphs"
_TREES = "triton.cudagraph_trees"


def cuda_graphs_option(value: object, call: str = "speedup") -> bool:
    """Validate ``cuda_graphs=``: ``True`` or ``False``, nothing else (not even ``None``).

    Example:
        >>> from speedflags._compile.graph_policy import cuda_graphs_option
        >>> cuda_graphs_option(True), cuda_graphs_option(False)
        (True, False)
        >>> cuda_graphs_option("yes")
        Traceback (most recent call last):
        ...
        speedflags.InvalidTypeError: speedup(cuda_graphs='yes'): expected True or False, got str
    """
    if value is True or value is False:
        return value
    raise InvalidTypeError(
        f"{call}(cuda_graphs={short_repr(value)}): expected True or False, got {type_name(value)}"
    )


def graph_options(options: Mapping[str, Any] | None, shown: str) -> dict[str, Any]:
    """The ``compile=`` options (``None``: no compile asked for) with CUDA graphs on.

    A mode that records CUDA graphs already (``"reduce-overhead"``, ``"max-autotune"``) is
    kept; another mode becomes its options plus ``triton.cudagraphs``; backend options get
    ``triton.cudagraphs`` added. Refused (``InvalidValueError``, starting with ``shown``):
    another backend than inductor, whose graph trees do the recording, and a mode or option
    that turns CUDA graphs (or their trees, which the output rule relies on) off.

    Example:
        >>> from speedflags._compile.graph_policy import graph_options
        >>> graph_options(None, "speedup(cuda_graphs=True)")
        {'options': {'triton.cudagraphs': True}}
        >>> graph_options({"mode": "reduce-overhead"}, "speedup(cuda_graphs=True)")
        {'mode': 'reduce-overhead'}
    """
    merged = dict(options or {})
    backend = merged.get("backend")
    if backend is not None and backend != "inductor":
        name = backend if isinstance(backend, str) else type_name(backend)
        raise InvalidValueError(
            f"{shown}: cuda_graphs=True records through inductor's CUDA graph trees, and "
            f"backend {short_repr(name)} has none; leave 'backend' out (inductor), or leave "
            "cuda_graphs out"
        )
    mode = merged.get("mode")
    if mode is not None:
        mode_options = _mode_options(mode, merged.get("dynamic"), shown)
        if mode_options.get(_CUDAGRAPHS) is True:
            return merged  # "reduce-overhead", "max-autotune": CUDA graphs already
        if mode_options.get(_CUDAGRAPHS) is False or "no-cudagraphs" in str(mode):
            raise InvalidValueError(
                f"{shown}: mode {mode!r} turns CUDA graphs off, and cuda_graphs=True turns "
                "them on; give one of the two"
            )
        del merged["mode"]
        merged["options"] = {**mode_options, _CUDAGRAPHS: True}
        return merged
    backend_options = dict(merged.get("options") or {})
    for key in (_CUDAGRAPHS, _TREES):
        if backend_options.get(key, True) is not True:
            raise InvalidValueError(
                f"{shown}: options[{key!r}]={backend_options[key]!r} turns CUDA graphs (or "
                "their trees) off, and cuda_graphs=True records them with inductor's graph "
                "trees; leave the option out"
            )
    backend_options[_CUDAGRAPHS] = True
    merged["options"] = backend_options
    return merged


def _mode_options(mode: Any, dynamic: Any, shown: str) -> dict[str, Any]:
    """Inductor's options for ``mode`` (``torch._inductor.list_mode_options``)."""
    try:
        from torch._inductor import list_mode_options
    except ImportError:  # pragma: no cover - every PyTorch with torch.compile has it
        return {}
    try:
        return dict(list_mode_options(mode, dynamic))
    except (RuntimeError, KeyError, ValueError):
        valid = ", ".join(repr(m) for m in list_mode_options())
        raise InvalidValueError(
            f"{shown}: torch.compile has no mode {short_repr(mode)}; valid: {valid}"
        ) from None


def unavailable(device: torch.device) -> str | None:
    """Why CUDA graphs can do nothing for a step on ``device``, or None where they can.

    Example:
        >>> import torch
        >>> from speedflags._compile.graph_policy import unavailable
        >>> unavailable(torch.device("cpu"))
        'no effect on cpu: CUDA graphs record and replay CUDA kernel launches; a CPU has none'
    """
    if device.type != "cuda":
        return (
            f"no effect on {device.type}: CUDA graphs record and replay CUDA kernel launches; "
            f"a {device.type.upper()} has none"
        )
    missing = missing_cuda(device)
    if missing is not None:
        return f"no effect on {device}: {missing}"
    if getattr(torch, "compile", None) is None:  # pragma: no cover - PyTorch 2.0 and later have it
        return f"PyTorch {torch.__version__} has no torch.compile, which records the graphs"
    return None


# --- shapes -------------------------------------------------------------------------------


def _part(value: Any, depth: int) -> Hashable:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device, value.requires_grad)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value  # dynamo specialises each value: a graph (and a recording) per value
    if depth < _DEPTH and isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_part(item, depth + 1) for item in value))
    if depth < _DEPTH and isinstance(value, dict):
        return ("dict", tuple((key, _part(item, depth + 1)) for key, item in value.items()))
    return ("object", type(value).__qualname__)


Signature = tuple[tuple[Hashable, ...], tuple[tuple[str, Hashable], ...]]


def signature(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Signature:
    """What makes CUDA graph trees record another graph: each tensor argument's shape,
    dtype, device and ``requires_grad``, and the value of each Python number, string or
    ``None`` (in lists, tuples and dicts too).

    Example:
        >>> import torch
        >>> from speedflags._compile.graph_policy import signature
        >>> signature([torch.ones(2, 3)], {}) == signature([torch.zeros(2, 3)], {})
        True
        >>> signature([torch.ones(2, 3)], {}) == signature([torch.ones(2, 4)], {})
        False
    """
    return (tuple(_part(a, 0) for a in args), tuple((k, _part(v, 0)) for k, v in kwargs.items()))


def _shown(part: Hashable) -> str:
    if isinstance(part, tuple) and part and part[0] == "tensor":
        return "(" + ", ".join(str(n) for n in part[1]) + ("," * (len(part[1]) == 1)) + ")"
    if isinstance(part, tuple) and part and part[0] in ("list", "tuple", "dict"):
        items = part[1]
        if part[0] == "dict":
            return "{" + ", ".join(f"{k!r}: {_shown(v)}" for k, v in items) + "}"
        return "[" + ", ".join(_shown(v) for v in items) + "]"
    if isinstance(part, tuple) and part and part[0] == "object":
        return f"<{part[1]}>"
    return repr(part)


def describe_signatures(seen: Sequence[Signature], names: Sequence[str] = ()) -> str:
    """The arguments that differ between the signatures ``seen``, with their values in the
    order seen (at most 10 each): ``"x: (16, 12, 256), (16, 17, 256); n: 3, 4"``.

    Example:
        >>> import torch
        >>> from speedflags._compile.graph_policy import describe_signatures, signature
        >>> seen = [signature([torch.ones(2, n), 1.0], {"k": n}) for n in (3, 4)]
        >>> describe_signatures(seen, ["x", "lr"])
        'x: (2, 3), (2, 4); k: 3, 4'
    """
    columns: dict[str, list[str]] = {}
    numbers: set[str] = set()
    for positional, keywords in seen:
        named = [
            (names[i] if i < len(names) else f"argument {i}", p) for i, p in enumerate(positional)
        ]
        for name, part in [*named, *keywords]:
            values = columns.setdefault(name, [])
            shown = _shown(part)
            if shown not in values:
                values.append(shown)
            if isinstance(part, (int, float)) and not isinstance(part, bool):
                numbers.add(name)
    varying = [(name, values) for name, values in columns.items() if len(values) > 1]
    if not varying:  # one signature (or several equal ones): all of it
        varying = list(columns.items())
    parts = []
    for name, values in varying:
        more = f", ... ({len(values)} in all)" if len(values) > 10 else ""
        parts.append(f"{name}: {', '.join(values[:10])}{more}")
    return "; ".join(parts)


def number_arguments(seen: Sequence[Signature], names: Sequence[str] = ()) -> list[str]:
    """The Python number arguments whose value differs between the signatures ``seen`` (a
    step count or a learning rate passed as a number: a graph per value).

    Example:
        >>> import torch
        >>> from speedflags._compile.graph_policy import number_arguments, signature
        >>> number_arguments([signature([torch.ones(2), i], {}) for i in (1, 2)], ["x", "step"])
        ['step']
    """
    values: dict[str, set[Hashable]] = {}
    for positional, keywords in seen:
        named = [
            (names[i] if i < len(names) else f"argument {i}", p) for i, p in enumerate(positional)
        ]
        for name, part in [*named, *keywords]:
            if isinstance(part, (int, float)) and not isinstance(part, bool):
                values.setdefault(name, set()).add(part)
    return [name for name, found in values.items() if len(found) > 1]


class ShapeBudget:
    """Which calls are graphed: the first ``limit`` distinct signatures, and no other.

    :meth:`admit` answers ``"record"`` for a new signature within the limit (inductor
    records a graph for it), ``"replay"`` for one recorded before, ``"eager"`` for a new one
    past the limit (it runs without graphs). ``seen`` lists the graphed signatures in order,
    ``beyond`` those met past the limit (the first 10 kept, ``beyond_count`` counts all).

    Example:
        >>> from speedflags._compile.graph_policy import ShapeBudget
        >>> budget = ShapeBudget(limit=2)
        >>> [budget.admit(s) for s in ("a", "b", "a", "c", "b", "c")]
        ['record', 'record', 'replay', 'eager', 'replay', 'eager']
        >>> budget.seen, budget.beyond_count
        (['a', 'b'], 1)
    """

    def __init__(self, limit: int = SHAPE_LIMIT) -> None:
        self.limit = limit
        self.seen: list[Any] = []
        self.beyond: list[Any] = []
        self.beyond_count = 0
        self._graphed: set[Any] = set()
        self._beyond: set[Any] = set()

    def admit(self, key: Any) -> str:
        if key in self._graphed:
            return "replay"
        if len(self._graphed) < self.limit:
            self._graphed.add(key)
            self.seen.append(key)
            return "record"
        if key not in self._beyond:
            self._beyond.add(key)
            self.beyond_count += 1
            if len(self.beyond) < 10:
                self.beyond.append(key)
        return "eager"

    @property
    def full(self) -> bool:
        """Whether a signature past the limit has been met."""
        return self.beyond_count > 0


# --- learning rates -----------------------------------------------------------------------


def _lr_text(value: Any) -> str:
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:g}"
    return short_repr(value)


def _params_device(group: Mapping[str, Any]) -> torch.device | None:
    for param in group.get("params", ()):
        if isinstance(param, torch.Tensor):
            device: torch.device = param.device
            return device
    return None


def rate_problems(
    optimizers: Sequence[torch.optim.Optimizer], was_tensor: MutableMapping[Hashable, bool]
) -> list[str]:
    """Why each optimizer's learning rate would be frozen into a graph or compiled per
    value, with the fix; ``[]`` when every param group's ``lr`` is a tensor on its
    parameters' device. ``was_tensor`` remembers, per param group, whether its rate was a
    tensor before (one a scheduler replaced by a number is said so).

    Example:
        >>> import torch
        >>> from speedflags._compile.graph_policy import rate_problems
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> rate_problems([torch.optim.SGD([w], lr=0.1)], {})[0][:60]
        'SGD param group 0: lr=0.1 is a Python number: dynamo guards '
        >>> rate_problems([torch.optim.AdamW([w], lr=torch.tensor(0.1))], {})
        []
    """
    problems = []
    for opt in optimizers:
        for index, group in enumerate(opt.param_groups):
            lr = group.get("lr")
            key = (id(opt), index)
            where = f"{type(opt).__name__} param group {index}"
            device = _params_device(group)
            shown = f"device={str(device)!r}" if device is not None else "on its parameters' device"
            if isinstance(lr, torch.Tensor):
                was_tensor[key] = True
                if device is not None and lr.device != device:
                    problems.append(
                        f"{where}: lr is a tensor on {lr.device}, its parameters on {device}: "
                        "a graph reads such a scalar once, when it records it. Make it "
                        f"torch.tensor(..., {shown})"
                    )
                continue
            if not isinstance(lr, (int, float)) or isinstance(lr, bool):
                continue  # not a rate speedflags knows how to keep: left to the optimizer
            value = _lr_text(lr)
            if was_tensor.get(key):
                cause = (
                    f"lr={value} is a Python number, where it was a tensor at an earlier call: "
                    "a learning-rate scheduler (or other code) wrote a number over it, and "
                    "each new number compiles the step again. PyTorch 2.1's OneCycleLR and "
                    "ReduceLROnPlateau do (its other schedulers write a new tensor; newer "
                    "PyTorch fills the tensor in place): use another scheduler, a newer "
                    "PyTorch, or call opt.step() outside the graphed step"
                )
            else:
                cause = (
                    f"lr={value} is a Python number: dynamo guards on it, so each new value "
                    "a scheduler writes compiles the step again (and a recorded graph would "
                    f"replay the old one). Create the optimizer with lr=torch.tensor({value}, "
                    f"{shown}) (Adam and AdamW take one with fused=True or capturable=True; "
                    "speedflags.training.fast_optimizer picks fused), or call opt.step() "
                    "outside the graphed step"
                )
            problems.append(f"{where}: {cause}")
    return problems


# --- outputs ------------------------------------------------------------------------------


def keep_outputs(value: Any, device_type: str, depth: int = 0) -> Any:
    """``value`` with each tensor on ``device_type`` copied (``clone()``, autograd kept), in
    tuples (named ones too), lists and dicts (to ``depth`` 3): what a graphed call returns
    lives in the graph's memory, which the next replay overwrites.

    Example:
        >>> import torch
        >>> from speedflags._compile.graph_policy import keep_outputs
        >>> buffer = torch.zeros(2)
        >>> kept = keep_outputs({"loss": buffer, "n": 3}, "cpu")
        >>> buffer.add_(1.0); kept["loss"].tolist(), kept["n"]
        tensor([1., 1.])
        ([0.0, 0.0], 3)
    """
    if isinstance(value, torch.Tensor):
        return value.clone() if value.device.type == device_type else value
    if depth >= _DEPTH:
        return value
    if isinstance(value, tuple):
        items = [keep_outputs(item, device_type, depth + 1) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, list):
        return [keep_outputs(item, device_type, depth + 1) for item in value]
    if isinstance(value, MutableMapping):
        kept = copy.copy(value)  # a dict, or a mapping such as transformers' ModelOutput
        for key, item in value.items():
            kept[key] = keep_outputs(item, device_type, depth + 1)
        return kept
    return value


def argument_names(func: Callable[..., Any]) -> list[str]:
    """The names of ``func``'s positional parameters (``[]`` where they cannot be read).

    Example:
        >>> from speedflags._compile.graph_policy import argument_names
        >>> argument_names(lambda x, y, *rest, k=1: None)
        ['x', 'y']
    """
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in params if p.kind in kinds]
