"""``speedflags.guard_levers``: ``torch.compile`` for a user's own model or function, with the
levers dynamo does not guard kept apart as ``@speedup(compile=...)`` keeps them.

Dynamo does not re-trace when the SDPA kernels, cuDNN's flags, oneDNN's precision or fp16
accumulation change, so a graph traced under one state serves the next
(:mod:`speedflags._compile.lever_guard`). ``guard_levers`` compiles the model itself, because
what ``torch.compile`` returned cannot be keyed by that state from outside: its backend is
fixed, and so are the cache entries of the frames it compiles.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .._short_repr import short_repr
from ..errors import InvalidTypeError
from . import autocast_left
from .backend import inner_backend
from .lever_guard import LeverBackend, LeverGuard
from .lever_state import LeverState
from .options import BACKEND_KEYS, compile_options

__all__ = ["guard_levers"]

M = TypeVar("M", bound=Callable[..., Any])

_is_compiling: Callable[[], bool] | None = None


def _tracing() -> bool:
    global _is_compiling
    if _is_compiling is None:
        found = getattr(torch.compiler, "is_compiling", None)  # PyTorch 2.3+
        if found is None:
            import torch._dynamo as dynamo

            found = dynamo.is_compiling
        _is_compiling = found
    return bool(_is_compiling())


def guard_levers(model: M, /, **options: Any) -> M:
    """``torch.compile(model, **options)``, never running a graph traced under another state
    of the levers ``torch.compile`` does not guard.

    Dynamo re-traces when grad mode, autocast or deterministic algorithms change, but not when
    the SDPA kernels or their order, cuDNN's benchmark/deterministic/TF32 flags, oneDNN's fp32
    precision or fp16 accumulation do (nor do inductor's on-disk caches key on them): a model
    compiled under ``fast_math(sdpa="flash")`` would run the flash kernel again under
    ``fast_math(sdpa="math")``. The model compiled here reads those levers before each call
    (a few microseconds) and keeps one compiled artefact per state (PyTorch 2.2+; each state
    counts one entry against dynamo's ``recompile_limit``, beyond which dynamo runs the frames
    eagerly, or raises under ``fullgraph=True``), or compiles again after each change
    (PyTorch 2.1). The state is also put into inductor's cache key while it compiles. How,
    and what stays out of reach: ``docs/compile.md``.

    Args:
        model: an ``nn.Module`` or a function, not yet compiled (pass what you would pass
            to ``torch.compile``; its result cannot be keyed by the levers from outside).
        **options: ``torch.compile``'s options (``backend``, ``mode``, ``fullgraph``,
            ``dynamic``, ``options``, ...), checked as ``@speedup(compile={...})`` checks them.

    Returns:
        For a module, an ``OptimizedModule`` as ``torch.compile`` returns (same parameters,
        ``train()``/``eval()`` and state dict), whose ``forward`` picks the compiled artefact
        and has ``.stats`` (:class:`~speedflags._compile.lever_guard.LeverGuardStats`); a
        copy of it (``copy.deepcopy``, pickle) is compiled but not guarded. For a function,
        a function (``functools.wraps``) with ``.stats``. With ``disable=True``, ``model``
        itself, as ``torch.compile`` returns it. Called while dynamo traces an
        enclosing compiled function, either runs the plain model, which dynamo inlines
        (the enclosing compile's guards then apply).

    Raises:
        InvalidTypeError: ``model`` is what ``torch.compile`` returned, or not callable; a
            bad option, as ``torch.compile``'s signature and ``@speedup`` check them
            (:class:`~speedflags.InvalidValueError` for an unknown option or backend).

    Scope: changes no lever and no flag, and so restores none; the compile settings it uses
    while a graph compiles (the cache key tag, the early backward compile) are thread-local
    where PyTorch makes them so, and put back after the compile.

    Example:
        >>> import torch, speedflags
        >>> import torch.nn.functional as F
        >>> attend = speedflags.guard_levers(F.scaled_dot_product_attention, backend="eager")
        >>> q = torch.randn(1, 1, 4, 8)
        >>> with speedflags.sdpa_backend("flash"):
        ...     flash = attend(q, q, q)
        >>> with speedflags.sdpa_backend("math"):
        ...     math = attend(q, q, q)   # not the graph traced under flash
        >>> attend.stats.states
        2
    """
    shown = _shown(model, options)
    if hasattr(model, "_torchdynamo_orig_callable") or _is_optimized_module(model):
        raise InvalidTypeError(
            f"{shown}: got what torch.compile returned; pass the model or function itself "
            "with torch.compile's options (guard_levers(model, mode=...)): guard_levers "
            "compiles it, as a compiled model cannot be keyed by the levers from outside"
        )
    if isinstance(model, type) or not callable(model):
        raise InvalidTypeError(
            f"{shown}: expected an nn.Module or a function to compile, got {type(model).__name__}"
        )
    checked = compile_options(dict(options), call="guard_levers", shown=shown) or {}
    if checked.get("disable"):
        return model  # as torch.compile(disable=True): the model itself, nothing compiled
    top = {k: v for k, v in checked.items() if k not in BACKEND_KEYS}
    if (checked.get("options") or {}).get("guard_filter_fn") is not None:
        top["options"] = {"guard_filter_fn": checked["options"]["guard_filter_fn"]}
    inner = inner_backend(checked)
    compile_fn: Any = torch.compile

    def compiled_for(key: LeverState | None) -> Any:
        return compile_fn(model, backend=LeverBackend(inner, key), **top)

    if isinstance(model, torch.nn.Module):
        return _guard_module(model, compiled_for)  # type: ignore[return-value]
    return _guard_function(model, compiled_for)  # type: ignore[return-value]


def _guard_module(
    model: torch.nn.Module, compiled_for: Callable[[LeverState | None], Any]
) -> torch.nn.Module:
    shell = compiled_for(None)
    own_forward = shell.forward  # the artefact of "recompile" mode

    def make(key: LeverState | None) -> Callable[..., Any]:
        return own_forward if key is None else compiled_for(key).forward  # type: ignore[no-any-return]

    shell.forward = _guarded(model, LeverGuard(make), like=model.forward)
    return shell  # type: ignore[no-any-return]


def _guard_function(
    func: Callable[..., Any], compiled_for: Callable[[LeverState | None], Any]
) -> Callable[..., Any]:
    return _guarded(func, LeverGuard(compiled_for), like=func)


def _guarded(
    plain: Callable[..., Any], guard: LeverGuard, like: Callable[..., Any]
) -> Callable[..., Any]:
    # ``plain`` called through the compiled version ``guard`` selects for the levers in force,
    # wrapped as ``like`` (the model's forward, or the function) with the guard's ``.stats``
    @functools.wraps(like)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if _tracing():  # inside an enclosing compile: dynamo inlines the plain callable
            return plain(*args, **kwargs)
        compiled = guard.select()
        return _call(compiled, plain, args, kwargs, guard)

    guarded.stats = guard.stats  # type: ignore[attr-defined]
    return guarded


def _call(
    compiled: Callable[..., Any] | None,
    plain: Callable[..., Any],
    args: Any,
    kwargs: Any,
    guard: LeverGuard,
) -> Any:
    # the compiled call (or the plain one); a compiled call that raised has the thread's
    # autocast put back if tracing left it entered (PyTorch 2.1: .autocast_left)
    try:
        if compiled is None:
            return plain(*args, **kwargs)
        autocast = autocast_left.held()
        try:
            return compiled(*args, **kwargs)
        except BaseException:
            autocast_left.put_back(autocast, f"guard_levers({short_repr(plain)})", None)
            raise
    finally:
        guard.ran()


def _is_optimized_module(model: object) -> bool:
    # torch.compile's module wrapper, without importing dynamo for a plain function
    return type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod")


def _shown(model: object, options: dict[str, Any]) -> str:
    parts = [short_repr(model)] + [f"{k}={short_repr(v)}" for k, v in options.items()]
    return f"guard_levers({', '.join(parts)})"
