"""Exceptions and warnings raised by speedflags.

Every exception subclasses :class:`SpeedflagsError` *and* the builtin a caller would
naturally catch (``ValueError`` for a bad value, ``RuntimeError`` for a state problem), so
``except ValueError`` keeps working for code that does not know about speedflags.

Example:
    >>> import speedflags
    >>> try:
    ...     speedflags.fast_math(amp="bf17")
    ... except ValueError as exc:
    ...     print(type(exc).__name__)
    InvalidValueError
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._short_repr import set_module

__all__ = [
    "AbandonedFrameWarning",
    "CompileFallbackWarning",
    "CudaGraphsError",
    "CudaGraphsWarning",
    "DeviceUnavailableWarning",
    "DriftWarning",
    "InstalledLeverWarning",
    "InvalidTypeError",
    "InvalidValueError",
    "LedgerOrderError",
    "LedgerReentryError",
    "LeverConflictWarning",
    "LeverFileNotFoundError",
    "LeverInGraphError",
    "LeverUnavailableError",
    "MixedTF32APIError",
    "RankMismatchError",
    "RestoreError",
    "SlowPathWarning",
    "SpeedflagsError",
    "SpeedflagsWarning",
    "StateMismatchError",
]


@set_module("speedflags")
class SpeedflagsError(Exception):
    """Base class of every error speedflags raises.

    Example:
        >>> import speedflags
        >>> issubclass(speedflags.MixedTF32APIError, speedflags.SpeedflagsError)
        True
    """


@set_module("speedflags")
class InvalidValueError(SpeedflagsError, ValueError):
    """An argument has the right type but a value outside its valid choices.

    Raised at construction (``fast_math(amp="bf17")``), before any torch state is touched.
    The message names the argument, shows the value with ``repr`` and lists the valid ones.

    Example:
        >>> import speedflags
        >>> try:
        ...     speedflags.fast_math(amp="bf17")
        ... except speedflags.InvalidValueError as exc:
        ...     print(str(exc).split(":")[0])
        fast_math(amp='bf17')
    """


@set_module("speedflags")
class InvalidTypeError(SpeedflagsError, TypeError):
    """An argument has the wrong type (``fast_math(tf32="yes")``).

    Raised at construction, before any torch state is touched.

    Example:
        >>> import speedflags
        >>> try:
        ...     speedflags.fast_math(tf32="yes")
        ... except TypeError as exc:  # also a speedflags.InvalidTypeError
        ...     print(type(exc).__name__)
        InvalidTypeError
    """


@set_module("speedflags")
class MixedTF32APIError(SpeedflagsError, RuntimeError):
    """PyTorch's legacy and new TF32 APIs disagree, so a legacy getter would raise.

    speedflags refuses to change TF32 or matmul precision from such a state, because
    PyTorch's own compile, autotune and benchmark paths read the legacy getters and crash.
    The message names the settings that disagree; :func:`speedflags.heal_tf32` is the fix.

    Example:
        >>> import speedflags
        >>> try:
        ...     with speedflags.fast_math(tf32=True):
        ...         pass
        ... except speedflags.MixedTF32APIError:
        ...     _ = speedflags.heal_tf32()  # make the two APIs agree, then enter again
    """


@set_module("speedflags")
class LeverUnavailableError(SpeedflagsError, RuntimeError):
    """With ``strict=True``: a lever would have no effect on this device (or no native speed-up).

    Raised on entry, before any lever is set; without ``strict`` such a lever is applied and
    the history records why it has no effect.

    Example:
        >>> import speedflags
        >>> try:
        ...     with speedflags.fast_math(tf32=True, device="cpu", strict=True):
        ...         pass
        ... except speedflags.LeverUnavailableError as exc:
        ...     print("no effect on cpu" in str(exc))
        True
    """


@set_module("speedflags")
class CudaGraphsError(SpeedflagsError, RuntimeError):
    """``@speedup(cuda_graphs=True)``: a step that a CUDA graph would run wrongly, refused.

    Raised before the call runs anything (nothing is changed, the levers are restored),
    with the fix in the message: an optimizer whose learning rate is a Python number (a
    scheduler's new value would make torch.compile compile again, or be frozen into a
    recorded graph), or a tensor on another device than its parameters. See
    ``docs/cuda_graphs.md``.

    Example:
        >>> import torch, speedflags
        >>> issubclass(speedflags.CudaGraphsError, RuntimeError)
        True
    """


@set_module("speedflags")
class LeverFileNotFoundError(SpeedflagsError, FileNotFoundError):
    """A lever or bench file that does not exist: the message names the call and the file.

    Also a ``FileNotFoundError`` (``filename`` is the path as given, ``errno`` is ``ENOENT``),
    so ``except FileNotFoundError`` and ``except OSError`` keep working.

    Example:
        >>> import speedflags
        >>> try:
        ...     speedflags.load_levers("no-such-levers.json")
        ... except FileNotFoundError as exc:
        ...     print(type(exc).__name__, exc.filename)
        LeverFileNotFoundError no-such-levers.json
    """

    def __str__(self) -> str:  # the message alone, not OSError's "[Errno 2] ...: 'path'"
        return str(self.strerror if self.strerror is not None else super().__str__())


@set_module("speedflags")
class LeverInGraphError(SpeedflagsError, RuntimeError):
    """A process-wide lever is set inside a function compiled with ``fullgraph=True``.

    A graph cannot set ``tf32``, ``matmul_precision``, ``cudnn_benchmark``, ``sdpa``,
    ``deterministic`` or ``reduced_precision_reduction``: dynamo drops the write (or keeps it
    for the first call only) and does not guard it. Without ``fullgraph=True`` such a block
    runs eagerly, a graph break around it, with the levers in force; with it, this error is
    raised when the function is compiled, naming the levers and where. The fix: set them
    outside the compiled function, or use ``@speedup(compile=...)``. An ``amp``-only block
    needs neither: it is traced into the graph as ``torch.autocast``. Also raised when a model
    under ``param_dtype`` or ``memory_format`` is traced into one graph (``fullgraph=True``,
    ``torch.export``) by a dynamo that reads parameters without the module's class (PyTorch
    2.1 to 2.4 unless ``inline_inbuilt_nn_modules`` is on), where the model runs eagerly.

    Raised while dynamo compiles, it is also an instance of dynamo's ``Unsupported`` (the
    error dynamo lets through unchanged; ``docs/inside_compile.md``), and its message ends with the
    lines dynamo traced.

    Example:
        >>> import torch, speedflags
        >>> @torch.compile(fullgraph=True, backend="eager")
        ... def step(x):
        ...     with speedflags.fast_math(deterministic=True):
        ...         return x + 1
        >>> try:
        ...     step(torch.ones(2))
        ... except speedflags.LeverInGraphError as exc:
        ...     print("Set it outside the compiled function" in str(exc))
        True
    """


@set_module("speedflags")
class LedgerOrderError(SpeedflagsError, RuntimeError):
    """A frame was exited out of order, twice, or from a thread other than its own.

    An out-of-order exit still restores the frame's levers; the error comes once it has.

    Example:
        >>> import speedflags
        >>> from speedflags.levers import PROCESS_LEVERS
        >>> frame = speedflags.ledger().open([(PROCESS_LEVERS["cudnn_benchmark"], True)])
        >>> frame.close()
        >>> try:
        ...     frame.close()
        ... except speedflags.LedgerOrderError:
        ...     print("closed already")
        closed already
    """


@set_module("speedflags")
class LedgerReentryError(SpeedflagsError, RuntimeError):
    """A block was entered or exited while the same thread was inside speedflags' ledger.

    Only code that interrupts the thread can do that: a signal handler that runs while the
    thread is entering or exiting another block. The ledger refuses (it would otherwise
    wait forever on the lock its own thread holds) and changes nothing. Wrapping the handler
    with :func:`speedflags.signal_safe` makes it run just after the ledger returns, where
    its block nests normally.

    Example:
        >>> import speedflags
        >>> issubclass(speedflags.LedgerReentryError, RuntimeError)
        True
    """


@set_module("speedflags")
class StateMismatchError(SpeedflagsError, RuntimeError):
    """A write left PyTorch in a different state than the one speedflags asked for.

    This means PyTorch behaves differently from what speedflags was built against; the
    message shows the intended and the actual state. The frame being entered is rolled back.

    Example:
        >>> import speedflags
        >>> try:
        ...     with speedflags.fast_math(sdpa="math", device="cpu"):
        ...         pass
        ... except speedflags.StateMismatchError as exc:  # a PyTorch speedflags does not know
        ...     print(exc)
    """


@set_module("speedflags")
class RestoreError(SpeedflagsError, RuntimeError):
    """Restoring several levers of a frame failed (a single failure is raised as itself).

    Every lever was tried. The message names the levers that failed (with their errors and
    what they read now) and the levers that were restored. ``errors`` holds each underlying
    exception, in the order the levers were applied; the first is also ``__cause__``.

    Example:
        >>> import speedflags
        >>> error = speedflags.RestoreError("2 levers failed", [OSError("a"), OSError("b")])
        >>> [str(e) for e in error.errors], isinstance(error, RuntimeError)
        (['a', 'b'], True)
    """

    def __init__(self, message: str, errors: Sequence[BaseException] = ()) -> None:
        super().__init__(message)
        self.errors: tuple[BaseException, ...] = tuple(errors)


@set_module("speedflags")
class RankMismatchError(SpeedflagsError, RuntimeError):
    """Ranks of a ``torch.distributed`` job run with different flags (see ``check_ranks``).

    Every rank raises it, with the same message: each lever that differs and the value on
    each rank. One rank with TF32 on and another with it off compute different numbers, and
    data-parallel replicas then drift apart without any error of their own.

    Attributes:
        levers: the names of the levers (snapshot keys) that differ, in snapshot order.
        differences: for each differing getter (``"tf32.torch.backends.cuda.matmul.allow_tf32"``),
            its value on each rank, indexed by rank in the group.

    Example:
        >>> import speedflags
        >>> differences = {"tf32.x": (True, False)}  # the getter's value on ranks 0 and 1
        >>> error = speedflags.RankMismatchError("ranks differ", ["tf32"], differences)
        >>> error.levers, error.differences["tf32.x"][1]
        (('tf32',), False)
    """

    def __init__(
        self,
        message: str,
        levers: Sequence[str] = (),
        differences: dict[str, tuple[Any, ...]] | None = None,
    ) -> None:
        super().__init__(message)
        self.levers: tuple[str, ...] = tuple(levers)
        self.differences: dict[str, tuple[Any, ...]] = dict(differences or {})


@set_module("speedflags")
class SpeedflagsWarning(UserWarning):
    """Base class of the warnings speedflags emits (each cause is reported once).

    Example:
        >>> import warnings, speedflags
        >>> with warnings.catch_warnings():  # e.g. in a test suite: every one is an error
        ...     warnings.simplefilter("error", speedflags.SpeedflagsWarning)
    """


@set_module("speedflags")
class DriftWarning(SpeedflagsWarning):
    """Code inside a block changed a lever the block had set; the exit restores it anyway.

    Example:
        >>> import torch, warnings, speedflags
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     with speedflags.fast_math(cudnn_benchmark=True, label="drift demo"):
        ...         torch.backends.cudnn.benchmark = False  # someone else's write
        >>> [w.category.__name__ for w in caught if "drift demo" in str(w.message)]
        ['DriftWarning']
        >>> torch.backends.cudnn.benchmark  # restored to what the block found
        False
    """


@set_module("speedflags")
class AbandonedFrameWarning(SpeedflagsWarning):
    """A block was left open by a thread that ended (or does not exist after a fork).

    No thread can exit it any more, so the ledger restores its process-wide levers at the
    next boundary (any block entered or exited, in any thread) and says so, naming the
    block, where it was entered and its thread. Its thread-local levers (autocast) ended
    with the thread.

    Example:
        >>> import speedflags
        >>> issubclass(speedflags.AbandonedFrameWarning, speedflags.SpeedflagsWarning)
        True
    """


@set_module("speedflags")
class LeverConflictWarning(SpeedflagsWarning):
    """A block changed a shared flag that another thread's or task's open block had set.

    PyTorch's TF32, matmul precision, cuDNN benchmark and SDPA flags are process-wide (and
    autocast is per thread, so shared by the asyncio tasks of one thread): while both
    blocks are open, the earlier one runs with the later one's value. The message names the
    flag, both blocks (label and ``file:line``) and both threads (and tasks). Each block
    still restores what it found; see ``docs/threading.md``.

    Example:
        >>> import speedflags
        >>> issubclass(speedflags.LeverConflictWarning, speedflags.SpeedflagsWarning)
        True
    """


@set_module("speedflags")
class SlowPathWarning(SpeedflagsWarning):
    """A requested lever makes this device slower than it is without it: bf16 or fp16
    autocast on a CPU without the instructions for the dtype, where PyTorch emulates it.

    Once per process, lever value and device, with what it costs; ``strict=True`` refuses
    such a lever instead, and ``amp="auto"`` never picks an emulated dtype.

    Example:
        >>> import warnings, speedflags
        >>> with warnings.catch_warnings():  # a deliberate choice: no need to say it each time
        ...     warnings.simplefilter("ignore", speedflags.SlowPathWarning)
        ...     with speedflags.fast_math(amp="bf16", device="cpu"):
        ...         pass
    """


@set_module("speedflags")
class DeviceUnavailableWarning(SpeedflagsWarning):
    """A block targets a device this PyTorch cannot use (``device="cuda"`` without CUDA).

    Its levers change nothing there: autocast for the device stays off in effect (as
    ``torch.autocast("cuda")`` warns and disables itself where CUDA is not available), and
    the process-wide flags it sets are read by no kernel. The block is still entered and
    restored, and its records say why; ``strict=True`` refuses it instead. Once per process,
    device and lever.

    Example:
        >>> import warnings, speedflags
        >>> issubclass(speedflags.DeviceUnavailableWarning, speedflags.SpeedflagsWarning)
        True
    """


@set_module("speedflags")
class CompileFallbackWarning(SpeedflagsWarning):
    """``@speedup(compile=...)``: torch.compile failed, so the function runs eagerly from now on.

    Emitted once per decorated function, with the reason; the call that failed still
    completes (eagerly) and later calls do not retry compiling. The event is also logged
    through the ``speedflags`` logger, recorded in the ledger's history and shown by the
    function's ``.stats``.

    Example:
        >>> import warnings, speedflags
        >>> with warnings.catch_warnings():  # in CI: a step that stops compiling fails loudly
        ...     warnings.simplefilter("error", speedflags.CompileFallbackWarning)
    """


@set_module("speedflags")
class CudaGraphsWarning(SpeedflagsWarning):
    """``@speedup(cuda_graphs=True)``: part of a step runs without CUDA graphs, and why.

    Emitted once per step and cause: the step met more distinct input shapes than it
    records graphs for (later shapes run eagerly; the warning names the shapes seen), or
    inductor declined to record a graph ("skipping cudagraphs due to ..."). Each event is
    also in the step's ``.stats.cuda_graphs`` and the ledger's history.

    Example:
        >>> import speedflags
        >>> issubclass(speedflags.CudaGraphsWarning, speedflags.SpeedflagsWarning)
        True
    """


@set_module("speedflags")
class InstalledLeverWarning(SpeedflagsWarning):
    """An installed package declares a lever (entry-point group ``speedflags.levers``) that
    cannot be loaded: its module fails to import, the entry names something that is not a
    lever made with ``speedflags.lever``, or its name is taken. The lever is left out, the
    others work; once per entry point. A block that asks for it by name is refused with the
    same reason.

    Example:
        >>> import speedflags
        >>> issubclass(speedflags.InstalledLeverWarning, speedflags.SpeedflagsWarning)
        True
    """
