"""The objects a step can reach: its arguments, its object, its closure and its globals.

``tune`` looks there for the state it puts back before each call (modules, optimizers,
schedulers, grad scalers); ``@speedup(cuda_graphs=True)`` for the optimizers whose learning
rates a recorded graph must not freeze. It looks in the positional and keyword arguments (and
in lists, tuples and dicts among them), in the step itself (a module, a bound method's
object, a ``functools.partial``'s arguments, a closure's variables, through decorators that
set ``__wrapped__``) and in the globals the step's code names; asked to look further (CUDA
graphs' learning-rate check does), one step beyond: the closures and named globals of the
functions found there, and the attributes of the objects found there (a trainer passed as
``self``). What it cannot see is not found: pass such objects as arguments.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["DEPTH", "reachable"]

DEPTH = 3  # how deep into containers and wrappers the search looks


def _candidates(
    fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> list[Any]:
    """Everything the step can reach directly: arguments, its object, closure and globals."""
    seen: list[Any] = [fn, *args, *kwargs.values()]
    target: Any = fn
    for _ in range(DEPTH):  # unwrap decorators and partials
        if isinstance(target, functools.partial):
            seen.extend([target.func, *target.args, *target.keywords.values()])
            target = target.func
        bound = getattr(target, "__self__", None)
        if bound is not None:
            seen.append(bound)
        code = getattr(target, "__code__", None)
        for cell in getattr(target, "__closure__", None) or ():
            try:
                seen.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
        names = getattr(target, "__globals__", None)
        if code is not None and isinstance(names, dict):
            seen.extend(names[n] for n in code.co_names if n in names)
        target = getattr(target, "__wrapped__", getattr(target, "func", None))
        if target is None:
            break
    return seen


def _one_step_further(seen: Sequence[Any]) -> list[Any]:
    """What the objects ``seen`` reach in one more step: a function's closure and the
    globals its code names (a helper the step calls), an object's attributes (a trainer
    passed as ``self``). Modules and tensors are not opened: their attributes are the
    model, not the training loop's state."""
    further: list[Any] = []
    for obj in seen:
        if isinstance(obj, types.FunctionType):
            further.extend(_candidates(obj, (), {}))
        elif not isinstance(obj, (type, types.ModuleType, torch.nn.Module, torch.Tensor)):
            attributes = getattr(obj, "__dict__", None)
            if isinstance(attributes, dict):
                further.extend(attributes.values())
    return further


def reachable(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    kinds: tuple[type, ...],
    further: bool = False,
) -> list[Any]:
    """The objects of ``kinds`` the step can reach (see the module docstring), once each;
    with ``further``, also through the functions and objects found there (a helper's
    closure, a trainer's attributes): one step more.

    Example:
        >>> import torch
        >>> from speedflags._compile.reachable import reachable
        >>> model = torch.nn.Linear(2, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> kinds = (torch.optim.Optimizer, torch.nn.Module)
        >>> [type(o).__name__ for o in reachable(lambda x: model(x), [{"opt": opt}], {}, kinds)]
        ['SGD', 'Linear']
    """
    found: dict[int, Any] = {}

    def visit(obj: Any, depth: int) -> None:
        if isinstance(obj, kinds):
            found.setdefault(id(obj), obj)
        elif depth < DEPTH and isinstance(obj, (list, tuple)):
            for item in obj:
                visit(item, depth + 1)
        elif depth < DEPTH and isinstance(obj, dict):
            for item in obj.values():
                visit(item, depth + 1)

    seen = _candidates(fn, args, kwargs)
    if further:
        seen += _one_step_further(seen)
    for obj in seen:
        visit(obj, 0)
    return list(found.values())
