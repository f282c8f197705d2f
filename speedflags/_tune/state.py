"""What ``tune`` compares and what it puts back: the step's outputs, and the step's state.

Outputs: a step returns a tensor, or a tuple, list or dict of them (nested, ``None`` leaves
ignored, Python numbers taken as scalars; a Hugging Face ``ModelOutput`` is a dict). The
error of a candidate is the largest relative error ``||y - y_ref|| / ||y_ref||`` over the
outputs, in float64; an output that is not finite rejects the candidate.

State: a train step changes what the next call computes (the weights, the optimizer's
moments, the RNG). Every call that ``tune`` makes must start from the same state, or the
error of a later candidate would include earlier updates and the timings would drift (a
loss growing into NaN, a sparse gradient turning dense). So, before the first call,
:class:`StepState` copies (``copy.deepcopy`` of ``state_dict()``) every
``torch.nn.Module``, ``torch.optim.Optimizer``, learning-rate scheduler and ``GradScaler`` it
can find, with the parameters' ``.grad`` and the torch RNG state (CPU, and CUDA where it is
initialised), and puts them back before every call, outside the timed region. It looks in
the positional and keyword arguments (and in lists, tuples and dicts among them), in the
step itself (a module, a bound method's object, a ``functools.partial``'s arguments, a
closure's variables) and in the globals the step's code names. State it cannot see (a model
reached through another object's attribute, Python's ``random``, NumPy) is not reset: pass
such objects as arguments.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.optim.optimizer import Optimizer

from .._compile.reachable import reachable
from .._measure.accuracy import relative_error
from ..errors import InvalidTypeError, InvalidValueError

__all__ = ["Outputs", "StepState", "error_against", "outputs"]

Outputs = list[tuple[str, torch.Tensor]]


def outputs(value: Any, where: str = "output") -> Outputs:
    """The tensors a step returned, each with its place (``"output[1]['loss']"``).

    Raises:
        InvalidTypeError: a value that is neither a tensor, a number, ``None``, nor a
            tuple, list or dict of those.

    Example:
        >>> import torch
        >>> from speedflags._tune.state import outputs
        >>> [name for name, _ in outputs((torch.ones(2), {"loss": 1.5, "aux": None}))]
        ['output[0]', "output[1]['loss']"]
    """
    if isinstance(value, torch.Tensor):
        return [(where, value)]
    if value is None:
        return []
    if isinstance(value, (bool, int, float)):
        return [(where, torch.tensor(float(value), dtype=torch.float64))]
    if isinstance(value, Mapping):
        found: Outputs = []
        for key, item in value.items():
            found.extend(outputs(item, f"{where}[{key!r}]"))
        return found
    if isinstance(value, (tuple, list)):
        found = []
        for index, item in enumerate(value):
            found.extend(outputs(item, f"{where}[{index}]"))
        return found
    raise InvalidTypeError(
        f"tune: the step returned {type(value).__name__} at {where}; it must return a "
        "tensor, or a tuple, list or dict of tensors (numbers and None are accepted too)"
    )


def reference_outputs(value: Any) -> Outputs:
    """The reference's outputs, detached and copied in float64 (later calls may reuse memory)."""
    return [(name, t.detach().to(torch.float64).clone()) for name, t in outputs(value)]


def error_against(value: Any, reference: Outputs) -> tuple[float, str]:
    """The largest relative error of ``value`` against ``reference``, and why it is not finite.

    Returns ``(error, "")``, or ``(math.inf, reason)`` when an output is not finite or the
    outputs do not match the reference's (other names or shapes).

    Example:
        >>> import torch
        >>> from speedflags._tune.state import error_against, reference_outputs
        >>> ref = reference_outputs((torch.tensor([3.0, 4.0]), torch.ones(2)))
        >>> error_against((torch.tensor([3.0, 4.5]), torch.ones(2)), ref)
        (0.1, '')
        >>> error_against((torch.tensor([3.0, float("nan")]), torch.ones(2)), ref)
        (inf, 'output[0] is not finite')
    """
    got = outputs(value)
    names = [name for name, _ in got]
    wanted = [name for name, _ in reference]
    if names != wanted:
        return math.inf, f"returned {names}, the reference {wanted}"
    worst = 0.0
    for (name, tensor), (_, ref) in zip(got, reference, strict=True):
        if tuple(tensor.shape) != tuple(ref.shape):
            shapes = f"{tuple(tensor.shape)}, the reference {tuple(ref.shape)}"
            return math.inf, f"{name} has shape {shapes}"
        inexact = tensor.is_floating_point() or tensor.is_complex()
        if inexact and not bool(torch.isfinite(tensor.detach()).all()):
            return math.inf, f"{name} is not finite"
        worst = max(worst, relative_error(tensor, ref))
    if not math.isfinite(worst):
        return math.inf, "the error is not finite"
    return worst, ""


