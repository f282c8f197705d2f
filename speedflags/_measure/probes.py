"""The probes: for one lever value, enter it through ``fast_math`` and measure what changed.

Every probe runs its lever on top of the baseline (every other lever off, as the bench and
``tune`` measure), inside ``fast_math`` frames that restore everything on exit, and returns an
:class:`Observation`: in effect or not, the figure in words, the numbers, and what the flags
read inside the frame (for :mod:`speedflags._measure.causes`).

=====================  =========================================================================
``baseline``           float32 matmul (and, on CUDA, conv) error against float64: fp32-level
``tf32``               the same errors at TF32 level (CUDA): cuBLAS and cuDNN used TF32
``matmul_precision``   CUDA: matmul error at TF32 level. CPU: ``"medium"`` routes the matmul to
                       oneDNN: bf16-level error (AMX), or a result that differs from MKL's
``cudnn_benchmark``    the first call of a new convolution shape launches the autotuner's trial
                       kernels, later calls one algorithm (profiler kernel counts, against a
                       control without benchmark)
``sdpa``               which SDPA operator ran: dispatched ATen operators on a CPU, the profiler's
                       operators and kernel names on CUDA
``amp``                a float32 matmul's output dtype and its error level (bf16 or fp16)
``reduced_precision_``  CUDA: a long fp16 and bf16 GEMM differ from their fp32-reduction results
``reduction``          (``probe_reductions.py``)
``param_dtype``        a Linear given as ``model=``: its matmul's operands arrive in the dtype,
                       its output in the input's dtype (dispatched ATen calls)
``memory_format``      a Conv2d given as ``model=``: its convolution's input and weight arrive in
                       channels_last (dispatched ATen calls)
``fp8``                a Linear(2048, 2048) in a model given as ``model=``: on CUDA, PyTorch's
                       scaled float8 matmul ran (``aten::_scaled_mm``) and launched its GEMM
                       kernel (the profiler); on a CPU, torchao's emulation cast its operands
                       to float8 e4m3 (dispatched ATen calls); either way an FP8-level error
=====================  =========================================================================
"""

from __future__ import annotations

import importlib
import itertools
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .._fast_math import fast_math
from .._status import tf32_status
from ..levers.lever_sets import baseline_levers, with_baseline
from .evidence import (
    FP32_MAX,
    Call,
    Observation,
    arithmetic,
    aten_calls,
    aten_ops,
    aten_outputs,
    cuda_trace,
    inputs,
    relative_error,
    short,
)
from .probe_reductions import reduced_precision_reduction

__all__ = ["PROBES", "Context", "Observation", "baseline"]

MATMUL_N = {"cpu": 256, "cuda": 1024}
SDPA_SHAPE = {"cpu": (2, 4, 128, 64), "cuda": (2, 8, 256, 64)}
SDPA_OPS = {
    "flash": "_scaled_dot_product_flash_attention",  # also ..._for_cpu
    "efficient": "_scaled_dot_product_efficient_attention",
    "cudnn": "_scaled_dot_product_cudnn_attention",
}
_shapes = itertools.count()  # a new convolution shape per autotuning probe (cuDNN caches per shape)


