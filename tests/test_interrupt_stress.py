"""Ctrl-C inside decorated generators, coroutines and async generators, and during refused
enters: every flag as before, every frame closed, and the interrupt always reaches the caller.

The forms are those of ``benchmarks/interrupt_stress.py`` (a generator, a coroutine and an
async generator under ``@fast_math`` and ``@speedup(inference=True)``, run to the end and
closed; enters refused in a mixed TF32 state). Two ways in:

- **every function start, in turn** (``sys.settrace``): a function's first instruction is
  where Python checks for signals (as well as after calls and on loop back edges), so an
  interrupt is raised at each one of a run, one run per start; as a plain handler raises it,
  or through :func:`speedflags.signal_safe`, which holds it back inside the ledger's
  critical code until the enter or exit is done;
- **random instants**: the script itself, in a subprocess, a few hundred trials per form
  under a one-shot timer (``make`` runs more: see the script's docstring).
"""

from __future__ import annotations

import dis
import gc
import importlib.util
import json
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from types import CodeType, FrameType, ModuleType
from typing import Any

import pytest
from conftest import needs_new_api

import speedflags
from speedflags._ledger.interrupts import PENDING

# an interrupt that lands before a coroutine's first step leaves it never awaited
pytestmark = pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")
ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "interrupt_stress.py"


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("interrupt_stress", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


STRESS = _load_script()
FORMS = STRESS.forms()
DECORATED = [name for name, (_, mixed) in FORMS.items() if not mixed]
REFUSED = [name for name, (_, mixed) in FORMS.items() if mixed] or ["refused with"]


def _raise(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


_INSTRUCTIONS: dict[CodeType, dict[int, dis.Instruction]] = {}


def signal_can_land(frame: FrameType) -> bool:
    """Whether a signal handler can run as ``frame`` starts or resumes (its "call" event).

    A function's start, yes. A generator or coroutine resumed after a plain ``yield``, yes;
    one resumed only to pass a value down an ``await`` or ``yield from`` chain, no: Python
    runs handlers in the innermost frame of such a chain (bpo-30039). From Python 3.11 the
    resume instruction says which (``RESUME`` 0 and 1 check for signals, 2 and 3 do not); on
    3.10 such a frame is parked with ``YIELD_FROM`` as its next instruction.
    """
    if frame.f_lasti <= 0:
        return True
    code = frame.f_code
    found = _INSTRUCTIONS.get(code)
    if found is None:
        found = _INSTRUCTIONS[code] = {i.offset: i for i in dis.get_instructions(code)}
    here = found.get(frame.f_lasti)
    if here is not None and here.opname == "RESUME":
        return bool(here.arg is not None and here.arg < 2)
    after = found.get(frame.f_lasti + 2)
    return after is None or after.opname != "YIELD_FROM"


class AtCall:
    """A trace function that interrupts the run at its ``target``-th function start or
    resumption where a signal can land (0: never; it only counts them), as a signal handler
    would: by raising, or through a ``signal_safe`` handler that may hold the interrupt
    back."""

    def __init__(self, target: int, safe: bool) -> None:
        self.target = target
        self.calls = 0
        self.fired = False
        self.handler = speedflags.signal_safe(_raise) if safe else _raise

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or self.fired or not signal_can_land(frame):
            return None
        self.calls += 1
        if self.calls == self.target:
            self.fired = True
            self.handler(signal.SIGINT, frame)  # raises, or is held back for the ledger
        return None


def traced(run: Callable[[], None], tracer: AtCall) -> BaseException | None:
    """Run once under ``tracer``, the garbage collector off; what came out of it.

    A collection inside the run would call the finalizers of objects other tests left (a
    ``torch.multiprocessing`` storage reference's ``__del__`` was one): an interrupt raised
    in a finalizer is ignored by Python itself, and the count of function starts would
    depend on when the collector runs. The random-instant stress test keeps it on.
    """
    collecting = gc.isenabled()
    gc.disable()
    sys.settrace(tracer)
    try:
        with warnings.catch_warnings():
            # a coroutine interrupted before its first step was never awaited
            warnings.simplefilter("ignore", RuntimeWarning)
            run()
    except BaseException as exc:  # what came out is what the test looks at
        return exc
    finally:
        sys.settrace(None)
        if collecting:
            gc.enable()
    return None


def interrupt_at_every_call(name: str, safe: bool) -> list[str]:
    """Interrupt ``name``'s run at each of its function starts in turn; what went wrong."""
    run, mixed = FORMS[name]
    problems: list[str] = []
    if mixed:
        STRESS.make_mixed()
    raw = STRESS.raw_state()  # put back after a leak, so that one leak is reported once
    try:
        traced(run, AtCall(0, safe))  # the first run compiles the plan: not counted
        counter = AtCall(0, safe)
        assert traced(run, counter) is None or mixed
        before = STRESS.state()
        for target in range(1, counter.calls + 1):
            tracer = AtCall(target, safe)
            came_out = traced(run, tracer)
            where = f"{name}, interrupted at call {target} of {counter.calls}"
            if tracer.fired and not isinstance(came_out, KeyboardInterrupt):
                held = " (held back)" if PENDING else ""
                problems.append(f"{where}: {type(came_out).__name__} came out{held}")
            after = STRESS.state()
            if after != before:
                problems.append(f"{where}: leaked {STRESS.diff(before, after)}")
            if PENDING or after != before:
                STRESS.reset(raw)
    finally:
        if mixed:
            STRESS.unmix()
    return problems


@pytest.mark.parametrize("safe", [False, True], ids=["plain handler", "signal_safe handler"])
@pytest.mark.parametrize("name", DECORATED)
def test_ctrl_c_at_any_call_of_a_decorated_generator_or_coroutine_leaves_nothing_on(
    name: str, safe: bool
) -> None:
    # Failed before: the per-step close was neither made again after an interruption nor
    # critical code (a leak at ~1 call in 6), and an async generator interrupted between
    # two sends of a step raised "RuntimeError: aclose(): asynchronous generator is already
    # running" instead of the KeyboardInterrupt.
    assert interrupt_at_every_call(name, safe) == []
    assert not speedflags.ledger().open_frames()


@needs_new_api
@pytest.mark.parametrize("safe", [False, True], ids=["plain handler", "signal_safe handler"])
@pytest.mark.parametrize("name", REFUSED)
def test_ctrl_c_at_any_call_of_a_refused_enter_reaches_the_caller(name: str, safe: bool) -> None:
    # Failed before: with signal_safe the interrupt held back in the ledger's enter was never
    # run once the enter was refused; with a plain handler, one that landed in the roll-back
    # of the refused enter was swallowed (MixedTF32APIError came out instead).
    assert interrupt_at_every_call(name, safe) == []


def stress_run(trials: int) -> tuple[dict, str]:
    result = subprocess.run(
        [sys.executable, "-W", "ignore", str(SCRIPT), "--trials", str(trials), "--json"],
        capture_output=True, text=True, timeout=300, cwd=ROOT, check=False,
    )  # fmt: skip
    return json.loads(result.stdout), result.stderr


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer")
def test_ctrl_c_at_random_instants_never_leaks_or_is_lost() -> None:
    report, stderr = stress_run(250)
    rows = report["results"]
    assert len(rows) == 2 * len(FORMS), stderr[-2000:]
    for key, row in rows.items():
        assert (row["lost"], row["leaks"]) == (0, 0), (key, row["examples"])
        # the run exercised what it is for: most trials were interrupted (nearly all on a
        # quiet machine; 64% for one row on a loaded 16-core GPU machine, where the timer
        # fires late; 71% at the worst in three runs under two busy loops on a 2-core Zen 3,
        # the timers set within the fastest run's time), and interrupts landed in
        # speedflags' own code (19.6% for a decorated generator on the py312 leg, whose body
        # runs outside it between steps) and were held back
        assert row["interrupts"] > 0.5 * row["trials"], key
        assert row["in_speedflags"] > 0.1 * row["interrupts"], key
        if "signal_safe" in key:
            assert row["deferred"] > 0.1 * row["interrupts"], key


# --- nothing held back after the last look at PENDING ---------------------------------------

# Leaving a function without running Python code of its own: no check point for signals.
_QUIET = {
    "NOP", "POP_BLOCK", "POP_TOP", "POP_EXCEPT", "LOAD_FAST", "LOAD_CONST", "STORE_FAST",
    "COPY", "SWAP", "EXTENDED_ARG", "CACHE", "TO_BOOL", "NOT_TAKEN", "RESUME_CHECK",
}  # fmt: skip
_LEAVE = {"RETURN_VALUE", "RETURN_CONST", "RERAISE", "RAISE_VARARGS"}
# Only ever called from critical code that delivers after them (FastMath.__exit__), or the
# signal handler's own machinery (which queues, and never runs a handler itself).
_INNER = {"close_innermost", "in_critical_section", "guarded"}


def leaves_quietly(code: CodeType, load: int) -> bool:
    """Whether, ``PENDING`` found empty at instruction ``load``, ``code`` returns (or
    re-raises) with no check point for signals on the way: no call, no backward jump, and on
    Python 3.10 no jump taken at all (3.10 checks at every taken jump, forward too)."""
    instructions = list(dis.get_instructions(code))
    at = {x.offset: i for i, x in enumerate(instructions)}
    i = load + 1
    first_test = True
    for _ in range(len(instructions)):
        x = instructions[i]
        name = x.opname
        if name in _LEAVE:
            return True
        if "JUMP" in name and "IF" in name and first_test:  # the test of PENDING itself
            first_test = False
            if "TRUE" in name:  # empty: not taken, falls through
                i += 1
                continue
            if sys.version_info < (3, 11):  # taken: a check point on 3.10
                return False
            i = at[x.argval]
            continue
        if name == "JUMP_FORWARD" or (name == "JUMP" and x.argval > x.offset):
            i = at[x.argval]
            continue
        if name not in _QUIET:
            return False  # a call, a backward jump, another test: code runs on the way out
        i += 1
    return False


def test_every_way_out_of_critical_code_leaves_no_interrupt_held_back() -> None:
    # A signal_safe handler held back at a check point after a critical function last looked
    # at PENDING waits until the next enter or exit: lost to the program meanwhile. Failed
    # before on Python 3.10 (the floor), where `while PENDING:` takes a jump on its way out
    # (~1 interrupt in 10,000 held in the async generator forms of the stress script).
    from speedflags._ledger.interrupts import _CRITICAL

    checked = []
    for code in list(_CRITICAL):
        if code.co_name in _INNER:
            continue
        loads = [i for i, x in enumerate(dis.get_instructions(code)) if x.argval == "PENDING"]
        assert loads, f"{code.co_name} never delivers held-back handlers"
        for load in loads:
            name = getattr(code, "co_qualname", code.co_name)
            assert leaves_quietly(code, load), f"{name}: a check point after PENDING at {load}"
        checked.append(code.co_name)
    assert {"open", "close", "close_left_open", "_end_step", "__exit__"} <= set(checked)
