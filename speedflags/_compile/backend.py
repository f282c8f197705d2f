"""The backend ``@speedup`` hands to torch.compile: the user's, with a way out per graph."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

__all__ = ["GuardedBackend", "early_backward_lowering", "inner_backend"]


def early_backward_lowering() -> AbstractContextManager[Any]:
    """Compile a backward graph together with its forward, where the guarded backend sees it.

    AOT autograd otherwise compiles it lazily, inside ``loss.backward()``, after the
    forward's side effects. Patched thread-locally, for as long as the context is open.
    """
    config = getattr(getattr(torch, "_functorch", None), "config", None)
    if config is None or not hasattr(config, "force_non_lazy_backward_lowering"):
        return contextlib.nullcontext()  # pragma: no cover - PyTorch without the option
    return config.patch(force_non_lazy_backward_lowering=True)  # type: ignore[no-any-return]


class GuardedBackend:
    """The backend torch.compile calls for every graph: the user's, with a way out.

    A graph whose compile raises is reported to ``on_failure`` and runs by its own
    ``GraphModule.forward`` (eagerly), so the call goes on. ``signals`` (dynamo's control
    flow: re-trace, skip a frame) pass through.
    """

    def __init__(
        self,
        inner: Callable[..., Any],
        on_failure: Callable[[BaseException], None],
        signals: tuple[type[BaseException], ...],
    ) -> None:
        self._inner = inner
        self._on_failure = on_failure
        self._signals = signals
        self.compiler_name = f"speedflags-guarded-{getattr(inner, 'compiler_name', 'backend')}"

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        try:
            with early_backward_lowering():
                return self._inner(gm, example_inputs)  # type: ignore[no-any-return]
        except self._signals:
            raise  # dynamo's own control flow (restart the analysis, skip the frame)
        except Exception as exc:
            self._on_failure(exc)
            return gm.forward  # this graph runs eagerly; the rest of the call goes on

    def __deepcopy__(self, memo: dict[int, Any]) -> GuardedBackend:
        # One backend per compiled function, holding its compile state (locks included): a
        # copy would be another backend. Lightning, once imported, wraps torch.compile and
        # deep-copies the keyword arguments of every module it compiles to record them
        # (lightning/fabric/wrappers.py); that copy must not fail the compile.
        return self

    def __eq__(self, other: object) -> bool:
        # As torch.compile's own backend wrappers: equal when they compile alike. PyTorch 2.1
        # warns "changing options to `torch.compile()`" whenever a compiled function's
        # backend differs from the one called before it (two steps compiled alike, say).
        if not isinstance(other, GuardedBackend):
            return NotImplemented
        return bool(self._inner == other._inner) and self._signals == other._signals

    __hash__ = None  # type: ignore[assignment]  # equal by value, and mutable: as torch's

    def reset(self) -> None:
        reset = getattr(self._inner, "reset", None)
        if reset is not None:
            reset()


def inner_backend(options: dict[str, Any]) -> Callable[..., Any]:
    """The backend torch.compile would build from these options (same classes, same args)."""
    backend = options.get("backend")
    if backend is None:
        import torch._dynamo.backends.registry as registry

        # feature detection: set/get_default_backend are recent; before them it was inductor
        get_default = getattr(registry, "get_default_backend", None)
        backend = get_default() if get_default is not None else "inductor"
    mode = options.get("mode")
    backend_options = options.get("options")
    if backend_options is not None:
        backend_options = {k: v for k, v in backend_options.items() if k != "guard_filter_fn"}
    if mode is None and backend_options is None:
        mode = "default"
    dynamic = options.get("dynamic")
    wrappers: Any = torch  # torch.compile's own (private, untyped) backend wrappers, 2.0+
    if backend == "inductor":
        return wrappers._TorchCompileInductorWrapper(mode, backend_options, dynamic)  # type: ignore[no-any-return]
    return wrappers._TorchCompileWrapper(backend, mode, backend_options, dynamic)  # type: ignore[no-any-return]