class Context:
    """One ``verify`` run's device and the baseline measurements the probes compare with."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.matmul_inputs = inputs([(self.n, self.n)] * 2, device)
        a, b = self.matmul_inputs
        self.matmul_reference = a.double() @ b.double()
        self.baseline: Observation | None = None
        self.baseline_result: torch.Tensor | None = None
        self.deterministic = False  # two baseline matmuls gave the same bits

    @property
    def n(self) -> int:
        return MATMUL_N.get(self.device.type, 256)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def frame(self, levers: dict[str, Any], what: str, model: Any = None) -> Any:
        """``levers`` on top of the baseline, as one ``fast_math`` frame (the model levers'
        on ``model``)."""
        return fast_math(
            **levers, device=str(self.device), label=f"speedflags verify {what}", model=model
        )

    def matmul(self) -> tuple[torch.Tensor, float]:
        a, b = self.matmul_inputs
        with torch.no_grad():
            out = a @ b
        _sync(self.device)
        return out, relative_error(out, self.matmul_reference)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _inside(ctx: Context) -> dict[str, Any]:
    """The switches a cause may hide in, read inside the frame (never raises)."""
    status = tf32_status()
    # typed Any: PyTorch 2.1's stubs lack mkldnn.enabled and the device-taking autocast getter
    mkldnn: Any = torch.backends.mkldnn
    generic: Any = torch
    return {
        "tf32_effective": dict(status.effective),
        "tf32_consistent": status.consistent,
        "tf32_conflicts": list(status.conflicts),
        "cudnn_enabled": bool(torch.backends.cudnn.enabled),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "mkldnn_enabled": bool(mkldnn.enabled),
        "autocast": bool(generic.is_autocast_enabled(ctx.device.type))
        if hasattr(torch, "get_autocast_dtype")
        else None,
    }


# --- convolutions (CUDA) --------------------------------------------------------------------------


def _conv_error(device: torch.device) -> float:
    x, w = inputs([(8, 64, 32, 32), (64, 64, 3, 3)], device)
    w = w * (64 * 9) ** -0.5
    with torch.no_grad():
        out = F.conv2d(x, w, padding=1)
    _sync(device)
    return relative_error(out, F.conv2d(x.double(), w.double(), padding=1))


# --- baseline and the TF32 family -----------------------------------------------------------------


def baseline(ctx: Context) -> Observation:
    """Every lever off: the float32 matmul (and conv on CUDA) must compute in fp32."""
    with ctx.frame(baseline_levers(), "baseline"):
        first, error = ctx.matmul()
        again, _ = ctx.matmul()
        conv = _conv_error(ctx.device) if ctx.cuda else None
        inside = _inside(ctx)
    ctx.baseline_result = first
    ctx.deterministic = bool(torch.equal(first, again))
    measured: dict[str, Any] = {"matmul_error": error, "deterministic": ctx.deterministic}
    figure = f"matmul error {error:.1e} ({arithmetic(error)})"
    in_effect = error < FP32_MAX
    if conv is not None:
        measured["conv_error"] = conv
        figure += f", conv error {conv:.1e} ({arithmetic(conv)})"
        in_effect = in_effect and conv < FP32_MAX
    obs = Observation(in_effect, figure, measured, inside)
    ctx.baseline = obs
    return obs


def _off(ctx: Context, key: str) -> str:
    value = (ctx.baseline.measured if ctx.baseline else {}).get(key)
    return f"; off: {value:.1e}" if isinstance(value, float) else ""


def tf32(ctx: Context, value: bool) -> Observation | None:
    """cuBLAS matmul and cuDNN conv errors at TF32 level (CUDA only; None elsewhere)."""
    if not ctx.cuda:
        return None
    with ctx.frame(with_baseline((("tf32", value),)), f"tf32={value!r}"):
        _, error = ctx.matmul()
        conv = _conv_error(ctx.device)
        inside = _inside(ctx)
    want = "tf32" if value else "fp32"
    figure = (
        f"matmul error {error:.1e} ({arithmetic(error)}{_off(ctx, 'matmul_error')}), "
        f"conv error {conv:.1e} ({arithmetic(conv)}{_off(ctx, 'conv_error')})"
    )
    measured = {
        "matmul_error": error,
        "conv_error": conv,
        "conv_in_effect": arithmetic(conv) == want,
    }
    return Observation(arithmetic(error) == want, figure, measured, inside)


def matmul_precision(ctx: Context, value: str) -> Observation | None:
    """CUDA: TF32-level matmul error for "high"/"medium". CPU: the oneDNN route of "medium"."""
    with ctx.frame(with_baseline((("matmul_precision", value),)), f"matmul_precision={value!r}"):
        out, error = ctx.matmul()
        inside = _inside(ctx)
    level = arithmetic(error)
    measured: dict[str, Any] = {"matmul_error": error, "arithmetic": level}
    if ctx.cuda:
        want = "fp32" if value == "highest" else "tf32"
        figure = f"matmul error {error:.1e} ({level}{_off(ctx, 'matmul_error')})"
        return Observation(level == want, figure, measured, inside)
    # CPU: "medium" moves the matmul from MKL to oneDNN (bf16 fpmath: bf16 arithmetic with
    # AMX, fp32 without); a different kernel gives different bits.
    same = ctx.baseline_result is not None and bool(torch.equal(out, ctx.baseline_result))
    measured["bit_identical_to_highest"] = same
    off = _off(ctx, "matmul_error")
    if level == "bf16":
        return Observation(
            True, f"matmul error {error:.1e} (bf16 arithmetic{off})", measured, inside
        )
    if not same and ctx.deterministic:
        figure = f"another kernel ran: the result differs from 'highest' (error {error:.1e}{off})"
        return Observation(value != "highest", figure, measured, inside)
    if same:
        figure = (
            f"the same kernel ran: the result is bit-identical to 'highest' (error {error:.1e})"
        )
        return Observation(value == "highest", figure, measured, inside)
    figure = f"matmul error {error:.1e} ({level}); the fp32 kernel is not deterministic here"
    return Observation(False, figure, measured, inside)


# --- cuDNN autotuning (CUDA) ----------------------------------------------------------------------


def _first_and_later(ctx: Context, benchmark: bool) -> tuple[int, int, int]:
    """(launches of the first call, distinct kernels of the first call, launches of the next)."""
    side = 24 + next(_shapes) % 97  # a shape cuDNN has not tuned yet in this process
    x, w = inputs([(4, 48, side, side), (48, 48, 3, 3)], ctx.device)

    def conv() -> torch.Tensor:
        with torch.no_grad():
            return F.conv2d(x, w, padding=1)

    levers = with_baseline((("cudnn_benchmark", benchmark),))
    with ctx.frame(levers, f"cudnn_benchmark={benchmark!r}"):
        _, first = cuda_trace(conv, ctx.device)
        _, later = cuda_trace(conv, ctx.device)
    return len(first.kernels), len(first.distinct_kernels()), len(later.kernels)


def cudnn_benchmark(ctx: Context, value: bool) -> Observation | None:
    """The autotuner's trial runs in the first call of a new shape (CUDA only)."""
    if not ctx.cuda:
        return None
    on_first, on_kinds, on_later = _first_and_later(ctx, value)
    off_first, _, off_later = _first_and_later(ctx, False)
    with ctx.frame(with_baseline((("cudnn_benchmark", value),)), "cudnn_benchmark (read)"):
        inside = _inside(ctx)
    extra_on, extra_off = on_first - on_later, off_first - off_later
    tuned = extra_on >= 2 and extra_on > 2 * max(extra_off, 0)
    figure = (
        f"first call of a new shape launched {on_first} kernels ({on_kinds} kinds), the next "
        f"{on_later}; without benchmark {off_first} and {off_later}"
    )
    measured = {
        "first_call_kernels": on_first,
        "first_call_kinds": on_kinds,
        "later_call_kernels": on_later,
        "control_first_call_kernels": off_first,
        "control_later_call_kernels": off_later,
    }
    return Observation(tuned == value, figure, measured, inside)


