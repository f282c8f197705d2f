"""The ``fp8`` lever: a model's large ``nn.Linear`` layers run their matmuls in FP8 (float8
e4m3, dynamically scaled) through torchao's float8 training, for the block only.

Inside the block each layer that takes part is computed by torchao's ``Float8Linear``, which
holds the layer's own float32 parameters: gradients arrive on them in float32, the optimizer
steps them, and ``state_dict()`` keys and tensors are the layer's own throughout. On exit
every layer is back in its place, the model's own object of its own class. Which layers take
part: those whose features are multiples of 16 (torchao's dimension rule) and at least 2048
(the size rule, :data:`speedflags.levers._fp8_swap.MIN_FEATURES`). Under ``torch.no_grad()``
or ``inference_mode`` each weight's float8 cast and scale are made once per parameter
version. Mechanism: :mod:`speedflags.levers._fp8_swap`; torchao itself is reached only
through :mod:`speedflags.levers._torchao`.

Where it runs: an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell),
with torchao installed (``pip install '.[fp8]'`` in a checkout; torchao 0.18 needs PyTorch 2.11
or newer). On a CPU it runs through torchao's emulation (float8 casts, a float32 matmul):
the same numbers, slower; ``SlowPathWarning`` once per process, and ``strict=True`` refuses
it. Without torchao, on an older PyTorch, or on a GPU below sm89 a block asking for it is
refused (``LeverUnavailableError``) before anything changes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._hardware import capabilities
from .._short_repr import type_name
from ..errors import InvalidTypeError, InvalidValueError
from ._base import Effect
from .spec import declare

__all__ = ["RECIPES", "fp8_effect", "validate_fp8"]

# torchao's float8 training recipes (Float8LinearRecipeName's values; the installed torchao's
# own list is checked when a block is entered): per-tensor scales (cuBLAS's tensorwise kernel,
# the fastest; True, torchao's default), per-row scales (more accurate), per-row with the
# weight gradient kept in high precision (the most accurate).
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
CHOICES = f"True, False or a torchao recipe name ({', '.join(map(repr, RECIPES))})"


def validate_fp8(value: object) -> str | None:
    """Normalise an ``fp8=`` argument: the recipe name (``True``: ``"tensorwise"``,
    torchao's default), or ``None`` for off (``False``). Recipe names in any case.

    Example:
        >>> from speedflags.levers.fp8 import validate_fp8
        >>> validate_fp8(True), validate_fp8("RowWise"), validate_fp8(False)
        ('tensorwise', 'rowwise', None)
    """
    if value is True:
        return RECIPES[0]
    if value is False:
        return None
    if isinstance(value, str):
        if value.lower() in RECIPES:
            return value.lower()
        raise InvalidValueError(f"not a float8 recipe torchao names; valid: {CHOICES}")
    if isinstance(value, torch.dtype):
        raise InvalidTypeError(
            f"expected {CHOICES}; a dtype is not a recipe (the recipe chooses float8 e4m3 or "
            "e5m2 per operand)"
        )
    raise InvalidTypeError(f"expected {CHOICES}, got {type_name(value)}")


def describe_fp8(value: Any) -> Any:
    """The recipe's name, or ``False`` for off."""
    return False if value is None else value


def fp8_effect(value: str | None, device: torch.device) -> Effect:
    """Whether ``fp8=value`` runs on ``device``: natively on a GPU of sm89 or newer,
    emulated (slow) on a CPU; refused without torchao (or with a PyTorch older than it
    needs) and on a GPU below sm89.

    Example:
        >>> import torch
        >>> from speedflags.levers.fp8 import fp8_effect
        >>> effect = fp8_effect("tensorwise", torch.device("cpu"))
        >>> effect.effective, effect.slow or effect.refused
        (False, True)
    """
    if value is None:
        return Effect(True, "")
    from . import _torchao  # imports no torchao: it reads the installed versions

    missing = _torchao.missing()
    if missing is not None:
        return Effect(False, missing, unsupported=True, refused=True)
    caps = capabilities(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        return Effect(False, f"no effect on {caps.device}: {caps.fp8.reason}")
    if device.type == "cuda":
        if caps.fp8:
            return Effect(True, "")
        return Effect(False, caps.fp8.reason, unsupported=True, refused=True)
    return Effect(
        False,
        "FP8 runs emulated on a CPU (torchao's emulation: float8 casts, a float32 matmul; "
        "FP8 tensor cores are on NVIDIA GPUs of sm89 and newer)",
        slow=True,
    )


def _lever(model: nn.Module) -> Any:
    # the lever object of ``model`` (its validation and effect are this module's functions,
    # given to the declaration); loaded when a block asks for fp8, not at import
    from ._fp8_swap import Fp8Lever

    return Fp8Lever.of(model)


DECLARED = (
    declare(
        _lever,
        name="fp8",
        scope="model",
        order=100,  # after param_dtype (80): its twins, made after, read the float32 weights
        values=f"{CHOICES} (with model=)",
        summary=(
            "the model's large nn.Linear layers compute in FP8 through torchao's float8 "
            "training (Float8Linear swapped in for the block, the layers put back on exit); "
            "the float32 parameters stay the parameters"
        ),
        accuracy=(
            "e4m3 keeps 3 mantissa bits: ~4e-2 relative error on a matmul (about 13x bf16's), "
            "more on gradients (tensorwise scales the output gradient in e5m2); costs the "
            "float8 copies of each weight and activation (1 byte each)"
        ),
        validate=validate_fp8,
        effect_of=fp8_effect,
        describe=describe_fp8,
        baseline=False,
        candidates=("tensorwise", "rowwise"),
        ops=("linear",),
        # no dynamo_misses: dynamo guards a module's identity (the twins in the slots)
    ),
)