def check_reference(reference: Outputs) -> None:
    """Refuse a reference with nothing to compare, or with a non-finite output."""
    if not reference:
        raise InvalidValueError("tune: the step returned no tensor to compare; return its output")
    for name, tensor in reference:
        if not bool(torch.isfinite(tensor).all()):
            raise InvalidValueError(
                f"tune: the fp32 reference's {name} is not finite; nothing can be compared "
                "with it (check the step and its inputs)"
            )


def _stateful_types() -> tuple[type, ...]:
    found: list[type] = [
        torch.nn.Module,
        Optimizer,
        torch.optim.lr_scheduler.LRScheduler,
    ]
    for owner in (getattr(torch, "amp", None), getattr(torch.cuda, "amp", None)):
        scaler = getattr(owner, "GradScaler", None)  # torch.amp's arrived in PyTorch 2.3
        if isinstance(scaler, type):
            found.append(scaler)
    return tuple(found)


def find_state(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
    """The modules, optimizers, schedulers and grad scalers the step can reach, once each.

    Example:
        >>> import torch
        >>> from speedflags._tune.state import find_state
        >>> model = torch.nn.Linear(2, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> [type(o).__name__ for o in find_state(lambda x: model(x), [{"opt": opt}], {})]
        ['SGD', 'Linear']
    """
    return reachable(fn, args, kwargs, _stateful_types())


class _Snapshot:
    """One copy of every module, gradient, optimizer (scheduler, scaler) and RNG state."""

    def __init__(self, modules: Sequence[torch.nn.Module], others: Sequence[Any]) -> None:
        with torch.no_grad():
            self.modules = [copy.deepcopy(m.state_dict()) for m in modules]
            params = {id(p): p for m in modules for p in m.parameters()}
            self.grads: list[tuple[torch.Tensor, torch.Tensor | None]] = [
                (p, None if p.grad is None else p.grad.detach().clone()) for p in params.values()
            ]
        self.others = [copy.deepcopy(o.state_dict()) for o in others]
        self.rng = torch.get_rng_state()
        self.cuda_rng: list[torch.Tensor] | None = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            self.cuda_rng = torch.cuda.get_rng_state_all()

    def restore_rng(self) -> None:
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)

    def restore(self, modules: Sequence[torch.nn.Module], others: Sequence[Any]) -> None:
        self.restore_rng()
        with torch.no_grad():
            for module, saved in zip(modules, self.modules, strict=True):
                module.load_state_dict(saved)  # copies into the live tensors
            for param, grad in self.grads:
                if grad is None:
                    param.grad = None
                elif param.grad is not None and param.grad.shape == grad.shape:
                    param.grad.copy_(grad)
                else:
                    param.grad = grad.clone()
            for obj, saved in zip(others, self.others, strict=True):
                if not (isinstance(obj, Optimizer) and _copy_into(obj, saved)):
                    # a fresh copy: load_state_dict may keep the given tensors as its state
                    obj.load_state_dict(copy.deepcopy(saved))

    def differs(self, modules: Sequence[torch.nn.Module]) -> bool:
        """Whether any module's state or gradient differs from this copy."""
        for module, saved in zip(modules, self.modules, strict=True):
            now = module.state_dict()
            if now.keys() != saved.keys() or any(
                not torch.equal(now[k], v) for k, v in saved.items()
            ):
                return True
        for param, grad in self.grads:
            if (param.grad is None) != (grad is None):
                return True
            if grad is not None and param.grad is not None and not torch.equal(param.grad, grad):
                return True
        return False


