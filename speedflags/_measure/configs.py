"""The lever configurations a benchmark compares, each applied through speedflags itself.

Every measurement runs inside a baseline frame, ``fast_math(**baseline_levers())``
(``tf32=False, matmul_precision="highest", cudnn_benchmark=False, deterministic=False,
reduced_precision_reduction=False, amp=False``), so whatever the process had
set before cannot leak in; a configuration opens its own ``fast_math`` frame inside it. Both
frames restore everything on exit, Ctrl-C included.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.amp.autocast_mode import autocast  # 2.1's stubs: not from torch or torch.amp

from .._fast_math import fast_math
from .._hardware import capabilities, cpu_kernels
from ..levers import Effect
from ..levers.lever_sets import baseline_levers
from ..levers.registry import lever_spec
from .accuracy import coarsest
from .route import effect_here

__all__ = ["BASELINE_LEVERS", "Config"]

# Every lever with an "off" value, at that value: plain fp32 eager.
BASELINE_LEVERS: Mapping[str, Any] = baseline_levers()
# How a configuration's step is compiled: not at all, @speedup(compile=True), or with CUDA graphs
STEPS = ("", "compile", "cuda_graphs")

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class Config:
    """One configuration: ``fast_math`` arguments on top of the baseline, or an input dtype.

    Attributes:
        name: the label in tables and result files (``"amp-bf16"``).
        levers: ``fast_math`` arguments applied on top of :data:`BASELINE_LEVERS`; the model
            levers (``param_dtype``, ``memory_format``, ``fp8``) on the problem's model.
        dtype: inputs (and weights) converted to this dtype before timing, with no lever:
            the "pure bf16" ceiling that autocast should approach.
        baseline: the configuration every other one in its workload is compared with.
        per_call: the levers entered around each timed call rather than held around the
            loop, as a user's code enters them: ``amp`` as ``torch.autocast`` around each
            call (its weight casts made again each time), any other as one ``fast_math``
            frame per call (as ``@speedup`` does).
        step: ``"compile"`` or ``"cuda_graphs"``: the timed call is a step decorated with
            ``@speedup(compile=True, ...)`` or ``@speedup(cuda_graphs=True, ...)``, every lever
            of the configuration (and the baseline's, so that nothing recommended creeps
            in) applied by it around each call; ``""``: not compiled.

    Example:
        >>> import torch
        >>> from speedflags._measure.configs import Config
        >>> amp = Config("amp-bf16", {"amp": "bf16"})
        >>> amp.describe(), amp.precision
        ("fast_math(amp='bf16')", 'bf16')
        >>> with amp.frames(torch.device("cpu")):
        ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype  # autocast on
        torch.bfloat16
    """

    name: str
    levers: Mapping[str, Any] = field(default_factory=dict)
    dtype: torch.dtype | None = None
    baseline: bool = False
    per_call: tuple[str, ...] = ()
    step: str = ""

    def __post_init__(self) -> None:
        if self.step not in STEPS:
            raise ValueError(f"Config.step={self.step!r}: valid: {', '.join(map(repr, STEPS))}")

    def _held(self) -> dict[str, Any]:
        # a compiled step applies all its levers itself, per call
        if self.step:
            return {}
        return {k: v for k, v in self.levers.items() if k not in self.per_call}

    def describe(self) -> str:
        """What this configuration is, in the words a user would write."""
        if self.step:
            args = ", ".join([f"{self.step}=True", *(f"{k}={v!r}" for k, v in self.levers.items())])
            return f"@speedup({args}) around each call"
        parts = []
        held = self._held()
        if held:
            args = ", ".join(f"{k}={v!r}" for k, v in held.items())
            parts.append(f"fast_math({args})")
        if "amp" in self.per_call:
            parts.append(f"torch.autocast({self.levers['amp']!r}) around each call")
        framed = {k: v for k, v in self.levers.items() if k in self.per_call and k != "amp"}
        if framed:
            args = ", ".join(f"{k}={v!r}" for k, v in framed.items())
            parts.append(f"fast_math({args}) around each call")
        if self.dtype is not None:
            parts.append(f"{_DTYPE_NAMES.get(self.dtype, self.dtype)} inputs and weights")
        if not parts:
            parts.append("fp32, TF32 off, matmul precision 'highest'")
        return " + ".join(parts)

    @property
    def precision(self) -> str:
        """The coarsest arithmetic this configuration allows (sets the error tolerance)."""
        return self.arithmetic("cpu")

    def arithmetic(self, device_type: str) -> str:
        """The coarsest arithmetic it computes in on ``device_type``: as :attr:`precision`,
        except that ``matmul_precision="medium"`` is TF32 on CUDA (cuBLAS; an H200 with
        PyTorch 2.11 measured TF32's error and speed), bf16 on an AMX CPU.

        Example:
            >>> from speedflags._measure.configs import Config
            >>> medium = Config("precision-medium", {"matmul_precision": "medium"})
            >>> medium.arithmetic("cuda"), medium.precision
            ('tf32', 'bf16')
        """
        found = ["fp32"]
        amp = self.levers.get("amp")
        if amp not in (None, False):
            found.append("fp16" if lever_spec("amp").validate(amp) == torch.float16 else "bf16")
        if self.dtype is not None:
            found.append(_DTYPE_NAMES.get(self.dtype, "bf16"))
        param = self.levers.get("param_dtype")
        if param not in (None, False):
            found.append(_DTYPE_NAMES.get(lever_spec("param_dtype").validate(param), "bf16"))
        if self.levers.get("fp8") not in (None, False):
            found.append("fp8")
        if self.levers.get("matmul_precision") == "medium":
            found.append("tf32" if device_type == "cuda" else "bf16")
        if self.levers.get("tf32") or self.levers.get("matmul_precision") == "high":
            found.append("tf32")
        return coarsest(*found)

    @contextlib.contextmanager
    def frames(self, device: torch.device, model: torch.nn.Module | None = None) -> Iterator[None]:
        """Enter the baseline frame, then this configuration's held levers' frame (the model
        levers on ``model``), restored on exit; the ``per_call`` levers are :meth:`around`
        each call."""
        label = f"speedflags bench {self.name}"
        held = self._held()
        with fast_math(**BASELINE_LEVERS, device=str(device), label=f"{label} (baseline)"):
            if held:
                with fast_math(**held, device=str(device), label=label, model=_for(held, model)):
                    yield
            else:
                yield

    def around(
        self, call: Callable[..., Any], device: torch.device, model: torch.nn.Module | None = None
    ) -> Callable[..., Any]:
        """``call``, entering the ``per_call`` levers around each call (itself when none); a
        compiled configuration's step, decorated with ``@speedup``."""
        if self.step:
            from .._speedup import speedup  # local: the compile machinery loads with it

            levers: dict[str, Any] = {**BASELINE_LEVERS, **self.levers}
            graphs = self.step == "cuda_graphs"
            decorate = speedup(
                compile=not graphs, cuda_graphs=graphs, device=str(device),
                model=_for(levers, model), **levers,
            )  # fmt: skip
            compiled: Callable[..., Any] = decorate(call)
            return compiled
        if not self.per_call:
            return call
        framed = {k: v for k, v in self.levers.items() if k in self.per_call and k != "amp"}
        spec = None
        if framed:
            label = f"speedflags bench {self.name} (per call)"
            spec = fast_math(**framed, device=str(device), label=label, model=_for(framed, model))
        amp = lever_spec("amp").validate(self.levers["amp"]) if "amp" in self.per_call else None

        def each(*args: Any) -> Any:
            with contextlib.ExitStack() as stack:
                if spec is not None:
                    stack.enter_context(spec)
                if amp is not None:
                    stack.enter_context(autocast(device.type, dtype=amp))
                return call(*args)

        return each

    def unavailable(self, device: torch.device) -> str | None:
        """Why this configuration cannot be measured on ``device``, or None if it can.

        Skipped: a lever that would make things slower (fp16 autocast on a CPU) or that
        this PyTorch refuses (fp16 CPU autocast on PyTorch 2.1), a
        configuration none of whose levers has an effect here (TF32 without an Ampere+ GPU),
        and input dtypes the device has no native arithmetic for, or that the installed
        PyTorch does not run there (float16 matmuls on a CPU with PyTorch 2.1), as
        :func:`speedflags.capabilities` answers.
        """
        if self.baseline:
            return None
        caps = capabilities(device)
        if self.dtype is not None:
            cap = caps.bf16 if self.dtype == torch.bfloat16 else caps.fp16
            name = _DTYPE_NAMES.get(self.dtype, self.dtype)
            if cap.missing_kernel:  # the instructions are there; PyTorch's kernels are not
                return f"{name} does not run here: {cap.reason}"
            if not cap:
                return f"no native {name}: {cap.reason}"
        if self.step == "cuda_graphs":
            from .._compile.graph_policy import unavailable  # local: compile/ is not loaded yet

            why = unavailable(device)
            if why is not None:
                return why
        effects = [self._effect(name, value, device) for name, value in self.levers.items()]
        blocked = [e.reason for e in effects if e.slow or e.unsupported]
        if blocked:
            return "; ".join(blocked)
        if effects and not any(e.effective for e in effects):
            return "; ".join(e.reason for e in effects)
        return None

    def emulated(self, device: torch.device) -> bool:
        """Whether what keeps this configuration from being measured is emulation alone: a
        slow lever (bf16 or fp16 autocast on a CPU without the instructions) or an input
        dtype the device has no native arithmetic for, and nothing this PyTorch refuses.
        ``bench`` measures such a configuration once, at a small size, marked as emulated.

        Example:
            >>> import torch
            >>> from speedflags import capabilities
            >>> from speedflags._measure.configs import Config
            >>> amp = Config("amp-bf16", {"amp": "bf16"})
            >>> amp.emulated(torch.device("cpu")) == (not capabilities("cpu").bf16)
            True
        """
        if self.baseline or self.unavailable(device) is None:
            return False
        if self.step == "cuda_graphs":
            from .._compile.graph_policy import unavailable

            if unavailable(device) is not None:
                return False  # no effect here: refused, not slow
        dtype_emulated = False
        if self.dtype is not None:
            caps = capabilities(device)
            cap = caps.bf16 if self.dtype == torch.bfloat16 else caps.fp16
            if cap.missing_kernel:  # refused by this PyTorch, not emulated
                return False
            dtype_emulated = not cap and device.type == "cpu"
            if dtype_emulated and not cpu_kernels(self.dtype).runs:
                return False  # no instructions, and no kernel either (fp16 on PyTorch 2.1)
        effects = [self._effect(name, value, device) for name, value in self.levers.items()]
        if any(e.unsupported for e in effects):
            return False
        return dtype_emulated or any(e.slow for e in effects)

    def identical_to_baseline(self) -> bool:
        """Whether this configuration sets nothing the baseline does not already set: timing
        it against the baseline would compare a thing with itself.

        Example:
            >>> from speedflags._measure.configs import Config
            >>> Config("off", {"tf32": False, "amp": False}).identical_to_baseline()
            True
            >>> Config("tf32", {"tf32": True}).identical_to_baseline()
            False
        """
        if self.baseline or self.dtype is not None or self.step:
            return False
        return all(
            name in BASELINE_LEVERS
            and lever_spec(name).validate(value) == lever_spec(name).validate(BASELINE_LEVERS[name])
            for name, value in self.levers.items()
        )

    def notes(self, device: torch.device) -> tuple[str, ...]:
        """The levers of this configuration that have no effect on ``device``, and why (an
        emulated one is in effect, only slower: it is no such note)."""
        return tuple(
            f"{name}: {effect.reason}"
            for name, value in self.levers.items()
            if not (effect := self._effect(name, value, device)).effective and not effect.slow
        )

    def in_effect(self, device: torch.device) -> tuple[object, ...]:
        """What this configuration does on ``device``: its levers in effect there (emulated
        ones included) with their values, which of them are entered around each call, and
        its input dtype. Two configurations that answer the same do the same work there.

        Example:
            >>> import torch
            >>> from speedflags._measure.configs import Config
            >>> both = Config("tf32+amp-bf16", {"tf32": True, "amp": "bf16"}, per_call=("amp",))
            >>> amp = Config("amp-bf16", {"amp": "bf16"}, per_call=("amp",))
            >>> both.in_effect(torch.device("cpu")) == amp.in_effect(torch.device("cpu"))
            True
        """
        kept = []
        for name, value in self.levers.items():
            effect = self._effect(name, value, device)
            if effect.effective or effect.slow:
                kept.append((name, repr(lever_spec(name).validate(value))))
        names = {name for name, _ in kept}
        per_call = tuple(sorted(name for name in self.per_call if name in names))
        return (tuple(sorted(kept)), per_call, self.dtype)

    @property
    def model_levers(self) -> bool:
        """Whether it sets a model lever (its problem must give a model)."""
        return any(lever_spec(name).per_model for name in self.levers)

    @staticmethod
    def _effect(name: str, value: Any, device: torch.device) -> Effect:
        spec = lever_spec(name, "Config")
        return effect_here(name, spec.validate(value), device)


def _for(levers: Mapping[str, Any], model: torch.nn.Module | None) -> torch.nn.Module | None:
    # the model, for a frame that sets a model lever (fast_math refuses a model without one)
    return model if any(lever_spec(name).per_model for name in levers) else None
