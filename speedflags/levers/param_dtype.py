"""The ``param_dtype`` lever: a model computes with bf16 or fp16 casts of its parameters,
which stay its float32 parameters (FSDP2's ``param_dtype``, on one device).

Inside the block, the model's ``forward`` reads each floating parameter as a cast, made once
and reused while the parameter is unchanged (renewed by any optimizer step: fused ones too);
gradients reach the float32 parameters, so the optimizer steps them and updates far below
bf16's resolution are kept. Floating inputs are cast at the model's boundary and floating
outputs come back in the inputs' dtype. Norm layers keep float32 parameters and statistics
and take the bf16 activations where their kernels do, as autocast feeds them.
``state_dict()``, ``named_parameters()`` and every optimizer reference are the model's own
throughout. Mechanism and limits: :mod:`speedflags.levers._model_shadow`,
:mod:`speedflags.levers._model_casts` and ``docs/model_levers.md``.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
from torch import nn

from .._hardware import capabilities, cpu_kernels
from ._base import Effect
from ._model_lever import OFF, ModelLever
from .autocast import read_half_dtype
from .spec import MATMUL_OPS, declare

__all__ = [
    "ParamDtypeLever",
    "param_dtype_effect",
    "validate_param_dtype",
]

CHOICES = (
    "'bf16' (or 'bfloat16'), 'fp16' (or 'float16', 'half') in any case, torch.bfloat16, "
    "torch.float16 or False"
)


def validate_param_dtype(value: object) -> torch.dtype | None:
    """Normalise a ``param_dtype=`` argument: a dtype, or ``None`` for off (``False``).
    Strings are read as ``amp=`` reads them (any case, PyTorch's dtype names too).

    Example:
        >>> from speedflags.levers.param_dtype import validate_param_dtype as valid
        >>> valid("bf16"), valid("Float16"), valid(False)
        (torch.bfloat16, torch.float16, None)
    """
    dtype: torch.dtype | None = read_half_dtype(
        value, CHOICES, "a model computes in bf16 or fp16 here", "not a compute dtype"
    )
    return dtype


class ParamDtypeLever(ModelLever):
    """``param_dtype=torch.bfloat16`` (or ``float16``, or ``False``) on one model.

    Scope: model (every thread calling it). Restores each module's own class, and with it
    computing in the parameters' own dtype; the parameters themselves are never replaced.

    Example (the output comes back in the input's dtype; the weight stays float32):
        >>> import torch, warnings, speedflags
        >>> net = torch.nn.Linear(4, 4)
        >>> with warnings.catch_warnings():  # a CPU without bf16 instructions warns: emulated
        ...     warnings.simplefilter("ignore", speedflags.SlowPathWarning)
        ...     with speedflags.fast_math(model=net, param_dtype="bf16"):
        ...         net(torch.ones(1, 4)).dtype, net.weight.dtype
        (torch.float32, torch.float32)
    """

    name = "param_dtype"
    field = "param_dtype"

    validate = staticmethod(validate_param_dtype)

    def configured(self, model: nn.Module) -> Hashable:
        config = self.config(model)
        if config is None or config[0] is None:
            return OFF
        dtype: torch.dtype = config[0]
        return dtype

    def describe_value(self, value: Any) -> Any:
        return describe_param_dtype(value)

    def available(self, value: Any, device: torch.device) -> Effect:
        return param_dtype_effect(value, device)


def describe_param_dtype(value: Any) -> Any:
    """``"bfloat16"`` for ``torch.bfloat16``; ``False`` for off."""
    if value is None or value is OFF:
        return False
    return str(value).replace("torch.", "")


def param_dtype_effect(value: torch.dtype | None, device: torch.device) -> Effect:
    """Whether computing in ``value`` runs natively on ``device`` (as ``amp`` judges)."""
    if value is None:
        return Effect(True, "")
    caps = capabilities(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        return Effect(False, f"no effect on {caps.device}: {caps.bf16.reason}")
    answer = caps.bf16 if value == torch.bfloat16 else caps.fp16
    if answer:
        return Effect(True, "")
    name = "bf16" if value == torch.bfloat16 else "fp16"
    why = f"{name} is not native on {caps.device}: {answer.reason}"
    if answer.missing_kernel:
        return Effect(False, why, unsupported=True)
    if device.type == "cpu":
        # no instructions, and no kernel either (fp16 on PyTorch 2.1): refused, not emulated
        missing = cpu_kernels(value).missing_one(("matmul", "linear backward"))
        if missing is not None:
            operation, message = missing
            return Effect(
                False,
                f"PyTorch {torch.__version__} has no {name} {operation} on cpu ({message})",
                unsupported=True,
            )
    return Effect(False, why, slow=device.type == "cpu")  # emulated: slower than fp32


DECLARED = (
    declare(
        ParamDtypeLever.of,
        name="param_dtype",
        scope="model",
        validate=validate_param_dtype,
        effect_of=param_dtype_effect,
        describe=describe_param_dtype,
        order=80,
        values=f"{CHOICES} (with model=)",
        summary=(
            "the model computes with bf16/fp16 casts of its float32 parameters, made once per "
            "parameter version or optimizer step (norm layers keep float32 parameters); the "
            "parameters stay the parameters"
        ),
        accuracy=(
            "as amp: bf16 ~3e-3, fp16 ~4e-4 relative error; float32 master weights keep small "
            "updates; costs a cast copy of each parameter (2 bytes each)"
        ),
        baseline=False,
        candidates=(torch.bfloat16, torch.float16),
        ops=MATMUL_OPS,
        # no dynamo_misses: dynamo guards a module's class (the shadow classes)
    ),
)
