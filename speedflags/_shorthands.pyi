# The shorthands' typed face: what mypy, pyright and editors read. The functions are made
# from the levers' declarations (_shorthands.py); tests/test_shorthands.py keeps this file
# equal to them, as LeverArgs is kept equal to the levers.
import enum
from collections.abc import Callable

from ._fast_math import FastMath
from ._hardware import DeviceLike
from .levers.arguments import AmpArg, DeterministicArg, MatmulPrecisionArg, SdpaName
from .levers.spec import LeverSpec

__all__: list[str]
MADE: dict[str, Callable[..., FastMath]]

def make_shorthand(spec: LeverSpec) -> Callable[..., FastMath]: ...
def tf32(
    enabled: bool = True,
    *,
    device: DeviceLike = None,
    strict: bool = False,
    label: str | None = None,
) -> FastMath: ...
def matmul_precision(
    value: MatmulPrecisionArg,
    *,
    device: DeviceLike = None,
    strict: bool = False,
    label: str | None = None,
) -> FastMath: ...
def cudnn_benchmark(
    enabled: bool = True,
    *,
    device: DeviceLike = None,
    strict: bool = False,
    label: str | None = None,
) -> FastMath: ...
def sdpa_backend(
    *backends: SdpaName | enum.Enum,
    device: DeviceLike = None,
    strict: bool = False,
    label: str | None = None,
) -> FastMath: ...
def deterministic(
    mode: DeterministicArg = True,
    *,
    device: DeviceLike = None,
    strict: bool = False,
    label: str | None = None,
) -> FastMath: ...
def reduced_precision_reduction(
    enabled: bool = True,
    *,
    device: DeviceLike = None,
    strict: bool = False,
    label: str | None = None,
) -> FastMath: ...
def autocast(
    dtype: AmpArg, device: DeviceLike = None, *, strict: bool = False, label: str | None = None
) -> FastMath: ...
