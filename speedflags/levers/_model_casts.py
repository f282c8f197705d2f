"""``param_dtype``'s cast cache: each parameter cast once, and cast again whenever it changed.

A cast is reused while its parameter is unchanged, and three facts say "unchanged": the
parameter's version counter (every in-place write through autograd's view of it, an
optimizer's for-loop and ``foreach`` steps, ``load_state_dict``, ``nn.init``), its data
pointer (``param.data = ...``, ``model.to(...)``), and the optimizer steps taken since the
cast was made. The last is needed because the first two do not see everything: a fused
optimizer (``fused=True`` Adam, AdamW, SGD, Adagrad) updates the weights in place without
bumping their version counters and keeps their storage, and so does any write through
``param.data``. PyTorch calls every global optimizer step hook
(``torch.optim.optimizer.register_optimizer_step_post_hook``) after each ``step()`` of every
``torch.optim.Optimizer``, whatever its implementation (for-loop, ``foreach``, fused, and
compiled where dynamo runs the hooks, as 2.13's does): :func:`optimizer_stepped` is that
hook, registered only while a
model-lever block is open (:mod:`speedflags.levers._model_state`), and it makes every cast
made before the step stale. It counts, nothing more: a step renews each cast at most once,
when the parameter is next read. (Its pre-step twin, in :mod:`._model_state`, empties the
caches of the models under a lever, so that the stale casts' memory serves the step.)

Where PyTorch calls no step hooks for its optimizers (PyTorch 2.1 once ``torch.compile`` has
run in the process: its dynamo takes every built-in optimizer's hook wrapper away, and a
compiled step bumps no version counters either), a cast made for training is renewed after
its backward instead: each micro-batch then casts again, as autocast does. Which of the two
holds is found by stepping a one-element SGD (:func:`steps_are_seen`), again only when
``torch.optim.SGD.step`` is another function.

What none of this sees: an in-place write through ``param.data`` outside an optimizer's
``step()`` (``p.data.mul_(0.5)``: autograd's own cache would not see it either). Writing
without ``.data`` (``with torch.no_grad(): p.mul_(0.5)``) or re-entering the block renews
the casts there.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from .._tracing import is_compiling

__all__ = ["Casts", "cast", "is_probe", "optimizer_stepped", "steps_are_seen", "steps_taken"]

# A model's casts: (id(parameter), dtype) -> (version, data pointer, mode, steps, cast).
# Modes: 0 made with autograd (serves every mode), 1 without (serves no_grad and inference
# mode), 2 in inference mode (serves inference mode only: inference tensors cannot be saved
# for backward). Steps: the optimizer steps taken when the cast was made.
Casts = dict[tuple[int, torch.dtype], tuple[int, int, int, int, torch.Tensor]]

# Plain tensors only: a tensor subclass (FakeTensor under torch.export, a lazy module's
# UninitializedParameter, DTensor) has no data pointer to key on, or means something else by it.
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_tracing_state = torch._C._get_tracing_state  # type: ignore[attr-defined, unused-ignore]
_is_lazy = torch.nn.parameter.is_lazy  # an uninitialised parameter of a lazy module


class _Steps:
    # A plain object with one int attribute: the hook's one write, which dynamo replays
    # after a compiled optimizer step as it replays any attribute write.
    def __init__(self) -> None:
        self.n = 0


_STEPS = _Steps()


def optimizer_stepped(optimizer: Any, args: Any, kwargs: Any) -> None:
    """The global optimizer step post-hook: every cast made before this step is stale."""
    if not is_probe(optimizer):
        _STEPS.n += 1


def is_probe(optimizer: Any) -> bool:
    """Whether ``optimizer`` is :func:`steps_are_seen`'s own one-element SGD, whose step
    changes no model: the step hooks pass it by (counted, it made every cast in the block
    that asked stale, and the next read cast again)."""
    return getattr(optimizer, "_speedflags_probe", False) is True


def steps_taken() -> int:
    """How many optimizer steps the hook has seen (while a model-lever block was open)."""
    return _STEPS.n


# id(torch.optim.SGD.step) -> whether the global step hooks run for PyTorch's optimizers: the
# function changes when the first SGD wraps it, and when 2.1's dynamo unwraps it
_SEEN: dict[int, bool] = {}


def steps_are_seen() -> bool:
    """Whether PyTorch calls the global optimizer step hooks after its optimizers' steps now
    (False on PyTorch 2.1 once ``torch.compile`` has run: its dynamo unwraps them all)."""
    found = _SEEN.get(id(torch.optim.SGD.step))
    if found is None:
        found = _try_a_step()
        _SEEN[id(torch.optim.SGD.step)] = found  # after the try: the first SGD wraps it
    return found


def _try_a_step() -> bool:
    fired: list[bool] = []
    param = torch.zeros(1, requires_grad=True)
    param.grad = torch.zeros(1)
    handle = register_optimizer_step_post_hook(lambda *_: fired.append(True))
    try:
        with torch.inference_mode(False):
            probe = torch.optim.SGD([param], lr=0.0)
            probe._speedflags_probe = True  # type: ignore[attr-defined]
            probe.step()
    finally:
        handle.remove()
    return bool(fired)


class _Forget:
    """A cast's gradient hook, where the steps are not seen: its backward ran, an optimizer
    may step the parameter next, so the cast is dropped from the cache (if still there)."""

    __slots__ = ("casts", "key", "made")

    def __init__(self, casts: Casts, key: tuple[int, torch.dtype], made: torch.Tensor) -> None:
        self.casts = casts
        self.key = key
        self.made = weakref.ref(made)

    def __call__(self, grad: torch.Tensor) -> None:
        hit = self.casts.get(self.key)
        if hit is not None and hit[4] is self.made():
            del self.casts[self.key]


def _mode(param: torch.Tensor) -> int:
    if torch.is_inference_mode_enabled():
        return 2
    return 0 if param.requires_grad and torch.is_grad_enabled() else 1


def cast(param: torch.Tensor, dtype: torch.dtype, casts: Casts) -> torch.Tensor:
    """``param`` in ``dtype``, made once and reused while ``param`` is unchanged (its version
    counter, its storage and the optimizer steps taken since: see the module's docstring).

    Traced code (``torch.compile``, ``torch.jit.trace``) and tensor subclasses get a fresh
    cast each time: a graph must cast from the parameter, not bake in a cast made before.
    """
    if type(param) not in _PLAIN:
        if _is_lazy(param) or param.dtype is dtype or not param.is_floating_point():
            return param  # a lazy module's, before its first call: nothing to cast yet
        converted: torch.Tensor = param.to(dtype)  # typed: Any in PyTorch 2.1's stubs
        return converted
    if param.dtype is dtype or not param.is_floating_point():
        return param
    if is_compiling() or _tracing_state() is not None:  # traced: the graph casts
        traced: torch.Tensor = param.to(dtype)
        return traced
    key = (id(param), dtype)
    version, pointer, mode, steps = param._version, param.data_ptr(), _mode(param), _STEPS.n
    hit = casts.get(key)
    if (
        hit is not None
        and hit[3] == steps
        and hit[0] == version
        and hit[1] == pointer
        and hit[2] <= mode
    ):
        return hit[4]
    made: torch.Tensor = param.to(dtype)
    casts[key] = (version, pointer, mode, steps, made)
    if mode == 0 and not steps_are_seen():
        made.register_hook(_Forget(casts, key, made))  # type: ignore[no-untyped-call, unused-ignore]
    return made