# --- SDPA -----------------------------------------------------------------------------------------


def _sdpa_inputs(ctx: Context) -> list[torch.Tensor]:
    dtype = torch.float32
    if ctx.cuda:
        from .._hardware import capabilities

        dtype = torch.bfloat16 if capabilities(ctx.device).bf16 else torch.float16
    return inputs([SDPA_SHAPE[ctx.device.type]] * 3, ctx.device, dtype)


def ran_backend(ops: Any) -> str:
    """Which SDPA backend the operator names show (``"math"`` when no fused one ran).

    Example:
        >>> from speedflags._measure.probes import ran_backend
        >>> ran_backend({"_scaled_dot_product_flash_attention_for_cpu", "empty"})
        'flash'
        >>> ran_backend({"aten::bmm", "aten::_softmax"})
        'math'
    """
    for name, op in SDPA_OPS.items():
        if any(op in str(found) for found in ops):
            return name
    return "math"


def sdpa(
    ctx: Context,
    value: tuple[str, ...],
    tensors: list[torch.Tensor] | None = None,
    **kwargs: Any,
) -> Observation:
    """Which kernel ran under ``sdpa=value`` (the preferred one, or the math fallback)."""
    q, k, v = tensors if tensors is not None else _sdpa_inputs(ctx)

    def call() -> torch.Tensor:
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, **kwargs)

    kernels: tuple[str, ...] = ()
    with ctx.frame(with_baseline((("sdpa", value),)), f"sdpa={list(value)!r}"):
        if ctx.cuda:
            _, trace = cuda_trace(call, ctx.device)
            ops: Any = trace.ops
            kernels = trace.distinct_kernels()
        else:
            _, ops = aten_ops(call)
        inside = _inside(ctx)
    ran = ran_backend(ops)
    wanted = value[0]
    op = next((o for o in sorted(ops) if SDPA_OPS.get(ran, "\0") in o), "")
    figure = f"the {ran} kernel ran" + (f" ({op})" if op else "")
    if kernels:
        figure += "; CUDA kernels: " + ", ".join(short(name) for name in kernels[:3])
    measured = {
        "ran": ran,
        "ops": sorted(o for o in ops if "scaled_dot" in o),
        "kernels": list(kernels),
    }
    inside["refusal"] = "" if ran == wanted else refusal(wanted, (q, k, v), kwargs)
    return Observation(ran == wanted, figure, measured, inside)


