"""Custom ops for the compile tests, on every supported PyTorch (not a test module).

``torch.library.custom_op`` (PyTorch 2.4+) where torch has it. Before, the same op is
defined with ``torch.library.Library``: a CPU kernel, a Meta kernel (what fake tensors run
while dynamo traces) and, for a backward, an Autograd kernel around a
``torch.autograd.Function`` (what ``register_autograd`` sets up on 2.4), each run with
dynamo disabled, as ``custom_op`` runs them.

Every op here takes one tensor and returns a new one: ``(Tensor x) -> Tensor``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo

HAS_CUSTOM_OP = hasattr(torch.library, "custom_op")
NAMESPACE = "speedflags_test"
_LIBRARY: Any | None = None

Kernel = Callable[[torch.Tensor], torch.Tensor]


def custom_op(
    name: str,
    real: Kernel,
    fake: Kernel,
    backward: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
) -> Kernel:
    """``speedflags_test::name``: ``real`` on CPU tensors, ``fake`` while tracing."""
    if HAS_CUSTOM_OP:
        # An explicit schema: the test modules' annotations are strings (from __future__
        # import annotations), which PyTorch 2.4's schema inference cannot read.
        op: Any = torch.library.custom_op(
            f"{NAMESPACE}::{name}", mutates_args=(), schema="(Tensor x) -> Tensor"
        )(real)
        op.register_fake(fake)
        if backward is not None:
            op.register_autograd(backward)
        return op  # type: ignore[no-any-return]
    global _LIBRARY
    if _LIBRARY is None:
        _LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")
    # as custom_op does: dynamo must not trace into a kernel the dispatcher calls
    disable = torch._dynamo.disable
    _LIBRARY.define(f"{name}(Tensor x) -> Tensor")
    _LIBRARY.impl(name, disable(real), "CPU")
    _LIBRARY.impl(name, disable(fake), "Meta")
    packet = getattr(getattr(torch.ops, NAMESPACE), name)
    if backward is None:
        return packet  # type: ignore[no-any-return]
    run_backward = backward

    class WithBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            with torch._C._AutoDispatchBelowAutograd():
                return packet(x)  # type: ignore[no-any-return]

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return run_backward(ctx, grad)

    _LIBRARY.impl(name, disable(WithBackward.apply), "Autograd")
    return packet  # type: ignore[no-any-return]
