"""The levers as typed keyword arguments: what a type checker and an editor see.

:class:`LeverArgs` has one key per lever of the registry, typed with the values that lever
accepts. ``fast_math``, ``FastMath``, ``@speedup`` and ``Schedule``'s entries take their
levers as ``**levers: Unpack[LeverArgs]`` (PEP 692), so mypy and pyright refuse
``fast_math(tf33=True)`` or ``amp="bf17"`` before the program runs, and an editor completes
the lever names. The registry's ``annotation`` of each lever is read from here, and
``tests/test_lever_arguments.py`` keeps the keys equal to the registry's lever names and
each type equal to what the lever's ``validate`` accepts, as numpy keeps ``errstate``'s
stub equal to its implementation.

``None`` (or leaving the keyword out) means "leave this lever unchanged".

Example:
    >>> from speedflags.levers.arguments import LeverArgs
    >>> list(LeverArgs.__annotations__)  # doctest: +NORMALIZE_WHITESPACE
    ['tf32', 'matmul_precision', 'cudnn_benchmark', 'sdpa', 'deterministic',
     'reduced_precision_reduction', 'amp', 'param_dtype', 'memory_format', 'fp8']
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, Literal, TypedDict, get_type_hints

import torch

__all__ = [
    "AmpArg",
    "DeterministicArg",
    "Fp8Arg",
    "LeverArgs",
    "MatmulPrecisionArg",
    "MemoryFormatArg",
    "ParamDtypeArg",
    "SdpaArg",
    "SdpaName",
    "lever_annotations",
]

MatmulPrecisionArg = Literal["highest", "high", "medium"]
SdpaName = Literal["flash", "efficient", "cudnn", "math"]
# torch.nn.attention.SDPBackend (2.2+) and torch.backends.cuda.SDPBackend (2.1) are enums
SdpaArg = SdpaName | enum.Enum | Sequence[SdpaName | enum.Enum]
DeterministicArg = bool | Literal["warn"]
# torch.bfloat16 or torch.float16 (a type checker cannot tell dtypes apart); False: off. At
# run time any case is read ("BF16"), and "half" too.
AmpArg = Literal["bf16", "fp16", "bfloat16", "float16", "auto", False] | torch.dtype
# as amp (without "auto"); False: the parameters' own dtype (given with model=)
ParamDtypeArg = Literal["bf16", "fp16", "bfloat16", "float16", False] | torch.dtype
# torch.channels_last; False: the weights' own layout (given with model=)
MemoryFormatArg = Literal["channels_last", False] | torch.memory_format
# True (torchao's default recipe, "tensorwise") or a torchao float8 recipe name (any case at
# run time); False: the model's own layers (given with model=)
Fp8Arg = bool | Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"]


class LeverArgs(TypedDict, total=False):
    """The lever keywords of ``fast_math``, ``@speedup`` and ``Schedule`` entries.

    Every key may be left out or given ``None``: the lever is then left unchanged.

    Example:
        >>> import speedflags
        >>> from speedflags.levers.arguments import LeverArgs
        >>> config: LeverArgs = {"matmul_precision": "high", "amp": "bf16"}
        >>> speedflags.fast_math(**config, device="cpu").levers
        {'matmul_precision': 'high', 'amp': 'bfloat16'}
    """

    tf32: bool | None
    matmul_precision: MatmulPrecisionArg | None
    cudnn_benchmark: bool | None
    sdpa: SdpaArg | None
    deterministic: DeterministicArg | None
    reduced_precision_reduction: bool | None
    amp: AmpArg | None
    param_dtype: ParamDtypeArg | None
    memory_format: MemoryFormatArg | None
    fp8: Fp8Arg | None


def lever_annotations() -> dict[str, Any]:
    """Each lever's keyword type, evaluated (for run-time signatures: ``help(fast_math)``).

    Example:
        >>> from speedflags.levers.arguments import lever_annotations
        >>> lever_annotations()["tf32"]
        bool | None
    """
    return get_type_hints(LeverArgs)