def _plain(message: str) -> str:
    # PyTorch's C++ warnings end in "(Triggered internally at <file>:<line>.)"
    return message.split("(Triggered internally at")[0].strip().replace("\n", " ")


_SDPBACKEND = {
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
}


def refusal(backend: str, tensors: tuple[torch.Tensor, ...], kwargs: dict[str, Any]) -> str:
    """Why the ``backend`` kernel alone refuses these inputs, in PyTorch's words ("" if it runs).

    PyTorch explains a refusal in warnings only when no enabled kernel can run, so the
    kernel is asked alone (``torch.nn.attention.sdpa_kernel``, PyTorch 2.3+; every flag it
    writes comes back on exit).
    """
    try:  # by name: PyTorch 2.1's stubs have no torch.nn.attention
        attention: Any = importlib.import_module("torch.nn.attention")
    except ImportError:  # PyTorch < 2.3: no way to ask one kernel alone
        return ""
    SDPBackend, sdpa_kernel = attention.SDPBackend, attention.sdpa_kernel
    chosen = getattr(SDPBackend, _SDPBACKEND.get(backend, ""), None)
    if chosen is None:
        return f"PyTorch {torch.__version__} has no {backend!r} SDPA kernel"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel([chosen]), torch.no_grad():
                q, k, v = tensors
                F.scaled_dot_product_attention(q, k, v, **kwargs)
        except RuntimeError as exc:
            said = [_plain(str(w.message)) for w in caught]
            said = [s for s in said if s and "kernel not used" not in s] or [
                str(exc).split("\n")[0]
            ]
            return f"the {backend} kernel refuses these inputs: " + "; ".join(said[:3])
    return ""


# --- autocast -------------------------------------------------------------------------------------


def amp(ctx: Context, value: torch.dtype | None) -> Observation:
    """A float32 matmul's output dtype and error level under autocast."""
    with ctx.frame(with_baseline((("amp", value if value is not None else False),)), "amp"):
        out, error = ctx.matmul()
        inside = _inside(ctx)
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(value, "fp32") if value else "fp32"
    level = arithmetic(error, "fp16")
    dtype = str(out.dtype).replace("torch.", "")
    figure = f"output {dtype}, error {error:.1e} ({level}{_off(ctx, 'matmul_error')})"
    measured = {"dtype": dtype, "matmul_error": error, "arithmetic": level}
    want_dtype = value if value is not None else torch.float32
    return Observation(out.dtype == want_dtype and level == name, figure, measured, inside)


# --- model levers --------------------------------------------------------------------------------

_MATMULS = ("addmm", "mm", "matmul", "linear", "_addmm_activation", "bmm")
_CONVS = ("convolution", "_convolution", "mkldnn_convolution", "cudnn_convolution", "conv2d")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _model_lever_call(
    ctx: Context, lever: str, value: Any, label: str, model: torch.nn.Module, x: torch.Tensor
) -> tuple[Any, list[Call], dict[str, Any]]:
    """``model(x)`` without grad inside a frame of the model lever ``lever`` at ``value`` (None:
    off) over the baseline: its output, the aten calls it made, and what was in force."""
    levers = {**with_baseline(()), lever: value if value is not None else False}
    with ctx.frame(levers, label, model=model):
        with torch.no_grad():
            out, calls = aten_calls(lambda: model(x))
        _sync(ctx.device)
        inside = _inside(ctx)
    return out, calls, inside


