"""Behaviour 4: bad input fails at construction.

The message names the argument, shows the value (at most ~200 characters of it: one helper,
``short_repr``, shortens every quoted value) and lists the valid choices.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

import speedflags
from speedflags import InvalidTypeError, InvalidValueError, fast_math
from speedflags._short_repr import SHOWN_CHARS, short_repr

# (kwargs, error type, fragments the message must contain)
BAD: dict[str, tuple[dict[str, Any], type, tuple[str, ...]]] = {
    "amp bf17": ({"amp": "bf17"}, InvalidValueError, ("amp='bf17'", "'bf16'", "'fp16'", "'auto'")),
    "amp float32": ({"amp": torch.float32}, InvalidValueError, ("amp=torch.float32", "'bf16'")),
    "amp True": ({"amp": True}, InvalidTypeError, ("amp=True", "'bf16'", "got bool")),
    "precision HIGH": (
        {"matmul_precision": "HIGH"},
        InvalidValueError,
        ("matmul_precision='HIGH'", "'highest', 'high', 'medium'"),
    ),
    "precision int": (
        {"matmul_precision": 1},
        InvalidTypeError,
        ("matmul_precision=1", "'highest'"),
    ),
    "sdpa flashy": ({"sdpa": "flashy"}, InvalidValueError, ("sdpa='flashy'", "'flash'", "'math'")),
    "sdpa empty": ({"sdpa": []}, InvalidValueError, ("sdpa=[]", "'flash'")),
    "sdpa twice": ({"sdpa": ["flash", "flash"]}, InvalidValueError, ("listed twice",)),
    "sdpa number": ({"sdpa": 3}, InvalidTypeError, ("sdpa=3", "'efficient'")),
    "tf32 yes": ({"tf32": "yes"}, InvalidTypeError, ("tf32='yes'", "True or False")),
    "tf32 1": ({"tf32": 1}, InvalidTypeError, ("tf32=1", "True or False")),
    "benchmark str": ({"cudnn_benchmark": "on"}, InvalidTypeError, ("cudnn_benchmark='on'",)),
    "tf32 off but high": (
        {"tf32": False, "matmul_precision": "high"},
        InvalidValueError,
        ("tf32=False", "matmul_precision='high'", "contradictory", "tf32=True"),
    ),
    "tf32 off but medium": (
        {"tf32": False, "matmul_precision": "medium"},
        InvalidValueError,
        ("contradictory",),
    ),
    "tf32 on but highest": (
        {"tf32": True, "matmul_precision": "highest"},
        InvalidValueError,
        ("tf32=True", "matmul_precision='highest'", "contradictory"),
    ),
    "device gpu": ({"device": "gpu"}, InvalidValueError, ("device='gpu'", "'cpu'", "'cuda'")),
    "device mps": ({"device": "mps"}, InvalidValueError, ("device='mps'", "'cpu' and 'cuda'")),
    "device int": ({"device": 0}, InvalidTypeError, ("device=0", "str or torch.device")),
    "strict str": ({"strict": "yes"}, InvalidTypeError, ("strict='yes'",)),
    "label int": ({"label": 3}, InvalidTypeError, ("label=3",)),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_arguments_fail_at_construction_with_a_clear_message(case: str) -> None:
    kwargs, error, fragments = BAD[case]
    before = speedflags.snapshot()
    with pytest.raises(error) as excinfo:
        fast_math(**kwargs)
    assert isinstance(excinfo.value, speedflags.SpeedflagsError)
    assert isinstance(excinfo.value, ValueError if error is InvalidValueError else TypeError)
    message = str(excinfo.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} missing from {message!r}"
    assert speedflags.snapshot() == before


def test_pytorch_itself_silently_ignores_HIGH() -> None:
    # Why speedflags refuses 'HIGH': PyTorch only warns and changes nothing. In a process of
    # its own: PyTorch 2.1 warns from C++ (stderr, no Python warning), and after that every
    # torch.library.Library fails to register ("could not parse dispatch key: high").
    code = (
        "import warnings, torch; warnings.simplefilter('always'); "
        "torch.set_float32_matmul_precision('HIGH'); print(torch.get_float32_matmul_precision())"
    )
    ran = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert ran.stdout.strip() == "highest"
    assert "HIGH is not one of 'highest', 'high', or 'medium'" in ran.stderr
    assert "no effect" in ran.stderr


SHORTHANDS: dict[str, tuple[Callable[[], Any], type, str]] = {
    "tf32": (lambda: speedflags.tf32("yes"), InvalidTypeError, "tf32(enabled='yes')"),
    "matmul_precision": (
        lambda: speedflags.matmul_precision("fast"),
        InvalidValueError,
        "matmul_precision(value='fast')",
    ),
    "cudnn_benchmark": (
        lambda: speedflags.cudnn_benchmark(None),
        InvalidTypeError,
        "cudnn_benchmark(enabled=None)",
    ),
    "sdpa_backend": (
        lambda: speedflags.sdpa_backend("flash", "turbo"),
        InvalidValueError,
        "sdpa_backend(backends=('flash', 'turbo'))",
    ),
    "sdpa_backend empty": (lambda: speedflags.sdpa_backend(), InvalidValueError, "backends=()"),
    "autocast": (lambda: speedflags.autocast("int8"), InvalidValueError, "autocast(dtype='int8')"),
    "autocast device": (
        lambda: speedflags.autocast("bf16", device="tpu"),
        InvalidValueError,
        "device='tpu'",
    ),
}


@pytest.mark.parametrize("case", list(SHORTHANDS), ids=list(SHORTHANDS))
def test_shorthands_name_their_own_arguments(case: str) -> None:
    call, error, fragment = SHORTHANDS[case]
    with pytest.raises(error) as excinfo:
        call()
    assert fragment in str(excinfo.value)


def test_none_means_leave_unchanged() -> None:
    before = speedflags.snapshot()
    with fast_math(
        tf32=None, matmul_precision=None, cudnn_benchmark=None, sdpa=None, amp=None
    ) as frame:
        assert frame.levers == ()
        assert speedflags.snapshot() == before


def test_positional_non_callable_is_refused() -> None:
    with pytest.raises(InvalidTypeError, match="keyword arguments only"):
        fast_math(True)  # type: ignore[call-overload]


def test_sdpbackend_members_are_accepted() -> None:
    attention = pytest.importorskip("torch.nn.attention")
    spec = fast_math(sdpa=[attention.SDPBackend.MATH, attention.SDPBackend.FLASH_ATTENTION])
    assert spec.levers == {"sdpa": ["math", "flash"]}


@pytest.mark.parametrize(
    ("word", "dtype"),
    [
        ("bf16", torch.bfloat16),
        ("BF16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        ("BFloat16", torch.bfloat16),
        ("torch.bfloat16", torch.bfloat16),
        ("fp16", torch.float16),
        ("FP16", torch.float16),
        ("float16", torch.float16),
        ("Half", torch.float16),
        (" torch.float16 ", torch.float16),
    ],
)
def test_amp_takes_pytorchs_dtype_names_in_any_case(word: str, dtype: torch.dtype) -> None:
    # Failed before: amp="bfloat16" (PyTorch's own name) and amp="BF16" were refused.
    spec = fast_math(amp=word, device="cpu")  # type: ignore[arg-type]
    assert spec.levers == {"amp": str(dtype).replace("torch.", "")}
    step = speedflags.speedup(amp=word, device="cpu")(lambda: None)  # type: ignore[arg-type]
    assert step.stats.levers == spec.levers  # type: ignore[attr-defined]


def test_amp_auto_in_any_case_is_auto() -> None:
    assert fast_math(amp="AUTO").levers == {"amp": "auto"}  # type: ignore[arg-type]


def test_spec_repr_and_levers() -> None:
    spec = fast_math(tf32=True, amp="bf16")
    assert repr(spec) == "<speedflags fast_math(tf32=True, amp='bf16')>"
    assert spec.levers == {"tf32": True, "amp": "bfloat16"}
    assert fast_math().levers == {}


# --- a huge bad value is quoted short ---------------------------------------------------------

HUGE = ["flash"] * 1_000_000
LONG = "x" * 1_000_000

# (the call, a fragment its message must hold): each quotes the bad value, shortened
QUOTED: dict[str, tuple[Callable[[], Any], str]] = {
    "fast_math sdpa": (lambda: fast_math(sdpa=HUGE), "fast_math(sdpa=['flash', 'flash', "),
    "fast_math amp": (lambda: fast_math(amp=LONG), "fast_math(amp='xxxx"),
    "fast_math keyword": (lambda: fast_math(**{LONG: True}), "unexpected keyword argument 'xx"),
    "fast_math device": (lambda: fast_math(device=LONG), "fast_math(device='xxxx"),
    "fast_math strict": (lambda: fast_math(strict=HUGE), "fast_math(strict=['flash', "),
    "sdpa_backend": (lambda: speedflags.sdpa_backend(LONG), "unknown backend 'xxxx"),
    "Schedule entry": (lambda: speedflags.Schedule({0: {"sdpa": HUGE}}), "sdpa=['flash', "),
    "Schedule type": (lambda: speedflags.Schedule(HUGE), "Schedule(['flash', "),  # type: ignore
    "speedup compile": (
        lambda: speedflags.speedup(compile={LONG: 1}),
        "unknown torch.compile option 'xxxx",
    ),
    "tune levers": (
        lambda: speedflags.tune(torch.sin, torch.ones(1), levers=[LONG]),
        "unknown lever 'xxxx",
    ),
    "tune budget": (
        lambda: speedflags.tune(torch.sin, torch.ones(1), budget=HUGE),  # type: ignore
        "tune(budget=['flash', ",
    ),
    "load_levers": (lambda: speedflags.load_levers(LONG + ".ini"), "load_levers('xxxx"),
}


@pytest.mark.parametrize("case", list(QUOTED), ids=list(QUOTED))
def test_a_huge_bad_value_is_quoted_in_at_most_about_200_characters(case: str) -> None:
    call, fragment = QUOTED[case]
    with pytest.raises(speedflags.SpeedflagsError) as excinfo:
        call()
    message = str(excinfo.value)
    assert fragment in message, message[:300]
    assert len(message) < 800, f"{len(message)} characters: {message[:300]}..."
    assert re.search(r"\(100000\d (items|characters)\)", message), message[:300]


class _BrokenRepr:
    def __repr__(self) -> str:
        raise RuntimeError("no repr today")


@pytest.mark.parametrize(
    "value",
    ["bf17", 3, 1.5, None, torch.float32, ["flash", "math"], ("flash",), {"amp": "bf16", 0: []}],
)
def test_short_repr_is_repr_for_the_values_messages_usually_quote(value: Any) -> None:
    assert short_repr(value) == repr(value)


def test_short_repr_is_bounded_and_never_raises() -> None:
    deep: list[Any] = []
    for _ in range(10_000):  # deeper than repr() can go
        deep = [deep]
    for value in (deep, HUGE, LONG, dict.fromkeys(range(100), LONG), 10**10_000, _BrokenRepr()):
        assert len(short_repr(value)) <= SHOWN_CHARS + len(" (1000000 characters)")
    assert short_repr(_BrokenRepr()).startswith("<_BrokenRepr ")


def test_a_numpy_bool_is_named_with_its_module() -> None:
    # NumPy 2 names its boolean scalar type "bool": the message read "expected True or False,
    # got bool" for np.True_ (numpy.bool_ on NumPy 1).
    np = pytest.importorskip("numpy")
    shown = f"numpy.{type(np.True_).__name__}"
    for call in (
        lambda: fast_math(tf32=np.True_),
        lambda: fast_math(cudnn_benchmark=np.False_),
        lambda: fast_math(strict=np.True_),
        lambda: speedflags.speedup(inference=np.True_),
        lambda: speedflags.Schedule({0: {}}, strict=np.True_),
    ):
        with pytest.raises(InvalidTypeError) as refused:
            call()
        assert str(refused.value).endswith(f"expected True or False, got {shown}")
    assert not str(refused.value).endswith("got bool")


SHORTHAND_CALLS: dict[str, Callable[..., Any]] = {
    "tf32": lambda **kw: speedflags.tf32(True, **kw),
    "matmul_precision": lambda **kw: speedflags.matmul_precision("high", **kw),
    "cudnn_benchmark": lambda **kw: speedflags.cudnn_benchmark(True, **kw),
    "sdpa_backend": lambda **kw: speedflags.sdpa_backend("flash", "math", **kw),
    "deterministic": lambda **kw: speedflags.deterministic("warn", **kw),
    "reduced_precision_reduction": lambda **kw: speedflags.reduced_precision_reduction(False, **kw),
    "autocast": lambda **kw: speedflags.autocast("bf16", **kw),
}


@pytest.mark.parametrize("name", list(SHORTHAND_CALLS))
def test_shorthands_take_device_and_label_as_fast_math_does(name: str) -> None:
    # Failed before: sdpa_backend("flash", device="cpu") was a TypeError; docs/levers.md says the
    # shorthands have fast_math's semantics.
    make = SHORTHAND_CALLS[name]
    before = speedflags.snapshot()
    with make(device="cpu", label="my block") as frame:
        assert (frame.label, frame.device) == ("my block", "cpu")
    assert speedflags.ledger().history[-1].label == "my block"
    with make(device=torch.device("cpu")) as frame:
        assert frame.label.startswith(f"{name}(") and frame.device == "cpu"
    assert speedflags.snapshot() == before
    with pytest.raises(InvalidTypeError, match=rf"^{name}\(label=3\): expected a str, got int$"):
        make(label=3)
    with pytest.raises(InvalidValueError, match=rf"^{name}\(device='gpu'\): not a device"):
        make(device="gpu")