def _same_layout(now: Any, value: Any) -> bool:
    """Whether ``value`` (a saved tensor) can be copied into ``now`` (the live one)."""
    return (
        isinstance(now, torch.Tensor)
        and isinstance(value, torch.Tensor)
        and now.shape == value.shape
        and now.dtype == value.dtype
    )


def _copy_into(optimizer: Optimizer, saved: dict[str, Any]) -> bool:
    """Copy ``saved`` into the optimizer's own state tensors, if they have its layout.

    Keeping the tensors (not replacing them, as ``load_state_dict`` does) keeps a compiled
    optimizer step's guards valid, and costs no allocation.
    """
    live = optimizer.state_dict()  # its "state" holds the live per-parameter dicts
    if live["state"].keys() != saved["state"].keys():
        return False
    if len(live["param_groups"]) != len(saved["param_groups"]):
        return False  # a group added since: load_state_dict says so, before copying anything
    for index, entry in saved["state"].items():
        target = live["state"][index]
        if target.keys() != entry.keys():
            return False
        for key, value in entry.items():
            now = target[key]
            if isinstance(value, torch.Tensor) and not _same_layout(now, value):
                return False
    for index, entry in saved["state"].items():
        target = live["state"][index]
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                target[key].copy_(value)
            else:
                target[key] = copy.deepcopy(value)
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"], strict=True):
        for key, value in saved_group.items():
            if key == "params":
                continue
            now = group.get(key)
            if isinstance(now, torch.Tensor) and _same_layout(now, value):
                # a tensor learning rate (what a CUDA-graphed step reads): copied into, not
                # replaced, so that a compiled step keeps reading the same tensor
                now.copy_(value)
            else:
                group[key] = copy.deepcopy(value)  # the learning rate a scheduler changed
    return True


class StepState:
    """The state a step changes, copied and put back before each call, and after tuning.

    Modules: their ``state_dict()`` and their parameters' ``.grad``; optimizers, schedulers
    and grad scalers: their ``state_dict()``; and the torch RNG. The original is copied at
    construction and put back by :meth:`finish`. :meth:`settle`, called after a first
    (priming) call, copies the state that call left: a train step's optimizer creates its
    moments lazily at the first step, so every later call, restored to this copy, times a
    steady-state step, with the optimizer's tensors kept in place. A step that changed no
    module and has no optimizer, scheduler or scaler (a forward) gets its RNG back only.

    Example:
        >>> import torch
        >>> from speedflags._tune.state import StepState
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.Adam(model.parameters(), lr=0.5)
        >>> def step(x):
        ...     opt.zero_grad(); loss = model(x).pow(2).sum(); loss.backward(); opt.step()
        ...     return loss.item()
        >>> weight = model.weight.detach().clone()
        >>> state = StepState(step, (torch.ones(1, 2),), {})
        >>> _ = step(torch.ones(1, 2)); state.settle()   # the priming call: Adam's moments
        >>> second = step(torch.ones(1, 2)); _ = step(torch.ones(1, 2))
        >>> state.restore(); step(torch.ones(1, 2)) == second
        True
        >>> state.finish(); torch.equal(model.weight, weight) and not opt.state
        True
    """

    def __init__(
        self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> None:
        found = find_state(fn, args, kwargs)
        self.modules = [o for o in found if isinstance(o, torch.nn.Module)]
        self.others = [o for o in found if not isinstance(o, torch.nn.Module)]
        self._original = _Snapshot(self.modules, self.others)
        self._working = self._original
        self.changes_state = True

    def describe(self) -> str:
        """What is reset, in words (for progress and the result)."""
        names = [type(o).__name__ for o in (*self.modules, *self.others)]
        what = ", ".join(names) if names else "no module or optimizer found"
        return f"{what}; RNG" + ("" if self.changes_state else " (the step changes no state)")

    def settle(self) -> None:
        """After the priming call: copy what it left; restores go back to that from now on."""
        self.changes_state = bool(self.others) or self._original.differs(self.modules)
        if self.changes_state:
            self._working = _Snapshot(self.modules, self.others)

    def restore(self) -> None:
        """Put back the state to start each call from (the RNG only if nothing else moves)."""
        if self.changes_state:
            self._working.restore(self.modules, self.others)
        else:
            self._working.restore_rng()

    def finish(self) -> None:
        """Put everything back as it was before the first call."""
        self._original.restore(self.modules, self.others)