def param_dtype(ctx: Context, value: torch.dtype | None) -> Observation:
    """The dtype a Linear's matmul computes in inside ``fast_math(model=..., param_dtype=)``."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(ctx.n, ctx.n).to(ctx.device)
    x = ctx.matmul_inputs[0]
    out, calls, inside = _model_lever_call(
        ctx, "param_dtype", value, f"param_dtype={value}", layer, x
    )
    with torch.no_grad():
        reference = x.double() @ layer.weight.double().t() + layer.bias.double()
    error = relative_error(out, reference)
    operands = next((tensors for name, tensors in calls if name in _MATMULS), ())
    dtypes = sorted({_dtype_name(dtype) for dtype, _ in operands})
    want = value if value is not None else torch.float32
    figure = (
        f"the Linear's matmul ran on {' and '.join(dtypes) or 'no matmul seen'} operands, output "
        f"{_dtype_name(out.dtype)}, error {error:.1e} ({arithmetic(error, 'fp16')})"
    )
    measured = {  # dtype: what it computed in (as amp's probe says it); output: what it gave
        "dtype": dtypes[0] if len(dtypes) == 1 else "mixed",
        "operands": dtypes,
        "output": _dtype_name(out.dtype),
        "error": error,
    }
    in_effect = dtypes == [_dtype_name(want)] and out.dtype == x.dtype
    return Observation(in_effect, figure, measured, inside)


def memory_format(ctx: Context, value: str | None) -> Observation:
    """The layout a Conv2d's input and weight arrive in inside ``memory_format=``."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(16, 16, 3, padding=1).to(ctx.device)
    (x,) = inputs([(2, 16, 16, 16)], ctx.device)
    _, calls, inside = _model_lever_call(
        ctx, "memory_format", value, f"memory_format={value!r}", conv, x
    )
    operands = next((tensors for name, tensors in calls if name in _CONVS), ())
    cl_input = tuple(x.contiguous(memory_format=torch.channels_last).stride())
    cl_weight = tuple(conv.weight.contiguous(memory_format=torch.channels_last).stride())
    layouts = [
        "channels_last" if stride == want else "contiguous"
        for (_, stride), want in zip(operands[:2], (cl_input, cl_weight), strict=False)
    ]
    figure = (
        f"the convolution's input and weight arrived {' and '.join(layouts)}"
        if len(layouts) == 2
        else "no convolution call seen"
    )
    expected = "channels_last" if value else "contiguous"
    measured = {"layouts": layouts}
    return Observation(layouts == [expected, expected], figure, measured, inside)


FP8_BATCH = 16
BF16_MAX = 1e-2  # a matmul error above bf16's level (~3e-3): e4m3's 3 mantissa bits (~4e-2)
_GEMM_WORDS = ("gemm", "e4m3", "nvjet", "xmma", "cutlass", "scaled")


def fp8(ctx: Context, value: str | None) -> Observation:
    """Whether a Linear's matmul ran in FP8 inside ``fast_math(model=..., fp8=value)``."""
    from ..levers._fp8_swap import MIN_FEATURES  # the smallest layer the size rule converts

    torch.manual_seed(0)
    layer = torch.nn.Linear(MIN_FEATURES, MIN_FEATURES).to(ctx.device)
    model = torch.nn.Sequential(layer)  # a layer is swapped in its parent
    (x,) = inputs([(FP8_BATCH, MIN_FEATURES)], ctx.device)
    levers = {**with_baseline(()), "fp8": value if value is not None else False}
    scaled: list[str] = []
    kernels: tuple[str, ...] = ()
    with ctx.frame(levers, f"fp8={value!r}", model=model):
        with torch.no_grad():
            if ctx.cuda:
                out, trace = cuda_trace(lambda: model(x), ctx.device)
                scaled = sorted(op for op in trace.ops if "_scaled_mm" in op)
                kernels = trace.distinct_kernels()
                e4m3 = bool(scaled)
            else:
                out, made = aten_outputs(lambda: model(x))
                e4m3 = any(dtype == torch.float8_e4m3fn for _, dtype in made)
        _sync(ctx.device)
        inside = _inside(ctx)
    with torch.no_grad():
        reference = x.double() @ layer.weight.double().t() + layer.bias.double()
    error = relative_error(out, reference)
    level = "fp8" if error >= BF16_MAX else arithmetic(error, "fp16")
    gemms = [k for k in kernels if any(word in k.lower() for word in _GEMM_WORDS)]
    if ctx.cuda:
        ran = (
            f"PyTorch's scaled float8 matmul ran ({', '.join(scaled)})"
            if scaled
            else ("no scaled float8 matmul ran")
        )
        if gemms:
            ran += f", GEMM kernel {short(gemms[0])}"
    else:
        ran = (
            "the Linear's operands were cast to float8_e4m3fn and multiplied in float32 "
            "(torchao's emulation)"
            if e4m3
            else "no float8 operand was seen"
        )
    figure = f"{ran}; error {error:.1e} ({level})"
    measured = {
        "float8_operands": e4m3,
        "scaled_mm": scaled,
        "kernels": [short(k) for k in gemms or kernels[:3]],
        "error": error,
        "arithmetic": level,
    }
    want = value is not None
    in_effect = (e4m3 and level == "fp8" and (bool(kernels) or not ctx.cuda)) == want
    return Observation(in_effect, figure, measured, inside)


Probe = Callable[..., Observation | None]
PROBES: dict[str, Probe] = {
    "tf32": tf32,
    "matmul_precision": matmul_precision,
    "cudnn_benchmark": cudnn_benchmark,
    "sdpa": sdpa,
    "reduced_precision_reduction": reduced_precision_reduction,
    "amp": amp,
    "param_dtype": param_dtype,
    "memory_format": memory_format,
    "fp8": fp8,
}
